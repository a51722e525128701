"""Notify (HCCL Post/Wait flag) and Stream (ordered tasks) semantics."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

from ahcomm import _stream
from ahcomm._errors import ConfigError
from ahcomm._notify import Notify
from ahcomm._stream import ENGINE_THRESHOLD, NO_ENGINE, Stream, engine_bytes_for
from ahcomm.testing import local_world


async def test_post_sets_one_and_wait_resets() -> None:
    n = Notify()
    n.post()
    assert n.value == 1
    await n.wait()
    assert n.value == 0


async def test_double_post_is_one_post() -> None:
    n = Notify()
    n.post()
    n.post()
    assert n.value == 1 and n.overruns == 1
    await n.wait()
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(n.wait(), 0.05)  # the second post was absorbed


async def test_wait_before_post_blocks_until_post() -> None:
    n = Notify()
    waiter = asyncio.ensure_future(n.wait())
    await asyncio.sleep(0.01)
    assert not waiter.done()
    n.post()
    await asyncio.wait_for(waiter, 1)
    assert n.value == 0  # the post went straight to the waiter


async def test_fail_wakes_waiter_and_later_waits() -> None:
    n = Notify()
    waiter = asyncio.ensure_future(n.wait())
    await asyncio.sleep(0)
    n.fail(RuntimeError("peer died"))
    with pytest.raises(RuntimeError, match="peer died"):
        await waiter
    with pytest.raises(RuntimeError):
        await n.wait()
    n.reset()
    n.post()
    await n.wait()


async def test_cancelled_waiter_does_not_eat_a_later_post() -> None:
    n = Notify()
    waiter = asyncio.ensure_future(n.wait())
    await asyncio.sleep(0)
    waiter.cancel()
    await asyncio.gather(waiter, return_exceptions=True)
    n.post()
    assert n.value == 1


async def test_stream_runs_tasks_in_submission_order() -> None:
    s = Stream("t")
    seen: list[int] = []

    async def slow(i: int) -> None:
        await asyncio.sleep(0.005)
        seen.append(i)

    for i in range(10):
        if i % 2:
            s.submit(lambda i=i: slow(i))
        else:
            s.call(lambda i=i: seen.append(i))
    await s.synchronize()
    assert seen == list(range(10))
    await s.close()


async def test_streams_run_concurrently_and_sync_through_notifies() -> None:
    main, sub = Stream("main"), Stream("sub")
    a, b = Notify("a"), Notify("b")
    log: list[str] = []
    # main: post a, wait b; sub: wait a, post b -- deadlocks unless the streams run concurrently
    main.call(lambda: log.append("main:start"))
    main.post(a)
    main.wait(b)
    main.call(lambda: log.append("main:end"))
    sub.wait(a)
    sub.call(lambda: log.append("sub:got-a"))
    sub.post(b)
    await asyncio.wait_for(asyncio.gather(main.synchronize(), sub.synchronize()), 1)
    assert log == ["main:start", "sub:got-a", "main:end"]
    await main.close()
    await sub.close()


async def test_failed_task_skips_rest_until_synchronize_then_recovers() -> None:
    s = Stream("t")
    seen: list[int] = []
    gate = Notify()
    s.wait(gate)  # keeps the stream busy so the next tasks queue up

    def boom() -> None:
        raise ValueError("bad task")

    s.call(boom)
    s.call(lambda: seen.append(1))
    gate.post()
    with pytest.raises(ValueError, match="bad task"):
        await s.synchronize()
    assert seen == []
    s.call(lambda: seen.append(2))
    await s.synchronize()
    assert seen == [2]
    await s.close()


async def test_large_copies_leave_the_event_loop_responsive() -> None:
    s = Stream("t")
    n = 64 << 20
    src, dst = np.ones(n, np.uint8), np.zeros(n, np.uint8)
    assert n >= ENGINE_THRESHOLD
    ticks: list[float] = []
    stop = False

    async def ticker() -> None:
        while not stop:
            ticks.append(time.perf_counter())
            await asyncio.sleep(0.001)

    t = asyncio.ensure_future(ticker())
    await asyncio.sleep(0)  # the ticker has started before the copies do
    threads: set[str] = set()

    def copy_and_note(d: np.ndarray, s_: np.ndarray) -> None:
        threads.add(threading.current_thread().name)
        np.copyto(d, s_)

    start = time.perf_counter()
    for _ in range(8):
        s.submit(lambda: s.memory(copy_and_note, dst, src))
    await s.synchronize()
    end = time.perf_counter()
    stop = True
    await t
    assert dst.all()
    assert all(name.startswith("ahcomm-engine") for name in threads)
    during = [tick for tick in ticks if start < tick < end]
    gaps = np.diff([start, *during, end])
    assert len(during) >= 2, f"the ticker ran {len(during)} times during {end - start:.3f} s of copies"
    assert gaps.max() < 0.25, gaps.max()
    await s.close()


async def test_progress_low_water_mark() -> None:
    from ahcomm.algorithms._executor import Progress

    p = Progress(rank=0, size=3)
    assert p.low() == -1
    p.reached(1, 5)  # peer 1 started #5: it finished #4; peer 2 is still unknown
    assert p.low() == -1
    waiter = asyncio.ensure_future(p.wait_all(2))
    await asyncio.sleep(0)
    assert not waiter.done()
    p.reached(2, 3)
    await asyncio.wait_for(waiter, 1)
    assert p.low() == 2 and p.finished == [-1, 4, 2]
    p.all_started(10)
    assert p.low() == 9 and p.finished == [9, 9, 9]
    p.reached(1, 4)  # old news changes nothing
    assert p.low() == 9
    assert Progress(rank=0, size=1).low() > 1 << 40  # no peers: never waits


def test_progress_low_water_mark_moves_when_the_last_peer_at_it_does() -> None:
    """The minimum is recomputed only once the last peer at it moved on (peers ahead stay ahead)."""
    from ahcomm.algorithms._executor import Progress

    p = Progress(rank=2, size=4)
    for peer, low in ((0, -1), (1, -1), (3, 2)):
        p.reached(peer, 3)
        assert p.low() == low
    p.reached(0, 9)  # peer 0 runs ahead
    p.all_started(4)
    assert p.low() == 3 and p.finished == [8, 3, 3, 3]
    p.reached(1, 5)
    assert p.low() == 3
    p.reached(3, 6)
    assert p.low() == 4
    p.reached(1, 7)
    assert p.low() == 5


def test_copy_engines_only_where_the_host_has_cores_to_spare(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AHCOMM_COPY_ENGINE", raising=False)
    monkeypatch.setattr(_stream, "usable_cores", lambda: 4)
    assert engine_bytes_for(1) == engine_bytes_for(3) == ENGINE_THRESHOLD
    assert engine_bytes_for(4) == engine_bytes_for(9) == NO_ENGINE
    monkeypatch.setenv("AHCOMM_COPY_ENGINE", "on")
    assert engine_bytes_for(9) == ENGINE_THRESHOLD
    monkeypatch.setenv("AHCOMM_COPY_ENGINE", "OFF")
    assert engine_bytes_for(1) == NO_ENGINE
    monkeypatch.setenv("AHCOMM_COPY_ENGINE", "sometimes")
    with pytest.raises(ConfigError, match="AHCOMM_COPY_ENGINE must be auto, on or off, got 'sometimes'"):
        engine_bytes_for(1)


async def test_a_stream_without_an_engine_copies_inline() -> None:
    s = Stream("t", engine_bytes=NO_ENGINE)
    src, dst = np.ones(4 << 20, np.uint8), np.zeros(4 << 20, np.uint8)
    s.copy(dst, src)  # an idle stream runs what can finish at once inside submit
    assert dst.all() and s._engine is None
    await s.close()


@pytest.mark.parametrize(("cores", "engines"), [(2, False), (64, True)])
async def test_ranks_as_many_as_cores_copy_on_their_event_loops(monkeypatch: pytest.MonkeyPatch, cores: int,
                                                               engines: bool) -> None:
    """4 ranks of one host, ring all_gather of 1 MiB blocks (pieces above ENGINE_THRESHOLD): on
    2 cores no stream starts a copy-engine thread, on 64 they do (the executor's policy)."""
    monkeypatch.delenv("AHCOMM_COPY_ENGINE", raising=False)
    monkeypatch.setattr(_stream, "usable_cores", lambda: cores)
    comms = await local_world(4, buffsize=16 << 20)
    try:
        xs = [np.full(1 << 18, r, np.float32) for r in range(4)]
        outs = await asyncio.gather(*(c.all_gather(x, algorithm="ring") for c, x in zip(comms, xs)))
        for out in outs:
            np.testing.assert_array_equal(np.asarray(out).reshape(4, -1)[:, 0], np.arange(4, dtype=np.float32))
        started = [s._engine is not None for c in comms for s in (c._executor.main, *c._executor.subs)]
        assert any(started) is engines, started
    finally:
        await asyncio.gather(*(c.close() for c in comms))


async def test_a_group_counts_every_rank_of_its_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """A sub-communicator's topology shows only its members, but its host runs the parent's
    ranks too: 4 ranks on 3 cores copy inline, and so do their groups of 2."""
    monkeypatch.delenv("AHCOMM_COPY_ENGINE", raising=False)
    monkeypatch.setattr(_stream, "usable_cores", lambda: 3)
    comms = await local_world(4)
    try:
        groups = await asyncio.gather(*(c.split(c.rank % 2) for c in comms))
        assert all(g is not None and g.size == 2 for g in groups)
        assert {c._executor.engine_bytes for c in comms} == {NO_ENGINE}
        assert {g._executor.engine_bytes for g in groups if g is not None} == {NO_ENGINE}
        assert {g._executor.host_ranks for g in groups if g is not None} == {4}
        await asyncio.gather(*(g.close() for g in groups if g is not None))
    finally:
        await asyncio.gather(*(c.close() for c in comms))


async def test_a_new_topology_sets_every_streams_engine_threshold(monkeypatch: pytest.MonkeyPatch) -> None:
    """``Comm._set_topology`` (elastic shrink/grow, suspend, init's agreement) re-decides the copy
    engines for the streams already made, sub-streams included: 4 ranks of one host on 3 cores
    copy inline; spread over two hosts (2 ranks each) they hand big tasks to engines again."""
    import dataclasses

    monkeypatch.delenv("AHCOMM_COPY_ENGINE", raising=False)
    monkeypatch.setattr(_stream, "usable_cores", lambda: 3)
    comms = await local_world(4, buffsize=16 << 20)
    try:
        xs = [np.full(1 << 18, r, np.float32) for r in range(4)]
        await asyncio.gather(*(c.all_gather(x, algorithm="ring") for c, x in zip(comms, xs)))
        streams = [s for c in comms for s in (c._executor.main, *c._executor.subs)]
        assert len(streams) > len(comms) and all(s.engine_bytes == NO_ENGINE for s in streams)
        for c in comms:
            c._set_topology(dataclasses.replace(c.topology, hosts=("a", "a", "b", "b")))
        assert all(s.engine_bytes == ENGINE_THRESHOLD for s in streams)
    finally:
        await asyncio.gather(*(c.close() for c in comms))

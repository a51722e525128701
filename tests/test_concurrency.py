"""Several collectives in flight; the event loop is never blocked by a collective."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

import ahcomm

from support.inproc import run_inproc


async def test_many_collectives_in_flight_pair_by_issue_order() -> None:
    size = 4

    async def body(comm: ahcomm.Comm) -> list[np.ndarray]:
        r = comm.rank
        futures = [
            comm.all_reduce(np.full(100, r + 1.0)),
            comm.all_gather(np.full(3, r, np.int32)),
            comm.broadcast(np.full(7, r * 10.0), root=2),
            comm.all_reduce(np.full(5000, r + 1.0), "max", algorithm="ring"),
            comm.reduce_scatter(np.arange(8.0) * (r + 1)),
            comm.barrier(),
            comm.all_reduce(np.full(10, 1, np.int64)),
        ]
        return list(await asyncio.gather(*futures))

    for res in await run_inproc(size, body, buffsize=4096):
        assert np.all(res[0] == 10)
        np.testing.assert_array_equal(res[1], np.repeat(np.arange(size, dtype=np.int32), 3))
        assert np.all(res[2] == 20)
        assert np.all(res[3] == size)
        assert res[5] is None and np.all(res[6] == size)


async def test_tasks_issue_concurrently_from_different_coroutines() -> None:
    # Each rank issues from two tasks; issue order (the sequence number) decides the pairing.
    async def body(comm: ahcomm.Comm) -> tuple[np.ndarray, np.ndarray]:
        a = asyncio.ensure_future(comm.all_reduce(np.full(4, 1.0)))
        b = asyncio.ensure_future(comm.all_reduce(np.full(4, 2.0)))
        return await a, await b

    for a, b in await run_inproc(3, body):
        assert np.all(a == 3) and np.all(b == 6)


async def test_cancelled_awaiter_does_not_break_later_collectives() -> None:
    async def body(comm: ahcomm.Comm) -> np.ndarray:
        fut = comm.all_reduce(np.ones(100_000))
        task = asyncio.ensure_future(asyncio.wait_for(asyncio.shield(fut), 0))
        try:
            await task
        except TimeoutError:
            pass
        await fut  # still completes for everyone
        return await comm.all_reduce(np.full(10, comm.rank + 1.0))

    for res in await run_inproc(3, body):
        assert np.all(res == 6)


async def test_event_loop_stays_responsive_during_a_large_collective() -> None:
    ticks: list[float] = []
    done = asyncio.Event()

    async def ticker() -> None:
        while not done.is_set():
            ticks.append(time.perf_counter())
            await asyncio.sleep(0.002)

    t = asyncio.ensure_future(ticker())
    x = np.ones(16 << 20, np.float32)  # 64 MiB per rank: tens of milliseconds of copying at least

    async def body(comm: ahcomm.Comm) -> np.ndarray:
        return await comm.all_reduce(x, algorithm="ring")

    start = time.perf_counter()
    await run_inproc(2, body, buffsize=16 << 20)
    end = time.perf_counter()
    done.set()
    await t
    during = [tick for tick in ticks if start < tick < end]
    gaps = np.diff([start, *during, end])
    assert len(during) >= 2, f"the ticker ran {len(during)} times in {end - start:.3f} s of collective"
    assert gaps.max() < 0.5, f"loop blocked for {gaps.max():.3f} s"


# -- cancellation: the defined behaviour ------------------------------------------------------
# Cancelling the task that awaits a collective does not withdraw the collective (its peers
# depend on it): it completes in the background, writing ``out`` if one was given, and the
# collectives after it pair and compute as if nothing happened.

BIG = 4 << 20  # float32 elements: 16 MiB, many slices through a 1 MiB CCL buffer


async def _cancel(task: "asyncio.Task[object]") -> None:
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass


async def test_cancel_before_the_collective_starts() -> None:
    comms = await ahcomm.init_inprocess(2, buffsize=1 << 20)
    xs = [np.full(BIG, r + 1.0, np.float32) for r in range(2)]
    outs = [np.zeros(1000, np.float32) for _ in range(2)]
    first = [c.all_reduce(xs[c.rank], algorithm="ring") for c in comms]
    waiting = [asyncio.ensure_future(c.all_reduce(np.full(1000, c.rank + 10.0, np.float32), out=outs[c.rank]))
               for c in comms]
    await asyncio.sleep(0)
    assert comms[0]._queue and comms[0]._queue[-1].call.seq == 1  # not started: queued behind #0
    await _cancel(waiting[0])
    later = await asyncio.wait_for(asyncio.gather(*first, waiting[1], *(c.all_gather(np.full(3, c.rank))
                                                                      for c in comms)), 30)
    assert all(np.all(r == 3) for r in later[:2])
    assert np.all(later[2] == 21) and np.all(outs[0] == 21)  # the cancelled one ran and wrote its out
    for g in later[3:]:
        np.testing.assert_array_equal(g, [0, 0, 0, 1, 1, 1])
    assert all(c._health.error is None for c in comms)
    await asyncio.gather(*(c.close() for c in comms))


async def test_cancel_while_a_big_collective_is_in_flight() -> None:
    comms = await ahcomm.init_inprocess(2, buffsize=1 << 20)
    outs = [np.zeros(BIG, np.float32) for _ in range(2)]
    tasks = [asyncio.ensure_future(c.all_reduce(np.full(BIG, c.rank + 1.0, np.float32), out=outs[c.rank],
                                                algorithm="ring")) for c in comms]
    for _ in range(200):
        await asyncio.sleep(0.001)
        if comms[0]._running is not None and comms[1]._running is not None:
            break
    assert comms[0]._running is not None and comms[0]._running.call.seq == 0  # mid-run
    await _cancel(tasks[0])
    await _cancel(tasks[1])  # both ranks' awaiters gone: it still completes
    res = await asyncio.wait_for(asyncio.gather(*(c.reduce_scatter(np.arange(8.0) * (c.rank + 1)) for c in comms)), 30)
    np.testing.assert_array_equal(res[0], [0, 3, 6, 9])
    np.testing.assert_array_equal(res[1], [12, 15, 18, 21])
    assert np.all(outs[0] == 3) and np.all(outs[1] == 3)
    await asyncio.gather(*(c.close() for c in comms))


async def test_cancel_between_the_count_exchange_and_the_data(monkeypatch: pytest.MonkeyPatch) -> None:
    """all_gather_v without counts is two collectives (#0 counts, #1 data): cancel in between.
    The data call's copies go to copy engines (threads), so it is still running when the
    exchange is done (inline, 3 ranks on 2 cores, it could finish within the same poll)."""
    monkeypatch.setenv("AHCOMM_COPY_ENGINE", "on")
    comms = await ahcomm.init_inprocess(3, buffsize=1 << 20)
    rows = [np.full((r + 1, 1 << 16), r, np.float32) for r in range(3)]
    tasks = [asyncio.ensure_future(c.all_gather_v(rows[c.rank])) for c in comms]
    for _ in range(200):
        await asyncio.sleep(0.001)
        if comms[0]._done_seq >= 0:
            break
    assert comms[0]._done_seq == 0 and comms[0]._seq == 2  # the exchange done, the data call not
    await _cancel(tasks[0])
    objs = await asyncio.wait_for(asyncio.gather(*tasks[1:], *(c.all_gather_object({"r": c.rank}) for c in comms)), 30)
    for got in objs[:2]:
        assert got.counts == (1, 2, 3) and np.array_equal(got.data[:, 0], [0, 1, 1, 2, 2, 2])
    assert all(o == [{"r": 0}, {"r": 1}, {"r": 2}] for o in objs[2:])
    await asyncio.gather(*(c.close() for c in comms))


async def test_cancel_through_wait_for_and_of_object_collectives() -> None:
    comms = await ahcomm.init_inprocess(2, buffsize=1 << 20)
    with_timeout = asyncio.wait_for(comms[0].all_reduce(np.ones(BIG, np.float32), algorithm="ring"), 0.001)
    objects = asyncio.ensure_future(comms[0].broadcast_object({"big": "x" * 100_000}, root=0))
    peer = [comms[1].all_reduce(np.ones(BIG, np.float32), algorithm="ring"), comms[1].broadcast_object(None, root=0)]
    try:
        await with_timeout
    except TimeoutError:
        pass
    await _cancel(objects)
    got = await asyncio.wait_for(asyncio.gather(*peer), 30)
    assert np.all(got[0] == 2) and got[1] == {"big": "x" * 100_000}
    after = await asyncio.wait_for(asyncio.gather(*(c.all_reduce(np.full(5, c.rank + 1)) for c in comms)), 10)
    assert all(np.all(a == 3) for a in after) and all(c._health.error is None for c in comms)
    await asyncio.gather(*(c.close() for c in comms))


async def test_a_cancelled_recv_consumes_its_message() -> None:
    """Point-to-point: a cancelled recv is not withdrawn either; the message it would have
    taken is dropped when it arrives, and the next recv gets the next message."""
    comms = await ahcomm.init_inprocess(2)
    first = comms[1].recv(0)
    second = comms[1].recv(0)
    await _cancel(first)  # type: ignore[arg-type]
    await asyncio.gather(comms[0].send(np.array([1.0]), 1), comms[0].send(np.array([2.0]), 1))
    assert (await asyncio.wait_for(second, 5))[0] == 2.0
    await asyncio.gather(*(c.close() for c in comms))

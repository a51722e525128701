"""Reliability: mismatch detection, timeouts that name the missing ranks, lost peers, the
flight recorder and SIGUSR1, and nothing leaked (in process, plus a few real jobs)."""

from __future__ import annotations

import asyncio
import gc
import inspect
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ahcomm
from ahcomm import _buffers, _health, _watchdog
from ahcomm._collectives import Gathered
from ahcomm.transports.base import Link

from jobs import job_argv, job_env, run_job
from support.events import Events
from support.inproc import links_of

HERE = Path(__file__).parent
ROOT = HERE.parent
F32 = np.float32
MIB = 1 << 20  # CCL buffers of the in-process jobs (the default 64 MB each is slow to fault in)


@pytest.fixture(autouse=True)
def flight_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "flight"
    monkeypatch.setenv("AHCOMM_FLIGHT_DIR", str(path))
    return path


async def close_all(comms: list[ahcomm.Comm]) -> None:
    await asyncio.wait_for(asyncio.gather(*(c.close() for c in comms), return_exceptions=True), 30)


async def outcomes(calls: list[Awaitable[Any]], limit: float = 10.0) -> list[Any]:
    return list(await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), limit))


def mismatch_of(comm: ahcomm.Comm, got: Any) -> ahcomm.CollectiveMismatchError:
    """The mismatch this rank saw: its call raised it, or (its part of the call was done
    before the difference was found, e.g. a broadcast root) its next call names it."""
    if isinstance(got, ahcomm.CollectiveMismatchError):
        return got
    assert not isinstance(got, BaseException), repr(got)
    with pytest.raises(ahcomm.CommClosedError) as info:
        comm.barrier()
    cause = info.value.__cause__
    assert isinstance(cause, ahcomm.CollectiveMismatchError), repr(cause)
    return cause


# -- 1. mismatch detection ---------------------------------------------------------------------
def _ar(n: int, dtype: Any = F32, op: str = "sum") -> Callable[[ahcomm.Comm], Any]:
    return lambda c: c.all_reduce(np.ones(n, dtype), op)


MISMATCHES = {
    "count": (_ar(8), _ar(16), "all_reduce #0 mismatch: rank 0 called all_reduce(float32, count=8, sum), "
                               "rank 1 called all_reduce(float32, count=16, sum)"),
    "dtype": (_ar(8), _ar(8, np.float64), "all_reduce #0 mismatch: rank 0 called all_reduce(float32, count=8, "
                                          "sum), rank 1 called all_reduce(float64, count=8, sum)"),
    "redop": (_ar(8), _ar(8, op="max"), "all_reduce #0 mismatch: rank 0 called all_reduce(float32, count=8, sum), "
                                        "rank 1 called all_reduce(float32, count=8, max)"),
    "root": (lambda c: c.broadcast(np.ones(8, F32), root=0), lambda c: c.broadcast(np.ones(8, F32), root=1),
             "broadcast #0 mismatch: rank 0 called broadcast(float32, count=8, root=0), "
             "rank 1 called broadcast(float32, count=8, root=1)"),
    "op": (lambda c: c.broadcast(np.ones(8, F32)), lambda c: c.all_gather(np.ones(8, F32)),
           "collective #0 mismatch: rank 0 called broadcast(float32, count=8, root=0), "
           "rank 1 called all_gather(float32, count=8)"),
    "empty": (_ar(0), _ar(8), "all_reduce #0 mismatch: rank 0 called all_reduce(float32, count=0, sum), "
                              "rank 1 called all_reduce(float32, count=8, sum)"),
    "reduce_vs_all_reduce": (lambda c: c.reduce(np.ones(1 << 16, F32)), _ar(1 << 16),
                             "collective #0 mismatch: rank 0 called reduce(float32, count=65536, sum, root=0), "
                             "rank 1 called all_reduce(float32, count=65536, sum)"),
    "barrier_vs_all_gather": (lambda c: c.barrier(), lambda c: c.all_gather(np.ones(4, F32)),
                              "collective #0 mismatch: rank 0 called barrier(), rank 1 called all_gather(float32, "
                              "count=4)"),
}


@pytest.mark.parametrize("case", sorted(MISMATCHES))
async def test_mismatch_raises_on_every_rank_naming_both_calls(case: str, flight_dir: Path) -> None:
    first, second, message = MISMATCHES[case]
    comms = await ahcomm.init_inprocess(2, buffsize=MIB)
    t0 = time.perf_counter()
    got = await outcomes([first(comms[0]), second(comms[1])])
    took = time.perf_counter() - t0
    for comm, res in zip(comms, got):
        err = mismatch_of(comm, res)
        assert message in str(err), str(err)
        assert err.seq == 0 and err.flight_record and Path(err.flight_record).parent == flight_dir
    assert took < 3, took
    await close_all(comms)


async def test_mismatch_on_three_ranks_every_rank_raises_mismatch_not_peer_failure() -> None:
    comms = await ahcomm.init_inprocess(3, buffsize=MIB)
    await outcomes([c.all_reduce(np.ones(4)) for c in comms])  # one good call first: #0
    got = await outcomes([comms[0].all_reduce(np.ones(8, F32)), comms[1].all_reduce(np.ones(8, np.int32)),
                          comms[2].all_reduce(np.ones(8, F32))])
    for res in got:
        assert isinstance(res, ahcomm.CollectiveMismatchError), repr(res)
        assert "all_reduce #1 mismatch:" in str(res) and "all_reduce(int32, count=8, sum)" in str(res)
    with pytest.raises(ahcomm.CommClosedError, match="failed earlier: all_reduce #1 mismatch"):
        comms[2].all_gather(np.ones(2))
    await close_all(comms)


async def test_a_call_made_while_a_mismatch_is_diagnosed_gets_the_verdict() -> None:
    """A call made while a failure is being diagnosed waits for the verdict and raises it. It
    used to raise the first error at once, which for a mismatch names only the peer's
    fingerprint: an eager broadcast's root returned, called barrier() before its diagnosis had
    asked the peer, and printed "rank 1 called a different collective (fingerprint ...)" where
    the verdict said "rank 1 called all_gather(float32, count=8)" (a fresh-clone CI run of
    test_mismatch_on_real_ranks[rdma])."""
    comms = await ahcomm.init_inprocess(2, buffsize=MIB)
    await outcomes([c.all_reduce(np.ones(4)) for c in comms])
    health = comms[0]._health
    ready = asyncio.Event()
    first = ahcomm.CollectiveMismatchError("all_reduce #0 mismatch: rank 0 called all_reduce(float64, count=4, "
                                           "sum), rank 1 called a different collective (fingerprint 0x00000001)")
    verdict = ahcomm.CollectiveMismatchError("all_reduce #0 mismatch: rank 0 called all_reduce(float64, count=4, "
                                             "sum), rank 1 called all_gather(float64, count=4)")

    async def diagnosis() -> tuple[BaseException, tuple[str, str]]:
        await ready.wait()
        return verdict, ("mismatch", str(verdict))

    health.freeze(first, diagnosis())
    pending = [comms[0].barrier(), comms[0].all_reduce(np.ones(2))]  # the old code raised here, at once
    await asyncio.sleep(0.05)
    assert not any(f.done() for f in pending)
    ready.set()
    for fut in pending:
        with pytest.raises(ahcomm.CollectiveMismatchError) as info:
            await fut
        assert info.value is verdict
    with pytest.raises(ahcomm.CommClosedError, match="failed earlier: .*rank 1 called all_gather"):
        comms[0].all_reduce(np.ones(2))  # the verdict is in: a new call raises at once, naming it
    await close_all(comms)


async def test_mismatch_found_when_the_late_rank_issues_its_call() -> None:
    """Rank 0's signals arrive before rank 1 issued #0: kept, and checked at issue."""
    comms = await ahcomm.init_inprocess(2, buffsize=MIB)

    async def late() -> Any:
        await asyncio.sleep(0.3)
        return await comms[1].all_gather(np.ones(8, np.float64))

    got = await outcomes([comms[0].all_gather(np.ones(8, F32)), late()])
    for comm, res in zip(comms, got):
        assert "all_gather #0 mismatch: rank 0 called all_gather(float32, count=8), rank 1 called " \
               "all_gather(float64, count=8)" in str(mismatch_of(comm, res))
    assert comms[1]._health.early == {}
    await close_all(comms)


async def test_mismatch_in_a_collective_prepared_later_is_found() -> None:
    """all_gather_v without counts: the exchange (#0) matches, the data call (#1) differs in dtype."""
    comms = await ahcomm.init_inprocess(2, buffsize=MIB)
    got = await outcomes([comms[0].all_gather_v(np.ones((3, 2), F32)), comms[1].all_gather_v(np.ones((3, 2)))])
    for comm, res in zip(comms, got):
        err = mismatch_of(comm, res)
        assert "all_gather_v #1 mismatch: rank 0 called all_gather_v(float32, counts=[6, 6]), rank 1 called " \
               "all_gather_v(float64, counts=[6, 6])" in str(err)
    await close_all(comms)


async def test_calls_whose_signals_never_carry_a_fingerprint_are_caught_by_the_announcement(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With no fingerprint on any signal, a collective running past PROBE_AFTER announces its
    own by control message; the late rank checks it when it issues its call."""
    deliver = Link.deliver

    def no_fingerprint(self: Link, signal: int, index: int, seq: int, value: int = 0, fingerprint: int = 0) -> None:
        deliver(self, signal, index, seq, value, 0)

    monkeypatch.setattr(Link, "deliver", no_fingerprint)
    monkeypatch.setattr(_watchdog, "PROBE_AFTER", 0.1)
    comms = await ahcomm.init_inprocess(2, buffsize=MIB)
    for c in comms:
        c._exec_timeout = 20

    async def late() -> Any:
        await asyncio.sleep(0.4)
        return await comms[1].reduce_scatter(np.ones(16, F32), algorithm="ring")

    t0 = time.perf_counter()
    got = await outcomes([comms[0].all_reduce(np.ones(16, F32), algorithm="ring"), late()])
    assert time.perf_counter() - t0 < 3
    for comm, res in zip(comms, got):
        assert "collective #0 mismatch: rank 0 called all_reduce(float32, count=16, sum), rank 1 called " \
               "reduce_scatter(float32, count=8, sum)" in str(mismatch_of(comm, res))
    await close_all(comms)


async def test_the_fingerprint_is_given_when_the_peer_does_not_describe_its_call(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_health, "REPLY_WAIT", 0.2)
    comms = await ahcomm.init_inprocess(2, buffsize=MIB)
    answer = comms[1]._health.on_control

    def mute(peer: int, payload: bytes) -> None:  # ... and does not describe its calls
        if b"desc?" not in payload:
            answer(peer, payload)

    for link in links_of(comms[1]).values():  # rank 1 does not check fingerprints, nor describe its calls
        link.attach(Events(link.events, on_fingerprint=None, on_control=mute))
    got = await outcomes([comms[0].all_reduce(np.ones(8, F32)), comms[1].all_reduce(np.ones(9, F32))])
    fp = comms[1]._flight.find(0).call.fingerprint  # type: ignore[union-attr]
    for comm, res in zip(comms, got):
        err = mismatch_of(comm, res)
        assert (f"collective #0 mismatch: rank 0 called all_reduce(float32, count=8, sum), rank 1 called a "
                f"different collective (fingerprint {fp:#010x}; it did not describe it within 0.2 s)") in str(err)
    await close_all(comms)


async def test_legitimate_per_rank_differences_are_not_a_mismatch() -> None:
    """Counts per rank (v ops), root-only data, objects of different sizes: no false alarm."""
    n = 3

    async def body(c: ahcomm.Comm) -> list[Any]:
        r = c.rank
        rows = np.arange(r + 1, dtype=F32).repeat(2).reshape(r + 1, 2)
        send = [(r + j) % 3 for j in range(n)]
        res = [
            await c.all_to_all_v(np.full((sum(send), 2), r, np.int64), send),
            await c.all_gather_v(rows),
            await c.gather_v(rows, root=1),
            await c.scatter_v(np.ones((6, 2), F32) if r == 2 else np.zeros((1, 2), F32), [1, 2, 3], root=2),
            await c.reduce(np.ones(5), root=2),
            await c.broadcast(np.zeros(7) if r else np.ones(7), root=0),
            await c.all_gather_object({"rank": r, "blob": "x" * (100 * r)}),
            await c.gather_object([r] * r, root=0),
            await c.broadcast_object("hello" * (r + 1), root=1),
        ]
        await c.barrier()
        return res

    comms = await ahcomm.init_inprocess(n, buffsize=MIB)
    results = await asyncio.wait_for(asyncio.gather(*(body(c) for c in comms)), 30)
    for c, res in zip(comms, results):
        assert c._health.error is None and c._health.early == {} and c._health.fps == {}
        assert isinstance(res[1], Gathered) and res[1].counts == (1, 2, 3)
        assert np.all(res[5] == 1) and res[8] == "hello" * 2
        assert res[6] == [{"rank": p, "blob": "x" * (100 * p)} for p in range(n)]
    await close_all(comms)


# -- 2. timeouts ---------------------------------------------------------------------------
async def test_timeout_names_the_rank_that_had_not_arrived_on_every_rank(flight_dir: Path) -> None:
    comms = await ahcomm.init_inprocess(3, buffsize=MIB)
    await outcomes([c.barrier() for c in comms])  # #0 on every rank
    t0 = time.perf_counter()
    got = await outcomes([comms[0].all_reduce(np.ones(8), timeout=0.3), comms[1].all_reduce(np.ones(8))])
    took = time.perf_counter() - t0
    head = "all_reduce #1 on rank 0 did not complete within 0.3 s (timeout=0.3): rank 2 had not arrived: " \
           "rank 2 has not called it yet (its last call: #0 barrier, last completed: #0)"
    assert isinstance(got[0], ahcomm.CollectiveTimeout) and head in str(got[0]), got[0]
    assert got[0].missing == (2,) and got[0].op == "all_reduce" and got[0].seq == 1
    assert isinstance(got[1], ahcomm.CollectiveTimeout), repr(got[1])  # told, with the same diagnosis
    assert f"rank 0 aborted its communicator: {head}" in str(got[1]) and got[1].missing == (2,)
    assert 0.3 <= took < 2, took
    with pytest.raises(ahcomm.CommClosedError, match="failed earlier: rank 0 aborted its communicator: all_reduce #1"):
        comms[2].all_reduce(np.ones(8))
    doc = json.loads(Path(got[0].flight_record or "").read_text())
    assert [(e["seq"], e["op"], e["state"]) for e in doc["entries"]] == [(0, "barrier", "done"),
                                                                          (1, "all_reduce", "failed")]
    assert doc["entries"][1]["timeout"] == 0.3 and doc["entries"][1]["algorithm"]
    await close_all(comms)


async def test_ranks_timing_out_together_do_not_count_each_other_as_missing() -> None:
    comms = await ahcomm.init_inprocess(3, buffsize=MIB)
    for c in comms[:2]:
        c._exec_timeout = 0.3
    got = await outcomes([comms[0].all_reduce(np.ones(8)), comms[1].all_reduce(np.ones(8))])
    for res in got:
        assert isinstance(res, ahcomm.CollectiveTimeout) and res.missing == (2,), repr(res)
        assert "rank 2 had not arrived: rank 2 has not called it yet (no collective called yet, none completed)" \
            in str(res)
    await close_all(comms)


async def test_timeout_names_a_rank_that_does_not_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_health, "REPLY_WAIT", 0.2)
    comms = await ahcomm.init_inprocess(3, buffsize=MIB)
    comms[0]._exec_timeout = 0.3  # AHCOMM_EXEC_TIMEOUT
    for link in links_of(comms[2]).values():
        link.attach(Events(link.events, on_control=None))
    got = await outcomes([comms[0].all_gather(np.ones(4)), comms[1].all_gather(np.ones(4))])
    err = got[0]
    assert isinstance(err, ahcomm.CollectiveTimeout), repr(err)
    assert "all_gather #0 on rank 0 did not complete within 0.3 s (AHCOMM_EXEC_TIMEOUT): rank 2 had not arrived: " \
           "rank 2 did not answer within 0.2 s" in str(err), str(err)
    assert err.missing == (2,)
    await close_all(comms)


async def test_every_collective_takes_a_timeout_and_checks_it() -> None:
    methods = ["all_reduce", "all_gather", "reduce_scatter", "broadcast", "barrier", "reduce", "gather", "gather_v",
               "scatter", "scatter_v", "all_to_all", "all_to_all_v", "all_gather_v", "reduce_scatter_v",
               "broadcast_object", "all_gather_object", "gather_object", "send", "recv", "batch_send_recv"]
    for name in methods:
        param = inspect.signature(getattr(ahcomm.Comm, name)).parameters.get("timeout")
        assert param is not None and param.kind is inspect.Parameter.KEYWORD_ONLY and param.default is None, name
    comms = await ahcomm.init_inprocess(2, buffsize=MIB)
    for bad in (0, -1, float("nan"), "5", True):
        with pytest.raises(ahcomm.InvalidArgument, match="timeout must be a positive number of seconds"):
            comms[0].all_reduce(np.ones(2), timeout=bad)
        with pytest.raises(ahcomm.InvalidArgument, match="timeout must be a positive number"):
            comms[0].gather_v(np.ones(2), timeout=bad)
        with pytest.raises(ahcomm.InvalidArgument, match="timeout must be a positive number"):
            comms[0].send(np.ones(2), 1, timeout=bad)
    assert [c.seq for c in comms] == [0, 0]  # nothing was issued

    async def body(c: ahcomm.Comm) -> None:
        t = 5.0
        x = np.ones((4, 2), F32)
        await c.all_reduce(x, timeout=t)
        await c.reduce_scatter(x, timeout=t)
        await c.all_gather_v(x, timeout=t)
        await c.gather_v(x, timeout=t)
        await c.all_to_all_v(x, [1, 3], timeout=t)
        await c.scatter_v(x, [1, 3], timeout=t)
        await c.all_gather_object("x", timeout=t)
        await c.broadcast_object("x", timeout=t)
        ops = [ahcomm.P2POp("send", x, 1 - c.rank), ahcomm.P2POp("recv", np.empty_like(x), 1 - c.rank)]
        await c.batch_send_recv(ops, timeout=t)
        await c.barrier(timeout=t)

    await asyncio.wait_for(asyncio.gather(*(body(c) for c in comms)), 20)
    await close_all(comms)


async def test_a_short_call_timeout_fires_on_time_after_long_running_calls() -> None:
    """The one watchdog timer is re-armed for a call with its own (shorter) timeout."""
    comms = await ahcomm.init_inprocess(2, buffsize=MIB)
    for _ in range(3):
        await outcomes([c.all_reduce(np.ones(4)) for c in comms])
    t0 = time.perf_counter()
    with pytest.raises(ahcomm.CollectiveTimeout, match=r"all_reduce #3 on rank 0 did not complete within 0.2 s"):
        await asyncio.wait_for(comms[0].all_reduce(np.ones(4), timeout=0.2), 5)
    assert time.perf_counter() - t0 < 0.9
    await close_all(comms)


# -- 3. peer failure -----------------------------------------------------------------------
async def test_a_lost_peer_fails_pending_and_later_calls_naming_it() -> None:
    comms = await ahcomm.init_inprocess(3, buffsize=MIB)
    await outcomes([c.barrier() for c in comms])
    pending = [comms[0].all_reduce(np.ones(1 << 16, F32)), comms[0].all_gather(np.ones(4)),
               comms[2].all_reduce(np.ones(1 << 16, F32))]  # rank 1 never joins
    await asyncio.sleep(0.05)
    t0 = time.perf_counter()
    links_of(comms[0])[1].peer_lost("test")
    got = await outcomes(pending, 5)
    assert time.perf_counter() - t0 < 1
    for res in got:
        assert isinstance(res, ahcomm.PeerFailure) and res.rank == 1, repr(res)
    assert "rank 1 was lost (test) during all_reduce #1; rank 0 can no longer run collectives on it" in str(got[0])
    assert got[0] is got[1]  # the queued call failed at once with the same error
    assert "rank 1 was lost (test, during all_reduce #1 on rank 0; found by rank 0)" in str(got[2])
    with pytest.raises(ahcomm.CommClosedError, match="failed earlier: rank 1 was lost"):
        comms[0].broadcast(np.ones(2))
    with pytest.raises(ahcomm.CommClosedError, match="failed earlier: rank 1 was lost"):
        comms[0].send(np.ones(2), 2)
    await close_all(comms)


async def test_a_peer_lost_while_idle_and_reported_from_another_thread() -> None:
    comms = await ahcomm.init_inprocess(2, buffsize=MIB)
    await outcomes([c.barrier() for c in comms])
    thread = threading.Thread(target=links_of(comms[1])[0].peer_lost, args=("heartbeats stopped",))
    thread.start()
    thread.join()
    for _ in range(50):
        await asyncio.sleep(0.01)
        if comms[1]._health.error is not None:
            break
    with pytest.raises(ahcomm.CommClosedError, match=r"rank 0 was lost \(heartbeats stopped\) while idle "
                                                      r"\(last collective: #0\)"):
        comms[1].all_reduce(np.ones(2))
    await close_all(comms)


# -- 6. flight recorder and SIGUSR1 --------------------------------------------------------
async def test_flight_recorder_keeps_the_last_calls_with_their_states(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AHCOMM_FLIGHT_ENTRIES", "16")
    comms = await ahcomm.init_inprocess(2, buffsize=MIB)
    for i in range(20):
        await outcomes([c.all_reduce(np.ones(3, F32)) if i % 2 else c.broadcast(np.ones(5), root=1) for c in comms])
    record = comms[0].flight_record()
    assert [e["seq"] for e in record] == list(range(4, 20))
    last = record[-1]
    assert last["op"] == "all_reduce" and last["call"] == "all_reduce(float32, count=3, sum)"
    assert last["state"] == "done" and last["algorithm"] and last["issued"] <= last["started"] <= last["ended"]
    assert record[-2]["call"] == "broadcast(float64, count=5, root=1)"
    await close_all(comms)


async def test_flight_records_in_the_temp_dir_are_capped(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from ahcomm import _flight

    monkeypatch.delenv("AHCOMM_FLIGHT_DIR")
    monkeypatch.setattr(_flight.tempfile, "gettempdir", lambda: str(tmp_path))
    monkeypatch.setattr(_flight, "KEEP_IN_TEMP", 3)
    (tmp_path / "unrelated.json").write_text("{}")
    recorder = _flight.FlightRecorder(0, 1)
    paths = []
    for i in range(5):
        paths.append(recorder.dump(f"failure {i}", {}))
        os.utime(paths[-1] or "", (i, i))  # distinct ages
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([Path(p or "").name for p in paths[2:]] +
                                                                ["unrelated.json"])
    assert json.loads(Path(paths[-1] or "").read_text())["reason"] == "failure 4"
    assert (os.stat(paths[-1] or "").st_mode & 0o777) == 0o600


async def test_sigusr1_prints_every_communicators_state(capfd: pytest.CaptureFixture[str]) -> None:
    if signal.getsignal(signal.SIGUSR1) is not signal.SIG_DFL:
        pytest.skip("SIGUSR1 is handled by the test runner")
    comms = await ahcomm.init_inprocess(2, buffsize=MIB)
    await outcomes([c.all_reduce(np.ones(2)) for c in comms])
    stuck = comms[0].all_gather(np.ones(6, F32))  # rank 1 does not join yet
    await asyncio.sleep(0.1)
    os.kill(os.getpid(), signal.SIGUSR1)
    await asyncio.sleep(0.1)
    err = capfd.readouterr().err
    assert "ahcomm rank 0/2: running all_gather #1 all_gather(float32, count=6)" in err, err
    assert "ahcomm rank 1/2: idle; last completed #0 (all_reduce); 0 queued; next seq #1; ok" in err, err
    await outcomes([stuck, comms[1].all_gather(np.ones(6, F32))])
    await close_all(comms)
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL  # the handler went with the last communicator


# -- 5. nothing leaks ----------------------------------------------------------------------
def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def _settled_threads(baseline: int) -> int:
    for _ in range(100):  # copy-engine threads exit shortly after their pool is shut down
        gc.collect()
        if threading.active_count() <= baseline:
            break
        await asyncio.sleep(0.02)
    return threading.active_count()


async def test_open_and_close_twenty_communicators_leaves_nothing_behind(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AHCOMM_COPY_ENGINE", "on")  # 3 ranks on 2 cores would copy inline: no threads to leak

    async def one_job(abort: bool) -> None:
        comms = await ahcomm.init_inprocess(3, buffsize=MIB)
        x = np.ones(1 << 17, F32)  # 512 KiB: copy-engine threads start
        await outcomes([c.all_reduce(x, algorithm="ring") for c in comms])
        await outcomes([c.all_gather_object(c.rank) for c in comms])
        if abort:
            stuck = comms[0].all_reduce(x)
            comms[1].abort("test")
            await outcomes([stuck])
        await close_all(comms)

    await one_job(False)  # warm-up: imports, the default executor, caches
    gc.collect()
    fds, threads, tasks = _fds(), threading.active_count(), len(asyncio.all_tasks())
    for i in range(20):
        await one_job(abort=i % 4 == 3)
    assert await _settled_threads(threads) <= threads
    assert len(asyncio.all_tasks()) <= tasks, asyncio.all_tasks()
    assert _fds() <= fds


async def test_real_links_in_one_process_release_sockets_and_memory_on_close_and_abort() -> None:
    from ahcomm._bootstrap import create
    from ahcomm.run import free_port

    async def one_job(transport: str, abort: bool) -> None:
        env = {"AHCOMM_TRANSPORT": transport, "AHCOMM_JOB_SECRET": "s" * 64, "AHCOMM_BUFFSIZE": "0.25",
               "AHCOMM_CONNECT_TIMEOUT": "20", "AHCOMM_EXEC_TIMEOUT": "20"}
        cfg = ahcomm.Config.from_env(env)
        port = free_port()
        comms = await asyncio.wait_for(asyncio.gather(*(create(cfg, rank=r, world_size=2, master_port=port)
                                                        for r in range(2))), 30)
        await outcomes([c.all_reduce(np.ones(1 << 16, F32)) for c in comms])
        if abort:
            stuck = comms[1].all_reduce(np.ones(4))
            comms[0].abort("test")
            await outcomes([stuck])
        await close_all(comms)

    await one_job("sdma", False)
    await one_job("rdma", False)
    gc.collect()
    fds, threads, shm = _fds(), threading.active_count(), set(os.listdir("/dev/shm"))
    for i, transport in enumerate(["sdma", "rdma"] * 4):
        await one_job(transport, abort=i % 4 >= 2)
    assert await _settled_threads(threads) <= threads
    # A closed connection's descriptor goes when libzmq's I/O thread gets to it (seconds, under
    # load): allow 2 in flight; a leak of one per job would show 8 (one per socket: dozens).
    for _ in range(100):
        if _fds() <= fds:
            break
        gc.collect()
        await asyncio.sleep(0.02)
    assert _fds() <= fds + 2
    assert not {n for n in os.listdir("/dev/shm") if n.startswith("ahcomm-")} - shm


def test_stale_shared_memory_of_dead_processes_is_reclaimed_at_the_next_init(tmp_path: Path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    stale = Path("/dev/shm") / f"ahcomm-{dead_pid}-r0-in-deadbeef"
    mine = Path("/dev/shm") / f"ahcomm-{os.getpid()}-r9-in-cafecafe"
    stale.write_bytes(b"x")
    mine.write_bytes(b"x")
    # and a job killed during set-up, before its peers mapped (and unlinked) its buffers
    killed = subprocess.run([sys.executable, "-c",
                             "import os, signal; from ahcomm._buffers import CclBuffers\n"
                             "b = CclBuffers.shared(4096, 'r0')\n"
                             "print(b.ccl_in.name, b.ccl_out.name, flush=True)\n"
                             "os.kill(os.getpid(), signal.SIGKILL)"],
                            capture_output=True, text=True, cwd=ROOT)
    left = killed.stdout.split()
    assert len(left) == 2 and all((Path("/dev/shm") / n).exists() for n in left), killed
    try:
        buffers = _buffers.CclBuffers.shared(4096, "test")  # what init does on this host
        buffers.close()
        assert not stale.exists() and not any((Path("/dev/shm") / n).exists() for n in left)
        assert mine.exists()  # a live process's segment stays
    finally:
        for p in (stale, mine, *(Path("/dev/shm") / n for n in left)):
            p.unlink(missing_ok=True)


# -- real processes ------------------------------------------------------------------------
def launch(n: int, script: Path, *args: str, env: dict[str, str] | None = None,
           timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return run_job(n, str(script), *args, env={"AHCOMM_BUFFSIZE": "0.0625", "AHCOMM_CONNECT_TIMEOUT": "60",
                                               **(env or {})}, timeout=timeout)


MISMATCH_RANK = """\
import asyncio, sys, time, numpy as np, ahcomm
async def main():
    comm = await ahcomm.init()
    for _ in range(5):
        await comm.all_reduce(np.ones(8, np.float32))
    t0 = time.perf_counter()
    try:
        if comm.rank == 0:
            await comm.broadcast(np.ones(8, np.float32), root=0)
            await comm.barrier()
        else:
            await comm.all_gather(np.ones(8, np.float32))
    except ahcomm.AhcommError as exc:
        cause = exc.__cause__ if isinstance(exc, ahcomm.CommClosedError) else exc
        print(f"RAISED {type(cause).__name__} after {time.perf_counter() - t0:.3f} s: {cause}", flush=True)
    await comm.close()
asyncio.run(main())
"""


@pytest.mark.multiprocess
@pytest.mark.parametrize("transport", ["sdma", "rdma"])
def test_mismatch_on_real_ranks(tmp_path: Path, transport: str) -> None:
    script = tmp_path / "mismatch.py"
    script.write_text(MISMATCH_RANK)
    proc = launch(2, script, env={"AHCOMM_TRANSPORT": transport, "AHCOMM_EXEC_TIMEOUT": "60",
                                  "AHCOMM_FLIGHT_DIR": str(tmp_path)}, timeout=90)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    want = ("collective #6 mismatch: rank 0 called broadcast(float32, count=8, root=0), "
            "rank 1 called all_gather(float32, count=8)")
    for rank in range(2):
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith(f"[{rank}] RAISED")), "")
        assert "RAISED CollectiveMismatchError after" in line and want in line, proc.stdout + proc.stderr
        assert float(line.split(" after ")[1].split(" s")[0]) < 5
    assert len(list(tmp_path.glob("ahcomm-flight-*.json"))) == 2


TIMEOUT_RANK = """\
import asyncio, os, time, numpy as np, ahcomm
async def main():
    comm = await ahcomm.init()
    await comm.barrier()
    if comm.rank == 2:
        await asyncio.sleep(float(os.environ["LATE"]))
    t0 = time.perf_counter()
    try:
        await comm.all_reduce(np.ones(8))
    except ahcomm.AhcommError as exc:
        print(f"RAISED {type(exc).__name__} after {time.perf_counter() - t0:.3f} s: {exc}", flush=True)
    await comm.close()
asyncio.run(main())
"""


@pytest.mark.multiprocess
def test_exec_timeout_on_real_ranks_names_the_late_rank(tmp_path: Path) -> None:
    script = tmp_path / "late.py"
    script.write_text(TIMEOUT_RANK)
    proc = launch(3, script, env={"AHCOMM_EXEC_TIMEOUT": "1", "LATE": "4", "AHCOMM_FLIGHT_DIR": str(tmp_path)},
                  timeout=90)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = {r: next((ln for ln in proc.stdout.splitlines() if ln.startswith(f"[{r}] RAISED")), "") for r in range(3)}
    diagnosis = "rank 2 had not arrived: rank 2 has not called it yet (its last call: #1 barrier"
    for r in (0, 1):
        assert "RAISED CollectiveTimeout" in lines[r] and diagnosis in lines[r], proc.stdout + proc.stderr
        assert float(lines[r].split(" after ")[1].split(" s")[0]) < 3
        assert "did not complete within 1 s (AHCOMM_EXEC_TIMEOUT)" in lines[r], lines[r]
    assert "RAISED CommClosedError" in lines[2] and diagnosis in lines[2], proc.stdout


SIGUSR1_RANK = """\
import asyncio, os, numpy as np, ahcomm
async def main():
    comm = await ahcomm.init()
    for _ in range(3):
        await comm.all_reduce(np.ones(8))
    print(f"READY {os.getpid()}", flush=True)
    if comm.rank == 1:
        while not os.path.exists(os.environ["RELEASE"]):
            await asyncio.sleep(0.05)
    await comm.all_reduce(np.ones(8, np.float32))
    await comm.close()
asyncio.run(main())
"""


@pytest.mark.multiprocess
@pytest.mark.parametrize("target", ["ranks", "launcher"])
def test_sigusr1_on_a_stuck_real_job_prints_each_ranks_state(tmp_path: Path, target: str) -> None:
    script = tmp_path / "stuck.py"
    script.write_text(SIGUSR1_RANK)
    release = tmp_path / "release"
    env = job_env({"AHCOMM_BUFFSIZE": "0.0625", "AHCOMM_EXEC_TIMEOUT": "60", "RELEASE": str(release)})
    proc = subprocess.Popen(job_argv(2, str(script)), env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    killer = threading.Timer(90, proc.kill)
    killer.start()
    try:
        assert proc.stdout is not None
        pids = []
        while len(pids) < 2:
            line = proc.stdout.readline()
            assert line, "the job ended before both ranks were ready"
            if " READY " in line:
                pids.append(int(line.split()[-1]))
        time.sleep(0.5)  # rank 0 is now waiting in all_reduce #4 (#0 is init's)
        for pid in (pids if target == "ranks" else [proc.pid]):  # ahcomm-run passes SIGUSR1 on
            os.kill(pid, signal.SIGUSR1)
        time.sleep(0.5)
        release.touch()
        out, err = proc.communicate(timeout=60)
    finally:
        killer.cancel()
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out + err
    assert "[0] ahcomm rank 0/2: running all_reduce #4 all_reduce(float32, count=8, sum)" in err, err
    assert "[1] ahcomm rank 1/2: idle; last completed #3 (all_reduce); 0 queued; next seq #4; ok" in err, err


@pytest.mark.multiprocess
def test_soak_keeps_memory_and_descriptors_flat(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "soak.py"), "-n", "2", "--ops", "1500",
                           "--every", "250", "--json", str(out), "--check"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    assert doc["ops"] == 1500 and doc["errors"] == 0
    for rank in doc["ranks"]:
        samples = rank["samples"]
        assert samples[-1]["ops"] == 1500
        assert samples[-1]["fds"] - samples[1]["fds"] <= 0, samples
        assert samples[-1]["rss_mb"] - samples[1]["rss_mb"] < 6, samples
        assert samples[-1]["threads"] <= samples[1]["threads"], samples

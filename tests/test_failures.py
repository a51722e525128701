"""Failures end collectives on every rank with an error, never a hang (in process)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import numpy as np
import pytest

import ahcomm
from ahcomm.transports import inproc

from support.events import Events
from support.inproc import links_of


async def close_all(comms: list[ahcomm.Comm]) -> None:
    await asyncio.gather(*(c.close() for c in comms), return_exceptions=True)


@pytest.mark.parametrize("algo", ["ring", "mesh"])
async def test_exec_timeout_mid_collective_fails_fast_and_tells_the_peers(algo: str) -> None:
    comms = await ahcomm.init_inprocess(3)
    comms[0]._exec_timeout = 0.3
    t0 = time.perf_counter()
    fut = comms[0].all_reduce(np.ones(1 << 20, np.float32), algorithm=algo)  # ranks 1, 2 never join
    with pytest.raises(ahcomm.CollectiveTimeout, match=r"all_reduce #0 on rank 0 did not complete within 0.3 s"):
        await asyncio.wait_for(fut, 10)
    assert time.perf_counter() - t0 < 5
    with pytest.raises(ahcomm.CommClosedError, match="rank 0 aborted.*all_reduce #0 on rank 0 did not complete"):
        comms[1].all_reduce(np.ones(4))  # the peers were told: they refuse at once
    await close_all(comms)


@pytest.mark.parametrize("algo", ["ring", "mesh"])
async def test_peer_abort_mid_collective(algo: str) -> None:
    comms = await ahcomm.init_inprocess(2)
    fut = comms[0].all_reduce(np.ones(1 << 20, np.float32), algorithm=algo)
    await asyncio.sleep(0.05)
    comms[1].abort("stop")
    with pytest.raises(ahcomm.PeerFailure, match=r"rank 1 aborted its communicator \(stop\)"):
        await asyncio.wait_for(fut, 5)
    await close_all(comms)


async def test_failing_single_copy_read_fails_every_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(self: object, dst: np.ndarray, addr: int, run: object) -> None:
        raise OSError(14, "simulated process_vm_readv failure")

    monkeypatch.setattr(inproc.InprocLink, "read", broken)
    comms = await ahcomm.init_inprocess(2)
    futs = [c.all_gather(np.ones(1 << 20, np.float32), algorithm="mesh") for c in comms]
    results = await asyncio.wait_for(asyncio.gather(*futs, return_exceptions=True), 5)
    assert all(isinstance(r, (OSError, ahcomm.PeerFailure)) for r in results), results
    await close_all(comms)


@pytest.mark.parametrize("algo", ["direct", "mesh"])
async def test_a_peer_lost_during_a_copy_is_named_with_the_call(algo: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A link's copy that finds its peer gone raises a PeerFailure naming the peer only; the rank
    that hit it raises it naming the collective and its sequence number too (the executor), as
    every other rank's error does."""
    def gone(self: inproc.InprocLink, dst: np.ndarray, addr: int, run: object) -> None:
        raise ahcomm.PeerFailure(f"rank {self.peer} is lost: its process is gone", rank=self.peer)

    monkeypatch.setattr(inproc.InprocLink, "read", gone)
    comms = await ahcomm.init_inprocess(2)
    futs = [c.all_gather(np.ones(1 << 20, np.float32), algorithm=algo) for c in comms]
    results = await asyncio.wait_for(asyncio.gather(*futs, return_exceptions=True), 5)
    assert all(isinstance(r, ahcomm.PeerFailure) for r in results), results
    assert any("is lost" in str(r) for r in results), results
    for r in results:
        assert isinstance(r, ahcomm.PeerFailure) and r.op == "all_gather" and r.seq == 0, (r, r.op, r.seq)
        assert "all_gather #0" in str(r), r
    await close_all(comms)
    named = ahcomm.PeerFailure("rank 3 is lost", rank=3)
    again = named.during("broadcast", 4)
    assert (again.rank, again.op, again.seq, str(again)) == (3, "broadcast", 4, "rank 3 is lost during broadcast #4")
    assert again.during("all_gather", 5) is again  # a failure that names its call keeps it


@pytest.mark.parametrize("algo", ["ring", "mesh"])
async def test_out_overlapping_the_input(algo: str) -> None:
    n, m = 4, 8
    comms = await ahcomm.init_inprocess(n)
    xs = [np.arange(n * m, dtype=np.float64) + 100 * r for r in range(n)]
    want = sum(xs).reshape(n, m)
    outs = await asyncio.gather(*(c.reduce_scatter(xs[r], out=xs[r][r * m:(r + 1) * m], algorithm=algo)
                                  for r, c in enumerate(comms)))
    for r in range(n):
        np.testing.assert_array_equal(outs[r], want[r])
    await close_all(comms)


async def test_all_ops_algo_setting_leaves_ops_it_cannot_serve_to_the_rule() -> None:
    comms = await ahcomm.init_inprocess(2, algo="level0:ring")
    await asyncio.wait_for(asyncio.gather(*(c.barrier() for c in comms)), 5)
    await close_all(comms)
    comms = await ahcomm.init_inprocess(2, algo="barrier=level0:ring")
    with pytest.raises(ahcomm.InvalidArgument, match="AHCOMM_ALGO's 'ring' cannot run barrier.*dissemination"):
        comms[0].barrier()
    await close_all(comms)


def test_asyncio_run_returns_with_a_collective_in_flight() -> None:
    script = ("import asyncio, numpy as np, ahcomm\n"
              "async def main():\n"
              "    comms = await ahcomm.init_inprocess(2)\n"
              "    comms[0].all_reduce(np.ones(1 << 16, np.float32), algorithm='ring')\n"
              "    await asyncio.sleep(0.1)\n"
              "asyncio.run(main())\n"
              "print('returned')\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "returned" in proc.stdout, proc.stderr


async def test_close_while_a_mismatch_is_being_diagnosed_delivers_the_verdict(monkeypatch: pytest.MonkeyPatch,
                                                                             tmp_path: object) -> None:
    """The peer never describes its call: the diagnosis waits REPLY_WAIT; close() meanwhile
    neither hangs nor leaves the pending call without its error."""
    from ahcomm import _health

    monkeypatch.setattr(_health, "REPLY_WAIT", 0.3)
    monkeypatch.setenv("AHCOMM_FLIGHT_DIR", str(tmp_path))
    comms = await ahcomm.init_inprocess(2, buffsize=1 << 20)
    for link in links_of(comms[1]).values():
        link.attach(Events(link.events, on_fingerprint=None, on_control=None))  # deaf and mute
    mine = comms[0].all_reduce(np.ones(8, np.float32))
    comms[1].all_reduce(np.ones(4, np.float32))
    await asyncio.sleep(0.05)
    assert comms[0]._health.error is not None and comms[0]._health.final is None  # diagnosing
    t0 = time.perf_counter()
    await asyncio.wait_for(comms[0].close(), 5)
    assert time.perf_counter() - t0 < 2
    with pytest.raises(ahcomm.CollectiveMismatchError, match="#0 mismatch: rank 0 called all_reduce.*"
                                                              "did not describe it within 0.3 s"):
        await mine
    comms[1].abort("done")
    await close_all(comms)


async def test_abort_during_a_diagnosis_wins_and_garbage_control_messages_are_ignored(
        monkeypatch: pytest.MonkeyPatch, tmp_path: object) -> None:
    from ahcomm import _health

    monkeypatch.setattr(_health, "REPLY_WAIT", 5.0)
    monkeypatch.setenv("AHCOMM_FLIGHT_DIR", str(tmp_path))
    comms = await ahcomm.init_inprocess(2, buffsize=1 << 20)
    for payload in (b"", b"AHc1", b"AHc1\xc1", b"AHc1" + b"\x92\x01\x02", b"other layer", b"AHc1\x81\xa1t\xa3st?",
                    b"AHc1\x82\xa1t\xa2fp\xa3seq\xa1x"):
        links_of(comms[0])[1].send_control(payload)  # arrives at rank 1
    assert comms[1]._health.error is None
    for link in links_of(comms[1]).values():
        link.attach(Events(link.events, on_fingerprint=None, on_control=None))
    mine = comms[0].all_reduce(np.ones(8, np.float32))
    comms[1].all_reduce(np.ones(4, np.float32))
    await asyncio.sleep(0.05)
    assert comms[0]._health.final is None and comms[0]._health.error is not None
    comms[0].abort("operator stop")
    with pytest.raises(ahcomm.CommClosedError, match=r"communicator \(rank 0\) operator stop"):
        await asyncio.wait_for(mine, 1)
    comms[1].abort("done")
    await close_all(comms)

"""Writes into peers' outputs stop when the owner's call stops (``algorithms._push``; mesh's
single-copy all_reduce): the gate a writer reads, the release an owner waits for, and a real
2-process job in which the owner aborts while a slowed peer is still pushing into its output."""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import re
import time
from pathlib import Path

import numpy as np
import pytest

import ahcomm
from ahcomm.algorithms import _push
from ahcomm.algorithms._push import GATE, RELEASED, Gates

from jobs import run_job

HERE = Path(__file__).parent


class WordLink:
    """A link's ``read`` in one process (an inproc link's), counting the reads; ``gone``: the peer's
    process is gone (the read raises as an sdma link's does)."""

    def __init__(self, peer: int, gone: bool = False) -> None:
        self.peer, self.gone, self.reads = peer, gone, 0

    def read(self, dst: np.ndarray, addr: int, run: object) -> None:
        self.reads += 1
        if self.gone:
            raise ahcomm.PeerFailure(f"rank {self.peer} is lost", rank=self.peer)
        ctypes.memmove(dst.ctypes.data, addr, dst.nbytes)


def test_a_writer_stops_at_a_closed_gate_naming_the_peer_op_and_seq() -> None:
    mine, owner = Gates(), Gates()
    mine.open(5)
    owner.open(5)
    owners = [(WordLink(1), 1, owner.address)]
    word = np.zeros(1, np.int64)
    _push.check(mine, 5, "all_reduce", 0, owners, word)  # both open: no error
    owner.close(5)
    with pytest.raises(ahcomm.PeerFailure, match=r"rank 1 ended all_reduce #5") as info:
        _push.check(mine, 5, "all_reduce", 0, owners, word)
    assert (info.value.rank, info.value.op, info.value.seq) == (1, "all_reduce", 5)
    owner.open(6)  # a later call's gate does not admit a late writer of call 5
    with pytest.raises(ahcomm.PeerFailure):
        _push.check(mine, 5, "all_reduce", 0, owners, word)


def test_a_writer_stops_when_its_own_call_failed() -> None:
    mine = Gates()
    mine.open(3)
    mine.close(3)
    with pytest.raises(ahcomm.PeerFailure, match=r"rank 0's all_reduce #3 ended"):
        _push.check(mine, 3, "all_reduce", 0, [], np.zeros(1, np.int64))


def test_a_loop_that_has_not_begun_never_begins_once_its_call_failed() -> None:
    gates = Gates()
    gates.open(4)
    assert gates.close(4) is False  # nothing running
    assert gates.begin(4) is False
    assert int(gates.words[RELEASED]) == 4 and int(gates.words[GATE]) == 0
    gates.open(5)
    assert gates.begin(5) is True
    assert gates.close(5) is True  # running: settle waits for it
    gates.done(5)
    assert int(gates.words[RELEASED]) == 5


async def test_settle_waits_for_a_live_writers_release() -> None:
    owner, writer = Gates(), Gates()
    owner.open(7)
    writer.open(7)
    assert writer.begin(7)
    owner.expose(7, {1: writer.address})
    task = asyncio.create_task(_push.settle(owner, {1: WordLink(1)}, 7, "all_reduce"))
    await asyncio.sleep(0.05)
    assert not task.done()  # the writer is still in its loop
    assert int(owner.words[GATE]) == 0  # closed: the writer stops at its next look
    writer.done(7)
    await asyncio.wait_for(task, 1)


async def test_settle_waits_for_this_ranks_own_running_loop() -> None:
    gates = Gates()
    gates.open(2)
    assert gates.begin(2)
    task = asyncio.create_task(_push.settle(gates, {}, 2, "all_reduce"))
    await asyncio.sleep(0.03)
    assert not task.done()
    gates.done(2)
    await asyncio.wait_for(task, 1)


async def test_settle_returns_at_once_where_the_output_was_never_exposed_or_the_writer_is_gone() -> None:
    owner, writer = Gates(), Gates()
    owner.open(8)
    link = WordLink(1)
    start = time.monotonic()
    await _push.settle(owner, {1: link}, 8, "all_reduce")  # no peer had our output's address
    assert link.reads == 0
    owner.open(9)
    owner.expose(9, {1: writer.address})
    await _push.settle(owner, {1: WordLink(1, gone=True)}, 9, "all_reduce")
    assert time.monotonic() - start < 0.5


async def test_settle_gives_up_after_release_wait_and_says_who(monkeypatch: pytest.MonkeyPatch,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(_push, "RELEASE_WAIT", 0.05)
    owner, writer = Gates(), Gates()
    owner.open(3)
    owner.expose(3, {2: writer.address})  # the writer never releases call 3
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="ahcomm"):
        await asyncio.wait_for(_push.settle(owner, {2: WordLink(2)}, 3, "all_reduce"), 2)
    assert 0.05 <= time.monotonic() - start < 1
    assert "all_reduce #3" in caplog.text and "[2]" in caplog.text


@pytest.mark.multiprocess
@pytest.mark.parametrize("engine", ["on", "off"])
def test_no_peer_writes_into_an_aborted_ranks_output_after_its_call_failed(engine: str) -> None:
    """Copy engines on (the push loop on a thread, the event loop free to fail the call): without
    the gate and the wait, rank 0's output went on changing after its call had raised (2.5-2.8
    million elements of 8 million). Off (the loop inline): rank 0 must still fail soon."""
    proc = run_job(2, str(HERE / "mp_push_abort.py"), timeout=120, env={
        "PYTHONPATH": f"{HERE}{os.pathsep}{HERE.parent}", "AHCOMM_TRANSPORT": "sdma", "AHCOMM_COPY_ENGINE": engine})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    match = re.search(r"\[0\] STABLE ([\d.]+)", out)
    assert match is not None, out
    assert float(match.group(1)) < 1.0, out  # rank 0 raised soon after its abort
    assert re.search(r"\[1\] FAILED PeerFailure", out), out

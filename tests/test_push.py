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
from ahcomm.algorithms._push import GATE, Gates

from jobs import run_job

HERE = Path(__file__).parent


class WordLink:
    """A link's ``read_word`` in one process (an inproc link's), counting the reads; ``gone``: the
    peer's process is gone (it raises as an sdma link's does); ``broken``: another read error."""

    def __init__(self, peer: int, gone: bool = False, broken: bool = False) -> None:
        self.peer, self.gone, self.broken, self.reads = peer, gone, broken, 0

    def read_word(self, addr: int) -> int:
        self.reads += 1
        if self.gone:
            raise ahcomm.PeerFailure(f"rank {self.peer} is lost", rank=self.peer)
        if self.broken:
            raise ahcomm.TransportError("reading failed: EPERM")
        return ctypes.c_int64.from_address(addr).value

    def words(self, addr: int, count: int) -> np.ndarray | None:
        return None  # not mapped: read_word reads them


@pytest.mark.parametrize("mapped", [False, True], ids=["kernel", "mapped"])  # read_word, or a load (words)
@pytest.mark.parametrize("seq", [0, 5])  # 0: a communicator's first call (a gate of 0 is closed)
def test_a_writer_stops_at_a_closed_gate_naming_the_peer_op_and_seq(seq: int, mapped: bool) -> None:
    mine, owner = Gates(), Gates()
    mine.open(seq)
    owner.open(seq)
    link = WordLink(1)
    owners: list[_push.Owner] = [(link, 1, owner.address, owner.words if mapped else None)]  # type: ignore[list-item]
    _push.check(mine, seq, "all_reduce", 0, owners)  # both open: no error
    assert link.reads == (0 if mapped else 1)
    owner.close(seq)
    with pytest.raises(ahcomm.PeerFailure, match=rf"rank 1 ended all_reduce #{seq}") as info:
        _push.check(mine, seq, "all_reduce", 0, owners)
    assert (info.value.rank, info.value.op, info.value.seq) == (1, "all_reduce", seq)
    owner.open(seq + 1)  # a later call's gate does not admit a late writer of this one
    with pytest.raises(ahcomm.PeerFailure):
        _push.check(mine, seq, "all_reduce", 0, owners)


@pytest.mark.parametrize("mapped", [False, True], ids=["kernel", "mapped"])
@pytest.mark.parametrize("how", ["close", "shut"])
def test_a_writer_stopped_by_a_peer_names_the_rank_whose_failure_ended_that_peers_call(mapped: bool,
                                                                                   how: str) -> None:
    """Rank 1's call ended because rank 3 was lost: rank 0, writing into rank 1's output, names
    rank 3 (the first failure; its own call then ends on rank 3's failure too). A later failure
    does not overwrite the cause, and the next call starts with none."""
    mine, owner = Gates(), Gates()
    mine.open(7)
    owner.open(7)
    link = WordLink(1)
    owners: list[_push.Owner] = [(link, 1, owner.address, owner.words if mapped else None)]  # type: ignore[list-item]
    if how == "close":  # the call failed there (the algorithm's settle)
        owner.close(7, _push.cause_of(ahcomm.PeerFailure("rank 3 is lost", rank=3)))
    else:  # Executor.abort
        owner.shut(3)
    owner.close(7, 2)  # later: the first cause stands
    with pytest.raises(ahcomm.PeerFailure, match=r"rank 1 ended all_reduce #7 on rank 3's failure before") as info:
        _push.check(mine, 7, "all_reduce", 0, owners)
    assert info.value.rank == 3
    owner.open(8)
    assert int(owner.words[_push.CAUSE]) == 0
    assert _push.cause_of(RuntimeError("no rank")) is None


def test_a_writer_stops_when_its_own_call_failed_or_its_communicator_aborted() -> None:
    mine = Gates()
    mine.open(3)
    mine.close(3)
    with pytest.raises(ahcomm.PeerFailure, match=r"rank 0's all_reduce #3 ended"):
        _push.check(mine, 3, "all_reduce", 0, [])
    mine.open(4)
    mine.shut()  # Executor.abort
    with pytest.raises(ahcomm.PeerFailure, match=r"rank 0's all_reduce #4 ended"):
        _push.check(mine, 4, "all_reduce", 0, [])


def test_bind_carries_the_words_over_and_the_address_follows() -> None:
    gates = Gates()
    gates.open(4)
    gates.done(3)
    shared = np.zeros(1 + _push.WORDS, np.int64)
    gates.bind(shared[1:])  # as Executor.bind does with the CCL_Out's words
    assert shared.tolist() == [0, 5, 4, 0] and gates.address == shared[1:].ctypes.data
    assert gates.is_open(4) and gates.released(3)
    gates.bind(np.zeros(_push.WORDS, np.int64))  # suspended: no view of the buffers kept
    assert gates.is_open(4) and gates.address != shared[1:].ctypes.data
    assert shared[1] == 0  # the old words read closed to a peer still looking at them


def test_a_loop_still_running_at_a_bind_releases_into_the_old_words_too() -> None:
    """A push loop that outlived settle's wait may end after close or suspend moved the words
    (helper-52): its release must show where the peers look, the old words."""
    gates = Gates()
    first = np.zeros(_push.WORDS, np.int64)
    gates.bind(first)
    gates.open(3)
    assert gates.begin(3)
    gates.bind(np.zeros(_push.WORDS, np.int64))  # Executor.close while the loop runs
    assert first[GATE] == 0 and first[_push.RELEASED] == 0
    gates.done(3)
    assert first[_push.RELEASED] == 4 and gates.released(3)


def test_a_peer_failures_traceback_keeps_no_view_of_the_peers_words() -> None:
    """The error of a closed gate is kept (the call's, the communicator's): its traceback must not
    hold the peer's words, a view that keeps the peer's CCL buffer mapped (helper-52)."""
    import gc
    import weakref
    mine = Gates()
    mine.open(2)
    words = np.zeros(1 + _push.WORDS, np.int64)
    view = words[1:]  # the owner's gate closed
    alive = weakref.ref(view)
    owners: list[_push.Owner] = [(WordLink(1), 1, int(view.ctypes.data), view)]  # type: ignore[list-item]
    with pytest.raises(ahcomm.PeerFailure) as info:
        _push.check(mine, 2, "all_reduce", 0, owners)
    owners.clear()  # as the push loop does when it ends
    del view
    gc.collect()
    assert info.value.__traceback__ is not None and alive() is None


def test_a_loop_that_has_not_begun_never_begins_once_its_call_failed() -> None:
    gates = Gates()
    assert not gates.released(0)  # nothing released before a first call
    gates.open(0)
    assert gates.close(0) is False  # nothing running
    assert gates.begin(0) is False
    assert gates.released(0) and int(gates.words[GATE]) == 0
    gates.open(5)
    assert gates.begin(5) is True
    assert gates.close(5) is True  # running: settle waits for it
    gates.done(5)
    assert gates.released(5)
    gates.done(4)  # a late end of an earlier loop does not take the release back
    assert gates.released(5)


def settling(seq: int) -> tuple[Gates, Gates, asyncio.Task[None]]:
    """An owner whose call ``seq`` failed, settling, and a writer (rank 1) still in its loop."""
    owner, writer = Gates(), Gates()
    owner.open(seq)
    writer.open(seq)
    assert writer.begin(seq)
    owner.expose(seq, {1: writer.address})
    return owner, writer, asyncio.create_task(_push.settle(owner, {1: WordLink(1)}, seq, "all_reduce"))


@pytest.mark.parametrize("seq", [0, 7])
async def test_settle_waits_for_a_live_writers_release(seq: int) -> None:
    owner, writer, task = settling(seq)
    await asyncio.sleep(0.05)
    assert not task.done()  # the writer is still in its loop
    assert int(owner.words[GATE]) == 0  # closed: the writer stops at its next piece
    writer.done(seq)
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


async def test_a_cancellation_does_not_cut_settle_short() -> None:
    """``Comm.close`` cancels its worker while a failed call settles: the old settle ended there,
    with a peer still writing into the output."""
    _owner, writer, task = settling(1)
    await asyncio.sleep(0.02)
    task.cancel()
    await asyncio.sleep(0.05)
    assert not task.done()  # still waiting for the writer
    writer.done(1)
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 1)  # and then cancelled


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


async def test_settle_keeps_asking_a_peer_it_cannot_read_and_gives_up_after_release_wait(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Only a gone process (PeerFailure) counts as released: a live peer whose permission was
    withdrawn may still write (the old settle took any read error for "gone")."""
    monkeypatch.setattr(_push, "RELEASE_WAIT", 0.05)
    owner, writer = Gates(), Gates()
    owner.open(3)
    owner.expose(3, {2: writer.address})  # the writer never releases call 3
    link = WordLink(2, broken=True)
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="ahcomm"):
        await asyncio.wait_for(_push.settle(owner, {2: link}, 3, "all_reduce"), 2)
    assert 0.05 <= time.monotonic() - start < 1 and link.reads > 1
    assert "all_reduce #3" in caplog.text and "[2]" in caplog.text


@pytest.mark.multiprocess
@pytest.mark.parametrize("n, engine, slow", [(2, "on", "peers"), (2, "off", "peers"), (3, "on", "peers"),
                                              (2, "on", "all"), (2, "off", "close"), (2, "on", "close")])
def test_no_peer_writes_into_an_aborted_ranks_output_after_its_call_failed(n: int, engine: str, slow: str) -> None:
    """Rank 0 aborts (``close``: leaves ``async with comm`` on an error) while slowed writes into its
    output go on; its call must raise soon and its output stay as it is after that. Without the
    gate and the wait, with copy engines on (the push loop on a thread, the event loop free to
    fail the call), rank 0's output went on changing after its call had raised (2.5-2.8 million
    elements of 8 million); with rank 0's own loop slowed too (``all``), the call returned as if
    it had succeeded (``Context.synchronize``), its output still changing; on ``close`` the
    worker's cancellation cut the wait short (helper-49's reproducers), and handed the pending
    call a CancelledError."""
    proc = run_job(n, str(HERE / "mp_push_abort.py"), timeout=120, env={
        "PYTHONPATH": f"{HERE}{os.pathsep}{HERE.parent}", "AHCOMM_TRANSPORT": "sdma", "AHCOMM_COPY_ENGINE": engine,
        "SLOW": slow})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    match = re.search(r"\[0\] STABLE ([\d.]+)", out)
    assert match is not None, out
    assert float(match.group(1)) < 1.5, out  # rank 0 raised soon after its abort
    unwritten = re.search(r"\[0\] UNWRITTEN (\d+)", out)
    assert unwritten is not None and int(unwritten.group(1)) > 0, out  # the peers' writes were cut short
    for r in range(1, n):
        assert re.search(rf"\[{r}\] FAILED (PeerFailure|CommClosedError)", out), out
    if slow == "close":  # the pending call gets the communicator's error, not a CancelledError (helper-50)
        assert "[0] CALL CommClosedError" in out, out


async def test_a_run_aborted_while_a_task_runs_raises_the_abort() -> None:
    """An abort drops the stream's queue but cannot stop the task in flight (a copy engine's):
    once that task ends the run used to return as if it had succeeded (helper-50's unit case)."""
    from ahcomm._stream import Stream
    from ahcomm.algorithms.base import Context
    from ahcomm.algorithms.call import Call, Topology

    main = Stream("main", inline=True)
    topo = Topology(rank=0, size=2, hosts=("h", "h"), link_kinds=("self", "sdma"), all_mapped=True,
                    single_copy=True)
    x = np.zeros(4, np.float32)
    ctx = Context(call=Call(op="all_reduce", seq=0, dtype=np.dtype(np.float32), count=4), topo=topo, links={},
                  src=x, dst=x, ccl_in=np.zeros(64, np.uint8), ccl_out=np.zeros(64, np.uint8), half_offset=0,
                  main=main, subs=[], ufunc=np.add)
    in_flight: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    ran: list[str] = []
    main.submit(lambda: in_flight)
    main.submit(lambda: ran.append("dropped"))
    error = ahcomm.CommClosedError("aborted")

    async def abort() -> None:
        await asyncio.sleep(0.01)
        ctx.fail(error)
        main.abort(error)
        in_flight.set_result(None)
    task = asyncio.ensure_future(abort())
    with pytest.raises(ahcomm.CommClosedError, match="aborted"):
        await ctx.synchronize()
    await task
    assert ran == []


async def test_an_abort_shuts_the_gate_and_mesh_reads_it_before_every_piece(monkeypatch: pytest.MonkeyPatch) -> None:
    """``Comm.abort`` closes this rank's gate at once (its own push loop and its writers stop at
    their next piece), and mesh's push reads the gates before each piece it writes, not once per
    batch of pieces (an earlier version read them every 2 MiB)."""
    from ahcomm.algorithms import mesh

    checks: list[int] = []
    real = _push.check
    monkeypatch.setattr(_push, "check", lambda *a, **k: (checks.append(1), real(*a, **k))[1])
    comms = await ahcomm.init_inprocess(2, buffsize=1 << 20)
    try:
        count = 5 * (mesh.PUSH_BYTES // 4) + 3  # 5 pieces and a bit of a sixth, over both shares
        xs = [np.full(count, r + 1, np.float32) for r in range(2)]
        outs = await asyncio.gather(*(c.all_reduce(x, algorithm="mesh") for c, x in zip(comms, xs)))
        assert all(np.all(out == 3) for out in outs)
        pieces = sum(-(-(b - a) * 4 // mesh.PUSH_BYTES) for a, b in ((0, count // 2), (count // 2, count)))
        assert len(checks) == pieces, (len(checks), pieces)
        gates = [c._executor.gates for c in comms]
        assert all(int(g.words[GATE]) != 0 for g in gates)  # open for the last call
        comms[0].abort("test")
        assert int(gates[0].words[GATE]) == 0
    finally:
        for c in comms:
            c.abort("done")
        for c in comms:
            await c.close()


@pytest.mark.parametrize("transport", ["inproc", "sdma"])
async def test_gates_live_in_the_ccl_out_words_which_peers_map_and_move_at_resume(
        transport: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A communicator's gates are the words after its CCL_Out (a peer's look is a load); while
    suspended they are private (no view keeps the buffers mapped), after resume the new buffers'."""
    from ahcomm.testing import local_world
    looks: list[bool] = []
    check = _push.check

    def counting(gates: Gates, seq: int, op: str, rank: int, owners: list[_push.Owner]) -> None:
        looks.extend(mapped is not None for *_, mapped in owners)
        check(gates, seq, op, rank, owners)
    monkeypatch.setattr(_push, "check", counting)
    comms = await local_world(2, transport=transport, buffsize=1 << 16)
    try:
        def where(comm: ahcomm.Comm) -> tuple[int, int]:
            ex, words = comm._executor, comm._executor.buffers.ccl_out.words
            return ex.gates.address, int(words.ctypes.data) + 8 if words.size else 0
        at, words = where(comms[0])
        assert at == words != 0
        link = comms[1]._executor.links[0]
        mapped = link.words(at, 2)
        assert mapped is not None  # rank 1 maps rank 0's gates
        comms[0]._executor.gates.open(41)
        assert int(mapped[GATE]) == 42
        await asyncio.gather(*(c.suspend() for c in comms))  # leaves the old words closed
        assert where(comms[0])[0] not in (at, 0) and int(mapped[GATE]) == 0
        await asyncio.gather(*(c.resume() for c in comms))
        at2, words2 = where(comms[0])
        assert at2 == words2 != 0 and comms[1]._executor.links[0].words(at2, 2) is not None
        x = np.arange(300_000, dtype=np.float32)  # a push all_reduce after resume is right
        outs = await asyncio.gather(*(c.all_reduce(x, algorithm="mesh") for c in comms))
        np.testing.assert_array_equal(outs[0], 2 * x)
        assert looks and all(looks)  # every look at a peer's gate was a load
    finally:
        await asyncio.gather(*(c.close() for c in comms), return_exceptions=True)

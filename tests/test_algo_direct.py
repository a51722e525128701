"""direct (single copy through the link's read, mailboxes for addresses and completion).

In process (world sizes 1..9, inproc links: a read is a memmove; real sdma links made in this
process: process_vm_readv of our own pid), between real processes over sdma (2..4 ranks),
the staged fallback where ranks cannot read each other's memory, selection, copies per byte,
and failures: a failing read, an abort while waiting, a peer SIGKILLed mid-call.
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import os
import re
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import ahcomm
from ahcomm._config import usable_cores
from ahcomm._memcopy import non_temporal
from ahcomm._stream import ENGINE_THRESHOLD, NO_ENGINE
from ahcomm.algorithms import direct
from ahcomm.algorithms.base import Call, Topology
from ahcomm.algorithms.copies import copies
from ahcomm.transports import inproc

from jobs import run_job
from support.failing import abort_fails_the_waiters
from support.inproc import busy_flags, issue_each, mailbox_of, run_inproc
from support.numerics import exact_values as values

HERE = Path(__file__).parent
SIZES = [1, 2, 3, 4, 5, 6, 7, 8, 9]
DTYPES = [np.float32, np.float64, np.int32, np.int8, np.float16, np.bool_, np.uint64, ml_dtypes.bfloat16]
COUNTS = [0, 1, 37, 1001]


def cases(rng: np.random.Generator, size: int, counts: list[int]) -> list[tuple[Any, ...]]:
    out: list[tuple[Any, ...]] = []
    for i, dtype in enumerate(DTYPES):
        count = counts[i % len(counts)]
        out.append(("all_gather", [values(rng, count, dtype) for _ in range(size)], 0, i % 2 == 1))
        out.append(("broadcast", [values(rng, count, dtype) for _ in range(size)], (2 * i + 1) % size, i % 2 == 1))
    return out


async def issue(comm: ahcomm.Comm, case: tuple[Any, ...]) -> Any:
    op, xs, root, inplace = case
    if op == "all_gather":
        return await comm.all_gather(xs[comm.rank], algorithm="direct")
    x = xs[comm.rank].copy() if inplace else xs[comm.rank]
    got = await comm.broadcast(x, root, out=x if inplace else None, algorithm="direct")
    assert got is x or not inplace
    return got


async def check_matrix(size: int, rng: np.random.Generator, counts: list[int] = COUNTS, transport: str = "inproc",
                       single_copy: bool = True) -> None:
    """Every case on ``size`` ranks; where the host's cores (``direct._cores``, which a test may
    set) are fewer than a broadcast's readers, its first readers forward."""
    todo = cases(rng, size, counts)
    forward = direct.forwarders(size - 1, direct._cores()) > 0

    def after(comm: ahcomm.Comm) -> None:
        assert not busy_flags(comm)
        box = mailbox_of(comm)  # direct's runs hear from every peer, its staged broadcast too
        assert box is None or box.loose is None

    async def body(comm: ahcomm.Comm) -> tuple[list[Any], dict[str, int]]:
        out = await issue_each(comm, todo, issue, in_place=lambda case: case[3], after=after)
        return out, comm.stats()["paths"]

    results = await run_inproc(size, body, transport=transport, single_copy=single_copy)
    path = "direct.single_copy" if single_copy else "direct.staged"
    for k, (op, xs, root, _) in enumerate(todo):
        want = np.concatenate(xs) if op == "all_gather" else xs[root]
        for rank in range(size):
            np.testing.assert_array_equal(results[rank][0][k].reshape(-1), want)
    if size > 1:
        forwarded = sum(op == "broadcast" and xs[0].size > 0 for op, xs, _, _ in todo)  # an empty call runs none
        want = {path, "direct.forward"} if forward and single_copy and forwarded else {path}
        assert all(set(paths) == want for _, paths in results), results[0][1]
        assert all(paths.get("direct.forward", 0) == (forwarded if want != {path} else 0) for _, paths in results)


@pytest.mark.parametrize("cores", [64, 2, 1])
@pytest.mark.parametrize("size", SIZES)
async def test_matrix_inproc(size: int, cores: int, rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    """With a core per reader, or readers that share the cores evenly, each reads the root's
    vector itself; else the first ``cores`` readers forward it to the others (2 cores: 4, 6 and 8
    ranks; ``direct._broadcast``)."""
    monkeypatch.setattr(direct, "_cores", lambda: cores)
    await check_matrix(size, rng)


@pytest.mark.parametrize("size, cores", [(4, 2), (6, 2), (5, 3), (8, 3), (9, 5)])
async def test_forwarders_split_the_vector_in_pieces(size: int, cores: int, rng: np.random.Generator,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Pieces of 40 bytes: shares of several pieces, uneven among the forwarders, a short last
    piece, a vector smaller than one piece per forwarder; every root, in place or not."""
    assert direct.forwarders(size - 1, cores) == cores
    monkeypatch.setattr(direct, "_cores", lambda: cores)
    monkeypatch.setattr(direct, "FORWARD_PIECE", 40)
    await check_matrix(size, rng, counts=[0, 1, 3, 37, 1001, 30_011])


def test_forwarders_where_readers_outnumber_the_cores_unevenly() -> None:
    assert [direct.forwarders(readers, 2) for readers in range(1, 9)] == [0, 0, 2, 0, 2, 0, 2, 0]
    assert [direct.forwarders(readers, 3) for readers in (3, 4, 5, 6, 7)] == [0, 3, 3, 0, 3]
    assert direct.forwarders(5, 1) == direct.forwarders(5, 0) == 0  # one core: every reader in turn anyway


def test_a_share_is_whole_pieces_but_the_last(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(direct, "FORWARD_PIECE", 40)
    for nbytes in (0, 1, 39, 40, 41, 400, 1001):
        for count in (1, 2, 3, 7):
            spans = [direct._share(nbytes, count, i) for i in range(count)]
            assert spans[0][0] == 0 and spans[-1][1] == nbytes
            assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))  # contiguous, in order
            assert all(lo % direct.FORWARD_PIECE == 0 and lo <= hi for lo, hi in spans)


@pytest.mark.parametrize("size", [2, 3])
async def test_matrix_over_sdma_links_in_process(size: int, rng: np.random.Generator) -> None:
    """Real sdma links: the reads are process_vm_readv (of this process), inline (below ``INLINE_BYTES``)."""
    await check_matrix(size, rng, counts=[0, 1, 37, 300_001], transport="sdma")


@pytest.mark.parametrize("size", [2, 5])
async def test_large_calls_are_copied_in_chunks_on_threads(size: int, rng: np.random.Generator,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of 64 KiB on two threads, a call far larger than the CCL buffer (64 KiB here)."""
    monkeypatch.setattr(direct, "CHUNK_BYTES", 64 << 10)
    monkeypatch.setattr(direct, "INLINE_BYTES", 1)
    monkeypatch.setattr(direct, "_cores", lambda: 2 * size)
    monkeypatch.setattr(direct, "_cache", lambda: 0)  # unknown: interleaved chunks
    lanes: list[int] = []
    spans: list[int] = []
    real_pool = direct._pool

    def pool(n: int) -> Any:
        lanes.append(n)
        inner = real_pool(n)

        class Counting:
            def submit(self, fn: Any, span: list[list[Any]], *args: Any) -> Any:
                spans.append(sum(len(ops) for ops in span))
                return inner.submit(fn, span, *args)
        return Counting()

    monkeypatch.setattr(direct, "_pool", pool)
    await check_matrix(size, rng, counts=[1, 100_003])
    assert set(lanes) == {1, 2}, lanes  # two lanes, one where the call is one chunk (count 1)
    # a lane without chunks holds at most one copy per row (reads, writes and the local copy); the
    # 100,003-element rows (100 KB to 800 KB) went in 64 KiB chunks
    assert max(spans) > size, spans


def test_chunks_interleave_the_moves() -> None:
    """Chunk k of every move before chunk k+1 of any, in the moves' order (the local copy first:
    its chunk is in cache for the writes that follow)."""
    made: list[tuple[str, int, int]] = []

    def move(name: str, nbytes: int) -> direct.Move:
        return nbytes, lambda lo, hi, later: later(made.append, (name, lo, hi))

    direct._run(direct._chunks([move("local", 150), move("p1", 150), move("p2", 70)], 64), None, False)
    assert made == [("local", 0, 64), ("p1", 0, 64), ("p2", 0, 64),
                    ("local", 64, 128), ("p1", 64, 128), ("p2", 64, 70),
                    ("local", 128, 150), ("p1", 128, 150)]


def test_rows_go_whole_where_the_hosts_data_fits_the_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the host's inputs and outputs fit its last-level cache, each row is one piece per
    lane (whole rows on one lane); beyond the cache, or where its size is unknown, ``CHUNK_BYTES``."""
    monkeypatch.setattr(direct, "CHUNK_BYTES", 64)
    monkeypatch.setattr(direct, "_cache", lambda: 1000)
    assert direct.chunk_bytes(1000, 150, 1) == 150
    assert direct.chunk_bytes(1000, 150, 2) == 75
    assert direct.chunk_bytes(1000, 100, 4) == 64  # never below CHUNK_BYTES
    assert direct.chunk_bytes(1001, 150, 1) == 64
    monkeypatch.setattr(direct, "_cache", lambda: 0)
    assert direct.chunk_bytes(10, 150, 1) == 64


@pytest.mark.parametrize("cache, pieces", [(1 << 40, 1), (0, 4)])
async def test_a_run_reads_whole_rows_where_the_data_fits_the_cache(cache: int, pieces: int,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A 3-rank all_gather of 200 KiB rows, 64 KiB chunks: each row is read whole where the host's
    data fits the cache, in 4 chunks where it does not (the copies counted as they are queued)."""
    monkeypatch.setattr(direct, "CHUNK_BYTES", 64 << 10)
    made: list[int] = []
    real_later = direct._Later.__call__

    def later(self: direct._Later, fn: Any, *args: Any, **kwargs: Any) -> None:
        made.append(args[0].nbytes)
        real_later(self, fn, *args, **kwargs)

    monkeypatch.setattr(direct._Later, "__call__", later)
    monkeypatch.setattr(direct, "_cache", lambda: cache)
    comms = await ahcomm.init_inprocess(3)
    try:
        count = 200 << 8  # 200 KiB of float32
        xs = [np.full(count, r + 1, np.float32) for r in range(3)]
        outs = await asyncio.wait_for(asyncio.gather(*(
            c.all_gather(xs[r], algorithm="direct") for r, c in enumerate(comms))), 10)
        for out in outs:
            np.testing.assert_array_equal(out, np.repeat([1, 2, 3], count).astype(np.float32))
        assert len(made) == 3 * 3 * pieces, made  # 3 ranks, 3 rows each
    finally:
        await asyncio.gather(*(c.close() for c in comms), return_exceptions=True)


@pytest.mark.parametrize("spare", [False, True])
async def test_one_lane_copies_inline_where_the_host_has_no_core_to_spare(spare: bool,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A 2-rank all_gather above ``INLINE_BYTES`` on one lane (2 cores): its copies stay on the
    event loop where the ranks fill the cores (as the streams' copies do), and go to a copy
    thread where a core is spare (``AHCOMM_COPY_ENGINE`` as the streams read it)."""
    monkeypatch.setattr(direct, "INLINE_BYTES", 1)
    monkeypatch.setattr(direct, "_cores", lambda: 2)
    monkeypatch.setattr(direct, "engine_bytes_for", lambda n: ENGINE_THRESHOLD if spare else NO_ENGINE)
    pools: list[int] = []
    real_pool = direct._pool
    monkeypatch.setattr(direct, "_pool", lambda n: pools.append(n) or real_pool(n))
    comms = await ahcomm.init_inprocess(2)
    try:
        xs = [np.full(1 << 16, r + 1, np.float32) for r in range(2)]
        outs = await asyncio.wait_for(asyncio.gather(*(
            c.all_gather(xs[r], algorithm="direct") for r, c in enumerate(comms))), 10)
        for out in outs:
            np.testing.assert_array_equal(out, np.repeat([1, 2], 1 << 16).astype(np.float32))
        assert pools == ([1, 1] if spare else []), pools
    finally:
        await asyncio.gather(*(c.close() for c in comms), return_exceptions=True)


@pytest.mark.parametrize("size", [2, 3, 5])
async def test_fallback_without_single_copy(size: int, rng: np.random.Generator,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranks that cannot read each other's memory run oneshot's staged path, in slices of a
    slot (192 bytes here), and say so in stats(); the selector never picks direct there."""
    comms = await ahcomm.init_inprocess(size, single_copy=False)
    try:
        assert "direct" not in [comms[0].explain(op, 1 << 22)[0] for op in ("broadcast", "all_gather")]
        assert comms[0].explain("broadcast", 1 << 22)[1].get("direct", 0) is None
    finally:
        await asyncio.gather(*(c.close() for c in comms))
    monkeypatch.setenv("AHCOMM_MAILBOX_BYTES", "192")
    await check_matrix(size, rng, single_copy=False)


async def test_selected_for_large_calls_on_one_host(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("AHCOMM_CORES", "2")  # the defaults on 2 cores: the picks below were measured so
    monkeypatch.setenv("AHCOMM_TUNING_FILE", str(tmp_path / "none.json"))
    comms = await ahcomm.init_inprocess(2)
    try:
        for op in ("broadcast", "all_gather"):
            assert comms[0].explain(op, 2, np.float32)[0] == "oneshot"
        # a broadcast from 4 MiB is read once, straight from the root; all_gathers go through
        # oneshot's slots at every size (cost.STAGED)
        assert comms[0].explain("broadcast", 1 << 19, np.float32)[0] == "oneshot"  # 2 MiB
        assert comms[0].explain("broadcast", 1 << 20, np.float32)[0] == "direct"  # 4 MiB
        assert comms[0].explain("broadcast", 16 << 20, np.float32)[0] == "direct"  # 64 MiB
        assert comms[0].explain("all_gather", 16 << 20, np.float32)[0] == "oneshot"
        assert "direct" not in comms[0].explain("all_reduce", 16 << 20, np.float32)[1]
    finally:
        await asyncio.gather(*(c.close() for c in comms))


@pytest.mark.parametrize("op", ["broadcast", "all_gather"])
def test_copies_one_per_byte(op: str) -> None:
    topo = Topology(rank=0, size=2, hosts=("h", "h"), link_kinds=("self", "sdma"), all_mapped=True,
                    single_copy=True, mailbox=1 << 18)
    call = Call(op=op, seq=0, dtype=np.dtype(np.float32), count=1 << 20)
    entry = copies("direct", call, topo)
    assert entry is not None and (entry["owner"], entry["reader"], entry["single_copy"]) == (0, 1, True)
    staged = copies("direct", call, Topology(**{**topo.__dict__, "single_copy": False}))
    assert staged is not None and (staged["total"], staged["single_copy"]) == (2, False)


@pytest.mark.parametrize("op", ["broadcast", "all_gather"])
async def test_a_failing_read_fails_every_rank(op: str, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(self: object, dst: np.ndarray, addr: int, run: object) -> None:
        raise OSError(14, "simulated process_vm_readv failure")

    monkeypatch.setattr(inproc.InprocLink, "read", broken)
    comms = await ahcomm.init_inprocess(3)
    try:
        x = np.ones(1 << 18, np.float32)
        futs = [c.all_gather(x, algorithm="direct") if op == "all_gather" else c.broadcast(x, 0, algorithm="direct")
                for c in comms]
        results = await asyncio.wait_for(asyncio.gather(*futs, return_exceptions=True), 10)
        assert all(isinstance(r, (OSError, ahcomm.AhcommError)) for r in results), results
    finally:
        await asyncio.gather(*(c.close() for c in comms), return_exceptions=True)


@pytest.mark.parametrize("op", ["all_gather", "broadcast"])
async def test_a_rank_copies_only_into_its_own_output(op: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every copy a rank makes lands in its own output: no peer writes there, so a call that
    fails or is cancelled stops the only copies into its output before it returns (a peer that
    wrote its block into the others' outputs could still be writing after an owner's failed call
    had returned and its buffer was reused or freed). Fails where ranks write their blocks into
    the peers' outputs."""
    rank: contextvars.ContextVar[int] = contextvars.ContextVar("rank")
    real_orchestrate, real_later = direct.Direct.orchestrate, direct._Later.__call__
    made: list[tuple[int, np.ndarray]] = []

    async def orchestrate(self: direct.Direct, ctx: Any) -> None:
        rank.set(ctx.rank)
        await real_orchestrate(self, ctx)

    def later(self: direct._Later, fn: Any, *args: Any, **kwargs: Any) -> None:
        made.append((rank.get(), args[0]))  # a copy's destination (np.copyto, a link's read)
        real_later(self, fn, *args, **kwargs)

    monkeypatch.setattr(direct.Direct, "orchestrate", orchestrate)
    monkeypatch.setattr(direct._Later, "__call__", later)
    monkeypatch.setattr(direct, "CHUNK_BYTES", 64 << 10)
    comms = await ahcomm.init_inprocess(3)
    try:
        count = 1 << 16
        outs = [np.zeros(3 * count if op == "all_gather" else count, np.float32) for _ in comms]
        xs = [np.full(count, r + 1, np.float32) for r in range(3)]
        await asyncio.wait_for(asyncio.gather(*(
            c.all_gather(xs[r], out=outs[r], algorithm="direct") if op == "all_gather"
            else c.broadcast(xs[r], 0, out=outs[r], algorithm="direct") for r, c in enumerate(comms))), 10)
        assert len(made) >= 3  # broadcast: one copy a rank; all_gather: chunks of three rows
        for r, target in made:
            assert isinstance(target, np.ndarray) and np.shares_memory(target, outs[r]), (r, target)
        for out in outs:
            np.testing.assert_array_equal(out, np.repeat([1, 2, 3], count) if op == "all_gather" else 1)
    finally:
        await asyncio.gather(*(c.close() for c in comms), return_exceptions=True)


async def test_abort_while_a_reader_is_missing() -> None:
    """The root published; rank 2 never joins and aborts: the root's wait fails, no hang."""
    await abort_fails_the_waiters(lambda c: c.broadcast(np.ones(1 << 20, np.float32), 0, algorithm="direct"), 2)


# -- real processes ------------------------------------------------------------------------------

@pytest.mark.multiprocess
@pytest.mark.parametrize("n,no_cma", [(2, False), (3, False), (4, False), (2, True), (4, True)])
def test_real_processes(n: int, no_cma: bool) -> None:
    proc = run_job(n, str(HERE / "mp_direct.py"), timeout=240, env={
        "PYTHONPATH": f"{HERE}{os.pathsep}{HERE.parent}", "AHCOMM_TRANSPORT": "sdma", "AHCOMM_BUFFSIZE": "1",
        "NO_CMA": "1" if no_cma else "0"})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    path = "staged" if no_cma else "single_copy"
    forwarded = r"\('direct\.forward', \d+\), " if not no_cma and direct.forwarders(n - 1, usable_cores()) else ""
    for r in range(n):
        streamed = r"\('copy\.non_temporal', \d+\), " if non_temporal() else ""  # its 16 MiB all_gathers (staged too)
        assert re.search(rf"\[{r}\] OK rank {r} single_copy {not no_cma} paths \[{streamed}{forwarded}"
                         rf"\('direct\.{path}', \d+\)\]", out), out


@pytest.mark.multiprocess
@pytest.mark.parametrize("victim", [3, 1])
def test_no_forwarder_writes_into_a_failed_readers_output(victim: int) -> None:
    """A reader whose broadcast fails (an abort) while the forwarders' slowed writes into its
    output go on: its call raises soon, and its output stays as it is after that (a forwarder
    looks at the reader's gate before each piece; the reader waits for each forwarder's release).
    Rank 3 only receives; rank 1 forwards too, and rank 2 writes the other half of its output."""
    proc = run_job(4, str(HERE / "mp_forward_abort.py"), timeout=120, env={
        "PYTHONPATH": f"{HERE}{os.pathsep}{HERE.parent}", "AHCOMM_TRANSPORT": "sdma", "AHCOMM_CORES": "2",
        "VICTIM": str(victim)})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    match = re.search(rf"\[{victim}\] STABLE ([\d.]+)", out)
    assert match is not None, out
    assert float(match.group(1)) < 1.5, out  # the victim raised soon after its abort
    unwritten = re.search(rf"\[{victim}\] UNWRITTEN (\d+)", out)
    assert unwritten is not None and int(unwritten.group(1)) > 0, out  # the forwarders' writes were cut short
    for r in set(range(4)) - {victim}:
        assert re.search(rf"\[{r}\] FAILED (PeerFailure|CommClosedError)", out), out


@pytest.mark.multiprocess
@pytest.mark.parametrize("n, ops", [(2, "all"), (3, "all"), (4, "all"), (4, "broadcast")])
def test_a_killed_peer_fails_the_others(n: int, ops: str, tmp_path: Path) -> None:
    """Told they share 2 cores, 4 ranks' broadcasts forward: the victim (rank 1) forwards, reads
    or is the root in turn; every other rank raises naming it and the collective."""
    proc = run_job(n, str(HERE / "mp_direct.py"), timeout=120, grace=20, env={
        "PYTHONPATH": f"{HERE}{os.pathsep}{HERE.parent}", "AHCOMM_TRANSPORT": "sdma", "MODE": "kill",
        "KILL_FILE": str(tmp_path / "killed"), "AHCOMM_EXEC_TIMEOUT": "60", "AHCOMM_CORES": "2", "OPS": ops})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 128 + 9, out  # the victim's SIGKILL is the job's status
    lines = re.findall(r"\[(\d+)\] DETECTED rank \d+ type=(\w+) cause=(\w+) after=([\d.]+) msg=(.*)", proc.stdout)
    assert sorted(int(rank) for rank, *_ in lines) == [r for r in range(n) if r != 1], out
    for _, kind, cause, after, msg in lines:
        assert "PeerFailure" in (kind, cause) and "rank 1" in msg, out
        assert re.search(r"(broadcast|all_gather) #\d+", msg), out
        assert float(after) < 15, out


async def test_split_groups_run_direct_beside_the_parent(rng: np.random.Generator) -> None:
    """Groups of a 5-rank world (colors by parity) read their members' buffers through their own
    mailboxes, interleaved with the parent's calls."""
    xs = [rng.integers(-9, 9, 70_001).astype(np.float32) for _ in range(5)]

    async def body(comm: ahcomm.Comm) -> tuple[Any, Any, Any]:
        group = await comm.split(comm.rank % 2)
        assert group is not None
        try:
            members = [p for p in range(5) if p % 2 == comm.rank % 2]
            mine = await group.all_gather(xs[comm.rank], algorithm="direct")
            world = await comm.broadcast(xs[comm.rank].copy(), 3, algorithm="direct")
            theirs = await group.broadcast(xs[comm.rank].copy(), group.size - 1, algorithm="direct")
            assert group.stats()["paths"] == {"direct.single_copy": 2}
            return mine, world, (members, theirs)
        finally:
            await group.close()

    for mine, world, (members, theirs) in await run_inproc(5, body):
        np.testing.assert_array_equal(mine.reshape(-1), np.concatenate([xs[p] for p in members]))
        np.testing.assert_array_equal(world, xs[3])
        np.testing.assert_array_equal(theirs, xs[members[-1]])


def test_the_estimate_does_not_depend_on_this_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every rank must price a call alike: the copy threads in the estimate come from the model's
    cores (rank 0's), not from this process's affinity or AHCOMM_DIRECT_THREADS."""
    from ahcomm.algorithms.cost import CostModel
    topo = Topology(rank=0, size=2, hosts=("h", "h"), link_kinds=("self", "sdma"), all_mapped=True,
                    single_copy=True, mailbox=1 << 18)
    call = Call(op="broadcast", seq=0, dtype=np.dtype(np.float32), count=1 << 24)
    model = CostModel(cores=2)
    before = direct.Direct().cost(call, topo, model)
    monkeypatch.setattr(direct, "_cores", lambda: 64)
    monkeypatch.setenv("AHCOMM_DIRECT_THREADS", "1")
    assert direct.threads(call, topo) == 1
    assert direct.Direct().cost(call, topo, model) == before


async def test_non_contiguous_inputs_and_outputs_are_staged(rng: np.random.Generator) -> None:
    """A strided input, and a strided broadcast output, go through the communicator's contiguous
    staging: direct publishes and reads only flat buffers, and the results land in place."""
    xs = [rng.integers(-9, 9, (300, 2)).astype(np.float64) for _ in range(3)]

    async def body(comm: ahcomm.Comm) -> tuple[Any, Any]:
        gathered = await comm.all_gather(xs[comm.rank][:, 1], algorithm="direct")  # stride 16 bytes
        out = np.zeros((300, 2))
        got = await comm.broadcast(xs[comm.rank][:, 0], 2, out=out[:, 1], algorithm="direct")
        assert np.shares_memory(got, out) and not out[:, 0].any()
        return gathered, out[:, 1].copy()

    for gathered, bcast in await run_inproc(3, body, transport="sdma"):
        np.testing.assert_array_equal(gathered.reshape(-1), np.concatenate([x[:, 1] for x in xs]))
        np.testing.assert_array_equal(bcast, xs[2][:, 0])


async def test_a_broadcast_root_does_not_spin_through_the_readers_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    """The root's last wait lasts the peers' whole read: it sleeps at once, so its adaptive spin
    does not count a miss (eight in a row turned spinning off for the next 256 short waits)."""
    seen: list[tuple[int, bool]] = []
    real = direct.sync.arrivals

    async def arrivals(ctx: Any, tick: int, *args: Any, may_spin: bool = True, **kwargs: Any) -> None:
        seen.append((ctx.rank, may_spin))
        await real(ctx, tick, *args, may_spin=may_spin, **kwargs)

    monkeypatch.setattr(direct.sync, "arrivals", arrivals)
    x = np.arange(1 << 20, dtype=np.float32)  # 4 MiB
    await run_inproc(3, lambda c: c.broadcast(x if c.rank == 1 else np.empty_like(x), 1, algorithm="direct"))
    assert sorted(seen) == [(0, True), (0, True), (1, False), (1, True), (2, True), (2, True)]



@pytest.mark.parametrize("n, cores, broadcast, all_gather", [(2, 2, 2, 1), (3, 2, 1, 1), (4, 2, 1, 1), (5, 16, 2, 2),
                                                             (9, 16, 2, 1)])
def test_copy_threads_are_one_per_core_at_most_among_the_ranks_that_copy(
        n: int, cores: int, broadcast: int, all_gather: int) -> None:
    """A broadcast's n - 1 readers and an all_gather's n ranks each get a thread per core at most
    (up to THREADS). The old rule gave a broadcast's readers two threads each until the host's
    copy threads reached four times its cores: at 3 readers on 2 cores, slower than one from
    16 MiB, level at 2 readers (results/2026-11-27-push.md)."""
    topo = Topology(rank=0, size=n, hosts=("h",) * n, link_kinds=("self",) + ("sdma",) * (n - 1), all_mapped=True,
                    single_copy=True, mailbox=1 << 18)
    for op, want in (("broadcast", broadcast), ("all_gather", all_gather)):
        call = Call(op=op, seq=0, dtype=np.dtype(np.float32), count=1 << 24)
        assert direct.threads(call, topo, cores, direct.THREADS) == want, op

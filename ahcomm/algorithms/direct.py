"""Direct (one host, single copy): every receiver reads the sender's user buffer itself.

For broadcast and all_gather on one host, OpenMPI's CMA idea: each byte is copied once,
by the rank that receives it, straight out of the sender's user buffer into its own
destination (``DataLink.read``: ``process_vm_readv`` between processes, a memmove in one
process). Nothing is staged in a CCL buffer or mailbox slot.

A run is two mailbox publications (``transports.mailbox``, as ``oneshot`` uses them):

1. every rank publishes the address of its input (broadcast: the root, with how many readers
   forward; the others their output's and their gate's), and waits until every peer's
   publication is there (the fingerprints checked);
2. each receiver reads what it needs. broadcast: the root's vector, in slices on up to two
   threads where the host's cores allow (ctypes releases the GIL); where its readers outnumber
   the host's cores unevenly, the first readers forward instead (``_broadcast``: each reads a
   share and writes it into the other readers' outputs). all_gather: its own block's local copy
   and every peer's block, whole rows where the host's inputs and outputs fit its last-level
   cache (split among the lanes), else interleaved chunk by chunk (``CHUNK_BYTES``), every rank
   in the same order, so that a block's chunk is still in the cache when the others read it
   (``chunk_bytes``); where the host's ranks outnumber its cores, the copy loop yields its core
   after each chunk. A rank's copies below ``INLINE_BYTES`` (16 MiB) run inline on the event
   loop's thread, and all of them where it copies on one lane and its host has no core to spare
   (as the streams' copies do);
3. every rank publishes "done" and waits for every peer's: no rank returns, and so reuses
   or frees the buffer its peers read, before every reader has finished.

A rank that reads stops its own copies before its call returns, failed or cancelled. A
forwarder's writes into another reader's output stop where that reader's call has ended
(``_push``'s gates: the forwarder looks at the reader's gate before each piece, and a reader
whose call fails closes its gate and waits for each forwarder's release).

Where a rank cannot read its peers' memory (``Topology.single_copy`` false: the kernel's
ptrace policy, a container, ``AHCOMM_SINGLE_COPY=0``) the run falls back to ``oneshot``'s
staged path in slot-sized slices; the selector does not pick direct there (no estimate),
but a call that names it still runs. ``comm.stats()["paths"]`` counts which path ran
(``direct.single_copy``, ``direct.staged``; ``direct.forward`` too for a forwarded broadcast).

A peer that dies fails the run: a read of a dead process raises ``PeerFailure``, and the
executor fails the mailbox wait of every other rank (as for oneshot).
"""

from __future__ import annotations

import asyncio
import functools
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import numpy as np

from .._config import last_level_cache
from .._config import usable_cores as _cores  # a name tests replace
from .._errors import PeerFailure
from .._memcopy import copy
from .._stream import NO_ENGINE, engine_bytes_for
from ..transports.base import DataLink, Mailboxes
from . import _mailbox_sync as sync
from . import _push
from .base import Algorithm, Call, Context, Resources, Topology, oversubscribed
from .cost import CostModel, Work
from .oneshot import STEP, OneShot

OPS = frozenset({"broadcast", "all_gather"})
# One copy's bytes at most where a run has several moves (all_gather: the local copy and a read of
# each peer's block, interleaved chunk by chunk: ``_chunks``; a failed peer is noticed between
# chunks). Each piece costs Python, a ctypes call and, oversubscribed, a sched_yield: with the
# copies stubbed out a 32 MiB np=4 call cost 0.54-0.62 ms of CPU per rank in 512 KiB chunks,
# 0.30-0.35 in 2 MiB. With real copies and inputs whose pages are written (3 interleaved rounds,
# CPU ms per rank): np=4 32 MiB 4.3-4.9 in 512 KiB chunks, 4.0-4.4 in 2 MiB; np=2 32 MiB 4.2-4.4
# against 3.1-4.2; 1-4 MiB level (results/2026-11-26-aligned-copies.md). (The 512 KiB of
# results/2026-11-25-bw3.md was chosen on inputs that may have been the kernel's zero page.)
# Only where the host's data does not fit its last-level cache (``chunk_bytes``): with 480 MiB of
# it (the Intel VM) whole rows were 6-30% faster at every size, 16-64 MiB, np=2 and np=4
# (results/2026-11-26-direct-rows.md); the interleaving's gain was measured with 32 MiB (EPYC).
CHUNK_BYTES = 2 << 20
# A lone move (a broadcast reader's read, a root's copy) has nothing to interleave: it goes in
# slices of at most this, split among the lanes. Measured at 64 MiB, np=2, load 1-2: slices of
# 4 MiB 11.5-12.0 GB/s, of 32 MiB 13.6-13.9 (mesh's two halves 13.1-14.0).
SLICE_BYTES = 32 << 20
MIN_SLICE = 512 << 10  # a lone move is not cut below this to feed a second thread
# A rank's reads (and local copy) below this run inline on the event loop's thread: every hand-off
# to a copy thread and back is a wake-up on each side, and two threads reading one source contend.
# Measured (np=2, blocks of calls interleaved in one job, load 1.5-2.4, us per call): broadcast
# 2 MiB inline 410-533 vs two threads 660-1294 (one thread 935), 4 MiB 567 vs 968 (one: 526),
# 8 MiB 1050 vs 1262; 16 MiB threads ahead (1241 vs 1404), 64 MiB too (5479 vs 6699); all_gather
# 2 MiB 162 vs 511, np=4 1591 vs 2989 (results/2026-11-25-bw2.md).
# Above it too where a rank copies on one lane and its host has no core to spare (``on_loop``):
# there a thread only adds hand-offs (np=2 all_gather 16 / 32 / 64 MiB 1432 / 2814 / 7476 us on a
# thread, 1355 / 2663 / 7271 inline; np=4 3517 / 8296 / 18303 and 3240 / 7897 / 17867; 7
# interleaved rounds, results/2026-11-26-direct-rows.md).
INLINE_BYTES = 16 << 20
# Per-rank bytes up to which the selector leaves an op to the others (oneshot's slots): a 2 MiB
# copy through the kernel (4 KiB pages) takes 160-210 us, two in-cache copies through 1 MiB slots
# far less. Measured (np=2, blocks interleaved in one job, load 2.5, us/call, oneshot / direct /
# mesh): broadcast 2 MiB 124 / 353 / 376, 4 MiB 182 / 389 / 622 (the model prices oneshot's
# copies as out-of-cache and picks direct there, still ahead of mesh), 8 MiB 414-1473 / 630-940 /
# 1157; all_gather (in all) 2 MiB 180 / 188, 4 MiB 541 / 402, 8 MiB 1256 / 752; np=4 (load 3.3)
# broadcast 2 MiB 736 / 916, 4 MiB 1465 / 1348, 8 MiB 2169 / 1655; all_gather 2 MiB 670 / 939,
# 4 MiB 1204 / 1325, 8 MiB 2517 / 2614 (results/2026-11-25-bw2.md).
MIN_BYTES = {"all_gather": 1 << 20, "broadcast": 2 << 20}
THREADS = 2  # copy threads per rank at most (AHCOMM_DIRECT_THREADS), used where cores allow
FORWARD_PIECE = 1 << 20  # a forwarder's piece (``_forward``): read, then written from the cache to each reader

_FALLBACK = OneShot()
_POOLS: dict[int, ThreadPoolExecutor] = {}


def max_threads() -> int:
    """AHCOMM_DIRECT_THREADS (default ``THREADS``), at least 1."""
    raw = os.environ.get("AHCOMM_DIRECT_THREADS", "").strip()
    return max(1, int(raw)) if raw.isdigit() else THREADS


def threads(call: Call, topo: Topology, cores: int = 0, most: int = 0) -> int:
    """Copy threads of one rank, up to ``max_threads()``: a thread per core at most among the
    ranks that copy at once (all_gather: all n; broadcast: the n - 1 readers, the root only
    waits). Measured on 2 cores (interleaved rounds, us a call): all_gather np=2, 32 / 64 MiB,
    one thread 4.2-4.5 / 7.7-8.3 ms, two 4.5-5.9 / 8.3-8.9; broadcast (three rounds each,
    results/2026-11-27-push.md) np=2 32 / 64 MiB two threads 1954-2232 / 4635-5667 against one
    2736-3105 / 8981-10234, np=3 one 3684-4080 / 9845-10908 against two 3813-4808 / 9935-10388,
    np=4 one 7916-9080 / 18724-19003 against two 9048-9666 / 19592-20131 (two threads per reader
    had measured ahead at np=4 64 MiB on 2026-11-26, 3.99 against 3.62 GB/s, and were kept for
    as many readers as four times the cores until then). ``cores`` and ``most`` default to this
    process's cores and ``max_threads()``; the cost estimate passes the model's (rank 0's) and
    ``THREADS``, so that every rank prices a call alike."""
    cores, most = cores or _cores(), most or max_threads()
    copying = topo.size if call.op == "all_gather" else topo.size - 1
    return max(1, min(most, cores // max(1, copying)))


_cache = functools.cache(last_level_cache)  # bytes of this host's last-level cache (0: unknown); tests replace it


def chunk_bytes(footprint: int, largest: int, lanes: int) -> int:
    """The piece in which a run of several moves (all_gather) copies each: ``CHUNK_BYTES``, to
    interleave the moves (``_chunks``) where ``footprint``, the bytes of the host's inputs and
    outputs, exceeds its last-level cache (or the cache is unknown); else whole rows, each cut
    in ``lanes`` pieces at most (one span of them per lane): the peers read a block that is
    still in the cache anyway, and a read of a whole row costs one kernel call, not one per
    chunk."""
    cache = _cache()
    if cache <= 0 or footprint > cache:
        return CHUNK_BYTES
    return max(CHUNK_BYTES, -(-largest // max(1, lanes)))


def on_loop(topo: Topology, lanes: int) -> bool:
    """Whether a rank's copies run inline whatever their size: one lane, and a host whose ranks
    leave no core to spare (``AHCOMM_COPY_ENGINE`` as for the streams: ``engine_bytes_for``)."""
    return lanes <= 1 and engine_bytes_for(topo.size) == NO_ENGINE


def _pool(n: int) -> ThreadPoolExecutor:
    pool = _POOLS.get(n)
    if pool is None:
        pool = _POOLS[n] = ThreadPoolExecutor(max_workers=n, thread_name_prefix=f"ahcomm-direct{n}")
    return pool


def _address(array: np.ndarray) -> np.ndarray:
    return np.array([array.ctypes.data], np.int64)


class Direct(Algorithm):
    name = "direct"
    ops = OPS
    exchanges = True  # every rank hears from every peer in every run (two publications)

    def select(self, call: Call, topo: Topology) -> bool:
        return call.op in OPS and call.counts is None and (topo.size == 1 or topo.mailbox > 0)

    def resources(self, call: Call, topo: Topology, half_bytes: int) -> Resources:
        """Single copy: the whole call in one run (it slices its reads itself); staged: oneshot's slices."""
        if topo.single_copy:
            return Resources()
        return _FALLBACK.resources(call, topo, half_bytes)

    def cost(self, call: Call, topo: Topology, model: CostModel) -> float | None:
        """None (never picked by the selector) where ranks cannot read each other's memory, and
        where a rank's input fits one mailbox slot: there oneshot's single publication beats
        direct's two (measured np=2/4 at 64 KiB: 140-300 vs 280-2100 us on the loaded host); nor
        below ``MIN_BYTES`` per rank."""
        nbytes = call.count * call.itemsize
        if topo.size > 1 and (not topo.single_copy or nbytes <= max(topo.mailbox, MIN_BYTES.get(call.op, 0))):
            return None
        return super().cost(call, topo, model)

    def work(self, call: Call, topo: Topology, model: CostModel, whole: float, block: float) -> Work:
        """Two mailbox steps (publish and wait, ``STEP`` of a link's alpha each); each byte is
        copied once into each destination: broadcast ``m`` by each reader (the root only
        publishes), all_gather ``n m`` by each rank (its block into its own output and every
        peer's); every byte read out of a peer pays the kernel's page pinning (``Work.pinned``);
        copies of at least ``INLINE_BYTES`` are handed to threads (one engine hand-off), spread
        over ``threads`` of them, except on one lane where the model's host has no core to spare
        (``on_loop``)."""
        busy = topo.size - 1 if call.op == "broadcast" else None
        lanes = threads(call, topo, model.cores or 1, THREADS)
        handed = whole >= INLINE_BYTES and (lanes > 1 or model.engines_on(topo))
        return Work(rounds=2 * STEP, copied=whole, pinned=whole if call.op == "broadcast" else whole - block,
                    engines=1 if handed else 0, busy=busy, streams=lanes, threads=True)

    async def orchestrate(self, ctx: Context) -> None:
        if not ctx.topo.single_copy:
            ctx.tally("direct.staged")
            await _FALLBACK.orchestrate(ctx)
            await sync.settle(ctx)  # a broadcast's non-root waited for the root only: direct's runs are exchanged
            return
        ctx.tally("direct.single_copy")
        if ctx.call.op == "broadcast":
            await _broadcast(ctx)
            return
        box = ctx.mailbox
        assert box is not None, "direct runs only where the executor has a mailbox"
        call, n, r = ctx.call, ctx.size, ctx.rank
        src, dst = ctx.src, ctx.dst
        tick, _ = await sync.publish(ctx, _address(src))
        await sync.arrivals(ctx, tick)
        # Only this rank writes into its output (reads of the peers' inputs): a call that fails or
        # is cancelled stops its own copies before it returns, and nothing else writes there.
        moves: list[Move] = []
        if not np.shares_memory(dst[r], src):
            moves.append(_copying(dst[r], src, ctx.stream_output()))
        for p in ((r + k) % n for k in range(1, n)):  # dst: (n, count), rows contiguous; peers in turn from the next
            moves.append(_reading(ctx.links[p], dst[p], int(box.payload(p, tick).view(np.int64)[0])))
        footprint = n * (src.nbytes + dst.nbytes)  # the host's inputs and outputs (direct runs on one host)
        lanes = threads(call, ctx.topo)
        await _copy_all(moves, lanes, oversubscribed(ctx.topo, _cores()), footprint, on_loop(ctx.topo, lanes))
        await _finish(ctx)


async def _finish(ctx: Context) -> None:
    """The run's last round: "done reading" from every rank, and every peer's awaited (no rank
    returns while a peer may still read its input, or write its output)."""
    box = ctx.mailbox
    assert box is not None
    call = ctx.call
    tick, _ = box.publish(call.seq, ctx.fingerprint)  # nothing loose: every peer's first publication was seen
    # A broadcast's root waits here for the whole read: sleeping at once keeps its spin for short waits
    await sync.arrivals(ctx, tick, may_spin=call.op != "broadcast" or ctx.rank != call.root)


def forwarders(readers: int, cores: int) -> int:
    """How many of a broadcast's readers forward (``_broadcast``): one per core where the readers
    outnumber the host's cores and cannot share them evenly, else none (each reader reads its
    whole output itself). Three readers on two cores: one reads alone, two share a core, and the
    last finishes alone; two forwarders keep both cores busy to the end. Measured on 2 cores, 32
    MiB, forwarded against read whole (results/2026-11-27-forward.md): np=4 9.8-14.0 ms against
    12.5-15.8 (64 MiB 20.7-25.0 against 25.1-28.8), np=6 17.5-20.1 against 18.8-21.2, np=8 level;
    but np=5 and np=7, whose readers share the cores evenly, 7-20% slower."""
    cores = max(1, cores)
    return cores if readers > cores and readers % cores else 0


async def _broadcast(ctx: Context) -> None:
    """A single-copy broadcast. Round one: the root publishes its input's address and how many
    readers forward (``forwarders``, its decision for every rank); each reader its output's
    address and its gate's (``_push``). Then each reader reads the root's vector into its
    output; or, where some forward, each forwarder reads its share of it piece by piece and writes
    each piece into the other readers' outputs while the piece is in its cache (a 4-process copy
    of 32 MiB with raw system calls took 8.2-9.9 ms a call forwarded against 10.1-10.6 read whole;
    results/2026-11-27-forward.md). Round two: "done" from every rank (``_finish``).

    A reader whose call fails closes its gate and waits until no forwarder may still write into
    its output (``_settle``)."""
    box, gates = ctx.mailbox, ctx.gates
    assert box is not None and gates is not None, "direct runs only where the executor has a mailbox and gates"
    call, n, r = ctx.call, ctx.size, ctx.rank
    root, seq = call.root, call.seq
    readers = [(root + k) % n for k in range(1, n)]
    if r == root:
        mine = np.array([ctx.src.ctypes.data, forwarders(n - 1, _cores())], np.int64)
    else:
        gates.open(seq)  # before the output's address goes out: forwarders may write it from then on
        mine = np.array([ctx.dst.ctypes.data, gates.address], np.int64)
    tick: int | None = None
    try:
        tick, _ = await sync.publish(ctx, mine)
        await sync.arrivals(ctx, tick)
        at, count = (int(v) for v in box.payload(root, tick).view(np.int64)[:2])
        if count:
            ctx.tally("direct.forward")
        moves: list[Move] = []
        if r == root:
            if not np.shares_memory(ctx.dst, ctx.src):
                moves.append(_copying(ctx.dst, ctx.src, ctx.stream_output()))
        elif not count:
            gates.done(seq)  # writes into no peer's output, and no peer into this one
            moves.append(_reading(ctx.links[root], ctx.dst, at))
        else:
            posted = {p: [int(v) for v in box.payload(p, tick).view(np.int64)[:2]] for p in readers if p != r}
            senders = readers[:count]
            gates.expose(seq, {p: posted[p][1] for p in senders if p != r})
            if r in senders:
                _forward(ctx, at, _share(ctx.dst.nbytes, count, senders.index(r)), posted)
            else:
                gates.done(seq)  # writes into no peer's output
        if moves:
            lanes = threads(call, ctx.topo)
            await _copy_all(moves, lanes, oversubscribed(ctx.topo, _cores()), inline=on_loop(ctx.topo, lanes))
        await _finish(ctx)
    except BaseException as exc:
        if r != root:
            await _settle(ctx, tick, readers, _push.cause_of(exc))
        raise


def _share(nbytes: int, count: int, index: int) -> tuple[int, int]:
    """Forwarder ``index``'s bytes [lo, hi) of ``count``: whole pieces (``FORWARD_PIECE``) but the last."""
    pieces = -(-nbytes // FORWARD_PIECE)
    lo, hi = (pieces * index // count, pieces * (index + 1) // count)
    return lo * FORWARD_PIECE, min(nbytes, hi * FORWARD_PIECE)


def _forward(ctx: Context, at: int, share: tuple[int, int], posted: dict[int, list[int]]) -> None:
    """Read ``share`` of the root's vector (at ``at``) into this reader's output piece by piece
    (out of the root's ``ahcomm.alloc`` memory where this rank maps it, else through the
    kernel), and write each piece into every other reader's output (``posted``: its address and
    its gate's) while it is in the cache; each owner's gate is looked at before each piece
    (``_push.check``: it stops at one a failed call closed). Inline, on the event loop's thread:
    forwarding runs only where the readers outnumber the cores (no core to hand a copy to)."""
    gates, call, r = ctx.gates, ctx.call, ctx.rank
    assert gates is not None
    if not gates.begin(call.seq):  # the call already failed here: write nothing, and say so
        raise PeerFailure(f"rank {r}'s {call.op} #{call.seq} ended before it forwarded its share", rank=r,
                          op=call.op, seq=call.seq)
    owners: list[_push.Owner] = []
    lo, hi = share
    try:
        owners += _push.owners(ctx.links, {p: words for p, (_, words) in posted.items()})
        mapped = ctx.links[call.root].view(at + lo, hi - lo) if hi > lo else None
        source = _push.pipe(ctx.links[call.root])
        outputs = [(_push.pipe(ctx.links[p]), out) for p, (out, _) in posted.items()]
        mine = ctx.dst.reshape(-1).view(np.uint8)
        here = int(mine.ctypes.data)
        for piece in range(lo, hi, FORWARD_PIECE):
            nbytes = min(FORWARD_PIECE, hi - piece)
            if mapped is not None:
                copy(mine[piece:piece + nbytes], mapped[piece - lo:piece - lo + nbytes])
            else:
                source.read(here + piece, at + piece, nbytes)
            _push.check(gates, call.seq, call.op, r, owners)
            for pipe, out in outputs:
                pipe.write(here + piece, out + piece, nbytes)
    finally:
        gates.done(call.seq)
        owners.clear()  # views of peers' memory: an error's traceback keeps this frame
        mapped = None


def _posted(box: Mailboxes, owner: int, tick: int, mine: tuple[int, int]) -> np.ndarray | None:
    """The two int64s ``owner`` published at ``tick`` for this call, or None (not yet, or its slot
    holds a later publication by now: the owner saw this rank's "done", so it writes no more)."""
    if box.arrived(owner, tick) != mine:
        return None
    words = box.payload(owner, tick).view(np.int64)[:2].copy()
    return words if words.size == 2 and box.arrived(owner, tick) == mine else None


async def _settle(ctx: Context, tick: int | None, readers: list[int], cause: int | None) -> None:
    """A reader's failed call: close its gate, then wait until no forwarder may still write into
    its output (``_push.settle``; ``cause``: the rank whose failure ended the call, for the
    forwarders' errors). A forwarder writes only after it has seen the root's
    publication and made its own; a reader that does not see one of them after closing its gate
    (``Gates.close`` fences) is past every look that forwarder could take of the gate open."""
    box, gates = ctx.mailbox, ctx.gates
    assert box is not None and gates is not None
    seq, mine = ctx.call.seq, (ctx.call.seq, ctx.fingerprint)
    gates.close(seq, cause)
    writers: dict[int, int] = {}
    root = _posted(box, ctx.call.root, tick, mine) if tick is not None else None
    if root is not None:
        assert tick is not None
        for p in readers[:int(root[1])]:
            theirs = _posted(box, p, tick, mine) if p != ctx.rank else None
            if theirs is not None:
                writers[p] = int(theirs[1])
    gates.expose(seq, writers)
    await _push.settle(gates, ctx.links, seq, ctx.call.op, cause)


class _Later:
    """A link's runner (``MemoryRunner``) that keeps each copy to run later, in order; the link
    counts its bytes at once, on the event loop's thread."""

    def __init__(self) -> None:
        self.ops: list[Callable[[], Any]] = []

    def __call__(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        self.ops.append(functools.partial(fn, *args, **kwargs))


Move = tuple[int, Callable[[int, int, _Later], None]]  # (bytes, queue the copy of bytes [lo, hi) on a _Later)


def _copying(dst: np.ndarray, src: np.ndarray, stream: bool = False) -> Move:
    to, of = (a.reshape(-1).view(np.uint8) for a in (dst, src))
    return to.nbytes, lambda lo, hi, later: later(copy, to[lo:hi], of[lo:hi], stream)


def _reading(link: DataLink, dst: np.ndarray, addr: int) -> Move:
    raw = dst.reshape(-1).view(np.uint8)

    def piece(lo: int, hi: int, later: _Later) -> None:
        link.read(raw[lo:hi], addr + lo, later)
    return raw.nbytes, piece


def _chunks(moves: list[Move], chunk: int) -> list[list[Callable[[], Any]]]:
    """The copies of a run, chunk by chunk: chunk ``k`` is every move's ``k``-th piece, in the
    moves' order. Every rank walks its rows alike, so a block's chunk is read while its owner's
    local copy (or another reader's read) of it is in the cache, and comes out of memory about
    once (np=2, 32 MiB blocks: 7.6-8.4 ms in 512 KiB chunks, 8.9-9.3 rows whole;
    results/2026-11-25-bw3.md; ``CHUNK_BYTES`` says why the chunks are now 2 MiB)."""
    chunks = []
    for lo in range(0, max((nbytes for nbytes, _ in moves), default=0), chunk):
        later = _Later()
        for nbytes, piece in moves:
            if lo < nbytes:
                piece(lo, min(lo + chunk, nbytes), later)
        chunks.append(later.ops)
    return chunks


def _run(chunks: list[list[Callable[[], Any]]], stop: threading.Event | None, yields: bool) -> None:
    """Run the chunks' copies in order (until ``stop`` is set); with ``yields``, give the core away
    after each chunk (``_copy_all``)."""
    for ops in chunks:
        if stop is not None and stop.is_set():
            return
        for op in ops:
            op()
        if yields:
            os.sched_yield()


async def _copy_all(moves: list[Move], lanes: int, yields: bool, footprint: int = 0, inline: bool = False) -> None:
    """Make every move in chunks of ``chunk_bytes`` (``_chunks``; ``footprint``: the host's
    inputs' and outputs' bytes; a lone move in slices of up to ``SLICE_BYTES``, one per lane):
    inline if small or ``inline`` (``on_loop``), else on ``lanes`` threads, each a contiguous
    span of the chunks; waits for every lane (none still writes once this returns).

    ``yields`` (the host's ranks outnumber its cores): give the core away after every chunk.
    Without it the scheduler runs a rank's whole copy (8 ms at 64 MiB) in one slice while others
    wait, the last rank finishes alone and a core idles: np=4 on 2 cores, 64 MiB all_gather, each
    rank's copy took 6-8.7 ms of CPU but 8.5-18 ms of wall time, 21.2 ms a call; yielding after
    each chunk, 12-13.7 ms of wall for every rank, 15.2 ms a call (after every second chunk 20.4,
    every fourth 26.3)."""
    total = sum(nbytes for nbytes, _ in moves)
    inline = inline or total < INLINE_BYTES
    if len(moves) > 1:
        chunk = chunk_bytes(footprint, max(nbytes for nbytes, _ in moves), 1 if inline else lanes)
    else:  # a lone move: one piece inline, else a slice per lane
        chunk = max(1, total) if inline else max(MIN_SLICE, min(SLICE_BYTES, -(-total // lanes)))
    chunks = _chunks(moves, chunk)
    if inline:
        _run(chunks, None, yields)
        return
    lanes = max(1, min(lanes, len(chunks)))
    pool = _pool(lanes)
    stop = threading.Event()
    spans = [chunks[i * len(chunks) // lanes:(i + 1) * len(chunks) // lanes] for i in range(lanes)]
    tasks: list[Future[Any]] = [pool.submit(_run, span, stop, yields) for span in spans]
    lanes_done = [asyncio.wrap_future(task) for task in tasks]
    for lane in lanes_done:  # a lane's error after another's is raised is still retrieved (no log)
        lane.add_done_callback(lambda f: f.cancelled() or f.exception())
    try:
        await asyncio.gather(*lanes_done)
    except BaseException:
        stop.set()  # lanes finish the chunk they are in and start no other
        wait(tasks)  # nothing writes into dst after we return
        raise

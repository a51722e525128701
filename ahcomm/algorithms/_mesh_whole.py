"""Mesh for the ops run whole: gather(_v), scatter(_v), all_to_all(_v), all_gather_v,
reduce_scatter_v and reduce (one host, mapped links; used by ``mesh.Mesh``).

As in HCCL's AlltoAll mesh, a sender stages a block in its own CCL_In and posts DataSignal;
the receiver copies (or reduces) it straight out of the sender's buffer, reads from
different peers on their own sub-streams. These calls are never sliced, so blocks of any
size stream through ``Pull``: the sender's CCL_In half is cut into one region per receiver
(one region that every receiver reads when they all get the same block), each region into
``SLOTS`` slots. Piece k of a block lies in slot k mod SLOTS; from the SLOTS-th piece on the
sender first waits for the readers' Ack (credit) of the piece that used the slot before. A
block that fits its region goes as one piece and needs no credit: small calls cost one
DataSignal per pair, and the executor handles the reuse of the buffer half afterwards.

* gather(_v): every rank stages its block for the root (one region); the root reads them.
* scatter(_v): the root stages block p in region p; rank p reads it.
* all_to_all(_v): rank r stages its block for p in region p; p reads it.
* all_gather_v: every rank stages its block once; every peer reads it.
* reduce_scatter_v: rank p reduces block p of every peer's staged input into its output.
* reduce: rank p reduces share p of ``split(count, n)`` the same way, into its CCL_Out
  (piece by piece, through a second ``Pull`` with the same piecing); the root reads the
  reduced shares from there. Own contribution first, then the peers'.

Single copy (``Topology.single_copy``): a pair whose block has at least ``SC_BYTES`` skips
the staging. The sender posts the block's address with DataSignal(SC_INDEX), the receiver
reads the user buffer in one copy and Acks, and the sender waits for every such Ack before
it returns. Both sides of a pair know the block size, so they always agree.

No deadlock however large the blocks: every task has a key (piece, phase) - stage k is
(k, 0), a read or reduction of piece k (k, 1), the root's read of a reduced piece (k, 2),
the single-copy handshake first and its closing waits last - and waits only for tasks of
lower keys (piece k waits for the credit of piece k - SLOTS). Each stream runs its tasks in
key order, so the lowest unfinished task can always run. Every notify is waited on one
stream only, so a post always wakes the task it is meant for.

Costs (a: one notify step; b, c, g: per byte read from a peer, copied locally, reduced;
m: bytes of one block, the largest for the _v ops; M: bytes of reduce's vector): gather
a + m c + (n - 1) m b at the root; scatter a + (n - 1) m c + m b; all_to_all a + (n - 1) m
(c + b); all_gather_v a + m c + (n - 1) m b; reduce_scatter_v a + (n - 1) m (c + g), the
reduction reading the peers' buffers; reduce 2 a + (n - 1) / n M (c + g + b). A single-copy
pair drops its c term and adds one a (the closing Ack). A block larger than its region
(H / (n - 1), or the whole CCL half H for gather and all_gather_v) moves in pieces of
min(H / regions / SLOTS, 1 MiB), pipelined: about one more notify per piece.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import numpy as np

from .._errors import ConfigError
from .._stream import Stream
from ..transports.base import Signal
from .base import ALIGN, Call, Context, Topology, aligned, split
from .cost import HALF_BYTES, Work, engine_tasks, npieces

SLOTS = 4  # credits per region: pieces of one block in flight
PIECE_BYTES = 1 << 20  # largest piece of a block that does not fit its region
SC_BYTES = 256 << 10  # pair blocks from this size are read from the sender's user buffer
SC_INDEX = 2 * SLOTS  # notify index of the single-copy handshake (the Pulls use 0 .. 2 SLOTS - 1)
FIRST, LAST = -1, 1 << 62  # plan keys of the handshake's start and of its closing waits

Key = tuple[int, int]
OPS = frozenset({"gather", "gather_v", "scatter", "scatter_v", "all_to_all", "all_to_all_v", "all_gather_v",
                 "reduce_scatter_v", "reduce"})


class Pull:
    """Pipelined blocks that receivers read out of the sender's CCL buffer ``buf``."""

    def __init__(self, ctx: Context, regions: int, buf: str = "in", base: int = 0) -> None:
        self.ctx, self.buf, self.base = ctx, buf, base
        item = ctx.call.itemsize
        self.own = ctx.ccl_in if buf == "in" else ctx.ccl_out
        self.region_bytes = aligned(self.own.nbytes // regions, item)
        unit = aligned(max(ALIGN, item), item) or item
        self.slots = min(SLOTS, self.region_bytes // unit)
        if self.slots < 1:
            raise ConfigError(f"AHCOMM_BUFFSIZE is too small for mesh {ctx.call.op} on {ctx.size} ranks: a CCL "
                              f"half of {self.own.nbytes} bytes cannot give {regions} region(s) of {unit} bytes")
        self.slot_bytes = aligned(self.region_bytes // self.slots, item)
        self.step = max(1, min(self.slot_bytes, PIECE_BYTES) // item)
        self.lone = min(self.region_bytes, PIECE_BYTES) // item  # a block up to this is one piece

    def pieces(self, count: int) -> list[tuple[int, int]]:
        if count <= self.lone:
            return [(0, count)] if count else []
        return [(a, min(a + self.step, count)) for a in range(0, count, self.step)]

    def _at(self, region: int, k: int) -> int:
        return region * self.region_bytes + (k % self.slots) * self.slot_bytes

    def slot(self, region: int, k: int, count: int) -> np.ndarray:
        """Where this rank stages piece ``k`` of its block in ``region``."""
        return self.ctx.typed(self.own, self._at(region, k), count)

    def landed(self, sender: int, region: int, k: int, count: int) -> np.ndarray:
        """Piece ``k`` as ``sender`` staged it in its ``region`` (mapped)."""
        return self.ctx.typed(self.ctx.remote(sender, self.buf), self._at(region, k), count)

    def _signal(self, stream: Stream, peers: Sequence[int], signal: Signal, k: int, post: bool) -> None:
        for p in peers:
            (self.ctx.post if post else self.ctx.wait)(stream, p, signal, self.base + k % self.slots)

    def claim(self, stream: Stream, readers: Sequence[int], k: int) -> None:
        """Before staging piece ``k``: wait for the credit of the piece that used its slot."""
        if k >= self.slots:
            self._signal(stream, readers, Signal.ACK, k, post=False)

    def publish(self, stream: Stream, readers: Sequence[int], k: int) -> None:
        self._signal(stream, readers, Signal.DATA, k, post=True)

    def arrive(self, stream: Stream, senders: Sequence[int], k: int) -> None:
        self._signal(stream, senders, Signal.DATA, k, post=False)

    def release(self, stream: Stream, senders: Sequence[int], k: int, total: int) -> None:
        """After reading piece ``k`` of ``total``: credit its slot if the sender will reuse it."""
        if k + self.slots < total:
            self._signal(stream, senders, Signal.ACK, k, post=True)


class Plan:
    """Tasks collected with their keys, then enqueued in key order (see the module docstring)."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.streams = ctx.subs or [ctx.main]
        self._items: list[tuple[Key, int, Callable[[], None]]] = []
        self.sc = ctx.topo.single_copy

    def add(self, key: Key, job: Callable[[], None]) -> None:
        self._items.append((key, len(self._items), job))

    def stream(self, i: int) -> Stream:
        return self.streams[i % len(self.streams)]

    def single(self, count: int) -> bool:
        """Whether a pair's block of ``count`` elements is read in place (the same on both sides)."""
        return self.sc and count * self.ctx.call.itemsize >= SC_BYTES

    def send(self, pull: Pull, readers: Sequence[int], region: int, src: np.ndarray, *, sc: bool = True) -> None:
        """Stage ``src`` for ``readers`` (or, with ``sc``, let big blocks be read in place)."""
        main = self.ctx.main
        if sc and self.single(src.size):
            for p in readers:
                self.add((FIRST, 0), partial(self.ctx.post, main, p, Signal.DATA, SC_INDEX, src.ctypes.data))
                self.add((LAST, 0), partial(self.ctx.wait, main, p, Signal.ACK, SC_INDEX))
            return
        for k, (a, b) in enumerate(pull.pieces(src.size)):
            self.add((k, 0), partial(_stage, pull, main, readers, region, k, src[a:b]))

    def recv(self, pull: Pull, stream: Stream, sender: int, region: int, dst: np.ndarray, phase: int = 1) -> None:
        if phase == 1 and self.single(dst.size):
            self.add((FIRST, 1), partial(_read, self.ctx, stream, sender, dst))
            return
        cut = pull.pieces(dst.size)
        for k, (a, b) in enumerate(cut):
            self.add((k, phase), partial(_fetch, pull, stream, sender, region, k, len(cut), dst[a:b]))

    def copy(self, dst: np.ndarray, src: np.ndarray) -> None:
        self.add((FIRST, 0), partial(self.ctx.main.copy, dst, src))

    def submit(self) -> None:
        for _, _, job in sorted(self._items, key=lambda item: item[:2]):
            job()


def _stage(pull: Pull, stream: Stream, readers: Sequence[int], region: int, k: int, piece: np.ndarray) -> None:
    pull.claim(stream, readers, k)
    stream.copy(pull.slot(region, k, piece.size), piece)
    pull.publish(stream, readers, k)


def _fetch(pull: Pull, stream: Stream, sender: int, region: int, k: int, total: int, dst: np.ndarray) -> None:
    pull.arrive(stream, [sender], k)
    stream.copy(dst, pull.landed(sender, region, k, dst.size))
    pull.release(stream, [sender], k, total)


def _read(ctx: Context, stream: Stream, sender: int, dst: np.ndarray) -> None:
    ctx.wait(stream, sender, Signal.DATA, SC_INDEX)
    ctx.read(stream, sender, dst, Signal.DATA, SC_INDEX)
    ctx.post(stream, sender, Signal.ACK, SC_INDEX)


def _chain(target: np.ndarray, own: np.ndarray, parts: list[np.ndarray], ufunc: np.ufunc) -> None:
    ufunc(own, parts[0], out=target)
    for part in parts[1:]:
        ufunc(target, part, out=target)


def _reduce_piece(pull: Pull, stream: Stream, k: int, total: int, target: np.ndarray, own: np.ndarray,
                  forward: tuple[Pull, int] | None) -> None:
    """target = own op (piece k of every peer's block for us); then, with ``forward``
    (out Pull, root), target is our slot of the out Pull and the root is told."""
    ctx = pull.ctx
    ufunc = ctx.ufunc
    assert ufunc is not None
    n, r = ctx.size, ctx.rank
    senders = [(r - j) % n for j in range(1, n)]
    pull.arrive(stream, senders, k)
    if forward is not None:
        forward[0].claim(stream, [forward[1]], k)
    parts = [pull.landed(s, (r - s - 1) % n, k, target.size) for s in senders]
    stream.submit(lambda: stream.memory(_chain, target, own, parts, ufunc))
    pull.release(stream, senders, k, total)
    if forward is not None:
        forward[0].publish(stream, [forward[1]], k)


# -- the ops ---------------------------------------------------------------------------------------
def _gather(ctx: Context, plan: Plan, d: list[int]) -> None:
    n, r, root = ctx.size, ctx.rank, ctx.call.root
    pull = Pull(ctx, 1)
    if r != root:
        plan.send(pull, [root], 0, ctx.src)
        return
    plan.copy(ctx.dst[d[r]:d[r + 1]], ctx.src)
    for j in range(1, n):
        p = (r + j) % n
        plan.recv(pull, plan.stream(j - 1), p, 0, ctx.dst[d[p]:d[p + 1]])


def _scatter(ctx: Context, plan: Plan, d: list[int]) -> None:
    n, r, root = ctx.size, ctx.rank, ctx.call.root
    pull = Pull(ctx, n - 1)
    if r != root:
        plan.recv(pull, plan.stream(0), root, (r - root - 1) % n, ctx.dst)
        return
    plan.copy(ctx.dst, ctx.src[d[r]:d[r + 1]])
    for j in range(1, n):
        p = (r + j) % n
        plan.send(pull, [p], j - 1, ctx.src[d[p]:d[p + 1]])


def _all_to_all(ctx: Context, plan: Plan, d: list[int]) -> None:
    n, r, call = ctx.size, ctx.rank, ctx.call
    assert call.counts is not None and call.recv_counts is not None
    sd, rd = Call.displs(call.counts), Call.displs(call.recv_counts)
    pull = Pull(ctx, n - 1)
    plan.copy(ctx.dst[rd[r]:rd[r + 1]], ctx.src[sd[r]:sd[r + 1]])
    for j in range(1, n):  # region j - 1 of the sender holds the block for sender + j
        p, s = (r + j) % n, (r - j) % n
        plan.send(pull, [p], j - 1, ctx.src[sd[p]:sd[p + 1]])
        plan.recv(pull, plan.stream(j - 1), s, j - 1, ctx.dst[rd[s]:rd[s + 1]])


def _all_gather_v(ctx: Context, plan: Plan, d: list[int]) -> None:
    n, r = ctx.size, ctx.rank
    pull = Pull(ctx, 1)
    plan.send(pull, [(r + j) % n for j in range(1, n)], 0, ctx.src)
    plan.copy(ctx.dst[d[r]:d[r + 1]], ctx.src)
    for j in range(1, n):
        s = (r - j) % n
        plan.recv(pull, plan.stream(j - 1), s, 0, ctx.dst[d[s]:d[s + 1]])


def _reduce_scatter_v(ctx: Context, plan: Plan, d: list[int]) -> None:
    n, r = ctx.size, ctx.rank
    pull = Pull(ctx, n - 1)
    for j in range(1, n):
        p = (r + j) % n
        plan.send(pull, [p], j - 1, ctx.src[d[p]:d[p + 1]], sc=False)
    own = ctx.src[d[r]:d[r + 1]]
    cut = pull.pieces(own.size)
    for k, (a, b) in enumerate(cut):
        plan.add((k, 1), partial(_reduce_piece, pull, plan.stream(0), k, len(cut), ctx.dst[a:b], own[a:b], None))


def _reduce(ctx: Context, plan: Plan, d: list[int]) -> None:
    n, r, root = ctx.size, ctx.rank, ctx.call.root
    pull, out = Pull(ctx, n - 1), Pull(ctx, n - 1, "out", SLOTS)
    shares = split(ctx.src.size, n)
    for j in range(1, n):
        a, b = shares[(r + j) % n]
        plan.send(pull, [(r + j) % n], j - 1, ctx.src[a:b], sc=False)
    lo, hi = shares[r]
    cut = pull.pieces(hi - lo)
    for k, (a, b) in enumerate(cut):
        if r == root:
            target, forward = ctx.dst[lo + a:lo + b], None
        else:
            target, forward = out.slot((root - r - 1) % n, k, b - a), (out, root)
        plan.add((k, 1), partial(_reduce_piece, pull, plan.stream(0), k, len(cut), target, ctx.src[lo + a:lo + b],
                                 forward))
    if r == root:  # the reduced shares, from the peers' CCL_Out
        for j in range(1, n):
            p = (r + j) % n
            a, b = shares[p]
            plan.recv(out, plan.stream(j), p, (root - p - 1) % n, ctx.dst[a:b], phase=2)


# How each op in ``OPS`` is planned: (ctx, plan, displacements of Call.counts, [] without counts).
_PLANS: dict[str, Callable[[Context, Plan, list[int]], None]] = {
    "gather": _gather, "gather_v": _gather, "scatter": _scatter, "scatter_v": _scatter,
    "all_to_all": _all_to_all, "all_to_all_v": _all_to_all, "all_gather_v": _all_gather_v,
    "reduce_scatter_v": _reduce_scatter_v, "reduce": _reduce}
assert _PLANS.keys() == OPS


def orchestrate_whole(ctx: Context) -> None:
    """Enqueue the one run of an op in ``OPS`` (the caller synchronizes)."""
    op, counts = ctx.call.op, ctx.call.counts
    plan = Plan(ctx)
    d = Call.displs(counts) if counts is not None else []
    _PLANS[op](ctx, plan, d)
    plan.submit()


# -- cost ------------------------------------------------------------------------------------------
def _geometry(regions: int) -> tuple[int, int]:
    """(bytes a block may have and still go as one piece, bytes per piece beyond) at the
    default CCL half (the cost model's ``HALF_BYTES``)."""
    region = HALF_BYTES // max(1, regions)
    return min(region, PIECE_BYTES), max(ALIGN, min(region // SLOTS, PIECE_BYTES))


def whole_work(call: Call, topo: Topology) -> Work:
    """What the busiest rank does in one of the ``OPS`` (the module docstring's costs).

    A block that goes as one piece is a copy into the sender's buffer and a copy out of it
    (``copied``); a bigger one streams through the slots, piece by piece, as ``Channels``
    does (``link``): a DataSignal per piece and, beyond ``SLOTS`` pieces, a credit. A
    single-copy pair is one read of the sender's memory, a DataSignal, an Ack and one more
    step. all_to_all_v is costed from ``n`` alone: its counts differ from rank to rank, and
    every rank must pick the same algorithm.
    """
    n, op, item = topo.size, call.op, call.itemsize
    peers, fan = n - 1, min(n - 1, 3)
    if op == "all_to_all_v":
        sizes = [0] * n
    elif call.counts is not None:
        sizes = [c * item for c in call.counts]
    else:  # reduce: the shares of the vector
        sizes = [(b - a) * item for a, b in split(call.count, n)]
    biggest, total = max(sizes, default=0), sum(sizes)
    sc_ok = topo.single_copy and op not in ("reduce", "reduce_scatter_v")
    regions = 1 if op in ("gather", "gather_v", "all_gather_v") else peers
    lone, step = _geometry(regions)

    def parts(nbytes: float) -> int:
        return 1 if nbytes <= lone else npieces(nbytes, step)

    def move(blocks: list[int], stage: bool) -> tuple[float, float, float, float, bool]:
        """(copied, link, posts, engine tasks, any single copy) for reading ``blocks`` (and
        staging them)."""
        copied = link = posts = engines = 0.0
        sc = False
        for b in blocks:
            k = parts(b)
            if sc_ok and b >= SC_BYTES:
                copied, posts, engines, sc = copied + b, posts + 2, engines + engine_tasks(b), True
            elif k > 1:
                link, posts = link + b, posts + k + max(0, k - SLOTS)
                engines += 2 * engine_tasks(b, step)
            else:
                copied, posts = copied + (2 if stage else 1) * b, posts + 1
                engines += (2 if stage else 1) * engine_tasks(b)
        return copied, link, posts, engines / fan, sc

    others = [b for p, b in enumerate(sizes) if p != call.root]
    if op in ("gather", "gather_v"):  # the root reads every block (single copy: the owners rest)
        copied, link, posts, engines, sc = move(others, stage=True)
        # The owners post their DataSignals at once; the root posts an Ack per single-copy pair
        # and the credits.
        owner = [1 if sc_ok and b >= SC_BYTES else parts(b) for b in others]  # DataSignals of each owner
        return Work(rounds=1 + sc, copied=copied + sizes[call.root], link=link,
                    tasks=posts - sum(owner) + max(owner, default=0), engines=engines, busy=1 if sc else 2,
                    streams=fan)
    if op in ("scatter", "scatter_v"):  # the root stages every block, each reader reads its own
        copied, link, posts, engines, sc = move(others, stage=True)
        if sc:  # the root posts an address to every reader, which read in parallel and Ack
            return Work(rounds=2, copied=max(others, default=0) + sizes[call.root], tasks=peers + 1,
                        engines=engine_tasks(max(others, default=0)), busy=peers)
        return Work(rounds=1, copied=copied + sizes[call.root], link=link, tasks=posts, engines=engines * fan, busy=2)
    if op in ("all_to_all", "all_to_all_v", "all_gather_v"):  # every rank stages and reads
        gathering = op == "all_gather_v"
        blocks = sorted(sizes)[1:] if gathering else [biggest] * peers
        copied, link, posts, engines, sc = move(blocks, stage=not gathering)
        if gathering and not (sc_ok and biggest >= SC_BYTES):
            copied += biggest  # staged once for every reader
        return Work(rounds=1 + sc, copied=copied + biggest, link=link, tasks=posts, engines=engines, streams=fan)
    # reduce_scatter_v, reduce: stage every block (share) for its owner, reduce ours out of the
    # peers' buffers; reduce: the root then reads the reduced shares
    k = parts(biggest)
    staged = total - min(sizes, default=0)
    credits = max(0, k - SLOTS)
    piece = engine_tasks(biggest, step) if k > 1 else engine_tasks(biggest)
    work = Work(rounds=1, copied=0.0 if k > 1 else staged, link=staged if k > 1 else 0.0,
                reduced=peers * biggest, tasks=peers * (k + credits), engines=(peers + 1) * piece)
    if op == "reduce":
        work = Work(rounds=2, copied=work.copied + (0.0 if k > 1 else peers * biggest),
                    link=work.link + (peers * biggest if k > 1 else 0.0), reduced=work.reduced,
                    tasks=work.tasks + k + peers * credits, engines=work.engines + peers * piece / fan)
    return work

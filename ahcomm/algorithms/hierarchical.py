"""Hier: HCCL's two-level (hierarchical) algorithms, for jobs whose ranks span servers, on
servers of any sizes (see ``_hier.Layout``: G = the most ranks on a server; on a server of
L ranks, local rank ``c % L`` owns chunk c of G; the owners of chunk c, one per server,
form its level-1 group). Level 0 runs inside a server, level 1 across servers; every byte
moves through ``Channels``.

* all_reduce: level-0 reduce-scatter (every rank sends each chunk to its owner, which
  reduces the contributions in local-rank order), level-1 all_reduce of each chunk among its
  group (ring, or RHD for chunks of at most ``RHD_BYTES``), level-0 all-gather (the owner
  sends the result to its server). An element is reduced once, in level 1, then copied:
  every rank gets the same bits. From ``2 * SEGMENT_BYTES`` the vector is cut into up to
  ``MAX_SEGMENTS`` segments, pipelined: level 0 of segment k + 1 (and the all-gather of
  k - 1) runs while level 1 works on segment k.
* broadcast: level-0 scatter of the G chunks on the root's server, level-1 broadcast of
  each chunk in its group (a pipelined chain, or a binomial tree for chunks of at most
  ``RHD_BYTES``), level-0 all-gather (owners send their chunks to their server); every step
  forwards piece by piece as it lands.
* all_gather: level 1 first, then level 0: a rank sends its block once to each other server
  (to the rank owning it there), owners pass it on inside their server; rank blocks go to
  local peers directly. Cross-server traffic carries each block once per server.
* reduce_scatter: the mirror: level-0 reduction of each block at its owner on every server
  (the destination rank itself on its own server), then one partial per other server to
  the destination, which reduces them in a fixed order.
* reduce: level-0 reduce-scatter, level-1 direct reduction of each chunk at its owner on
  the root's server, level-0 gather to the root.

Costs (m bytes, S servers; a0/B0 and a1/B1: alpha/beta inside and between servers; b0: the
most bytes a rank moves in level 0, (L-1)/L m for all_reduce's reduce-scatter on a server of
L ranks; o = ceil(G / smallest L) chunks per rank of the smallest server): all_reduce
t0 + t1 with t0 = 2 (a0 + b0 B0), t1 = o (2 (S-1) a1 + 2 (S-1)/S m/G B1) for a ring level 1
(2 log2 S steps with RHD); in P segments t0 + t1 + (P-1) max(t0, t1), each with m/P;
all_gather / reduce_scatter a0 + a1 + max(b0 B0, (S-1) block B1); broadcast 2 a0 + (S-1) a1
(log2 S binomial) + max(b0 B0, o m/G B1); reduce 2 a0 + a1 + (b0 + m) B0 + (S-1) o m/G B1.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import ClassVar

import numpy as np

from .._errors import ConfigError
from ._hier import (
    Layout,
    Price,
    Streams,
    all_reduce_senders,
    group_all_reduce,
    layout,
    rhd_all_reduce,
    ring_all_reduce,
    tree,
)
from .base import Algorithm, Call, Context, Resources, Topology, split
from .channels import PIECE_BYTES, Channels, Lane
from .cost import CostModel, Work, log2up, npieces

RHD_BYTES = 256 << 10  # level-1 chunks up to this size: RHD (all_reduce), binomial tree (broadcast)
SEGMENT_BYTES = 2 << 20  # all_reduce pipelines from two segments of this size
MAX_SEGMENTS = 4
LEVEL1 = ("ring", "rhd")  # level-1 algorithms it can run

Span = tuple[int, int]


def segments(lay: Layout, nbytes: int) -> int:
    """How many pipelined segments an all_reduce of ``nbytes`` is cut into (1: not pipelined)."""
    if lay.G == 1:  # no level 0 to overlap
        return 1
    return max(1, min(MAX_SEGMENTS, nbytes // SEGMENT_BYTES))


def with_level1(level1: str | None) -> "Hierarchical":
    """Hier with its level-1 algorithm fixed ("ring" or "rhd"; None: by size), as
    AHCOMM_ALGO's ``level1:ring`` asks where ranks span servers (one instance per choice)."""
    if level1 not in _BY_LEVEL1:
        _BY_LEVEL1[level1] = Hierarchical(level1)
    return _BY_LEVEL1[level1]


def _reduce_local(ctx: Context, lay: Layout, ch: Channels, st: Streams, piece: np.ndarray, own: np.ndarray) -> None:
    """``piece`` = the local ranks' contributions (``own`` for this rank), combined in local-rank
    order on the level-0 receive stream: the same order on every server."""
    for j, p in enumerate(lay.local):
        if p != lay.me:
            ch.recv(st.rx0, p, piece, reduce_with=piece if j else None)
        elif j:
            assert ctx.ufunc is not None
            st.rx0.reduce(ctx.ufunc, piece, piece, own)
        else:
            st.rx0.copy(piece, own)


class Hierarchical(Algorithm):
    name = "hier"

    def __init__(self, level1: str | None = None) -> None:
        if level1 is not None and level1 not in LEVEL1:
            raise ConfigError(f"hier: level-1 algorithm {level1!r} is not one of {', '.join(LEVEL1)}")
        self.level1 = level1

    def select(self, call: Call, topo: Topology) -> bool:
        return call.op in self.ops and topo.servers > 1

    def resources(self, call: Call, topo: Topology, half_bytes: int) -> Resources:
        return Resources(substreams=2 + len(layout(topo).peers), max_count=None)

    def ring(self, nbytes: float) -> bool:
        """Whether level 1 runs a ring (chain) rather than RHD (binomial tree) on a chunk."""
        return self.level1 == "ring" if self.level1 else nbytes > RHD_BYTES

    # -- cost ---------------------------------------------------------------------------------
    def work(self, call: Call, topo: Topology, model: CostModel, whole: float, block: float) -> float:
        """The module docstring's costs in seconds, level 0 priced at the link kind inside a server,
        level 1 at the kind between servers; only what every rank sees the same is used."""
        lay = layout(topo)
        price = Price(lay, topo, model)
        sizes, S, G, n = lay.sizes(), lay.S, lay.G, topo.size
        chunk = whole / G
        pieces = npieces(chunk, PIECE_BYTES)
        o = math.ceil(G / min(sizes))  # chunks a rank of the smallest server owns
        spread = max((L - 1) * math.ceil(G / L) for L in sizes) * chunk  # level-0 bytes of the busiest owner
        inner = G > 1  # there is level-0 work
        if call.op == "all_reduce":
            parts = segments(lay, int(whole))
            steps, moved = group_all_reduce(S, self.ring(chunk / parts))
            # link posts of a rank (as RHD and ring count them): a DataSignal per piece sent, an Ack
            # per piece received; level 0 sends and receives G - 1 chunks in each half, level 1 one
            # piece each way per step (ahcomm-sim counts the same: 32 posts a rank at 16 ranks)
            w0 = Work(rounds=2 * inner, link=2 * spread, reduced=spread, copied=o * chunk,
                      tasks=4 * (G - 1) * pieces)
            w1 = Work(rounds=o * steps, link=o * moved * chunk, reduced=o * moved * chunk / 2,
                      tasks=2 * o * steps * pieces)
            return price.segmented(w0, w1, parts)
        if call.op == "reduce":
            w0 = Work(rounds=2 * inner, link=spread + whole, reduced=spread, tasks=8 * G * pieces)
            w1 = Work(rounds=1, link=(S - 1) * o * chunk, reduced=(S - 1) * o * chunk, tasks=4 * (S - 1) * o * pieces)
            return price.segmented(w0, w1, 1)
        if call.op == "broadcast":
            fan = 1 if self.ring(chunk) else log2up(S)  # level-1 sends of a chunk: chain 1, binomial root
            scatter = (G - math.ceil(G / sizes[lay.server[call.root]])) * chunk
            w0 = Work(rounds=2 * inner, link=max(scatter, spread), copied=whole, tasks=4 * G * pieces)
            w1 = Work(rounds=S - 1 if fan == 1 else log2up(S), link=o * chunk * fan, tasks=4 * o * pieces * fan)
            return price.overlapped(w0, w1)
        held = max(1 + math.ceil((n - L) / L) for L in sizes)  # blocks the busiest holder holds
        reduced = call.op == "reduce_scatter"
        pieces = npieces(block, PIECE_BYTES)
        b0 = max((L - 1) * held * block for L in sizes)
        w0 = Work(rounds=inner, link=max(b0, (n - 1) * block), reduced=b0 if reduced else 0.0, copied=block,
                  tasks=4 * n * pieces)
        sends = max(S - 1, held - 1)  # level-1 blocks of the busiest rank
        w1 = Work(rounds=1, link=sends * block, reduced=(S - 1) * block if reduced else 0.0, tasks=4 * sends * pieces)
        return price.overlapped(w0, w1)

    # -- orchestration --------------------------------------------------------------------------
    async def _run(self, ctx: Context) -> None:
        lay = layout(ctx.topo)
        # all_reduce's ranks hear from their server and a few level-1 peers: CCL_In regions for those only
        ch = Channels(ctx, senders=all_reduce_senders(ctx.topo.hosts) if ctx.call.op == "all_reduce" else None)
        st = Streams.of(ctx, lay)
        self._plans[ctx.call.op](self, ctx, lay, ch, st)
        ch.finish()
        await ctx.synchronize()

    def _reduce_chunks(self, ctx: Context, lay: Layout, ch: Channels, st: Streams, chunks: list[Span],
                       work: dict[int, np.ndarray], tag: object) -> None:
        """Level-0 reduce-scatter: chunk c (``chunks[c]`` of ``ctx.src``) reduced at its owner
        into ``work[c]``, contributions in local-rank order, piece by piece; then the owner
        posts (tag, c, "tx") and (tag, c, "rx")."""
        src, me = ctx.src, lay.me
        for c, (a, b) in enumerate(chunks):
            o = lay.owner(lay.s, c)
            if a < b and o != me:
                ch.send(st.tx0[o], o, src[a:b])
        for c, w in work.items():
            a = chunks[c][0]
            for pa, pb in ch.pieces(w.size):
                _reduce_local(ctx, lay, ch, st, w[pa:pb], src[a + pa:a + pb])
            st.rx0.post(ctx.local((tag, c, "tx")))
            st.rx0.post(ctx.local((tag, c, "rx")))

    def _owned(self, ctx: Context, lay: Layout, chunks: list[list[Span]]) -> list[dict[int, np.ndarray]]:
        """Per segment, this rank's working copy of each non-empty chunk it owns (one scratch)."""
        mine = [[c for c, (a, b) in enumerate(seg) if a < b and lay.owner(lay.s, c) == lay.me] for seg in chunks]
        total = sum(chunks[k][c][1] - chunks[k][c][0] for k, cs in enumerate(mine) for c in cs)
        scratch, at, out = ctx.scratch(total), 0, []
        for k, cs in enumerate(mine):
            views = {}
            for c in cs:
                size = chunks[k][c][1] - chunks[k][c][0]
                views[c], at = scratch[at:at + size], at + size
            out.append(views)
        return out

    def _all_reduce(self, ctx: Context, lay: Layout, ch: Channels, st: Streams) -> None:
        count = ctx.dst.size
        segs = split(count, segments(lay, count * ctx.call.itemsize))
        chunks = [[(s0 + a, s0 + b) for a, b in split(s1 - s0, lay.G)] for s0, s1 in segs]
        work = self._owned(ctx, lay, chunks)
        for k in range(len(segs)):  # level-0 streams: RS 0, RS 1, AG 0, RS 2, AG 1, ..., AG P-1
            self._reduce_chunks(ctx, lay, ch, st, chunks[k], work[k], ("rs", k))
            if k:
                self._gather_chunks(ctx, lay, ch, st, chunks[k - 1], work[k - 1], ("ag", k - 1))
            self._level1_all_reduce(ctx, lay, ch, st, work[k], ("rs", k), ("ag", k))
        self._gather_chunks(ctx, lay, ch, st, chunks[-1], work[-1], ("ag", len(segs) - 1))

    def _level1_all_reduce(self, ctx: Context, lay: Layout, ch: Channels, st: Streams,
                           work: dict[int, np.ndarray], ready: object, done: object) -> None:
        for c, w in work.items():
            st.tx1.wait(ctx.local((ready, c, "tx")))
            st.rx1.wait(ctx.local((ready, c, "rx")))
            lane = Lane(ctx, ch, st.tx1, st.rx1, (done, c))
            run = ring_all_reduce if self.ring(w.nbytes) else rhd_all_reduce
            run(lane, lay.group(c), lay.s, w)
            for p in (*lay.peers, "own"):
                st.rx1.post(ctx.local((done, c, p)))

    def _gather_chunks(self, ctx: Context, lay: Layout, ch: Channels, st: Streams, chunks: list[Span],
                       work: dict[int, np.ndarray], done: object) -> None:
        """Level-0 all-gather: each owner sends its final chunks (once (done, c, peer) is posted)."""
        for p in lay.peers:
            for c, w in work.items():
                st.tx0[p].wait(ctx.local((done, c, p)))
                ch.send(st.tx0[p], p, w)
        for c, (a, b) in enumerate(chunks):
            o = lay.owner(lay.s, c)
            if a == b:
                continue
            if o == lay.me:
                st.rx0.wait(ctx.local((done, c, "own")))
                st.rx0.copy(ctx.dst[a:b], work[c])
            else:
                ch.recv(st.rx0, o, ctx.dst[a:b])

    def _broadcast(self, ctx: Context, lay: Layout, ch: Channels, st: Streams) -> None:
        root, me, S = ctx.call.root, lay.me, lay.S
        R, dst = lay.server[root], ctx.dst
        src = ctx.src if me == root else dst
        if me == root and dst is not src:
            st.rx0.copy(dst, src)
        for c, (a, b) in enumerate(split(dst.size, lay.G)):
            if a == b:
                continue
            o, members = lay.owner(lay.s, c), lay.group(c)
            parent, kids = tree((lay.s - R) % S, S, self.ring((b - a) * ctx.call.itemsize))
            children = [members[(v + R) % S] for v in kids]
            if me == root and o != me:  # level-0 scatter
                ch.send(st.tx0[o], o, src[a:b])
            if o != me:  # level-0 all-gather: from the owner (the root there if it owns c)
                if me != root:
                    ch.recv(st.rx0, o, dst[a:b])
                continue
            peers = [p for p in lay.peers if p != root]
            if me != root:  # the owner receives the chunk (from the root, or the group's parent)
                keys = [("b1", c, k) for k in children] + [("b0", c, p) for p in peers]
                if parent is None:
                    ch.recv(st.rx0, root, dst[a:b], done=keys)
                else:
                    ch.recv(st.rx1, members[(parent + R) % S], dst[a:b], done=keys)
            for k in children:
                ch.send(st.tx1, k, src[a:b], after=None if me == root else ("b1", c, k))
            for p in peers:
                ch.send(st.tx0[p], p, src[a:b], after=None if me == root else ("b0", c, p))

    def _all_gather(self, ctx: Context, lay: Layout, ch: Channels, st: Streams) -> None:
        src, dst, me, S = ctx.src, ctx.dst, lay.me, lay.S
        st.rx0.copy(dst[me], src)
        rounds = [[b for b in lay.ranks[(lay.s - t) % S] if lay.holder(lay.s, b) == me] for t in range(1, S)]
        for t in range(1, S):  # level 1: to the rank holding our block on server s + t
            ch.send(st.tx1, lay.holder((lay.s + t) % S, me), src)
        for held in rounds:  # ... and the blocks we hold of the ranks of server s - t
            for b in held:
                ch.recv(st.rx1, b, dst[b], done=[("g", b, p) for p in lay.peers])
        for p in lay.peers:  # level 0: our block, then the blocks we hold, in arrival order
            ch.send(st.tx0[p], p, src)
            for held in rounds:
                for b in held:
                    ch.send(st.tx0[p], p, dst[b], after=("g", b, p))
        for p in lay.peers:
            ch.recv(st.rx0, p, dst[p])
        for t in range(1, S):
            for b in lay.ranks[(lay.s - t) % S]:
                if lay.holder(lay.s, b) != me:
                    ch.recv(st.rx0, lay.holder(lay.s, b), dst[b])

    def _reduce_scatter(self, ctx: Context, lay: Layout, ch: Channels, st: Streams) -> None:
        src, dst, me, S, n = ctx.src, ctx.dst, lay.me, lay.S, ctx.size
        count = dst.size
        held = [b for b in range(n) if lay.holder(lay.s, b) == me]
        scratch = ctx.scratch(len(held) * count)
        work = {b: scratch[i * count:(i + 1) * count] for i, b in enumerate(held)}
        for b in range(n):  # level 0: every block to its owner here, reduced in local-rank order
            o = lay.holder(lay.s, b)
            if o != me:
                ch.send(st.tx0[o], o, src[b])
        for b, w in work.items():
            for i, (pa, pb) in enumerate(ch.pieces(count)):
                _reduce_local(ctx, lay, ch, st, w[pa:pb], src[b, pa:pb])
                st.rx0.post(ctx.local((("r", b), i)))
        for t in range(1, S):  # level 1: our partial of each block we hold to its rank
            for b in lay.ranks[(lay.s + t) % S]:
                if b in work:
                    ch.send(st.tx1, b, work[b], after=("r", b))
        for t in range(1, S):  # ... and the other servers' partials of ours, in a fixed order
            o = lay.holder((lay.s - t) % S, me)
            for i, (pa, pb) in enumerate(ch.pieces(count)):
                if t == 1:
                    st.rx1.wait(ctx.local((("r", me), i)))
                ch.recv(st.rx1, o, dst[pa:pb], reduce_with=(work[me] if t == 1 else dst)[pa:pb])

    def _reduce(self, ctx: Context, lay: Layout, ch: Channels, st: Streams) -> None:
        root, me, S = ctx.call.root, lay.me, lay.S
        R = lay.server[root]
        chunks = split(ctx.src.size, lay.G)
        work = self._owned(ctx, lay, [chunks])[0]
        self._reduce_chunks(ctx, lay, ch, st, chunks, work, "rs")
        for c, w in work.items():  # level 1: the partials to the owner on the root's server
            if lay.s != R:
                st.tx1.wait(ctx.local(("rs", c, "tx")))
                ch.send(st.tx1, lay.owner(R, c), w)
                continue
            st.rx1.wait(ctx.local(("rs", c, "rx")))
            for t in range(1, S):
                ch.recv(st.rx1, lay.owner((R + t) % S, c), w, reduce_with=w)
            st.rx1.post(ctx.local(("red", c)))
            if me != root:  # level 0: gather at the root
                st.tx0[root].wait(ctx.local(("red", c)))
                ch.send(st.tx0[root], root, w)
        if me == root:
            for c, (a, b) in enumerate(chunks):
                o = lay.owner(R, c)
                if a == b:
                    continue
                if o == me:
                    st.rx0.wait(ctx.local(("red", c)))
                    st.rx0.copy(ctx.dst[a:b], work[c])
                else:
                    ch.recv(st.rx0, o, ctx.dst[a:b])

    _plans: ClassVar[dict[str, Callable[[Hierarchical, Context, Layout, Channels, Streams], None]]] = {
        "all_reduce": _all_reduce, "broadcast": _broadcast, "all_gather": _all_gather,
        "reduce_scatter": _reduce_scatter, "reduce": _reduce}
    runs = dict.fromkeys(_plans, _run)


_BY_LEVEL1: dict[str | None, Hierarchical] = {}

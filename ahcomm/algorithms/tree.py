"""Tree: binomial trees for the rooted collectives (MPI's binomial broadcast, reduce, gather
and scatter; van de Geijn's scatter + all_gather broadcast for large messages).

Ranks are renumbered relative to the root: virtual rank ``v = (rank - root) mod n``. The
parent of ``v > 0`` is ``v`` with its lowest set bit cleared, its children are ``v + 2^k``
for every ``2^k`` below that bit (every ``2^k < n`` at the root), and its subtree is the
virtual range ``[v, v + span(v))``. Every transfer goes through ``Channels``; transfers
with different peers run on different streams (child ``j``: sub-stream ``j``), so a rank
forwards while it receives. ``ceil(log2 n)`` steps deep:

* broadcast: each rank receives from its parent and forwards piece by piece to its
  children: ``(log2 n + P - 1) (alpha + m beta / P)`` for ``P`` pieces.
* broadcast of at least ``LARGE_BYTES`` on more than two ranks (van de Geijn): a binomial
  scatter of the vector's ``n`` chunks, then a ring all_gather of the chunks in virtual
  rank order (chunks a rank already holds land in scratch and are passed on from ``dst``):
  ``(log2 n + n - 1) alpha + 2 (n - 1) / n m beta``. Measured in process on 4 and 8 ranks
  it overtakes the binomial broadcast between 256 KiB and 1 MiB.
* reduce: each rank reduces its children's partials into its own piece by piece (scratch,
  or ``dst`` at the root) and passes them up: always in virtual rank order, so the result
  does not depend on timing: ``(log2 n + P - 1) (alpha + m beta / P) + log2 n m gamma``.
* gather / gather_v: subtrees' blocks are collected upward in virtual rank order (scratch
  at inner ranks); scatter / scatter_v: the mirror. ``log2 n alpha + (n - 1) / n m beta``
  at the root for the total ``m``. A virtual range that wraps past rank ``n - 1`` moves as
  two blocks, so the root's buffer is read and written in true rank order.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from functools import cached_property
from typing import ClassVar

import numpy as np

from .base import Algorithm, Call, Context, Resources, Topology, split
from .channels import PIECE_BYTES, Channels
from .cost import CostModel, Work, engine_tasks, log2up, npieces

LARGE_BYTES = 512 << 10  # broadcasts from this size, on more than two ranks, scatter then all_gather


def span(v: int, n: int) -> int:
    """Size of the subtree of virtual rank ``v``."""
    return n if v == 0 else min(v & -v, n - v)


def children(v: int, n: int) -> list[int]:
    """Virtual children of ``v``, smallest subtree first."""
    limit = span(v, n)
    return [v + (1 << i) for i in range(limit.bit_length()) if 1 << i < limit]


def large_broadcast(call: Call, size: int) -> bool:
    """Whether a broadcast takes the scatter + all_gather path (every rank decides the same)."""
    return call.op == "broadcast" and size > 2 and call.count * call.itemsize >= LARGE_BYTES


@dataclass(frozen=True)
class _Tree:
    """This rank's place in the binomial tree rooted at ``root``."""

    n: int
    root: int
    v: int
    counts: tuple[int, ...] = ()

    def real(self, u: int) -> int:
        return (u + self.root) % self.n

    @property
    def parent(self) -> int:
        return self.real(self.v - (self.v & -self.v))

    @cached_property
    def kids(self) -> list[int]:
        return children(self.v, self.n)

    def subtree(self, u: int) -> range:
        return range(u, u + span(u, self.n))

    def segments(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """The virtual range [lo, hi) cut where it wraps past rank n - 1."""
        w = self.n - self.root  # virtual rank of rank 0
        return [(lo, w), (w, hi)] if lo < w < hi else [(lo, hi)]

    def elems(self, lo: int, hi: int) -> int:
        """Elements of the blocks of virtual ranks [lo, hi)."""
        return sum(self.counts[self.real(u)] for u in range(lo, hi))


class Tree(Algorithm):
    name = "tree"

    def resources(self, call: Call, topo: Topology, half_bytes: int) -> Resources:
        return Resources(substreams=max(1, (topo.size - 1).bit_length()))  # one per child of the root

    def work(self, call: Call, topo: Topology, model: CostModel, whole: float, block: float) -> Work:
        """The module docstring's costs, L = ceil(log2 n) steps deep plus the last credits; an
        inner rank forwards what it received (a hand-off per level). The root sends to (receives
        from) its L children concurrently, an inner rank receives and forwards: ``link`` is the
        busier of the two. Every piece posts a DataSignal and an Ack; into a mapped buffer the
        put is a copy too. Gather and scatter store and forward whole subtrees."""
        n, op = topo.size, call.op
        depth = log2up(n)
        puts = 1 + topo.all_mapped
        if op == "broadcast" and large_broadcast(call, n):  # scatter, then a ring all_gather
            moved, p = (n - 1) / n * whole, npieces(whole / n, PIECE_BYTES)
            work = Work(rounds=depth + n, handoffs=depth + n - 2, link=3 * moved, copied=moved, tasks=3 * (n - 1) * p,
                        engines=(depth + n - 1) * puts * engine_tasks(whole / n, PIECE_BYTES))
        elif op in ("broadcast", "reduce"):  # pipelined down (up) the tree in P pieces
            p = npieces(whole, PIECE_BYTES)
            fanout = max(depth, 2 if n > 2 else 1)  # the root's children, or an inner rank's parent and child
            reducing = op == "reduce"
            work = Work(rounds=depth + 1, handoffs=depth - 1, link=fanout * whole + (depth - 1) * whole / p,
                        reduced=depth * whole if reducing else 0.0, copied=0.0 if reducing else whole,
                        tasks=fanout * p + depth - 1,
                        engines=(depth if reducing else 1) * puts * engine_tasks(whole, PIECE_BYTES),
                        busy=min(n, depth + p))
        else:  # gather(_v), scatter(_v): the root receives (sends) every block but its own
            own = call.counts[call.root] * call.itemsize if call.counts else block
            work = Work(rounds=depth + 1, handoffs=depth - 1, link=whole - own, copied=whole,
                        tasks=(n - 1) * npieces(block, PIECE_BYTES),
                        engines=n * puts * engine_tasks(block, PIECE_BYTES), busy=2)
        return work

    async def _run(self, ctx: Context) -> None:
        call = ctx.call
        t = _Tree(ctx.size, call.root, (ctx.rank - call.root) % ctx.size, call.counts or ())
        ch = Channels(ctx)
        self._plans[call.op](self, ctx, ch, t)
        ch.finish()
        await ctx.synchronize()

    def _broadcast_any(self, ctx: Context, ch: Channels, t: _Tree) -> None:
        """A binomial tree, or for large vectors scatter then a ring all_gather."""
        if large_broadcast(ctx.call, ctx.size):
            self._broadcast_large(ctx, ch, t)
        else:
            self._broadcast(ctx, ch, t)

    def _broadcast(self, ctx: Context, ch: Channels, t: _Tree) -> None:
        keys = [("bc", j) for j in range(len(t.kids))]
        if t.v == 0:
            data = ctx.src
            if ctx.dst is not ctx.src:
                ctx.main.copy(ctx.dst, ctx.src)
        else:
            data = ctx.dst
            ch.recv(ctx.main, t.parent, data, done=keys)
        for j, c in enumerate(t.kids):
            ch.send(ctx.subs[j], t.real(c), data, after=None if t.v == 0 else keys[j])

    def _broadcast_large(self, ctx: Context, ch: Channels, t: _Tree) -> None:
        n, v, src, dst = t.n, t.v, ctx.src, ctx.dst
        chunks = split(dst.size, n)  # chunk u belongs to virtual rank u
        data = src if v == 0 else dst
        if v == 0 and dst is not src:
            ctx.main.copy(dst, src)
        mine = t.subtree(v)
        ring_out = {(v - s) % n for s in range(n - 1)}  # the chunks this rank passes on in the ring
        via = {u: j for j, c in enumerate(t.kids) for u in t.subtree(c)}  # child that gets chunk u

        def chunk(arr: np.ndarray, u: int) -> np.ndarray:
            a, b = chunks[u]
            return arr[a:b]

        if v:  # scatter: the subtree's chunks arrive one by one, own first
            for u in mine:
                done = ([("fwd", u)] if u in via else []) + ([("have", u)] if u in ring_out else [])
                ch.recv(ctx.main, t.parent, chunk(dst, u), done=done)
        for j, c in enumerate(t.kids):
            for u in t.subtree(c):
                ch.send(ctx.subs[j], t.real(c), chunk(data, u), after=None if v == 0 else ("fwd", u))
        # Ring all_gather in virtual rank order; the next rank is child 0 when there are children.
        nxt, prv = t.real(v + 1), t.real(v - 1)
        spare = ctx.scratch(chunks[0][1] - chunks[0][0])  # chunks this rank already has land here
        for s in range(n - 1):
            out_u, in_u = (v - s) % n, (v - s - 1) % n
            after: Hashable | None = None
            if v:
                after = ("have", out_u) if out_u in mine else ("ag", s - 1)
            ch.send(ctx.subs[0], nxt, chunk(data, out_u), after=after)
            if in_u in mine:
                ch.recv(ctx.main, prv, spare[:chunks[in_u][1] - chunks[in_u][0]])
            else:
                ch.recv(ctx.main, prv, chunk(dst, in_u), done=[("ag", s)] if s < n - 2 else [])

    def _reduce(self, ctx: Context, ch: Channels, t: _Tree) -> None:
        src = ctx.src
        if not t.kids:
            ch.send(ctx.main, t.parent, src)
            return
        acc = ctx.dst if t.v == 0 else ctx.scratch(src.size)
        last = len(t.kids) - 1
        for i, (a, b) in enumerate(ch.pieces(src.size)):  # piece by piece: src, child 1, child 2, ...
            for j, c in enumerate(t.kids):
                done = [("up", i)] if t.v and j == last else []
                ch.recv(ctx.main, t.real(c), acc[a:b], reduce_with=(src if j == 0 else acc)[a:b], done=done)
            if t.v:
                ctx.subs[0].wait(ctx.local((("up", i), 0)))
                ch.send(ctx.subs[0], t.parent, acc[a:b])

    def _layout(self, ctx: Context, t: _Tree, root_buf: np.ndarray) -> tuple[np.ndarray, list[int]]:
        """The buffer holding this rank's subtree and the offset of each virtual rank in it.

        The root's is its user buffer in true rank order; an inner rank's, scratch in
        virtual rank order.
        """
        if t.v == 0:
            displs = Call.displs(t.counts)
            return root_buf, [displs[t.real(u)] for u in range(t.n)]
        sub = t.subtree(t.v)
        offsets = [0] * t.n
        for u in sub[1:]:
            offsets[u] = offsets[u - 1] + t.counts[t.real(u - 1)]
        return ctx.scratch(t.elems(sub.start, sub.stop)), offsets

    def _blocks(self, t: _Tree, buf: np.ndarray, at: list[int], lo: int, hi: int) -> list[np.ndarray]:
        """The views of virtual ranks [lo, hi) in ``buf``, one per segment."""
        return [buf[at[a]:at[a] + t.elems(a, b)] for a, b in t.segments(lo, hi)]

    def _gather(self, ctx: Context, ch: Channels, t: _Tree) -> None:
        if not t.kids:
            ch.send(ctx.main, t.parent, ctx.src)
            return
        buf, at = self._layout(ctx, t, ctx.dst)
        ctx.main.copy(buf[at[t.v]:at[t.v] + ctx.src.size], ctx.src)
        for j, c in enumerate(t.kids):
            sub = t.subtree(c)
            for block in self._blocks(t, buf, at, sub.start, sub.stop):
                ch.recv(ctx.subs[j], t.real(c), block)
            if t.v:
                ctx.subs[j].post(ctx.local(("got", j)))
        if t.v:
            for j in range(len(t.kids)):
                ctx.main.wait(ctx.local(("got", j)))
            mine = t.subtree(t.v)
            for block in self._blocks(t, buf, at, mine.start, mine.stop):
                ch.send(ctx.main, t.parent, block)

    def _scatter(self, ctx: Context, ch: Channels, t: _Tree) -> None:
        if not t.kids:
            ch.recv(ctx.main, t.parent, ctx.dst)
            return
        buf, at = self._layout(ctx, t, ctx.src)
        if t.v:
            mine = t.subtree(t.v)
            for block in self._blocks(t, buf, at, mine.start, mine.stop):
                ch.recv(ctx.main, t.parent, block)
            for j in range(len(t.kids)):
                ctx.main.post(ctx.local(("go", j)))
        ctx.main.copy(ctx.dst, buf[at[t.v]:at[t.v] + ctx.dst.size])
        for j, c in enumerate(t.kids):
            if t.v:
                ctx.subs[j].wait(ctx.local(("go", j)))
            sub = t.subtree(c)
            for block in self._blocks(t, buf, at, sub.start, sub.stop):
                ch.send(ctx.subs[j], t.real(c), block)

    _plans: ClassVar[dict[str, Callable[[Tree, Context, Channels, _Tree], None]]] = {
        "broadcast": _broadcast_any, "reduce": _reduce, "gather": _gather, "gather_v": _gather,
        "scatter": _scatter, "scatter_v": _scatter}
    runs = dict.fromkeys(_plans, _run)

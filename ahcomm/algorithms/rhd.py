"""RHD: recursive halving-doubling (HCCL's RHD, MPICH's Rabenseifner all_reduce).

With p the largest power of two <= n ranks, every rank runs on a virtual rank v < p:

* reduce-scatter by recursive halving: log2(p) steps at distances p/2, p/4, ..., 1; in
  each step v keeps the half of its current range that holds its own block, sends the
  other half to ``v ^ distance`` and reduces the half it keeps with what that peer sends;
* all-gather by recursive doubling: log2(p) steps at distances 1, 2, ..., p/2; v sends
  everything it holds to ``v ^ distance`` and receives as much.

all_reduce is both (the vector cut into p chunks); reduce_scatter(_v) is the halving,
all_gather(_v) the doubling, on the rank blocks (uneven and empty blocks included).

A world that is not a power of two is folded first (r = n - p): ranks 2i and 2i+1 (i < r)
are one virtual rank i, run by the odd one; ranks >= 2r are virtual rank ``rank - r``. A
virtual rank owns the blocks of its real ranks, so its range stays contiguous. The even
rank of a pair sends its input to its partner before (reduced there, or its block for the
gather) and receives its result after: two extra steps.

Cost, m = the whole vector (all_reduce) or all blocks together (reduce_scatter's input,
all_gather's output): all_reduce 2 log2(p) alpha + 2 (p-1)/p m beta, reduce_scatter and
all_gather log2(p) alpha + (p-1)/p m beta; when n is not a power of two, add the fold's
two steps, moving m each (all_reduce), m then m/n (reduce_scatter), m/n then m (all_gather).

Every element is reduced by one rank and then copied, so all ranks get the same bits.
Data moves through ``Channels``: sends on the main stream, receives on sub-stream 0, a
block received in one step forwarded in the next piece by piece as it lands (``Mover``).
"""

from __future__ import annotations

from collections.abc import Iterator

from .base import Algorithm, Call, Context, Resources, Topology, split
from .channels import Channels, Lane, channel_piece
from .cost import CostModel, Work, engine_tasks, npieces

Span = tuple[int, int]  # [lo, hi) in virtual ranks or in elements


class Mover(Lane):
    """A Lane with its own Channels: sends on the main stream, receives on sub-stream 0."""

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx, Channels(ctx), ctx.main, ctx.subs[0], "mv")

    async def finish(self) -> None:
        self.ch.finish()
        await self.ctx.synchronize()


class Fold:
    """The virtual ranks of n ranks: p = largest power of two <= n, r = n - p pairs folded."""

    def __init__(self, n: int) -> None:
        self.p = 1 << (n.bit_length() - 1)
        self.r = n - self.p
        self.n = n

    def virtual(self, rank: int) -> int | None:
        """The virtual rank ``rank`` runs (None: an even rank of a folded pair)."""
        if rank < 2 * self.r:
            return rank // 2 if rank % 2 else None
        return rank - self.r

    def real(self, v: int) -> int:
        return 2 * v + 1 if v < self.r else v + self.r

    def first(self, v: int) -> int:
        """The lowest real rank (so the first block) of virtual rank ``v``."""
        return 2 * v if v < self.r else v + self.r

    def halving(self, v: int) -> Iterator[tuple[int, Span, Span]]:
        """(peer, virtual ranks whose blocks v sends, ... whose blocks it keeps) per step."""
        lo, hi, dist = 0, self.p, self.p // 2
        while dist:
            mid = lo + dist
            if v < mid:
                yield self.real(v + dist), (mid, hi), (lo, mid)
                hi = mid
            else:
                yield self.real(v - dist), (lo, mid), (mid, hi)
                lo = mid
            dist //= 2

    def doubling(self, v: int) -> Iterator[tuple[int, Span, Span]]:
        """(peer, virtual ranks whose blocks v sends, ... it receives) per step."""
        dist = 1
        while dist < self.p:
            mine = v & ~(dist - 1)
            theirs = mine ^ dist
            yield self.real(v ^ dist), (mine, mine + dist), (theirs, theirs + dist)
            dist *= 2


def _span(bounds: list[int], s: Span) -> Span:
    return bounds[s[0]], bounds[s[1]]


class RHD(Algorithm):
    name = "rhd"

    def resources(self, call: Call, topo: Topology, half_bytes: int) -> Resources:
        return Resources(substreams=1, max_count=None)

    def work(self, call: Call, topo: Topology, model: CostModel, whole: float, block: float) -> Work:
        """The module docstring's costs (m: the vector or all blocks; p: the largest power of
        two <= n; the fold's two steps when p < n), plus the last credits. Each step halves
        (doubles) the data, exchanges it with one peer (``link``: sent plus received) and
        forwards what the previous step received (a hand-off); halving reduces what it
        receives, doubling copies it out of the slots. Every piece posts a DataSignal and an
        Ack; into a mapped buffer the put is a copy too."""
        n, op = topo.size, call.op
        fold = Fold(n)
        steps = fold.p.bit_length() - 1
        share = (fold.p - 1) / fold.p * whole
        folded = int(fold.r > 0)
        puts = 1 + topo.all_mapped
        halves = [whole / 2 ** k for k in range(1, steps + 1)]  # what each step sends
        piece = channel_piece(n)  # small at large n: a piece per slot of 1 / (n - 1) of CCL_In
        posts = 2 * sum(npieces(h, piece) for h in halves)
        big = puts * sum(engine_tasks(h, piece) for h in halves)
        fold_posts = 2 * folded * npieces(whole, piece)
        fold_big = 2 * folded * puts * engine_tasks(whole, piece)
        if op == "all_reduce":
            work = Work(rounds=2 * steps + 1 + 2 * folded, handoffs=2 * steps - 1 + 2 * folded,
                        link=4 * share + 2 * folded * whole, reduced=share + folded * whole, copied=share,
                        tasks=2 * posts + 2 * fold_posts, engines=2 * big + fold_big)
        else:
            reducing = op.startswith("reduce_scatter")
            work = Work(rounds=steps + 1 + 2 * folded, handoffs=steps - 1 + 2 * folded,
                        link=2 * share + folded * (whole + block),
                        reduced=(share + folded * whole) if reducing else 0.0,
                        copied=block + (0.0 if reducing else share), tasks=posts + fold_posts, engines=big + fold_big)
        return work

    async def _all_reduce(self, ctx: Context) -> None:
        fold, rank, count = Fold(ctx.size), ctx.rank, ctx.dst.size
        mv, src, work = Mover(ctx), ctx.src, ctx.dst
        v = fold.virtual(rank)
        if v is None:
            mv.send(rank + 1, src, 0, count)
            mv.recv(rank + 1, work, 0, count)
            return await mv.finish()
        bounds = [a for a, _ in split(count, fold.p)] + [count]
        cur = src
        if rank < 2 * fold.r:
            mv.recv(rank - 1, work, 0, count, operand=src)
            cur = work
        for peer, give, keep in fold.halving(v):
            (a, b), (c, d) = _span(bounds, give), _span(bounds, keep)
            mv.send(peer, cur, a, b)
            mv.recv(peer, work, c, d, operand=cur[c:d])
            cur = work
        for peer, mine, theirs in fold.doubling(v):
            mv.send(peer, work, *_span(bounds, mine))
            mv.recv(peer, work, *_span(bounds, theirs))
        if rank < 2 * fold.r:
            mv.send(rank - 1, work, 0, count)
        await mv.finish()

    async def _reduce_scatter(self, ctx: Context) -> None:
        fold, rank, call = Fold(ctx.size), ctx.rank, ctx.call
        displs = Call.displs(call.counts or (call.count,) * ctx.size)
        total, own = displs[-1], (displs[rank], displs[rank + 1])
        mv, src, dst = Mover(ctx), ctx.src.reshape(-1), ctx.dst
        v = fold.virtual(rank)
        if v is None:
            mv.send(rank + 1, src, 0, total)
            mv.recv(rank + 1, dst, 0, dst.size)
            return await mv.finish()
        work = ctx.scratch(total)
        bounds = [displs[fold.first(u)] for u in range(fold.p)] + [total]
        cur = src
        if rank < 2 * fold.r:
            mv.recv(rank - 1, work, 0, total, operand=src)
            cur = work
        steps = list(fold.halving(v))
        for i, (peer, give, keep) in enumerate(steps):
            (a, b), (c, d) = _span(bounds, give), _span(bounds, keep)
            mv.send(peer, cur, a, b)
            if i == len(steps) - 1 and (c, d) == own:  # the last step lands in the output
                mv.recv(peer, dst, 0, d - c, operand=cur[c:d])
            else:
                mv.recv(peer, work, c, d, operand=cur[c:d])
                if i == len(steps) - 1:
                    mv.rx.copy(dst, work[own[0]:own[1]])
            cur = work
        if rank < 2 * fold.r:
            mv.send(rank - 1, work, displs[rank - 1], displs[rank])
        await mv.finish()

    async def _all_gather(self, ctx: Context) -> None:
        fold, rank, call = Fold(ctx.size), ctx.rank, ctx.call
        displs = Call.displs(call.counts or (call.count,) * ctx.size)
        total = displs[-1]
        mv, src, dst = Mover(ctx), ctx.src, ctx.dst.reshape(-1)
        mv.tx.copy(dst[displs[rank]:displs[rank + 1]], src)
        v = fold.virtual(rank)
        if v is None:
            mv.send(rank + 1, src, 0, src.size)
            mv.recv(rank + 1, dst, 0, displs[rank])
            mv.recv(rank + 1, dst, displs[rank + 1], total)
            return await mv.finish()
        bounds = [displs[fold.first(u)] for u in range(fold.p)] + [total]
        if rank < 2 * fold.r:
            mv.recv(rank - 1, dst, displs[rank - 1], displs[rank])
        for peer, mine, theirs in fold.doubling(v):
            mv.send(peer, dst, *_span(bounds, mine))
            mv.recv(peer, dst, *_span(bounds, theirs))
        if rank < 2 * fold.r:
            mv.send(rank - 1, dst, 0, displs[rank - 1])
            mv.send(rank - 1, dst, displs[rank], total)
        await mv.finish()

    runs = {"all_reduce": _all_reduce, "reduce_scatter": _reduce_scatter, "reduce_scatter_v": _reduce_scatter,
            "all_gather": _all_gather, "all_gather_v": _all_gather}

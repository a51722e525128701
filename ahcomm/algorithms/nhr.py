"""NHR: HCCL's nonuniform hierarchical ring, ceil(log2 n) steps for any n (no fold).

The data is cut into n slices, slice b owned by rank b (its block; a chunk of the vector
for all_reduce). With S = ceil(log2 n), as in HCCL's ReduceScatterNHR/AllGatherNHR:

* reduce-scatter, steps s = 0 .. S-1: rank r sends to r - 2^s and receives from r + 2^s
  the slices r - 2^s - j 2^(s+1) (sent) and r - j 2^(s+1) (received, reduced), for
  j < floor((n - 1 + 2^s) / 2^(s+1)). Seen from slice b, the ranks at ring distance
  d = (rank - b) mod n form a binomial tree rooted at b: in step s distance d + 2^s sends
  its partial sum to distance d (d a multiple of 2^(s+1), d + 2^s < n). Every rank
  sends every slice but its own exactly once: (n-1)/n of the data in S steps;
* all-gather, steps s = S-1 .. 0: the mirror image (distance d sends to d + 2^s).

all_reduce is both. Its slices are laid out in memory in HCCL's tree order (each stage
puts the even positions of a part before the odd ones), so that the slices of one step
lie mostly side by side and go as one message; reduce_scatter(_v) does the same in a
scratch copy of its input (HCCL keeps rank order there; the copy is needed anyway as a
working area). all_gather(_v) keeps the rank order of its output, as HCCL does, and
merges only slices that happen to be adjacent.

Cost, m = the whole vector (all_reduce), all blocks (reduce_scatter's input,
all_gather's output), S = ceil(log2 n): all_reduce 2 S alpha + 2 (n-1)/n m beta (plus a
local copy of m when not in place); reduce_scatter S alpha + (n-1)/n m beta (plus a local
copy of m); all_gather S alpha + (n-1)/n m beta. Steps send uneven amounts (about m/2 in
the first reduce-scatter step) and up to ceil(n/2) messages where slices do not merge.

Each slice is reduced along one tree and then copied, so every rank gets the same bits.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from .base import Algorithm, Call, Context, Resources, Topology, split
from .channels import channel_piece
from .cost import CostModel, Work, engine_tasks, npieces
from .rhd import Mover

Plan = tuple[int, int, list[int], list[int]]  # (send to, receive from, slices sent, slices received)


def steps(n: int) -> int:
    return (n - 1).bit_length()


def _slices(n: int, s: int) -> int:
    return (n - 1 + (1 << s)) >> (s + 1)


def reduce_scatter_step(rank: int, n: int, s: int) -> Plan:
    dist, stride = 1 << s, 1 << (s + 1)
    k = range(_slices(n, s))
    return ((rank - dist) % n, (rank + dist) % n, [(rank - dist - j * stride) % n for j in k],
            [(rank - j * stride) % n for j in k])


def all_gather_step(rank: int, n: int, s: int) -> Plan:
    dist, stride = 1 << s, 1 << (s + 1)
    k = range(_slices(n, s))
    return ((rank + dist) % n, (rank - dist) % n, [(rank - j * stride) % n for j in k],
            [(rank - dist - j * stride) % n for j in k])


def tree_order(n: int) -> list[int]:
    """The slices in memory order (HCCL's NHR slice map): within parts of width w (n, n/2,
    ... while the width stays even), even positions first, then odd ones."""
    order, width = list(range(n)), n
    for s in range(steps(n)):
        if _slices(n, s) <= 1:
            break
        order = [x for a in range(0, n, width) for x in order[a:a + width:2] + order[a + 1:a + width:2]]
        if width % 2:
            break
        width //= 2
    return order


class Layout:
    """Where each slice lies in a flat array: ``order`` lists the slices in memory order."""

    def __init__(self, sizes: list[int], order: list[int]) -> None:
        self.pos = [0] * len(order)
        for i, b in enumerate(order):
            self.pos[b] = i
        self.offsets = Call.displs([sizes[b] for b in order])

    def span(self, b: int) -> tuple[int, int]:
        i = self.pos[b]
        return self.offsets[i], self.offsets[i + 1]

    def runs(self, slices: list[int]) -> Iterator[tuple[int, int]]:
        """Element ranges of ``slices``, neighbours in memory merged, in memory order."""
        positions = sorted(self.pos[b] for b in slices)
        start = prev = positions[0]
        for i in [*positions[1:], -1]:
            if i != prev + 1:
                yield self.offsets[start], self.offsets[prev + 1]
                start = i
            prev = i


def _reduce_scatter(mv: Mover, work: np.ndarray, layout: Layout, last: np.ndarray | None = None) -> None:
    """The reduce-scatter steps on ``work``; with ``last`` the final step lands there."""
    rank, n = mv.ctx.rank, mv.ctx.size
    for s in range(steps(n)):
        to, frm, sent, received = reduce_scatter_step(rank, n, s)
        for a, b in layout.runs(sent):
            mv.send(to, work, a, b)
        if last is not None and s == steps(n) - 1:  # one slice: ours
            a, b = layout.span(rank)
            mv.recv(frm, last, 0, b - a, operand=work[a:b])
            continue
        for a, b in layout.runs(received):
            mv.recv(frm, work, a, b, operand=work[a:b])


def _all_gather(mv: Mover, work: np.ndarray, layout: Layout) -> None:
    rank, n = mv.ctx.rank, mv.ctx.size
    for s in reversed(range(steps(n))):
        to, frm, sent, received = all_gather_step(rank, n, s)
        for a, b in layout.runs(sent):
            mv.send(to, work, a, b)
        for a, b in layout.runs(received):
            mv.recv(frm, work, a, b)


def _ready(mv: Mover) -> None:
    """The receives start after what the main stream has queued so far (the initial copy)."""
    mv.tx.post(mv.ctx.local("init"))
    mv.rx.wait(mv.ctx.local("init"))


class NHR(Algorithm):
    name = "nhr"

    def resources(self, call: Call, topo: Topology, half_bytes: int) -> Resources:
        return Resources(substreams=1, max_count=None)

    def work(self, call: Call, topo: Topology, model: CostModel, whole: float, block: float) -> Work:
        """The module docstring's costs (S = ceil(log2 n) steps each way, every slice but its
        own sent once), plus the last credits and the local copy into the working area. Each
        step exchanges with one peer (``link``: sent plus received) and forwards what the
        previous one received (a hand-off); every piece posts a DataSignal and an Ack; into a
        mapped buffer the put is a copy too."""
        n, op = topo.size, call.op
        s = steps(n)
        share = (n - 1) / n * whole
        puts = 1 + topo.all_mapped
        sent = [_slices(n, k) * whole / n for k in range(s)]  # what each step sends
        piece = channel_piece(topo.size)  # Channels' pieces shrink as 1 / (n - 1)
        posts = 2 * sum(npieces(b, piece) for b in sent)
        big = puts * sum(engine_tasks(b, piece) for b in sent)
        if op == "all_reduce":
            work = Work(rounds=2 * s + 1, handoffs=2 * s, link=4 * share, reduced=share, copied=share + whole,
                        tasks=2 * posts, engines=2 * big + engine_tasks(whole))
        elif op.startswith("reduce_scatter"):
            work = Work(rounds=s + 1, handoffs=s, link=2 * share, reduced=share, copied=whole, tasks=posts,
                        engines=big + engine_tasks(whole))
        else:
            work = Work(rounds=s + 1, handoffs=s - 1, link=2 * share, copied=share + block, tasks=posts,
                        engines=big + engine_tasks(block))
        return work

    async def _all_reduce(self, ctx: Context) -> None:
        n, mv, work = ctx.size, Mover(ctx), ctx.dst
        layout = Layout([b - a for a, b in split(work.size, n)], tree_order(n))
        if work is not ctx.src:
            mv.tx.copy(work, ctx.src)
            _ready(mv)
        _reduce_scatter(mv, work, layout)
        _all_gather(mv, work, layout)
        await mv.finish()

    async def _reduce_scatter(self, ctx: Context) -> None:
        n, call, mv = ctx.size, ctx.call, Mover(ctx)
        counts = list(call.counts or (call.count,) * n)
        src, displs = ctx.src.reshape(-1), Call.displs(counts)
        work = ctx.scratch(displs[-1])
        layout = Layout(counts, tree_order(n))
        for b in range(n):
            a, z = layout.span(b)
            mv.tx.copy(work[a:z], src[displs[b]:displs[b + 1]])
        _ready(mv)
        _reduce_scatter(mv, work, layout, last=ctx.dst)
        await mv.finish()

    async def _all_gather(self, ctx: Context) -> None:
        n, call, mv = ctx.size, ctx.call, Mover(ctx)
        counts = list(call.counts or (call.count,) * n)
        work = ctx.dst.reshape(-1)
        layout = Layout(counts, list(range(n)))
        a, z = layout.span(ctx.rank)
        mv.tx.copy(work[a:z], ctx.src)
        _all_gather(mv, work, layout)
        await mv.finish()

    runs = {"all_reduce": _all_reduce, "reduce_scatter": _reduce_scatter, "reduce_scatter_v": _reduce_scatter,
            "all_gather": _all_gather, "all_gather_v": _all_gather}

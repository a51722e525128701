"""Mesh (one host, mapped links): every rank reaches every peer's CCL buffers directly.

As in HCCL's AllGatherMesh, a rank stages its data in its own CCL buffer, tells every
peer (DataSignal), and each rank then reads - or reduces - straight out of its peers'
buffers; reads from different peers run on their own sub-streams. Between two slices of
one collective an Ack round tells the owners that their buffers are free again; after
the last slice that job falls to the executor (a buffer half is reused two collectives
later, once every rank is known to be past this one).

Reductions combine contributions in rank order, so every rank gets the same bits.
"""

from __future__ import annotations

import numpy as np

from .._stream import Stream
from ..transports.base import Signal
from .base import Algorithm, Call, Context, Resources, Topology, split

DIRECT_BYTES = 32 * 1024  # all_reduce below this: every rank reduces the whole vector itself


def _exchange(ctx: Context, signal: Signal, index: int = 0, peers: list[int] | None = None,
              waiters: list[int] | None = None) -> None:
    """On the main stream: post ``signal`` to ``peers``, then wait it from ``waiters``."""
    others = [p for p in range(ctx.size) if p != ctx.rank]
    for p in others if peers is None else peers:
        ctx.post(ctx.main, p, signal, index)
    for p in others if waiters is None else waiters:
        ctx.wait(ctx.main, p, signal, index)


def _fan_out(ctx: Context, jobs: list[tuple[np.ndarray, np.ndarray]]) -> None:
    """Copy each (dst, src) on its own sub-stream, all after the main stream's tasks so far."""
    streams: list[Stream] = ctx.subs or [ctx.main]
    for i, (dst, src) in enumerate(jobs):
        stream = streams[i % len(streams)]
        if stream is not ctx.main:
            key = ("go", i)
            ctx.main.post(ctx.local(key))
            stream.wait(ctx.local(key))
        stream.copy(dst, src)
        if stream is not ctx.main:
            stream.post(ctx.local(("done", i)))
    for i in range(len(jobs)):
        if streams[i % len(streams)] is not ctx.main:
            ctx.main.wait(ctx.local(("done", i)))


def _reduce_in_order(ctx: Context, dst: np.ndarray, parts: list[np.ndarray]) -> None:
    """dst = parts[0] op parts[1] op ... on the main stream."""
    ufunc = ctx.ufunc
    assert ufunc is not None
    if len(parts) == 1:
        ctx.main.copy(dst, parts[0])
        return
    ctx.main.reduce(ufunc, dst, parts[0], parts[1])
    for part in parts[2:]:
        ctx.main.reduce(ufunc, dst, dst, part)


class Mesh(Algorithm):
    name = "mesh"
    ops = frozenset({"all_reduce", "all_gather", "reduce_scatter", "broadcast"})

    def select(self, call: Call, topo: Topology) -> bool:
        return call.op in self.ops and topo.all_mapped

    def resources(self, call: Call, topo: Topology, half_bytes: int) -> Resources:
        per = half_bytes // call.itemsize
        if call.op == "reduce_scatter":
            per //= topo.size
        subs = min(topo.size - 1, 3) if call.op in ("all_gather", "all_reduce", "broadcast") else 0
        return Resources(substreams=subs, max_count=max(1, per))

    async def orchestrate(self, ctx: Context) -> None:
        op = ctx.call.op
        if op == "all_reduce":
            if ctx.dst.nbytes <= DIRECT_BYTES:
                self._all_reduce_direct(ctx)
            else:
                self._all_reduce(ctx)
        elif op == "all_gather":
            self._all_gather(ctx)
        elif op == "reduce_scatter":
            self._reduce_scatter(ctx)
        else:
            self._broadcast(ctx)
        await ctx.synchronize()

    def _end_slice(self, ctx: Context) -> None:
        if not ctx.final:
            _exchange(ctx, Signal.ACK)  # peers are done with our buffers: the next slice may write

    def _all_reduce_direct(self, ctx: Context) -> None:
        n, r, count = ctx.size, ctx.rank, ctx.dst.size
        mine = ctx.typed(ctx.ccl_in, 0, count)
        ctx.main.copy(mine, ctx.src)
        _exchange(ctx, Signal.DATA)
        parts = [mine if p == r else ctx.typed(ctx.remote(p, "in"), 0, count) for p in range(n)]
        _reduce_in_order(ctx, ctx.dst, parts)
        self._end_slice(ctx)

    def _all_reduce(self, ctx: Context) -> None:
        n, r, src, dst = ctx.size, ctx.rank, ctx.src, ctx.dst
        item = ctx.call.itemsize
        chunks = split(dst.size, n)
        for p, (a, b) in enumerate(chunks):  # stage the chunks the peers will reduce
            if p != r:
                ctx.main.copy(ctx.typed(ctx.ccl_in, a * item, b - a), src[a:b])
        _exchange(ctx, Signal.DATA, 0)
        a, b = chunks[r]
        parts = [src[a:b] if p == r else ctx.typed(ctx.remote(p, "in"), a * item, b - a) for p in range(n)]
        mine = ctx.typed(ctx.ccl_out, a * item, b - a)
        _reduce_in_order(ctx, mine, parts)
        _exchange(ctx, Signal.DATA, 1)
        jobs = [(dst[a:b], mine if p == r else ctx.typed(ctx.remote(p, "out"), a * item, b - a))
                for p, (a, b) in enumerate(chunks)]
        _fan_out(ctx, jobs)
        self._end_slice(ctx)

    def _all_gather(self, ctx: Context) -> None:
        n, r, src, dst = ctx.size, ctx.rank, ctx.src, ctx.dst
        ctx.main.copy(ctx.typed(ctx.ccl_out, 0, src.size), src)
        _exchange(ctx, Signal.DATA)
        jobs = [(dst[p], src if p == r else ctx.typed(ctx.remote(p, "out"), 0, src.size)) for p in range(n)]
        _fan_out(ctx, jobs)
        self._end_slice(ctx)

    def _reduce_scatter(self, ctx: Context) -> None:
        n, r, src, dst = ctx.size, ctx.rank, ctx.src, ctx.dst
        stride = dst.size * ctx.call.itemsize
        for p in range(n):
            if p != r:
                ctx.main.copy(ctx.typed(ctx.ccl_in, p * stride, dst.size), src[p])
        _exchange(ctx, Signal.DATA)
        parts = [src[r] if p == r else ctx.typed(ctx.remote(p, "in"), r * stride, dst.size) for p in range(n)]
        _reduce_in_order(ctx, dst, parts)
        self._end_slice(ctx)

    def _broadcast(self, ctx: Context) -> None:
        r, root, count = ctx.rank, ctx.call.root, ctx.dst.size
        others = [p for p in range(ctx.size) if p != root]
        if r == root:
            ctx.main.copy(ctx.typed(ctx.ccl_in, 0, count), ctx.src)
            if ctx.dst is not ctx.src:
                ctx.main.copy(ctx.dst, ctx.src)
            _exchange(ctx, Signal.DATA, peers=others, waiters=[])
            if not ctx.final:
                _exchange(ctx, Signal.ACK, peers=[], waiters=others)
        else:
            _exchange(ctx, Signal.DATA, peers=[], waiters=[root])
            ctx.main.copy(ctx.dst, ctx.typed(ctx.remote(root, "in"), 0, count))
            if not ctx.final:
                _exchange(ctx, Signal.ACK, peers=[root], waiters=[])

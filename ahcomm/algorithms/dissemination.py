"""Dissemination barrier: ceil(log2 N) rounds; in round k rank r signals r + 2^k and waits
for r - 2^k. Signals only, so it runs on every link kind and any world size."""

from __future__ import annotations

from ..transports.base import Signal
from .base import Algorithm, Call, Context, Topology
from .cost import CostModel, Work, log2up


class Dissemination(Algorithm):
    name = "dissemination"

    def work(self, call: Call, topo: Topology, model: CostModel, whole: float, block: float) -> Work:
        """ceil(log2 n) dependent steps, one signal posted in each (so the selector can weigh it
        against eager's one step of n - 1 messages)."""
        k = log2up(topo.size)
        return Work(rounds=k, tasks=k)

    async def _barrier(self, ctx: Context) -> None:
        n, r, dist, k = ctx.size, ctx.rank, 1, 0
        while dist < n:
            ctx.post(ctx.main, (r + dist) % n, Signal.DATA, k)
            ctx.wait(ctx.main, (r - dist) % n, Signal.DATA, k)
            dist, k = dist * 2, k + 1
        await ctx.synchronize()

    runs = {"barrier": _barrier}

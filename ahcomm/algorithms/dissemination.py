"""Dissemination barrier: ceil(log2 N) rounds; in round k rank r signals r + 2^k and waits
for r - 2^k. Signals only, so it runs on every link kind and any world size."""

from __future__ import annotations

from ..transports.base import Signal
from .base import Algorithm, Context


class Dissemination(Algorithm):
    name = "dissemination"

    async def _barrier(self, ctx: Context) -> None:
        n, r, dist, k = ctx.size, ctx.rank, 1, 0
        while dist < n:
            ctx.post(ctx.main, (r + dist) % n, Signal.DATA, k)
            ctx.wait(ctx.main, (r - dist) % n, Signal.DATA, k)
            dist, k = dist * 2, k + 1
        await ctx.synchronize()

    runs = {"barrier": _barrier}

"""Pairwise exchange (HCCL's AlltoAllV pairwise): all_to_all and all_to_all_v, any world size.

In step k (1 <= k < n) rank r sends its block for r + k to r + k and receives the block of
r - k from r - k; its own block is a local copy. Every transfer goes through ``Channels``:
the main stream sends, in step order, and sub-stream 0 receives, in step order.

All n - 1 steps are enqueued at once. That cannot deadlock however large the blocks: each
peer appears once as destination and once as source, so a pair carries one block and its
credits belong to that block alone. Take the lowest step s at which some stream is stuck.
A sender stuck at s waits for a credit of the block its receiver takes at step s; that
receiver has passed every lower step (none is stuck) and can take the pieces already sent.
A receiver stuck at s waits for a piece from the sender's step s; that sender is at step s
and stuck only on a credit the receiver is about to give. So nothing is stuck.

The sends of all steps start without waiting for each other (the first slots of every
pair are free), so small blocks cost about one latency plus n - 1 notify overheads; large
ones stream at link bandwidth. Cost: (n - 1) a + (n - 1) m b (m = one block; for _v, the
larger of the bytes this rank sends and receives).
"""

from __future__ import annotations

from .base import Algorithm, Call, Context, Resources, Topology
from .channels import PIECE_BYTES, Channels
from .cost import CostModel, Work, engine_tasks, npieces


class Pairwise(Algorithm):
    name = "pairwise"

    def resources(self, call: Call, topo: Topology, half_bytes: int) -> Resources:
        return Resources(substreams=1)

    def work(self, call: Call, topo: Topology, model: CostModel, whole: float, block: float) -> Work:
        """(n - 1) blocks out and in (``link``: both), copied out of the slots, and the own
        block copied; every send starts at once, so one step plus the last credits, and a
        DataSignal and an Ack per piece of every block; into a mapped buffer the put is a copy
        too. all_to_all_v is costed from n alone: its counts differ from rank to rank, and
        every rank must pick the same algorithm."""
        n = topo.size
        if call.op == "all_to_all_v":
            block = 0.0
        puts = 1 + topo.all_mapped
        work = Work(rounds=2, link=2 * (n - 1) * block, copied=n * block,
                    tasks=2 * (n - 1) * npieces(block, PIECE_BYTES),
                    engines=(n - 1) * puts * engine_tasks(block, PIECE_BYTES) + engine_tasks(block))
        return work

    async def _all_to_all(self, ctx: Context) -> None:
        n, r, call = ctx.size, ctx.rank, ctx.call
        assert call.counts is not None and call.recv_counts is not None
        out, back = Call.displs(call.counts), Call.displs(call.recv_counts)
        ch = Channels(ctx)
        tx, rx = ctx.main, ctx.subs[0]
        rx.copy(ctx.dst[back[r]:back[r + 1]], ctx.src[out[r]:out[r + 1]])
        for k in range(1, n):
            to, frm = (r + k) % n, (r - k) % n
            ch.send(tx, to, ctx.src[out[to]:out[to + 1]])
            ch.recv(rx, frm, ctx.dst[back[frm]:back[frm + 1]])
        ch.finish()
        await ctx.synchronize()

    runs = {"all_to_all": _all_to_all, "all_to_all_v": _all_to_all}

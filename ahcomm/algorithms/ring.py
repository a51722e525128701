"""Ring: all_reduce (reduce-scatter + all-gather), all_gather(_v), reduce_scatter(_v), broadcast, reduce.

Works on any link kind and any world size. Every step sends to the next rank and
receives from the previous one through ``SLOTS`` slots of the receiver's CCL_In:

* the main stream sends: [wait local "piece ready"] -> [wait Ack(slot) from next, once all
  ``SLOTS`` slots are in use] -> put -> post DataSignal(slot) to next;
* sub-stream 0 receives: wait DataSignal(slot) from prev -> reduce or copy out of the
  slot -> post Ack(slot) to prev -> post local "piece ready".

Chunks are cut into pieces of at most ``PIECE_BYTES`` so that, across the ring, puts,
receives and reductions of successive pieces overlap (a pipelined ring).

The uneven variants run the same ring with blocks sized by ``Call.counts`` (empty blocks
move nothing); their calls are never sliced, so the reduce_scatter_v partials live in the
run's scratch. Reduce is a pipelined chain toward the root: root + 1 sends its vector to
root + 2, which reduces each piece with its own and forwards it, ..., up to the root. With
P pieces that costs (n - 2 + P) (a + m / P b + m / P g), where a ring reduce-scatter
followed by a gather of the blocks would take 2 (n - 1) a + 2 (n - 1) / n m b: the chain
needs about half the bytes per link and half the steps.

Costs (m = bytes of the whole vector, or of one block for all_gather/reduce_scatter):
all_reduce 2 (n - 1) (a + m / n b); all_gather and reduce_scatter (n - 1) (a + m b);
all_gather_v and reduce_scatter_v about (n - 1) a + (M - smallest block) b, M = all the
blocks (every link carries every block but one); broadcast and reduce (n - 2 + P) (a + m /
P b), P = ceil(m / piece) pieces of min(CCL half / SLOTS, PIECE_BYTES).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Iterator
from itertools import islice

import numpy as np

from .._errors import ConfigError
from ..transports.base import Signal
from .base import ALIGN, Algorithm, Call, Context, Resources, Topology, align_up, aligned, pieces, split
from .cost import CostModel, Work, engine_tasks, npieces

PIECE_BYTES = 2 << 20
SLOTS = 4  # receive slots per rank: up to this many pieces in flight on each ring link
WINDOW = 64  # pieces enqueued ahead on each stream (ring_pass): a rank's tasks stay O(WINDOW), not O(n)

Send = tuple[np.ndarray, Hashable | None]  # (source, local key to wait for first)
Recv = tuple[np.ndarray, np.ndarray | None, Hashable]  # (destination, reduce operand or None, key)


def _piece_elems(ctx: Context) -> tuple[int, int]:
    """(slot bytes, elements per piece) for this run."""
    slot = aligned(ctx.ccl_in.nbytes // SLOTS, ctx.call.itemsize)
    return slot, max(1, min(slot, PIECE_BYTES) // ctx.call.itemsize)


async def ring_pass(ctx: Context, sends: Iterable[Send], recvs: Iterable[Recv]) -> None:
    """Run the sends to the next rank and the receives from the previous one.

    At most about ``WINDOW`` pieces are enqueued ahead on each stream, so that a rank holds
    O(WINDOW) tasks and views rather than O(n) (``sends`` and ``recvs`` may be generators) and
    its first put does not wait for every step of a large ring to be enqueued. The receive
    stream feeds itself: the last task of a window enqueues the next one, so receives never
    wait for this rank's sends (a peer's credits only need our receives). The main stream runs
    a window of sends (``synchronize``) before the next one is made. The run ends with a
    ``synchronize`` once the last receive is enqueued (a marker queued earlier would pass
    the receives enqueued after it)."""
    n, r = ctx.size, ctx.rank
    nxt, prv = (r + 1) % n, (r - 1) % n
    slot_bytes, _ = _piece_elems(ctx)
    tx, rx = ctx.main, ctx.subs[0]
    ufunc = ctx.ufunc
    recv_it = iter(recvs)
    received = 0

    def feed() -> None:  # enqueue a window of receives on rx, then a task that enqueues the next
        nonlocal received
        j = received
        for dst, operand, key in islice(recv_it, WINDOW):
            ctx.wait(rx, prv, Signal.DATA, j % SLOTS)
            landed = ctx.typed(ctx.ccl_in, (j % SLOTS) * slot_bytes, dst.size)
            if operand is None:
                rx.copy(dst, landed)
            else:
                assert ufunc is not None
                rx.reduce(ufunc, dst, operand, landed)
            ctx.post(rx, prv, Signal.ACK, j % SLOTS)
            rx.post(ctx.local(key))
            j += 1
        full, received = j - received == WINDOW, j
        if full:
            rx.call(feed)
        else:  # all enqueued: a synchronize() from now on covers every receive
            ctx.local(_FED).post()

    feed()
    k = 0  # pieces sent (enqueued)
    waited: list[Hashable] = []  # the last window's local keys: posted and waited once each
    for window in _windows(sends):
        if k:
            await tx.synchronize()  # run the last window's sends (the main stream runs when synchronized)
            ctx.forget(waited)  # done with: a rank keeps O(WINDOW) local notifies, not 2 (n - 1)
            waited = []
        for src, dep in window:
            if dep is not None:
                waited.append(dep)
                tx.wait(ctx.local(dep))
            if k >= SLOTS:
                ctx.wait(tx, nxt, Signal.ACK, k % SLOTS)
            ctx.put(tx, nxt, src, "in", (k % SLOTS) * slot_bytes)
            ctx.post(tx, nxt, Signal.DATA, k % SLOTS)
            k += 1
    for s in range(max(0, k - SLOTS), k):
        ctx.wait(tx, nxt, Signal.ACK, s % SLOTS)  # drain the credits: flags rest at 0
    await tx.synchronize()  # our sends first: the receives still to come need them (around the ring)
    await ctx.local(_FED).wait()  # then rx's marker must follow its last receive (a failure fails the flag)
    await ctx.synchronize()


_FED = ("ring_pass", "receives enqueued")  # a local notify's key: no algorithm key is a 2-tuple of str


def _windows(sends: Iterable[Send]) -> Iterator[list[Send]]:
    it = iter(sends)
    while window := list(islice(it, WINDOW)):
        yield window


class Ring(Algorithm):
    name = "ring"

    def resources(self, call: Call, topo: Topology, half_bytes: int) -> Resources:
        if call.op == "reduce_scatter":
            # Partial sums of the blocks in flight live in our CCL_Out half.
            blocks = max(1, topo.size - 2)
            per_block = (half_bytes // blocks // ALIGN * ALIGN) // call.itemsize
            if per_block < 1:
                raise ConfigError(f"AHCOMM_BUFFSIZE is too small for ring reduce_scatter on {topo.size} ranks: "
                                  f"it needs at least {2 * blocks * ALIGN} bytes")
            return Resources(substreams=1, max_count=per_block)
        return Resources(substreams=1)

    def work(self, call: Call, topo: Topology, model: CostModel, whole: float, block: float) -> Work:
        """The module docstring's costs for the busiest rank, plus one step for the last credits.
        A step forwards what the previous one received (a hand-off from the receive stream to
        the send stream); ``link`` counts bytes sent plus bytes received. Every piece posts a
        DataSignal at its sender and an Ack at its receiver and is copied (or reduced) out of
        the slot; into a mapped buffer the put is a copy too. all_reduce first copies the input
        to the output. The chain (broadcast, reduce) keeps only P + 1 ranks busy at a time."""
        n, op = topo.size, call.op
        puts = 1 + topo.all_mapped
        if op == "all_reduce":
            steps, moved = 2 * (n - 1), 2 * (n - 1) / n * whole
            work = Work(rounds=steps + 1, handoffs=steps - 1, link=2 * moved, reduced=moved / 2,
                        copied=moved / 2 + whole, tasks=2 * steps * npieces(whole / n, PIECE_BYTES),
                        engines=engine_tasks(whole) + steps * puts * engine_tasks(whole / n, PIECE_BYTES))
        elif op in ("all_gather", "reduce_scatter", "all_gather_v", "reduce_scatter_v"):
            smallest = min(call.counts) * call.itemsize if call.counts else block
            moved = whole - smallest  # every link carries every block but one
            reducing = op.startswith("reduce")
            work = Work(rounds=n, handoffs=n - 2, link=2 * moved, reduced=moved if reducing else 0.0,
                        copied=0.0 if reducing else whole, tasks=2 * (n - 1) * npieces(block, PIECE_BYTES),
                        engines=(n - 1) * puts * engine_tasks(block, PIECE_BYTES))
        else:  # broadcast, reduce: a middle rank receives and forwards every piece (an end does one
            # of the two); the first piece crosses n - 1 links, then one piece time each
            p = npieces(whole, PIECE_BYTES)
            ends = 1 if n == 2 else 2
            reducing = op == "reduce"
            work = Work(rounds=n, handoffs=n - 2, link=ends * whole + (n - 2) * whole / p,
                        reduced=whole if reducing else 0.0, copied=0.0 if reducing else whole,
                        tasks=ends * p + n - 2, engines=puts * engine_tasks(whole, PIECE_BYTES), busy=min(n, p + 1))
        return work

    async def _all_reduce(self, ctx: Context) -> None:
        n, r, dst = ctx.size, ctx.rank, ctx.dst
        _, step = _piece_elems(ctx)
        if dst is not ctx.src:
            ctx.main.copy(dst, ctx.src)
            ctx.main.post(ctx.local("init"))
            ctx.subs[0].wait(ctx.local("init"))
        chunks = split(dst.size, n)

        def sent(i: int) -> int:  # the chunk this rank sends at step i (reduce-scatter, then all-gather)
            return (r - i) % n if i < n - 1 else (r + 1 - (i - n + 1)) % n

        def sends() -> Iterator[Send]:  # generators: ring_pass takes a window at a time
            for i in range(2 * (n - 1)):
                for a, b in pieces(*chunks[sent(i)], step):
                    yield dst[a:b], ("rx", i - 1, a) if i else None

        def recvs() -> Iterator[Recv]:  # step i receives the chunk the previous rank sends
            for i in range(2 * (n - 1)):
                for a, b in pieces(*chunks[(sent(i) - 1) % n], step):
                    yield dst[a:b], dst[a:b] if i < n - 1 else None, ("rx", i, a)

        await ring_pass(ctx, sends(), recvs())

    async def _all_gather(self, ctx: Context) -> None:
        n, r, src, dst = ctx.size, ctx.rank, ctx.src, ctx.dst
        _, step = _piece_elems(ctx)
        ctx.subs[0].copy(dst[r], src)
        sends: list[Send] = []
        recvs: list[Recv] = []
        for t in range(n - 1):
            send_b, recv_b = (r - t) % n, (r - t - 1) % n
            for a, b in pieces(0, src.size, step):
                sends.append((src[a:b] if t == 0 else dst[send_b, a:b], ("rx", t - 1, a) if t else None))
                recvs.append((dst[recv_b, a:b], None, ("rx", t, a)))
        await ring_pass(ctx, sends, recvs)

    async def _reduce_scatter(self, ctx: Context) -> None:
        n, r, src, dst = ctx.size, ctx.rank, ctx.src, ctx.dst
        _, step = _piece_elems(ctx)
        stride = align_up(dst.size * ctx.call.itemsize)
        sends: list[Send] = []
        recvs: list[Recv] = []
        partial: list[np.ndarray] = []
        for s in range(n - 1):
            send_b, recv_b = (r - s - 1) % n, (r - s - 2) % n
            out = dst if s == n - 2 else ctx.typed(ctx.ccl_out, s * stride, dst.size)
            for a, b in pieces(0, dst.size, step):
                sends.append((src[send_b, a:b] if s == 0 else partial[s - 1][a:b], ("rx", s - 1, a) if s else None))
                recvs.append((out[a:b], src[recv_b, a:b], ("rx", s, a)))
            partial.append(out)
        await ring_pass(ctx, sends, recvs)

    async def _broadcast(self, ctx: Context) -> None:
        n, r, root = ctx.size, ctx.rank, ctx.call.root
        pos = (r - root) % n
        _, step = _piece_elems(ctx)
        sends: list[Send] = []
        recvs: list[Recv] = []
        for a, b in pieces(0, ctx.dst.size, step):
            if pos == 0:
                sends.append((ctx.src[a:b], None))
            else:
                recvs.append((ctx.dst[a:b], None, ("rx", a)))
                if pos < n - 1:
                    sends.append((ctx.dst[a:b], ("rx", a)))
        if pos == 0 and ctx.dst is not ctx.src:
            ctx.subs[0].copy(ctx.dst, ctx.src)
        await ring_pass(ctx, sends, recvs)

    async def _all_gather_v(self, ctx: Context) -> None:
        n, r, src, dst = ctx.size, ctx.rank, ctx.src, ctx.dst
        assert ctx.call.counts is not None
        d = Call.displs(ctx.call.counts)
        _, step = _piece_elems(ctx)
        ctx.subs[0].copy(dst[d[r]:d[r + 1]], src)
        sends: list[Send] = []
        recvs: list[Recv] = []
        for t in range(n - 1):
            send_b, recv_b = (r - t) % n, (r - t - 1) % n
            for a, b in _cut(d[send_b], d[send_b + 1], step):
                sends.append((src[a - d[r]:b - d[r]] if t == 0 else dst[a:b], ("rx", t - 1, a) if t else None))
            for a, b in _cut(d[recv_b], d[recv_b + 1], step):
                recvs.append((dst[a:b], None, ("rx", t, a)))
        await ring_pass(ctx, sends, recvs)

    async def _reduce_scatter_v(self, ctx: Context) -> None:
        n, r, src, dst = ctx.size, ctx.rank, ctx.src, ctx.dst
        assert ctx.call.counts is not None
        d = Call.displs(ctx.call.counts)
        _, step = _piece_elems(ctx)
        # Block b's partial sum lands at its own offset: every block is received once.
        partial = ctx.scratch(d[n] if n > 2 else 0)
        sends: list[Send] = []
        recvs: list[Recv] = []
        for s in range(n - 1):
            send_b, recv_b = (r - s - 1) % n, (r - s - 2) % n
            out, at = (dst, d[r]) if s == n - 2 else (partial, 0)
            for a, b in _cut(d[send_b], d[send_b + 1], step):
                sends.append((src[a:b] if s == 0 else partial[a:b], ("rx", s - 1, a) if s else None))
            for a, b in _cut(d[recv_b], d[recv_b + 1], step):
                recvs.append((out[a - at:b - at], src[a:b], ("rx", s, a)))
        await ring_pass(ctx, sends, recvs)

    async def _reduce(self, ctx: Context) -> None:
        n, r, src, dst = ctx.size, ctx.rank, ctx.src, ctx.dst
        pos = (r - ctx.call.root - 1) % n  # the chain runs root + 1 -> ... -> root (pos n - 1)
        _, step = _piece_elems(ctx)
        if pos == n - 1:
            out = dst  # the root: own + the chain's partial
        else:  # the head sends its input; the others send own + partial from their scratch
            out = ctx.scratch(src.size) if pos else src
        sends: list[Send] = []
        recvs: list[Recv] = []
        for a, b in _cut(0, src.size, step):
            if pos:
                recvs.append((out[a:b], src[a:b], ("rx", a)))
            if pos < n - 1:
                sends.append((out[a:b], ("rx", a) if pos else None))
        await ring_pass(ctx, sends, recvs)

    runs = {"all_reduce": _all_reduce, "all_gather": _all_gather, "reduce_scatter": _reduce_scatter,
            "broadcast": _broadcast, "all_gather_v": _all_gather_v, "reduce_scatter_v": _reduce_scatter_v,
            "reduce": _reduce}


def _cut(start: int, stop: int, step: int) -> list[tuple[int, int]]:
    """[start, stop) in pieces of at most ``step``; none if empty."""
    return [(a, min(a + step, stop)) for a in range(start, stop, step)]

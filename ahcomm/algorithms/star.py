"""Star (one host, mapped links): one rank moves every block itself through its peers'
mapped CCL buffers (HCCL's star-shaped one-shot algorithms for small messages).

* broadcast, gather(_v), all_gather(_v) - pull: an owner stages its block in its own
  CCL_In and posts DataSignal; the root (gather), every other rank (broadcast) or every
  rank (all_gather) copies straight out of the mapped buffer, owners spread over
  sub-streams. ``2 alpha + m beta`` per owner block, plus the reader's ``(n - 1) m beta``.
* reduce - the peers stage, the root reduces its own input and then theirs, in rank
  order, into ``dst``: ``2 alpha + m beta + (n - 1) m gamma``.
* scatter(_v) - push: the root writes block ``p`` into rank ``p``'s CCL_In and posts
  DataSignal; ``p`` copies it out: ``2 alpha + (n - 1) m_p beta`` at the root.
* all_reduce - every rank but ``CENTER`` stages; the centre reduces all inputs in rank order
  into its CCL_Out and posts DataSignal(1); every rank copies the result from there (the same
  bits everywhere): ``3 alpha + 2 m beta + (n - 1) m gamma``.

The data must fit a CCL half: all_reduce, broadcast and all_gather are sliced by the
executor (``Resources.max_count``); the whole ops (reduce, gather, scatter, their v
variants, all_gather_v) are cut into rounds of one half here. Between rounds, and after a
non-final slice, whoever read a buffer posts Ack to its owner before the owner restages;
after the last one the executor keeps the half from being reused too early. Every
reader works round by round, so an owner's next round never waits on a later one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import numpy as np

from .._errors import ConfigError
from .._stream import Stream
from ..transports.base import Signal
from .base import Algorithm, Call, Context, Resources, Topology, aligned
from .cost import HALF_BYTES, CostModel, Work, engine_tasks, npieces

CENTER = 0  # the rank that reduces an all_reduce
FAN = 3  # sub-streams that read (or write) peers' buffers in parallel
FANNED = frozenset({"gather", "gather_v", "scatter", "scatter_v", "all_gather", "all_gather_v"})
RESULT = 1  # DataSignal index of the all_reduce result


def _rounds(count: int, per: int) -> list[tuple[int, int]]:
    return [(a, min(a + per, count)) for a in range(0, count, per)]


def _post(ctx: Context, stream: Stream, peers: list[int], signal: Signal, index: int = 0) -> None:
    for p in peers:
        ctx.post(stream, p, signal, index)


def _wait(ctx: Context, stream: Stream, peers: list[int], signal: Signal, index: int = 0) -> None:
    for p in peers:
        ctx.wait(stream, p, signal, index)


def _per(ctx: Context) -> int:
    """Elements of the call's dtype that fit a CCL half."""
    per = aligned(ctx.ccl_in.nbytes, ctx.call.itemsize) // ctx.call.itemsize
    if per < 1:
        raise ConfigError(f"AHCOMM_BUFFSIZE is too small for star {ctx.call.op}: a CCL half of "
                          f"{ctx.ccl_in.nbytes} bytes holds no aligned element")
    return per


def _reduce_into(ctx: Context, dst: np.ndarray, parts: list[np.ndarray]) -> None:
    """dst = parts[0] op parts[1] op ... on the main stream (parts[0] may be dst itself)."""
    assert ctx.ufunc is not None
    ctx.main.reduce(ctx.ufunc, dst, parts[0], parts[1])
    for part in parts[2:]:
        ctx.main.reduce(ctx.ufunc, dst, dst, part)


def _publish(ctx: Context, data: np.ndarray, readers: list[int]) -> None:
    """Owner, on the main stream: stage ``data`` in rounds into our CCL_In for ``readers``."""
    rounds = _rounds(data.size, _per(ctx))
    for k, (a, b) in enumerate(rounds):
        if k:
            _wait(ctx, ctx.main, readers, Signal.ACK)
        ctx.main.copy(ctx.typed(ctx.ccl_in, 0, b - a), data[a:b])
        _post(ctx, ctx.main, readers, Signal.DATA)
    if rounds and not ctx.final:
        _wait(ctx, ctx.main, readers, Signal.ACK)


def _collect(ctx: Context, blocks: dict[int, np.ndarray]) -> None:
    """Reader: copy ``blocks[p]`` out of each owner ``p``'s CCL_In, round by round."""
    streams = ctx.subs or [ctx.main]
    per = _per(ctx)
    plans = {p: _rounds(block.size, per) for p, block in blocks.items()}
    for k in range(max(map(len, plans.values()), default=0)):
        for i, (p, plan) in enumerate(plans.items()):
            if k < len(plan):
                stream, (a, b) = streams[i % len(streams)], plan[k]
                ctx.wait(stream, p, Signal.DATA)
                stream.copy(blocks[p][a:b], ctx.typed(ctx.remote(p, "in"), 0, b - a))
                if k < len(plan) - 1 or not ctx.final:
                    ctx.post(stream, p, Signal.ACK)


class Star(Algorithm):
    name = "star"

    def select(self, call: Call, topo: Topology) -> bool:
        return call.op in self.ops and topo.all_mapped

    def resources(self, call: Call, topo: Topology, half_bytes: int) -> Resources:
        per = aligned(half_bytes, call.itemsize) // call.itemsize
        subs = min(topo.size - 1, FAN) if call.op in FANNED else 0
        return Resources(substreams=subs, max_count=max(1, per))  # whole ops ignore max_count

    def work(self, call: Call, topo: Topology, model: CostModel, whole: float, block: float) -> Work | float:
        """The module docstring's costs along the critical path, every byte a copy (staging, or
        reading or writing a peer's mapped buffer): owners stage in parallel, one step, the
        reader copies out, from up to ``FAN`` owners at once. One rank does most of the work,
        the others little (``busy``): all_reduce 2 a + 2 m c + (n - 1) m g, n notifies in a
        row; reduce a + m c + (n - 1) m g; broadcast a + 2 m c; gather, scatter, all_gather
        a + (M + m) c (M: all blocks). Data beyond a CCL half goes in rounds of one half, each
        closed by an Ack step.

        all_reduce and reduce are priced in phases, each with the ranks that work in it: the
        centre's reduction as one of two busy ranks, the staging with every owner (all but the
        centre or root) copying at once, the all_reduce's copy-out with every rank (the centre
        copies its CCL_Out into its own output too). Where ranks outnumber
        cores those copies wait for a core (np=4 on 2 cores, float32 all_reduce, us a call:
        16 MiB star 12287-12884, mesh 9430-9703; 32 MiB 22904-23043 against 16757-17227;
        results/2026-11-26-star-phases.md); with a core per rank this is the old single-phase sum."""
        n, op = topo.size, call.op
        peers, fan = n - 1, min(n - 1, FAN)
        staged = whole if op in ("all_reduce", "reduce", "broadcast") else block
        s = npieces(staged, HALF_BYTES)
        acks = (s - 1) * peers  # readers free the buffers between rounds
        big = s * engine_tasks(staged / s)  # one memory task per round
        reads = -(-peers // fan)  # reads (writes) one stream makes in a round
        if op == "all_reduce":  # the others stage, the centre reduces everything, every rank copies the result out
            centre = Work(rounds=3 * s - 1, reduced=peers * whole, tasks=s * n + acks, engines=(n + 1) * big, busy=2)
            return (centre.seconds(model, topo) + Work(copied=whole, busy=peers).seconds(model, topo)
                    + Work(copied=whole).seconds(model, topo))
        if op == "reduce":  # the peers stage, the root reduces
            centre = Work(rounds=2 * s - 1, reduced=peers * whole, tasks=s + acks, engines=n * big, busy=2)
            return centre.seconds(model, topo) + Work(copied=whole, busy=peers).seconds(model, topo)
        if op == "broadcast":  # the root stages, every other rank copies out
            work = Work(rounds=2 * s - 1, copied=2 * whole, tasks=s * peers + acks, engines=2 * big, busy=peers)
        elif op in ("scatter", "scatter_v"):  # the root writes every block into its owner's CCL_In
            work = Work(rounds=2 * s - 1, copied=whole + block, tasks=s * peers + acks, engines=(reads + 1) * big,
                        busy=2, streams=fan)
        elif op in ("gather", "gather_v"):  # owners stage, the root reads every block
            work = Work(rounds=2 * s - 1, copied=whole + block, tasks=s + acks, engines=(reads + 1) * big, busy=2,
                        streams=fan)
        else:  # all_gather(_v): every rank stages its block and reads all the others
            work = Work(rounds=2 * s - 1, copied=whole + block, tasks=s * peers + acks, engines=(reads + 1) * big,
                        streams=fan)
        return work

    async def _run(self, ctx: Context) -> None:
        self._plans[ctx.call.op](self, ctx)
        await ctx.synchronize()

    def _pull(self, ctx: Context) -> None:
        """broadcast, gather(_v), all_gather(_v): owners publish, readers collect."""
        call, n, r, src, dst = ctx.call, ctx.size, ctx.rank, ctx.src, ctx.dst
        others = [p for p in range(n) if p != r]
        if call.op == "broadcast":
            if r == call.root:
                _publish(ctx, src, others)
                if dst is not src:
                    ctx.main.copy(dst, src)
            else:
                _collect(ctx, {call.root: dst})
            return
        everyone = call.op.startswith("all")
        if r != call.root or everyone:
            readers = others if everyone else [call.root]
            if src.size:
                _publish(ctx, src, readers)
        if r == call.root or everyone:
            if call.op == "all_gather":
                rows = [dst[p] for p in range(n)]
            else:
                displs = Call.displs(call.counts or ())
                rows = [dst[displs[p]:displs[p + 1]] for p in range(n)]
            ctx.main.copy(rows[r], src)
            _collect(ctx, {p: rows[p] for p in others if rows[p].size})

    def _reduce(self, ctx: Context) -> None:
        r, root, src = ctx.rank, ctx.call.root, ctx.src
        others = [p for p in range(ctx.size) if p != root]
        if r != root:
            _publish(ctx, src, [root])
            return
        rounds = _rounds(src.size, _per(ctx))
        for k, (a, b) in enumerate(rounds):  # own input first: dst may be src (in place)
            _wait(ctx, ctx.main, others, Signal.DATA)
            parts = [ctx.typed(ctx.remote(p, "in"), 0, b - a) for p in others]
            _reduce_into(ctx, ctx.dst[a:b], [src[a:b], *parts])
            if k < len(rounds) - 1:
                _post(ctx, ctx.main, others, Signal.ACK)

    def _scatter(self, ctx: Context) -> None:
        call, r, root, src, dst = ctx.call, ctx.rank, ctx.call.root, ctx.src, ctx.dst
        counts = call.counts or ()
        per = _per(ctx)
        if r != root:
            plan = _rounds(dst.size, per)
            for k, (a, b) in enumerate(plan):
                ctx.wait(ctx.main, root, Signal.DATA)
                ctx.main.copy(dst[a:b], ctx.typed(ctx.ccl_in, 0, b - a))
                if k < len(plan) - 1:
                    ctx.post(ctx.main, root, Signal.ACK)
            return
        displs = Call.displs(counts)
        ctx.main.copy(dst, src[displs[r]:displs[r + 1]])
        plans = {p: _rounds(counts[p], per) for p in range(ctx.size) if p != r and counts[p]}
        streams = ctx.subs or [ctx.main]
        for k in range(max(map(len, plans.values()), default=0)):
            for i, (p, plan) in enumerate(plans.items()):
                if k < len(plan):
                    stream, (a, b) = streams[i % len(streams)], plan[k]
                    if k:
                        ctx.wait(stream, p, Signal.ACK)
                    ctx.put(stream, p, src[displs[p] + a:displs[p] + b], "in", 0)
                    ctx.post(stream, p, Signal.DATA)

    def _all_reduce(self, ctx: Context) -> None:
        n, r, src, dst = ctx.size, ctx.rank, ctx.src, ctx.dst
        others = [p for p in range(n) if p != CENTER]
        if r != CENTER:
            ctx.main.copy(ctx.typed(ctx.ccl_in, 0, src.size), src)
            ctx.post(ctx.main, CENTER, Signal.DATA)
            ctx.wait(ctx.main, CENTER, Signal.DATA, RESULT)  # also: the centre is done with our CCL_In
            ctx.main.copy(dst, ctx.typed(ctx.remote(CENTER, "out"), 0, dst.size))
            if not ctx.final:
                ctx.post(ctx.main, CENTER, Signal.ACK)
            return
        out = ctx.typed(ctx.ccl_out, 0, dst.size)
        _wait(ctx, ctx.main, others, Signal.DATA)
        parts = [src if p == CENTER else ctx.typed(ctx.remote(p, "in"), 0, src.size) for p in range(n)]
        _reduce_into(ctx, out, parts)
        _post(ctx, ctx.main, others, Signal.DATA, RESULT)
        ctx.main.copy(dst, out)
        if not ctx.final:
            _wait(ctx, ctx.main, others, Signal.ACK)

    _plans: ClassVar[dict[str, Callable[[Star, Context], None]]] = {
        "all_reduce": _all_reduce, "reduce": _reduce, "scatter": _scatter, "scatter_v": _scatter,
        "broadcast": _pull, "gather": _pull, "gather_v": _pull, "all_gather": _pull, "all_gather_v": _pull}
    runs = dict.fromkeys(_plans, _run)

"""Mesh (one host, mapped links): every rank reaches every peer's CCL buffers directly.

As in HCCL's AllGatherMesh, a rank stages its data in its own CCL buffer, tells every
peer (DataSignal), and each rank then reads - or reduces - straight out of its peers'
buffers; reads from different peers run on their own sub-streams. Between two slices of
one collective an Ack round tells the owners that their buffers are free again; after
the last slice that job falls to the executor (a buffer half is reused two collectives
later, once every rank is known to be past this one).

Reductions combine contributions in rank order, so every rank gets the same bits.

The ops that run whole (gather, scatter, all_to_all and their _v forms, all_gather_v,
reduce_scatter_v, reduce) follow the same idea, pipelined through the owners' buffers for
blocks of any size: see ``_mesh_whole``.

Single copy: where every rank can read its peers' memory (``Topology.single_copy``; on
one host through cross-memory attach), large all_gather, broadcast and all_reduce skip
the staging copy. A rank posts the address of its user buffer with DataSignal and its
peers read from it directly (HCCL's zero-copy idea, OpenMPI's CMA single copy); a closing
Ack round tells every owner that nobody reads its buffers any more. The all_reduce pulls
each peer's share through a small scratch piece that stays in cache while it is reduced.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import numpy as np

from .._stream import Stream
from ..transports.base import Pipe, Signal
from . import _push
from ._mesh_whole import OPS as WHOLE_OPS
from ._mesh_whole import orchestrate_whole, whole_work
from .base import Algorithm, Call, Context, Resources, Topology, aligned, split
from .cost import HALF_BYTES, CostModel, Work, engine_tasks, npieces

DIRECT_BYTES = 32 * 1024  # all_reduce below this: every rank reduces the whole vector itself
# Per-rank bytes from which single-copy reads pay off (measured on the 2-core host; below,
# staging wins because it needs no closing Ack round).
SINGLE_COPY_BYTES = {"all_gather": 256 << 10, "all_reduce": 256 << 10, "broadcast": 4 << 20}
# Piece in which a rank reduces its share and pushes it into the peers' outputs (single-copy
# all_reduce): small enough that the piece is still in the core's cache when it is written out.
# np=2 in-place 64 MiB, ms a call: 256 KiB 8.8-9.1, 512 KiB 8.9-9.3, 128 KiB 10.2-10.5, 1 MiB
# no better than reading the shares afterwards (results/2026-11-27-push.md).
PUSH_BYTES = 256 << 10
# Notify indexes of the single-copy protocol (0 and 1 belong to the staged one): DataSignal
# 2 carries the input's address, DataSignal 3 the output's, DataSignal 4 the address of the
# rank's words (``_push``); Ack 2 says "done with yours".
SC_DATA, SC_RESULT, SC_WORDS, SC_DONE = 2, 3, 4, 2
SPLIT_BYTES = 4 << 20  # reads at least this big are cut in two, one half per copy engine

Job = Callable[[Stream], None]


def single_copy(call: Call, topo: Topology) -> bool:
    """Whether ``call`` takes the single-copy path (every rank decides the same)."""
    threshold = SINGLE_COPY_BYTES.get(call.op)
    return topo.single_copy and threshold is not None and call.count * call.itemsize >= threshold


def _exchange(ctx: Context, signal: Signal, index: int = 0, peers: list[int] | None = None,
              waiters: list[int] | None = None, value: int = 0) -> None:
    """On the main stream: post ``signal`` (with ``value``) to ``peers``, then wait it from ``waiters``."""
    others = [p for p in range(ctx.size) if p != ctx.rank]
    for p in others if peers is None else peers:
        ctx.post(ctx.main, p, signal, index, value)
    for p in others if waiters is None else waiters:
        ctx.wait(ctx.main, p, signal, index)


def _copy(dst: np.ndarray, src: np.ndarray) -> Job:
    return lambda stream: stream.copy(dst, src)


def _fan_out(ctx: Context, jobs: list[Job]) -> None:
    """Run each job on its own sub-stream, all after the main stream's tasks so far."""
    streams: list[Stream] = ctx.subs or [ctx.main]
    for i, job in enumerate(jobs):
        stream = streams[i % len(streams)]
        if stream is not ctx.main:
            key = ("go", i)
            ctx.main.post(ctx.local(key))
            stream.wait(ctx.local(key))
        job(stream)
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

    def select(self, call: Call, topo: Topology) -> bool:
        return call.op in self.ops and topo.all_mapped

    def resources(self, call: Call, topo: Topology, half_bytes: int) -> Resources:
        if call.op in WHOLE_OPS:  # never sliced: reads from up to three peers at once
            return Resources(substreams=max(1, min(topo.size - 1, 3)))
        if single_copy(call, topo):  # user buffers are read in place: no slicing; all_reduce's one task
            subs = 0 if call.op == "all_reduce" else max(2, min(topo.size - 1, 3))  # needs no sub-stream
            return Resources(substreams=subs, max_count=None)
        per = half_bytes // call.itemsize
        if call.op == "reduce_scatter":
            per //= topo.size
        subs = min(topo.size - 1, 3) if call.op in ("all_gather", "all_reduce", "broadcast") else 0
        return Resources(substreams=subs, max_count=max(1, per))

    def work(self, call: Call, topo: Topology, model: CostModel, whole: float, block: float) -> Work:
        """Per path, for the busiest rank (m: the vector, or one rank's block; reads of peers'
        buffers or memory are copies, c; S slices of a CCL half, each but the last closed by an
        Ack round): all_reduce direct a + m c + (n - 1) m g; staged 2 a + (1 + (n - 1) / n) m c +
        (n - 1) / n m g; single copy 3 a + 2 (n - 1) / n m c + (n - 1) / n m g; all_gather a +
        (n + 1) m c, single copy 2 a + n m c; reduce_scatter a + (n - 1) m (c + g); broadcast
        a + 2 m c, single copy 2 a + m c (the readers work, the root only posts); a single-copy
        read of an all_gather or broadcast pays the kernel's page pinning (``Work.pinned``; all_reduce's
        reads were measured without it). Each exchange
        posts to every peer; copies fanned out to sub-streams after an exchange are two
        hand-offs. The whole-run ops: ``_mesh_whole.whole_work``."""
        n, op = topo.size, call.op
        if op in WHOLE_OPS:
            return whole_work(call, topo)
        peers, fan = n - 1, min(n - 1, 3)
        sc = single_copy(call, topo)
        if op == "all_reduce":
            if sc:
                # one engine task reduces and pushes; the words' and the input's addresses go out
                # together (one wake-up of each peer), the output's, then "done"
                work = Work(rounds=3, copied=2 * peers / n * whole, reduced=peers / n * whole,
                            tasks=3 * peers, engines=engine_tasks(whole / n))
            elif whole <= DIRECT_BYTES:
                work = Work(rounds=1, copied=whole, reduced=peers * whole, tasks=peers)
            else:
                s = npieces(whole, HALF_BYTES)
                work = Work(rounds=3 * s - 1, handoffs=2 * s, copied=(1 + peers / n) * whole,
                            reduced=peers / n * whole, tasks=(3 * s - 1) * peers,
                            engines=s * (2 * peers + 1) * engine_tasks(whole / n / s))
        elif op == "all_gather":
            if sc:
                work = Work(rounds=2, handoffs=2, copied=n * block, tasks=2 * peers, engines=engine_tasks(block),
                            streams=fan, pinned=peers * block)
            else:
                s = npieces(block, HALF_BYTES)
                work = Work(rounds=2 * s - 1, handoffs=2 * s, copied=(n + 1) * block, tasks=(2 * s - 1) * peers,
                            engines=2 * s * engine_tasks(block / s), streams=fan)
        elif op == "reduce_scatter":
            s = npieces(whole, HALF_BYTES)
            work = Work(rounds=2 * s - 1, copied=peers * block, reduced=peers * block, tasks=(2 * s - 1) * peers,
                        engines=2 * peers * s * engine_tasks(block / s))
        elif sc:  # broadcast, the readers read the root's buffer in two halves at once
            halves = 2 if whole >= SPLIT_BYTES else 1
            work = Work(rounds=2, copied=whole, tasks=peers, engines=engine_tasks(whole / halves), busy=peers,
                        streams=halves, pinned=whole)
        else:  # broadcast: the root stages and posts, the readers copy
            s = npieces(whole, HALF_BYTES)
            work = Work(rounds=2 * s - 1, copied=2 * whole, tasks=s * peers, engines=2 * s * engine_tasks(whole / s),
                        busy=peers)
        return work

    async def _run(self, ctx: Context) -> None:
        """Enqueue the call's path (single copy where it pays, else staged), then wait for it."""
        op = ctx.call.op
        path = self._single[op] if single_copy(ctx.call, ctx.topo) else self._staged[op]
        try:
            path(self, ctx)
            await ctx.synchronize()
        except BaseException as exc:
            if ctx.gates is not None and path is Mesh._sc_all_reduce:  # peers may still write our output
                await _push.settle(ctx.gates, ctx.links, ctx.call.seq, op, _push.cause_of(exc))
            raise

    async def _run_whole(self, ctx: Context) -> None:
        orchestrate_whole(ctx)
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
        if ctx.dst.nbytes <= DIRECT_BYTES:
            return self._all_reduce_direct(ctx)
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
        jobs = [_copy(dst[a:b], mine if p == r else ctx.typed(ctx.remote(p, "out"), a * item, b - a))
                for p, (a, b) in enumerate(chunks)]
        _fan_out(ctx, jobs)
        self._end_slice(ctx)

    def _all_gather(self, ctx: Context) -> None:
        n, r, src, dst = ctx.size, ctx.rank, ctx.src, ctx.dst
        ctx.main.copy(ctx.typed(ctx.ccl_out, 0, src.size), src)
        _exchange(ctx, Signal.DATA)
        jobs = [_copy(dst[p], src if p == r else ctx.typed(ctx.remote(p, "out"), 0, src.size)) for p in range(n)]
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

    # -- single copy: read peers' user buffers directly -------------------------------------------
    def _sc_read(self, ctx: Context, peer: int, dst: np.ndarray, index: int) -> list[Job]:
        """Read jobs for ``dst`` from ``peer``; big reads become two halves for two engines."""
        if dst.nbytes < SPLIT_BYTES:
            return [lambda stream: ctx.read(stream, peer, dst, Signal.DATA, index)]
        half = dst.size // 2
        cut = half * ctx.call.itemsize
        return [lambda stream: ctx.read(stream, peer, dst[:half], Signal.DATA, index),
                lambda stream: ctx.read(stream, peer, dst[half:], Signal.DATA, index, cut)]

    def _sc_all_gather(self, ctx: Context) -> None:
        n, r, src, dst = ctx.size, ctx.rank, ctx.src, ctx.dst
        _exchange(ctx, Signal.DATA, SC_DATA, value=src.ctypes.data)
        jobs = [_copy(dst[r], src)]
        for p in range(n):
            if p != r:
                jobs += self._sc_read(ctx, p, dst[p], SC_DATA)
        _fan_out(ctx, jobs)
        _exchange(ctx, Signal.ACK, SC_DONE)

    def _sc_broadcast(self, ctx: Context) -> None:
        r, root = ctx.rank, ctx.call.root
        others = [p for p in range(ctx.size) if p != root]
        if r == root:
            _exchange(ctx, Signal.DATA, SC_DATA, peers=others, waiters=[], value=ctx.src.ctypes.data)
            if ctx.dst is not ctx.src:
                ctx.main.copy(ctx.dst, ctx.src)
            _exchange(ctx, Signal.ACK, SC_DONE, peers=[], waiters=others)
        else:
            _exchange(ctx, Signal.DATA, SC_DATA, peers=[], waiters=[root])
            _fan_out(ctx, self._sc_read(ctx, root, ctx.dst, SC_DATA))
            _exchange(ctx, Signal.ACK, SC_DONE, peers=[root], waiters=[])

    def _sc_all_reduce(self, ctx: Context) -> None:
        """Each rank reduces its share piece by piece (peers' pieces read through the kernel into
        a scratch piece, or mapped where they are ``ahcomm.alloc`` memory) and writes each reduced
        piece into every peer's output while it is in its cache (``_push``: the writes stop where
        a peer's call ended). Three rounds: the inputs' and the words' addresses, then the
        outputs' (posted only once every peer's words are known), then "done writing yours"."""
        n, r, src, dst = ctx.size, ctx.rank, ctx.src, ctx.dst
        item, ufunc, gates, seq = ctx.call.itemsize, ctx.ufunc, ctx.gates, ctx.call.seq
        assert ufunc is not None and gates is not None
        chunks = split(dst.size, n)
        a, b = chunks[r]
        others = [p for p in range(n) if p != r]
        gates.open(seq)
        for p in others:
            ctx.post(ctx.main, p, Signal.DATA, SC_WORDS, gates.address)
        _exchange(ctx, Signal.DATA, SC_DATA, value=src.ctypes.data)
        for p in others:
            ctx.wait(ctx.main, p, Signal.DATA, SC_WORDS)
        ctx.main.submit(lambda: gates.expose(seq, {p: ctx.posted(p, Signal.DATA, SC_WORDS) for p in others}))
        _exchange(ctx, Signal.DATA, SC_RESULT, value=dst.ctypes.data)
        # The reduction writes the output itself, in place or not. Out of place, each piece used to
        # be reduced in a second scratch piece and streamed out with non-temporal stores where
        # every rank had a core (measured ahead before the push loop existed); with the push
        # loop that pass cost more than the output lines' reads it saved: np=2, four interleaved
        # rounds on the Intel VM, ms, streamed / direct: 16 MiB 8.1-13.5 / 5.8-7.8, 32 MiB
        # 15.5-19.2 / 11.7-15.5, 64 MiB 25.2-30.9 / 22.3-29.2 (results/2026-11-27-oop-push.md).
        step = max(1, aligned(min(PUSH_BYTES, ctx.ccl_out.nbytes), item) // item)
        scratch = ctx.typed(ctx.ccl_out, 0, min(step, b - a))
        op = ctx.call.op

        def reduce_share() -> None:  # one engine task: no event-loop round trip per piece
            if not gates.begin(seq):  # the call already failed here: write nothing
                return
            shares: list[tuple[Pipe, int, np.ndarray | None]] = []
            owners: list[_push.Owner] = []
            try:
                # A peer's share from ahcomm.alloc memory is mapped here and reduced where it lies;
                # any other is read through the kernel into the scratch piece first. Pieces move
                # by address through each link's pipe (made once: per-call work in read/write cost
                # about 2 ms of a 64 MiB call at np=2).
                for p in others:
                    link, at = ctx.links[p], ctx.posted(p, Signal.DATA, SC_DATA)
                    mapped = link.view(at + a * item, (b - a) * item)
                    shares.append((_push.pipe(link), at, None if mapped is None else mapped.view(src.dtype)))
                owners += _push.owners(ctx.links, gates.peers)  # every other rank's (``expose``)
                outputs = [(_push.pipe(link), ctx.posted(p, Signal.DATA, SC_RESULT)) for link, p, _, _ in owners]
                tmp_at, out_at = int(scratch.ctypes.data), int(dst.ctypes.data)
                for lo in range(a, b, step):
                    hi = min(lo + step, b)
                    nbytes = (hi - lo) * item
                    tmp = scratch[:hi - lo]
                    out = dst[lo:hi]
                    for i, (pipe, at, mapped) in enumerate(shares):
                        if mapped is None:
                            pipe.read(tmp_at, at + lo * item, nbytes)
                        ufunc(src[lo:hi] if i == 0 else out, tmp if mapped is None else mapped[lo - a:hi - a], out=out)
                    _push.check(gates, seq, op, r, owners)  # the owners' gates, before each piece
                    for pipe, at in outputs:
                        pipe.write(out_at + lo * item, at + lo * item, nbytes)
            finally:
                gates.done(seq)
                shares.clear()  # views of peers' memory: an error's traceback keeps this frame
                owners.clear()

        ctx.main.submit(lambda: ctx.main.memory(lambda _d: reduce_share(), dst[a:b]))
        _exchange(ctx, Signal.ACK, SC_DONE)

    _staged: ClassVar[dict[str, Callable[[Mesh, Context], None]]] = {
        "all_reduce": _all_reduce, "all_gather": _all_gather, "reduce_scatter": _reduce_scatter,
        "broadcast": _broadcast}
    _single: ClassVar[dict[str, Callable[[Mesh, Context], None]]] = {
        "all_gather": _sc_all_gather, "broadcast": _sc_broadcast, "all_reduce": _sc_all_reduce}
    runs = dict.fromkeys(_staged, _run) | dict.fromkeys(WHOLE_OPS, _run_whole)

"""One-shot (one host, mailboxes): every rank publishes its input once and reads its peers'.

For small calls, latency is everything: each rank writes what it contributes into its
mailbox slot (``transports.mailbox``: payload, fingerprint, then the flag ``seq + 1``),
wakes its peers, waits until every peer's flag for this call is up, and computes its result
from the slots - in one task, with no step, notify or stream between.

* all_reduce - reduce every rank's slot in rank order (the same bits on every rank);
* reduce_scatter - the same on this rank's block of every slot;
* all_gather - copy every slot into its row;
* broadcast - the root publishes its input, the others a header only, and copy the root's;
* barrier - a header only.

A waiter whose peers are not all there polls the flags for a while (``Spin``: busy where every
rank of the host has a core, yielding its core between looks where they share cores two to
one), then marks itself asleep and waits for a wake-up.

Every rank hears from every peer in every run (``exchanged``), so finishing a call proves
every peer started it, as for the executor's all-dependent ops - but a broadcast's non-roots,
which wait for the root only; their next publication waits for the others (``publish``). Every
fingerprint a rank sees is checked against the call's (a mismatch fails the communicator,
naming both calls). A peer
lost or an abort fails the run's wake-up notify, so a waiting rank raises at once.
"""

from __future__ import annotations

from .._memcopy import copy
from ._mailbox_sync import arrivals, publish
from .base import Algorithm, Call, Context, Resources, Topology, fold, fold_may_read
from .cost import CostModel, Work, npieces

STEP = 1 / 3  # a mailbox step, in link alphas (see ``OneShot.cost``)
OPS = frozenset({"all_reduce", "reduce_scatter", "all_gather", "broadcast", "barrier"})


def published_bytes(call: Call, size: int) -> int:
    """Bytes of a rank's publication for ``call``: what its slot must hold (reduce_scatter leaves
    its own row unwritten there, twoshot its own share: only it reads them, from its input)."""
    if call.op == "barrier":
        return 0
    if call.op == "reduce_scatter":
        return call.count * size * call.itemsize
    return call.count * call.itemsize


class OneShot(Algorithm):
    name = "oneshot"
    ops = OPS
    waits_progress = False  # no CCL buffers; the mailbox slots keep their own rule (``_mailbox_sync.publish``)

    def exchanged(self, call: Call) -> bool:
        """A broadcast's non-roots wait for the root's publication only (the root waits for
        every peer's: it checks every fingerprint), so a run proves nothing about the others."""
        return call.op != "broadcast"

    def select(self, call: Call, topo: Topology) -> bool:
        return call.op in OPS and call.counts is None and (topo.size == 1 or topo.mailbox > 0)

    def resources(self, call: Call, topo: Topology, half_bytes: int) -> Resources:
        """A call larger than a slot runs in slices of one slot (the executor cuts them)."""
        per = published_bytes(call, topo.size) // max(1, call.count)  # bytes per element of count
        return Resources(max_count=max(1, topo.mailbox // per) if per and topo.mailbox else None)

    def work(self, call: Call, topo: Topology, model: CostModel, whole: float, block: float) -> float:
        """One dependent step (publish, wake, read): ``STEP`` of a link's alpha (a flag in shared
        memory and, at most, a FIFO byte, against a ZeroMQ message: measured 110 vs 300 us per
        small call at np=2), the same for every further slot-sized slice where every rank has a
        core, ``hop - 1`` alphas more where ranks share cores (measured at np=4 on 2 cores: 8
        slices of 256 KiB took 8 small calls' time, 2x star's 2 MiB all_reduce, while at np=2
        the sliced 2 MiB broadcast and all_gather beat every other algorithm by 20-50%); the
        copies and reductions of a rank: all_reduce publishes m and reduces (n - 1) m;
        reduce_scatter publishes (n - 1) m (its own row stays out: only it reads it) and
        reduces (n - 1) m; all_gather publishes m and copies
        n m (``Work.staged``: through a slot the cache keeps, half of each copy's traffic goes
        through memory; np=4 all_gather of 8-64 MiB ran 1.2-1.8x faster than direct's reads).
        broadcast: 2 m, the root's publication and, out of place, its own copy (in place it
        copies m, and forced in place it ran 1.2-2.6x faster than direct from 4 MiB; out of
        place, the API's default, direct was 1.2-1.5x faster at np=4 at 32-64 MiB, 16 MiB
        mixed, and a call does not say which it is). all_reduce and reduce_scatter keep their
        copies plain: their picks against twoshot and star were measured so."""
        n = topo.size
        m = float(published_bytes(call, n))
        s = npieces(m, topo.mailbox)
        op = call.op
        if op == "all_reduce":
            work = Work(copied=m, reduced=(n - 1) * m)
        elif op == "reduce_scatter":
            work = Work(copied=(n - 1) * m / n, reduced=(n - 1) * m / n)
        elif op == "all_gather":
            work = Work(staged=m + whole)
        elif op == "broadcast":
            work = Work(copied=2 * m)
        else:
            work = Work()
            s = 1
        hop = model.hop(topo)
        steps = STEP + (s - 1) * (STEP + hop - 1.0)  # slices in a row cost more where ranks share cores
        return steps * model.link(topo).alpha * hop + work.seconds(model, topo)

    async def orchestrate(self, ctx: Context) -> None:
        box = ctx.mailbox
        assert box is not None, "oneshot runs only where the executor has a mailbox"
        call, n, r = ctx.call, ctx.size, ctx.rank
        seq, op = call.seq, call.op
        src, dst = ctx.src, ctx.dst
        data = None if op == "barrier" or (op == "broadcast" and r != call.root) else src
        # reduce_scatter: this rank's row, which only it reads, from its input, not a copy in its slot
        own = op == "reduce_scatter" and fold_may_read(r, src[r], dst)
        tick, mine = await publish(ctx, data, skip=(r, r + 1) if own else None)
        if op == "broadcast" and r != call.root:  # the root's publication is all it reads
            await arrivals(ctx, tick, (call.root,))
            box.loose = (tick, seq, ctx.fingerprint)
            copy(dst, box.payload(call.root, tick).view(call.dtype).reshape(dst.shape), ctx.stream_output())
            return
        dtype = call.dtype
        if op == "all_gather":  # dst: (n, slice)
            # This rank's row first, while its slot is still in the cache and the peers publish:
            # 4-16% faster at np=2 1-64 MiB, 4-12% at np=4 16-64 MiB (results/2026-11-26-tune.md).
            stream = ctx.stream_output()
            copy(dst[r], mine.view(dtype), stream)
            await arrivals(ctx, tick)
            for p in range(n):
                if p != r:
                    copy(dst[p], box.payload(p, tick).view(dtype), stream)
            return
        await arrivals(ctx, tick)
        if op == "barrier":
            return
        if op == "broadcast":
            if dst is not src:
                copy(dst, src, ctx.stream_output())
            return
        assert ctx.ufunc is not None
        ufunc = ctx.ufunc
        parts = [(mine if p == r else box.payload(p, tick)).view(dtype) for p in range(n)]
        if op == "reduce_scatter":  # src: (n, slice), published row by row: this rank's row of each
            k = src.shape[1]
            parts = [part[r * k:(r + 1) * k] for part in parts]
            if own:
                parts[r] = src[r]
        fold(ufunc, parts, dst.reshape(-1))

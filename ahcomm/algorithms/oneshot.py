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

Every rank hears from every peer in every run (``exchanges``), so finishing a call proves
every peer started it, as for the executor's all-dependent ops. Every peer's fingerprint is
checked against this call's (a mismatch fails the communicator, naming both calls). A peer
lost or an abort fails the run's wake-up notify, so a waiting rank raises at once.
"""

from __future__ import annotations

import numpy as np

from .._errors import CollectiveMismatchError
from ._cost import CostModel, Work, call_bytes
from .base import Algorithm, Call, Context, Topology

OPS = frozenset({"all_reduce", "reduce_scatter", "all_gather", "broadcast", "barrier"})


def published_bytes(call: Call, size: int) -> int:
    """Bytes a rank writes into its slot for ``call`` (the most any rank writes)."""
    if call.op == "barrier":
        return 0
    if call.op == "reduce_scatter":
        return call.count * size * call.itemsize
    return call.count * call.itemsize


class OneShot(Algorithm):
    name = "oneshot"
    ops = OPS
    exchanges = True

    def select(self, call: Call, topo: Topology) -> bool:
        return (call.op in OPS and topo.mailbox > 0 and call.counts is None
                and published_bytes(call, topo.size) <= topo.mailbox)

    def cost(self, call: Call, topo: Topology, model: CostModel) -> float | None:
        """One dependent step (publish, wake, read); the copies and reductions of the busiest
        rank: all_reduce publishes m and reduces (n - 1) m; reduce_scatter publishes n m and
        reduces (n - 1) m; all_gather publishes m and copies n m; broadcast 2 m. The wake-ups
        are a syscall each, far below a link notify (``task``): counted as none."""
        n = topo.size
        if n == 1:
            return 0.0
        whole, block = call_bytes(call, n)
        m = float(published_bytes(call, n))
        op = call.op
        if op == "all_reduce":
            work = Work(rounds=1, copied=m, reduced=(n - 1) * m)
        elif op == "reduce_scatter":
            work = Work(rounds=1, copied=m, reduced=(n - 1) * m / n)
        elif op == "all_gather":
            work = Work(rounds=1, copied=m + whole)
        elif op == "broadcast":
            work = Work(rounds=1, copied=2 * m)
        else:
            work = Work(rounds=1)
        return work.seconds(model, topo)

    async def orchestrate(self, ctx: Context) -> None:
        box = ctx.mailbox
        assert box is not None, "oneshot runs only where the executor has a mailbox"
        call, n, r = ctx.call, ctx.size, ctx.rank
        seq, fp, op = call.seq, ctx.fingerprint, call.op
        src, dst = ctx.src, ctx.dst
        data = None if op == "barrier" or (op == "broadcast" and r != call.root) else src
        mine = box.publish(seq, fp, data)
        await _arrivals(ctx, seq, fp)
        if op == "barrier":
            return
        dtype = call.dtype
        if op == "broadcast":
            if r != call.root:
                np.copyto(dst, box.payload(call.root, seq).view(dtype).reshape(dst.shape))
            elif dst is not src:
                np.copyto(dst, src)
            return
        if op == "all_gather":
            for p in range(n):
                part = mine if p == r else box.payload(p, seq)
                np.copyto(dst[p], part.view(dtype))
            return
        assert ctx.ufunc is not None
        ufunc = ctx.ufunc
        if op == "all_reduce":
            parts = [(mine if p == r else box.payload(p, seq)).view(dtype) for p in range(n)]
        else:  # reduce_scatter: this rank's block of every rank's input
            count = call.count
            parts = [(mine if p == r else box.payload(p, seq)).view(dtype)[r * count:(r + 1) * count]
                     for p in range(n)]
        out = dst.reshape(-1)
        ufunc(parts[0], parts[1], out=out)
        for part in parts[2:]:
            ufunc(out, part, out=out)


async def _arrivals(ctx: Context, seq: int, fp: int) -> None:
    """Until every peer has published ``seq``; each peer's fingerprint is checked on the way."""
    box = ctx.mailbox
    assert box is not None
    pending = [p for p in range(ctx.size) if p != ctx.rank]
    flag = None
    try:
        while True:
            left = []
            for p in pending:
                theirs = box.fingerprint(p, seq)
                if not theirs:
                    left.append(p)
                elif theirs != fp:
                    hook = ctx.links[p].on_fingerprint
                    if hook is None:
                        raise CollectiveMismatchError(f"{ctx.call.op} #{seq}: rank {p} published a different "
                                                      f"collective (fingerprint {theirs:#010x})", seq=seq)
                    hook(p, seq, theirs)  # fails the communicator, and with it this run's wake-up
                    left.append(p)  # its slot holds another call: never read it
            if not left:
                return
            pending = left
            if flag is None:
                flag = ctx.local("mailbox")
                box.on_wake = flag.post
                continue  # a publish may have landed before on_wake was set: look once more
            await flag.wait()
    finally:
        if flag is not None:
            box.on_wake = None

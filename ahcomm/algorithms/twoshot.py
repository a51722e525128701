"""Two-shot all_reduce (one host, mailboxes): a reduce-scatter and an all-gather in one run.

Every rank publishes its input in its mailbox slot (as ``oneshot`` does), waits for its
peers', reduces its 1/n share of every slot in rank order into its output, publishes that
share, waits for the peers' shares and copies them into its output. oneshot makes every rank
reduce the whole vector out of every slot, (n - 1) m per rank; here each reduces (n - 1) m / n
and copies m more, for a second mailbox round: fewer bytes through each core where ranks
share cores (vLLM's custom all-reduce and TensorRT-LLM switch to two shots likewise as the
message grows). The bits are oneshot's: every element is folded in rank order, once, by its
share's owner.

The second publication waits for nothing more than the first: a rank publishes its share only
after it has read every peer's input, and the next run's first publication (the same slot
parity as this run's first) comes after every peer's share, which each published after reading
this rank's input. A call larger than a slot runs in slot-sized slices (the executor cuts them).
"""

from __future__ import annotations

import math

from .._memcopy import copy
from ._mailbox_sync import arrivals, publish
from .base import Algorithm, Call, Context, Resources, Topology, fold, fold_may_read, split
from .cost import CostModel, Work, npieces
from .oneshot import STEP

MAX_SLOTS = 4  # the largest call the selector gives it, in mailbox slots (4 MiB at the default): measured up to here


class TwoShot(Algorithm):
    name = "twoshot"
    ops = frozenset({"all_reduce"})
    exchanges = True  # every rank reads every peer's two publications
    waits_progress = False  # no CCL buffers; the mailbox slots keep their own rule (``_mailbox_sync.publish``)

    def select(self, call: Call, topo: Topology) -> bool:
        return call.op == "all_reduce" and call.counts is None and topo.size > 1 and topo.mailbox > 0

    def resources(self, call: Call, topo: Topology, half_bytes: int) -> Resources:
        """A call larger than a slot runs in slices of one slot."""
        return Resources(max_count=max(1, topo.mailbox // call.itemsize) if topo.mailbox else None)

    def work(self, call: Call, topo: Topology, model: CostModel, whole: float, block: float) -> float:
        """Two mailbox steps per slot-sized slice (``oneshot``'s step each; each slice after the
        first ``hop - 1`` alphas more where ranks share cores, as oneshot's slices: measured at
        np=4 on 2 cores, an 8 B call takes 229-246 us against oneshot's 139-160, the second
        step one plain step more); per rank the input copied into the slot (m; without the
        rank's own share, m - m / n, except where in place a third rank or later needs it there:
        priced so at n = 2 only, where no rank does), its share reduced out of every slot
        ((n - 1) m / n) and copied into the slot (m / n), the peers' shares copied out (m - m / n)."""
        n, m = topo.size, whole
        if m > MAX_SLOTS * topo.mailbox:  # beyond the range measured: never the selector's pick
            return math.inf
        s = npieces(m, topo.mailbox)
        hop = model.hop(topo)
        steps = 2 * s * STEP + (s - 1) * (hop - 1.0)
        work = Work(copied=2 * m - (m / n if n == 2 else 0.0), reduced=(n - 1) * m / n)
        return steps * model.link(topo).alpha * hop + work.seconds(model, topo)

    async def orchestrate(self, ctx: Context) -> None:
        box = ctx.mailbox
        assert box is not None and ctx.ufunc is not None, "twoshot runs only where the executor has a mailbox"
        n, r, dtype = ctx.size, ctx.rank, ctx.call.dtype
        out = ctx.dst.reshape(-1)
        shares = split(out.size, n)
        a, b = shares[r]
        own = ctx.src.reshape(-1)[a:b]
        # Only this rank reads its share of its input: it reads it from the input, and the slot
        # goes without it, (n - 1)/n of the copy (np=2 0.5-4 MiB 12-14% faster, results/
        # 2026-11-26-tune.md); not where ``out`` is the input and fold has written it by then
        from_input = fold_may_read(r, own, out)
        tick, mine = await publish(ctx, ctx.src.reshape(-1), skip=(a, b) if from_input else None)
        await arrivals(ctx, tick)
        parts = [(mine if p == r else box.payload(p, tick)).view(dtype)[a:b] for p in range(n)]
        if from_input:
            parts[r] = own
        fold(ctx.ufunc, parts, out[a:b])  # the slots hold the inputs: out may be the input (in place)
        tick, _ = await publish(ctx, out[a:b])
        await arrivals(ctx, tick)
        for p in range(n):
            if p != r:
                a, b = shares[p]
                copy(out[a:b], box.payload(p, tick).view(dtype))

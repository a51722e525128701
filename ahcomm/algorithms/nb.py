"""NB (HCCL's nonuniform Bruck): all_gather, all_gather_v and all_to_all in ceil(log2 n) steps.

Any world size; every transfer goes through ``Channels`` (main stream sends, sub-stream 0
receives), so blocks of any size pipeline through the slots.

* all_gather(_v): at step k (d = 2^k) a rank holds blocks r, r-1, ..., r-d+1; it sends the
  first c = min(d, n - d) of them to r + d and receives blocks r-d, ..., r-d-c+1 from r - d.
  The last step of a non-power of two thus sends only the n - d blocks still missing: no
  volume beyond the (n - 1) blocks every rank must get. Blocks land in their final place in
  the output (uneven blocks are fine: every rank knows every count); a range that wraps past
  the last rank travels as two messages. Cost: ceil(log2 n) a + (n - 1) m b.
* all_to_all: Bruck's index algorithm. Entry i of a rank's rotated view of its input (the
  block for rank r + i) moves at step k to rank r + 2^k when bit k of i is set, keeping its
  index; after the last step entry i holds the block from rank r - i. Each step packs its
  entries (about n/2 blocks) into scratch, sends them as one message and receives as many
  from r - 2^k. Cost: ceil(log2 n) a + P m b with P = sum of popcount(i), 0 < i < n
  (about n/2 log2 n), plus local copies of P + n blocks.

A step sends what the previous step received only once it is in (local notify per step).
No send source is rewritten within a run (puts on unmapped links may read it until the
executor flushes them at the end of the run).
"""

from __future__ import annotations

from .base import Algorithm, Call, Context, Resources, Topology
from .channels import PIECE_BYTES, Channels, channel_run
from .cost import CostModel, Work, engine_tasks, npieces


def distances(n: int) -> list[int]:
    """1, 2, 4, ... below ``n``: one Bruck step each."""
    out, d = [], 1
    while d < n:
        out.append(d)
        d *= 2
    return out


def runs(lo: int, length: int, n: int) -> list[tuple[int, int]]:
    """Block ranges [a, b) covering the cyclic range lo, lo+1, ..., lo+length-1 (mod n)."""
    lo %= n
    if lo + length <= n:
        return [(lo, lo + length)]
    return [(lo, n), (0, lo + length - n)]


def _all_gather(ctx: Context, ch: Channels) -> None:
    n, r = ctx.size, ctx.rank
    counts = ctx.call.counts or (ctx.call.count,) * n
    at = Call.displs(counts)
    assert ctx.dst.flags.c_contiguous, "nb all_gather needs the whole output in one run"
    out = ctx.dst.reshape(-1)  # blocks in rank order (a view: dst is contiguous)
    tx, rx = ctx.main, ctx.subs[0]
    steps = distances(n)
    for k, d in enumerate(steps):
        c = min(d, n - d)
        to, frm = (r + d) % n, (r - d) % n
        if k == 0:  # c == 1: our own block, straight from the input
            ch.send(tx, to, ctx.src)
            tx.copy(out[at[r]:at[r + 1]], ctx.src)
        else:
            tx.wait(ctx.local(("rx", k - 1)))
            for a, b in runs(r - c + 1, c, n):
                ch.send(tx, to, out[at[a]:at[b]])
        for a, b in runs(frm - c + 1, c, n):
            ch.recv(rx, frm, out[at[a]:at[b]])
        if k < len(steps) - 1:
            rx.post(ctx.local(("rx", k)))


def _all_to_all(ctx: Context, ch: Channels) -> None:
    n, r = ctx.size, ctx.rank
    m = ctx.src.size // n
    src, dst = ctx.src.reshape(n, m), ctx.dst.reshape(n, m)
    steps = distances(n)
    moved = [[i for i in range(1, n) if i & d] for d in steps]  # entries each step sends
    total = sum(len(idx) for idx in moved)
    scratch = ctx.scratch(2 * total * m).reshape(2 * total, m)  # [packed sends | receives]
    where = [src[(r + i) % n] for i in range(n)]  # where entry i lives now
    tx, rx = ctx.main, ctx.subs[0]
    base = 0
    for k, (d, idx) in enumerate(zip(steps, moved)):
        pack = scratch[base:base + len(idx)]
        got = scratch[total + base:total + base + len(idx)]
        base += len(idx)
        fresh = [j for j, i in enumerate(idx) if not i & (d - 1)]  # never moved: still in src
        for j in fresh:
            tx.copy(pack[j], where[idx[j]])
        if k:
            tx.wait(ctx.local(("rx", k - 1)))
        for j, i in enumerate(idx):
            if i & (d - 1):
                tx.copy(pack[j], where[i])
        ch.send(tx, (r + d) % n, pack.reshape(-1))
        ch.recv(rx, (r - d) % n, got.reshape(-1))
        if k < len(steps) - 1:
            rx.post(ctx.local(("rx", k)))
        for j, i in enumerate(idx):
            where[i] = got[j]
    for i in range(n):
        rx.copy(dst[(r - i) % n], where[i])


class NB(Algorithm):
    name = "nb"

    def resources(self, call: Call, topo: Topology, half_bytes: int) -> Resources:
        return Resources(substreams=1)

    def work(self, call: Call, topo: Topology, model: CostModel, whole: float, block: float) -> Work:
        """The module docstring's costs, plus the last credits: all_gather(_v) ceil(log2 n) a +
        (n - 1) m b and the copies out of the slots; all_to_all ceil(log2 n) a + P m b with
        P = sum of popcount(i), 0 < i < n, plus the packing and unpacking copies (2 P + n)
        blocks. ``link`` counts bytes sent plus received; a step forwards what the previous one
        received (a hand-off); every piece posts a DataSignal and an Ack; into a mapped buffer
        the put is a copy too."""
        n, op = topo.size, call.op
        dist = distances(n)
        puts = 1 + topo.all_mapped
        if op == "all_to_all":
            sent = [sum(1 for i in range(1, n) if i & d) * block for d in dist]  # what each step sends
            entries = sum(sent) / block if block else 0.0
            copies = (entries + n) * engine_tasks(block)
        else:
            smallest = min(call.counts) * call.itemsize if call.counts else block
            mean = (whole - smallest) / (n - 1)  # what a block moved is worth, all but one moving
            sent = [min(d, n - d) * mean for d in dist]
            copies = engine_tasks(block)
        moved = sum(sent)
        work = Work(rounds=len(dist) + 1, handoffs=len(dist) - 1, link=2 * moved,
                    copied=moved + (moved + n * block if op == "all_to_all" else block),
                    tasks=2 * sum(npieces(b, PIECE_BYTES) for b in sent),
                    engines=puts * sum(engine_tasks(b, PIECE_BYTES) for b in sent) + copies)
        return work

    runs = {"all_gather": channel_run(_all_gather), "all_gather_v": channel_run(_all_gather),
            "all_to_all": channel_run(_all_to_all)}

"""Eager (any links that carry eager messages): one message per peer for a small call.

Where there are no host mailboxes (``oneshot``) - ranks on several hosts, or the rdma
transport - a small call is latency-bound by its messages: a multi-step algorithm pays one
ZeroMQ message per notify and step, and an rdma put its DataAck. Here each rank sends what a
peer needs of its input in one message (``DataLink.send_eager``: tagged with the call's
sequence number and fingerprint, copied on the way, never acknowledged), and computes its
result from what it received, in one task, with no stream, notify or CCL buffer:

* all_reduce - every rank sends its input to every peer and reduces all of them in rank
  order (the same bits on every rank); reduce - the same, to the root only;
* reduce_scatter - rank p gets block p of every input, reduced in rank order;
* all_gather, gather - every rank sends its block to every peer (to the root);
* broadcast, scatter - the root sends the vector (block p) to every peer (to p);
* all_to_all - block p to rank p;
* barrier - an empty message to every peer.

A call runs only if every message fits one (``Topology.eager``, ``EAGER_BYTES``): the link
keeps a message that arrives before it is asked for, and a peer is never more than a call
ahead (the executor's rule: ``seq`` starts once every peer finished ``seq - 2``), so what
waits there is bounded. The receiver checks every message's fingerprint against its own call
of that sequence number (a mismatch fails the communicator); a peer lost or an abort fails the
link's pending messages, so a waiting rank raises at once.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .base import Algorithm, Call, Context, Topology, fold
from .cost import CostModel, Work

EXCHANGED = frozenset({"all_reduce", "reduce_scatter", "all_gather", "all_to_all", "barrier"})  # all to all
OPS = EXCHANGED | {"reduce", "gather", "broadcast", "scatter"}


# A step of eager, in link alphas. Mesh, star and eager all cost one step per small call in the
# model, and ties went to mesh; measured on one host (quiet, 2 selection sweeps, 8 B-32 KiB):
# eager's all_to_all 1.1-1.9x faster than mesh's at np=2 and np=4, its gather and scatter up to
# 1.1-1.7x at np=2.
ONE_WAY = 0.75


def message_bytes(call: Call) -> int:
    """The largest message a rank sends in ``call``."""
    if call.op == "barrier":
        return 0
    count = max(call.counts) if call.counts else call.count
    return count * call.itemsize


class Eager(Algorithm):
    name = "eager"
    ops = OPS

    def select(self, call: Call, topo: Topology) -> bool:
        if call.op not in OPS or (topo.size > 1 and topo.eager <= 0):
            return False
        if call.op in ("all_to_all", "gather", "scatter") and call.counts is not None \
                and len(set(call.counts)) > 1:  # the _v-like uneven blocks go elsewhere
            return False
        return message_bytes(call) <= topo.eager or topo.size == 1

    def exchanged(self, call: Call) -> bool:
        """Every rank hears from every peer in the ops of ``EXCHANGED`` (not in the rooted ones)."""
        return call.op in EXCHANGED

    def work(self, call: Call, topo: Topology, model: CostModel, whole: float, block: float) -> Work:
        """One dependent step, ``ONE_WAY`` of a link's alpha (a message that is never acknowledged,
        where a step of the other algorithms waits for a put's signal); the busiest rank sends and
        receives ``n - 1`` messages of ``m`` bytes (each a notify's worth of loop work and two
        copies: into the message, out of it) and reduces ``(n - 1) m``. The root of a rooted op
        does it all alone (``busy`` 2). A barrier counts a whole step (measured even with
        dissemination over rdma at 4 ranks)."""
        n, op = topo.size, call.op
        m = float(message_bytes(call))
        peers = n - 1
        if op == "barrier":
            return Work(rounds=1, tasks=peers)
        reduced = peers * m if op in ("all_reduce", "reduce", "reduce_scatter") else 0.0
        if op in EXCHANGED:
            return Work(rounds=ONE_WAY, tasks=peers, link=2 * peers * m, copied=2 * peers * m, reduced=reduced)
        return Work(rounds=ONE_WAY, tasks=peers, link=peers * m, copied=peers * m + m, reduced=reduced, busy=2)

    async def orchestrate(self, ctx: Context) -> None:
        call, n, r = ctx.call, ctx.size, ctx.rank
        op, root = call.op, call.root
        src, dst = ctx.src, ctx.dst
        peers = [p for p in range(n) if p != r]
        if op in ("all_reduce", "all_gather", "barrier"):
            _send(ctx, peers, None if op == "barrier" else src)
            got = await _receive(ctx, peers)
            if op == "barrier":
                return
            if op == "all_gather":  # dst: (n, count)
                for p in range(n):
                    dst[p] = src if p == r else np.frombuffer(got[p], call.dtype)
                return
            _reduce(ctx, src, dst, got)
        elif op == "reduce_scatter":  # src: (n, count): row p goes to rank p
            for p in peers:
                ctx.links[p].send_eager(call.seq, ctx.fingerprint, src[p])
            _reduce(ctx, src[r], dst, await _receive(ctx, peers))
        elif op == "all_to_all":  # flat blocks of k elements
            k = _block(call)
            for p in peers:
                ctx.links[p].send_eager(call.seq, ctx.fingerprint, src[p * k:(p + 1) * k])
            dst[r * k:(r + 1) * k] = src[r * k:(r + 1) * k]
            got = await _receive(ctx, peers)
            for p in peers:
                dst[p * k:(p + 1) * k] = np.frombuffer(got[p], call.dtype)
        elif op == "broadcast":
            if r == root:
                _send(ctx, peers, src)
                if dst is not src:
                    np.copyto(dst, src)
            else:
                dst[...] = np.frombuffer((await _receive(ctx, [root]))[root], call.dtype).reshape(dst.shape)
        elif op == "scatter":
            k = _block(call)
            if r == root:
                for p in peers:
                    ctx.links[p].send_eager(call.seq, ctx.fingerprint, src[p * k:(p + 1) * k])
                dst[...] = src[r * k:(r + 1) * k]
            else:
                dst[...] = np.frombuffer((await _receive(ctx, [root]))[root], call.dtype)
        elif r != root:  # reduce, gather: to the root only
            _send(ctx, [root], src)
        elif op == "reduce":
            _reduce(ctx, src, dst, await _receive(ctx, peers))
        else:  # gather at the root: dst is every rank's block in rank order
            k = _block(call)
            got = await _receive(ctx, peers)
            for p in range(n):
                dst[p * k:(p + 1) * k] = src if p == r else np.frombuffer(got[p], call.dtype)


def _block(call: Call) -> int:
    """Elements of one rank's block (the ops with ``counts``: all equal, see ``select``)."""
    return call.counts[0] if call.counts else call.count


def _send(ctx: Context, peers: list[int], data: np.ndarray | None) -> None:
    seq, fp, links = ctx.call.seq, ctx.fingerprint, ctx.links
    for p in peers:
        links[p].send_eager(seq, fp, data)


async def _receive(ctx: Context, peers: list[int]) -> dict[int, Any]:
    """Every peer's eager message of this call (arrived, or awaited in turn)."""
    seq, links = ctx.call.seq, ctx.links
    futs = [(p, links[p].eager(seq)) for p in peers]
    got: dict[int, Any] = {}
    try:
        for p, fut in futs:
            got[p] = fut.result() if fut.done() else await fut
    except BaseException:
        for _, fut in futs:  # the others: no error left unretrieved, no waiter left behind
            if not fut.done():
                fut.cancel()
            elif not fut.cancelled():
                fut.exception()
        raise
    return got


def _reduce(ctx: Context, mine: np.ndarray, dst: np.ndarray, got: dict[int, Any]) -> None:
    """dst = part 0 op part 1 op ... in rank order (this rank's part is ``mine``)."""
    assert ctx.ufunc is not None
    ufunc, r, dtype = ctx.ufunc, ctx.rank, ctx.call.dtype
    if r >= 2 and np.may_share_memory(mine, dst):  # dst is written before this rank's part is read
        mine = mine.copy()
    parts = [mine if p == r else np.frombuffer(got[p], dtype) for p in range(ctx.size)]
    fold(ufunc, parts, dst.reshape(-1))

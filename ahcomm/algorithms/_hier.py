"""The pieces of the hierarchical algorithm: the servers' layout, its streams, the level-1
collectives it runs among one rank per server (ring and RHD all_reduce, chain and binomial
broadcast trees) on a ``Lane`` (sends on one stream, receives on another), and the pricing
of its two levels at their own link kinds.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from .._stream import Stream
from .base import Context, Topology, split
from .channels import Lane, Senders
from .cost import CostModel, LinkCost, Work, log2up
from .rhd import Fold


class Layout:
    """The servers of a job and who owns what on them.

    Servers are numbered in the order of their lowest rank, their ranks kept in rank order
    (local rank j = the j-th). G = the most ranks on one server. A vector is cut into G
    chunks; on a server of L ranks, local rank ``c % L`` owns chunk c. A rank's block
    (all_gather, reduce_scatter) is owned on its own server by the rank itself and, on
    every other server, by one of its ranks, round-robin over the blocks of the other servers.
    """

    def __init__(self, topo: Topology) -> None:
        self.ranks, self.server = _servers(topo.hosts)  # shared by every rank's layout: read only
        self.S = len(self.ranks)
        self.G = max(len(r) for r in self.ranks)
        self.me = topo.rank
        self.s = self.server[self.me]
        self.local = self.ranks[self.s]
        self.peers = [p for p in self.local if p != self.me]

    def owner(self, s: int, c: int) -> int:
        """The rank of server ``s`` that owns chunk ``c``."""
        ranks = self.ranks[s]
        return ranks[c % len(ranks)]

    def group(self, c: int) -> list[int]:
        """The owners of chunk ``c``, one per server, in server order."""
        return [self.owner(s, c) for s in range(self.S)]

    def holder(self, s: int, b: int) -> int:
        """The rank of server ``s`` that owns rank ``b``'s block: ``b`` itself on its own server,
        else round-robin over the ranks of ``s`` in the order of the other servers' ranks."""
        if self.server[b] == s:
            return b
        ranks = self.ranks[s]
        return ranks[(b - bisect_left(ranks, b)) % len(ranks)]  # b's index among the ranks not on s

    def sizes(self) -> list[int]:
        return [len(r) for r in self.ranks]


@lru_cache(maxsize=8)
def _servers(hosts: tuple[str, ...]) -> tuple[list[list[int]], list[int]]:
    """(ranks of each server, server of each rank), servers in the order of their lowest rank:
    O(n) once per job, where each rank's layout used to cost O(servers x n)."""
    index: dict[str, int] = {}
    ranks: list[list[int]] = []
    server: list[int] = []
    for r, h in enumerate(hosts):
        s = index.get(h)
        if s is None:
            s = index[h] = len(ranks)
            ranks.append([])
        ranks[s].append(r)
        server.append(s)
    return ranks, server


@lru_cache(maxsize=64)
def layout(topo: Topology) -> Layout:
    return Layout(topo)


@dataclass
class Streams:
    """A run's streams: level 1 sends (main) and receives, level 0 receives, one level-0 send
    stream per local peer (Channels: all sends to one peer on one stream, so do a phase's
    sends to several peers never wait for each other)."""

    tx1: Stream
    rx1: Stream
    rx0: Stream
    tx0: dict[int, Stream]

    @staticmethod
    def of(ctx: Context, lay: Layout) -> "Streams":
        return Streams(ctx.main, ctx.subs[0], ctx.subs[1], {p: ctx.subs[2 + i] for i, p in enumerate(lay.peers)})


def ring_all_reduce(lane: Lane, members: list[int], q: int, w: np.ndarray) -> None:
    """All_reduce ``w`` in place among ``members`` (this rank is members[q]): a ring."""
    n = len(members)
    subs = split(w.size, n)
    nxt, prv = members[(q + 1) % n], members[(q - 1) % n]
    for t in range(n - 1):  # reduce-scatter: member q ends with sub (q + 1) reduced
        lane.send(nxt, w, *subs[(q - t) % n])
        a, b = subs[(q - t - 1) % n]
        lane.recv(prv, w, a, b, operand=w[a:b])
    for t in range(n - 1):  # all-gather
        lane.send(nxt, w, *subs[(q + 1 - t) % n])
        lane.recv(prv, w, *subs[(q - t) % n])


def rhd_all_reduce(lane: Lane, members: list[int], q: int, w: np.ndarray) -> None:
    """All_reduce ``w`` in place among ``members``: recursive halving-doubling (rhd.py's
    schedule, with the fold of a member count that is not a power of two)."""
    fold, count = Fold(len(members)), w.size
    v = fold.virtual(q)
    if v is None:  # the even member of a folded pair: hand over, get the result back
        lane.send(members[q + 1], w, 0, count)
        lane.recv(members[q + 1], w, 0, count)
        return
    bounds = [a for a, _ in split(count, fold.p)] + [count]
    if q < 2 * fold.r:
        lane.recv(members[q - 1], w, 0, count, operand=w)
    for peer, give, keep in fold.halving(v):
        c, d = bounds[keep[0]], bounds[keep[1]]
        lane.send(members[peer], w, bounds[give[0]], bounds[give[1]])
        lane.recv(members[peer], w, c, d, operand=w[c:d])
    for peer, mine, theirs in fold.doubling(v):
        lane.send(members[peer], w, bounds[mine[0]], bounds[mine[1]])
        lane.recv(members[peer], w, bounds[theirs[0]], bounds[theirs[1]])
    if q < 2 * fold.r:
        lane.send(members[q - 1], w, 0, count)


class _Sources:
    """A stand-in ``Lane`` that records whom a level-1 schedule receives from."""

    def __init__(self) -> None:
        self.peers: set[int] = set()

    def send(self, peer: int, arr: np.ndarray, lo: int, hi: int) -> None:
        pass

    def recv(self, peer: int, arr: np.ndarray, lo: int, hi: int, operand: np.ndarray | None = None) -> None:
        self.peers.add(peer)


@lru_cache(maxsize=8)
def all_reduce_senders(hosts: tuple[str, ...]) -> Senders:
    """Who sends to each rank in hier all_reduce: its server's other ranks (level 0) and, in the
    level-1 group of each chunk it owns, the members ring or RHD receives from (both counted:
    the choice goes by chunk size). Built once per job, the same on every rank."""
    ranks, server = _servers(hosts)
    senders: list[set[int]] = [set(ranks[server[r]]) - {r} for r in range(len(hosts))]
    w = np.empty(len(ranks), np.uint8)
    for c in range(max(len(rs) for rs in ranks)):
        members = [rs[c % len(rs)] for rs in ranks]
        for q, m in enumerate(members):
            lane = _Sources()
            ring_all_reduce(lane, members, q, w)  # type: ignore[arg-type]
            rhd_all_reduce(lane, members, q, w)  # type: ignore[arg-type]
            senders[m] |= lane.peers
    return Senders(senders)


def tree(v: int, n: int, chain: bool) -> tuple[int | None, list[int]]:
    """(parent, children) of position ``v`` in a broadcast tree over positions 0..n-1 rooted
    at 0: a chain (v - 1 -> v -> v + 1) or a binomial tree (children v + 2^k, farthest first)."""
    if chain:
        return (v - 1 if v else None), ([v + 1] if v + 1 < n else [])
    top = v.bit_length()  # children are v + 2^k for 2^k > v's highest bit
    kids = [v + (1 << k) for k in range(top, max(1, n).bit_length()) if v + (1 << k) < n]
    parent = v - (1 << (top - 1)) if v else None
    return parent, kids[::-1]


def group_all_reduce(n: int, ring: bool) -> tuple[int, float]:
    """(steps, bytes moved per byte of the vector) of an all_reduce among ``n`` by ring or RHD."""
    if ring:
        return 2 * (n - 1), 2 * (n - 1) / n
    p = 1 << (n.bit_length() - 1)
    return 2 * log2up(p) + 2 * (p < n), 2 * (p - 1) / p + 2 * (p < n)


class Price:
    """Seconds of the two levels' ``Work``: level 0 at the link kind inside a server, level 1
    at the kind between servers, both the same on every rank. Level 1 is the slowest kind to
    another server; level 0 the slowest kind to a local peer where every server has one, else
    what a same-host link is by default (sdma where servers are joined by rdma)."""

    def __init__(self, lay: Layout, topo: Topology, model: CostModel) -> None:
        self.topo, self.model = topo, model
        remote = {topo.link_kinds[p] for p in range(topo.size) if lay.server[p] != lay.s}
        inner = {topo.link_kinds[p] for p in lay.peers} if min(lay.sizes()) > 1 else \
            {"sdma" if k == "rdma" else k for k in remote}
        self.link0, self.link1 = self._slowest(inner), self._slowest(remote)

    def _slowest(self, kinds: set[str]) -> LinkCost:
        costs = [self.model.links.get(k, self.model.links["rdma"]) for k in kinds]
        return max(costs, key=lambda c: (c.beta, c.alpha))

    def seconds(self, work: Work, link: LinkCost, parts: int = 1) -> float:
        """Work.seconds at ``link``; with ``parts``, one of that many pipelined segments."""
        m = self.model
        cpu = (work.tasks * m.notify_cpu + work.link * link.beta + work.reduced * m.gamma
               + work.copied * m.copy) / parts
        return (work.rounds * link.alpha * m.hop(self.topo) + work.tasks * m.notify_wait / parts
                + cpu * m.slowdown(self.topo, work.busy, work.streams))

    def segmented(self, w0: Work, w1: Work, parts: int) -> float:
        """Level 0 then level 1 per segment, segment k + 1's level 0 beside segment k's level 1."""
        t0, t1 = self.seconds(w0, self.link0, parts), self.seconds(w1, self.link1, parts)
        return t0 + t1 + (parts - 1) * max(t0, t1)

    def overlapped(self, w0: Work, w1: Work) -> float:
        """Both levels forwarding piece by piece: their steps add up, their bytes overlap."""
        s0, s1 = self.seconds(Work(rounds=w0.rounds), self.link0), self.seconds(Work(rounds=w1.rounds), self.link1)
        return s0 + s1 + max(self.seconds(w0, self.link0) - s0, self.seconds(w1, self.link1) - s1)

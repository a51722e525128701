"""Closed-form alpha-beta times of ring, RHD and hier all_reduce on ``ahcomm-sim``'s cluster
(``ahcomm.sim.closed_form``): what the simulation is checked against with contention off."""

from __future__ import annotations

from .algorithms.channels import SLOTS as CHANNEL_SLOTS
from .algorithms.channels import channel_piece
from .algorithms.cost import CostModel
from .transports.sim import INTER, INTRA

BUFFSIZE = 64 << 20  # ahcomm.sim's CCL buffers (the default AHCOMM_BUFFSIZE)


def _level1(servers: int, chunk: float, piece: float, a1: float, b1: float) -> float:
    """Seconds of hier's level-1 all_reduce of ``chunk`` bytes among ``servers`` members: ring
    (chunks above ``RHD_BYTES``: 2 (S - 1) steps of chunk / S) or RHD (halving then doubling,
    plus the fold's two whole-chunk steps where S is not a power of two). Each step waits for
    the last (its data was reduced there); a step of several pieces forwards them as they land
    (``Lane``), so only the largest step's later pieces add their puts."""
    from .algorithms.hierarchical import RHD_BYTES

    if chunk > RHD_BYTES:
        parts = [chunk / servers] * (2 * (servers - 1))
    else:
        p = 1 << (servers.bit_length() - 1)
        halves = [chunk / (2 << i) for i in range(p.bit_length() - 1)]
        parts = halves + halves[::-1]
        if p < servers:
            parts = [chunk, *parts, chunk]
    big = max(parts)
    pieces = max(1.0, -(-big // piece))
    first = sum(a1 + min(part, piece) * b1 for part in parts)
    return first + (pieces - 1) * big / pieces * b1


def _hier_piece(servers: int, k: int) -> float:
    """Channels' piece in hier all_reduce: CCL_In cut among the most senders a rank has."""
    from .algorithms._hier import all_reduce_senders
    from .algorithms.channels import PIECE_BYTES

    regions = all_reduce_senders(tuple(f"s{r // k}" for r in range(servers * k))).regions
    return float(min(PIECE_BYTES, BUFFSIZE // 2 // regions // CHANNEL_SLOTS))


def _hier(servers: int, k: int, m: float, link0: tuple[float, float], link1: tuple[float, float]) -> float:
    """Hier all_reduce as ``ahcomm.algorithms.hierarchical`` runs it, contention off: P segments
    (``segments``), each cut into k chunks of c bytes. Each local peer's level-0 send stream
    carries RS 0, RS 1, AG 0, RS 2, AG 1, ..., AG P-1 (a put of c each, landing a0 after it;
    an all-gather once its segment's level 1 is done); the one level-0 receive stream takes
    them in that order (a segment's reduction can wait behind the previous all-gather); level 1
    runs the segments one after another (the next one's first send leaves once the previous
    one's last send has, a1 before its last receive); the run ends when the last all-gather's
    credits are back (a0)."""
    from .algorithms.hierarchical import MAX_SEGMENTS, SEGMENT_BYTES

    (a0, b0), (a1, b1) = link0, link1
    parts = max(1, min(MAX_SEGMENTS, int(m // SEGMENT_BYTES)))
    chunk = m / parts / k
    x0, t1 = chunk * b0, _level1(servers, chunk, _hier_piece(servers, k), a1, b1)
    order = [("rs", 0)] + [x for j in range(1, parts) for x in (("rs", j), ("ag", j - 1))] + [("ag", parts - 1)]
    tx = rx = 0.0  # when a level-0 send stream and the receive stream are free
    level1 = float("-inf")  # when level 1's send stream is free for the next segment
    done: dict[int, float] = {}  # level 1 of segment j finished (its result at the owner)
    for what, j in order:
        tx = (tx if what == "rs" else max(tx, done[j])) + x0
        rx = max(rx, tx + a0)  # landed, then reduced or copied at once (no compute)
        if what == "rs":
            done[j] = max(rx, level1) + t1
            level1 = done[j] - a1
    return rx + a0


def closed_form(op: str, algorithm: str, n: int, k: int, nbytes: int, model: CostModel) -> float | None:
    """The textbook alpha-beta seconds of all_reduce by ring, RHD (``n`` a power of two) or hier
    (``n`` a multiple of ``k``) on this cluster; None for anything else. Pure alpha-beta: no
    compute, no contention (compare with ``simulate(..., contention=False)`` and a model whose
    ``gamma`` and ``copy`` are 0). Ring is bound by its slowest link; an RHD step at distance d
    stays inside a server when d < k; hier follows what ``ahcomm.algorithms.hierarchical`` runs
    (``_hier``: its streams' order, its segments, its level-1 ring or RHD)."""
    if op != "all_reduce" or n < 2:
        return None
    a0, b0 = model.links[INTRA].alpha, model.links[INTRA].beta
    a1, b1 = model.links[INTER].alpha, model.links[INTER].beta
    m = float(nbytes)
    if algorithm == "ring":  # a chain around the ring (mean hop), or the slowest port busy all along
        from .algorithms.ring import SLOTS as RING_SLOTS

        inter = 1 if n > k else 0
        hops = n // k if n > k else 0  # hops between servers in the ring (k divides n)
        a_mean = ((n - hops) * a0 + hops * a1) / n
        b_mean = ((n - hops) * b0 + hops * b1) / n
        a_max, b_max = (a1, b1) if inter else (a0, b0)
        steps, c = 2 * (n - 1), m / n
        # a step forwards what the last one received (one hop), but a link carries at most SLOTS
        # pieces per credit round trip (put, DataSignal, Ack); the last Acks come back at the end
        step = max(a_mean + c * b_mean, (2 * a_max + c * b_max) / RING_SLOTS)
        return max(steps * step + a_max, steps * c * b_max)
    if algorithm == "rhd":
        if n & (n - 1):
            return None
        piece = float(channel_piece(n, BUFFSIZE // 2))
        total, d, part = 0.0, n // 2, m / 2
        while d >= 1:  # halving at p/2, p/4, ..., 1 moves m/2, m/4, ...; doubling mirrors it
            a, b = (a0, b0) if d < k else (a1, b1)
            pieces = max(1.0, part / piece)  # Channels: SLOTS pieces per credit round trip
            total += 2 * (a + max(part * b, pieces / CHANNEL_SLOTS * (2 * a + min(part, piece) * b) - a))
            d, part = d // 2, part / 2
        return total + (a1 if n > k else a0)  # the last credits (Acks) of the widest step come back
    if algorithm == "hier":
        if n % k or n <= k:
            return None
        return _hier(n // k, k, m, (a0, b0), (a1, b1))
    return None

"""Closed-form alpha-beta times of ring, RHD and hier all_reduce on ``ahcomm-sim``'s cluster
(``ahcomm.sim.closed_form``): what the simulation is checked against with contention off."""

from __future__ import annotations

from .algorithms.channels import SLOTS as CHANNEL_SLOTS
from .algorithms.channels import channel_piece
from .algorithms.cost import CostModel
from .transports.sim import INTER, INTRA

BUFFSIZE = 64 << 20  # ahcomm.sim's CCL buffers (the default AHCOMM_BUFFSIZE)


def closed_form(op: str, algorithm: str, n: int, k: int, nbytes: int, model: CostModel) -> float | None:
    """The textbook alpha-beta seconds of all_reduce by ring, RHD (``n`` a power of two) or hier
    (``n`` a multiple of ``k``) on this cluster; None for anything else. Pure alpha-beta: no
    compute, no contention (compare with ``simulate(..., contention=False)`` and a model whose
    ``gamma`` and ``copy`` are 0). Ring is bound by its slowest link; an RHD step at distance d
    stays inside a server when d < k; hier follows ``ahcomm.algorithms.hierarchical``'s costs
    (level-1 ring for chunks above ``RHD_BYTES``, RHD below; segments from 2 ``SEGMENT_BYTES``)."""
    from .algorithms.hierarchical import MAX_SEGMENTS, RHD_BYTES, SEGMENT_BYTES

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
        s = n // k
        segments = min(MAX_SEGMENTS, int(m // SEGMENT_BYTES)) if m >= 2 * SEGMENT_BYTES else 1
        seg = m / segments
        t0 = 2 * (a0 + (k - 1) / k * seg * b0)
        chunk = seg / k
        steps = 2 * (s - 1) if chunk > RHD_BYTES else 2 * max(0, (s - 1).bit_length())
        t1 = steps * a1 + 2 * (s - 1) / s * chunk * b1
        return t0 + t1 + (segments - 1) * max(t0, t1)
    return None

"""Clock offsets between ranks for trace files, estimated once at init (``_bootstrap``).

Each rank's trace is in its own monotonic clock; ``ahcomm-trace merge`` shifts it by the
offset measured here (NTP-style ping-pongs with rank 0 over point-to-point messages).
"""

from __future__ import annotations

import asyncio
import logging
from time import perf_counter_ns
from typing import Any, Protocol

import numpy as np

from ._trace import Tracer, set_process_offset
from .algorithms.base import Topology

log = logging.getLogger("ahcomm.trace")

PING_TAG = 0xFFFF  # point-to-point tag of the clock ping-pongs at init
PINGS = 8  # ping-pongs per rank; the one with the smallest round trip counts
PING_TIMEOUT = 10.0  # seconds: a rank without tracing never answers


class Pinging(Protocol):
    """What the estimate uses of a communicator: its ranks, hosts and point-to-point messages."""

    @property
    def rank(self) -> int: ...
    @property
    def size(self) -> int: ...
    @property
    def topology(self) -> Topology: ...

    def send(self, x: Any, dst: int, *, tag: int = 0, timeout: float | None = None) -> asyncio.Future[None]: ...
    def recv(self, src: int, *, out: np.ndarray | None = None, shape: Any = None, dtype: Any = None, tag: int = 0,
             timeout: float | None = None) -> asyncio.Future[np.ndarray]: ...


def tracer_of(comm: object) -> Tracer | None:
    """The communicator's tracer (None when tracing is off)."""
    executor = getattr(comm, "_executor", None)
    return getattr(executor, "tracer", None)


async def estimate_offsets(comm: Pinging) -> None:
    """Estimate this rank's clock offset to rank 0's (NTP-style) for the trace files.

    Each rank sends rank 0 ``PINGS`` pings over point-to-point messages (tag ``PING_TAG``;
    they take no sequence number); rank 0 answers each with its clock. The sample with the
    smallest round trip gives offset = (t_send + t_back) / 2 - t_rank0 (within half that round
    trip of the truth). Rank 0 serves the ranks one after another, then releases them all
    together (so the first collective does not wait for the last rank served). A rank on rank 0's host
    shares its monotonic clock: its offset is 0, and the estimate is only recorded. init()
    calls it only when every rank traces (agreed in its first collective); a rank that stops
    answering makes the others give up after ``PING_TIMEOUT`` seconds, offset unknown.
    """
    tracer = tracer_of(comm)
    if tracer is None:
        return
    offset, rtt = 0, 0
    try:
        if comm.rank == 0:
            for peer in range(1, comm.size):
                for _ in range(PINGS):
                    await comm.recv(peer, tag=PING_TAG, timeout=PING_TIMEOUT)
                    await comm.send(np.array([perf_counter_ns()], np.int64), peer, tag=PING_TAG)
            for peer in range(1, comm.size):  # all served: every rank leaves init at about the same time
                await comm.send(np.zeros(1, np.int64), peer, tag=PING_TAG)
        else:
            offset, rtt = await _ping(comm)
            await comm.recv(0, tag=PING_TAG, timeout=PING_TIMEOUT * comm.size)
    except Exception as exc:  # noqa: BLE001 - tracing must not break init
        log.warning("ahcomm: rank %d: clock offset to rank 0 unknown (is AHCOMM_TRACE set on every rank?): %s",
                    comm.rank, exc)
        return
    tracer.estimate, tracer.rtt = offset, rtt
    if comm.topology.hosts[comm.rank] == comm.topology.hosts[0]:
        offset = 0  # one host, one kernel: the very same monotonic clock
    tracer.offset = offset
    set_process_offset(offset)


async def _ping(comm: Pinging) -> tuple[int, int]:
    """(offset, round trip) of the fastest of ``PINGS`` ping-pongs with rank 0, in ns."""
    best: tuple[int, int] | None = None
    for _ in range(PINGS):
        t0 = perf_counter_ns()
        sent = comm.send(np.array([t0], np.int64), 0, tag=PING_TAG)
        reply = await comm.recv(0, tag=PING_TAG, timeout=PING_TIMEOUT)
        t3 = perf_counter_ns()
        await sent
        sample = ((t0 + t3) // 2 - int(reply[0]), t3 - t0)
        if best is None or sample[1] < best[1]:
            best = sample
    assert best is not None
    return best

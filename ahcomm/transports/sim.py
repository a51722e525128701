"""Simulated transport: every rank in one process, in virtual time (``ahcomm.sim``).

``VirtualLoop`` is an asyncio event loop whose clock is virtual: its selector never blocks,
it jumps the clock to the next scheduled timer when nothing is ready, so the real stream,
notify and algorithm coroutines run unchanged while time only passes where the network
model says so. A loop with nothing ready and no timer is a deadlock: it raises.

``SimNetwork`` holds the link model: a post (link notify) lands ``alpha`` after it is sent;
a put occupies the sender's outgoing port and the receiver's incoming port of its link kind
(inside a server, between servers) for ``bytes * beta`` (per-port contention: a port moves
one thing at a time) and completes when the last byte left. ``SimLink`` is the link contract
over it: post, put, flush, progress, abort; no mapping, no reads, no messages. Data moves
only in ``check`` mode (small arrays compared with numpy by ``ahcomm.sim``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ._simloop import SimDeadlock, VirtualLoop
from .base import MAX_CONTROL, Link, MemoryRunner, MessageKey, as_bytes

__all__ = ["INTER", "INTRA", "LinkParams", "SimDeadlock", "SimLink", "SimNetwork", "VirtualLoop"]

INTRA, INTER = "sdma", "rdma"  # the link kinds the algorithms see: inside a server, between servers


@dataclass(frozen=True)
class LinkParams:
    alpha: float  # seconds from a post to the peer's flag
    beta: float  # seconds per byte through a port


@dataclass
class SimNetwork:
    """The cluster model and its state: ports' busy-until times, bytes per link kind."""

    loop: VirtualLoop
    ranks_per_server: int
    params: dict[str, LinkParams]
    contention: bool = True
    check: bool = False
    busy: dict[tuple[int, str, int], float] = field(default_factory=dict)  # (rank, kind, 0 out/1 in) -> until
    bytes_by_kind: dict[str, int] = field(default_factory=lambda: {INTRA: 0, INTER: 0})
    puts: int = 0
    posts: int = 0

    def kind(self, a: int, b: int) -> str:
        return INTRA if a // self.ranks_per_server == b // self.ranks_per_server else INTER

    def at(self, when: float, fn: Callable[..., Any], *args: Any) -> None:
        self.loop.at(when, fn, *args)

    def transfer(self, src: int, dst: int, kind: str, nbytes: int) -> float:
        """Reserve the ports for ``nbytes`` from ``src`` to ``dst``; the time the last byte left."""
        now = self.loop.now
        span = nbytes * self.params[kind].beta
        self.bytes_by_kind[kind] += nbytes
        self.puts += 1
        if not self.contention:
            return now + span
        out, into = (src, kind, 0), (dst, kind, 1)
        start = max(now, self.busy.get(out, 0.0), self.busy.get(into, 0.0))
        end = self.busy[out] = self.busy[into] = start + span
        return end


class SimLink(Link):
    """One simulated link (``INTRA`` or ``INTER`` by the subclass); the peer's end is ``twin``."""

    def __init__(self, net: SimNetwork, rank: int, peer: int, peer_buffers: tuple[np.ndarray, np.ndarray]) -> None:
        super().__init__(rank, peer, None)
        self.net = net
        self.twin: SimLink | None = None
        self._peer_buffers = peer_buffers  # the peer's (CCL_In, CCL_Out): written only in check mode

    def post(self, signal: int, index: int, seq: int, value: int = 0, fingerprint: int = 0) -> None:
        assert self.twin is not None
        self.signals_sent += 1
        self.net.posts += 1
        self.net.at(self.net.loop.now + self.net.params[self.kind].alpha, self.twin.deliver, signal, index, seq,
                    value, fingerprint)

    def put(self, src: np.ndarray, buf: str, offset: int, seq: int, run: MemoryRunner) -> "Awaitable[Any] | None":
        data = as_bytes(src)
        self.bytes_sent += data.nbytes
        if self.net.check:
            target = self._peer_buffers[0 if buf == "in" else 1]
            target[offset:offset + data.nbytes] = data
        end = self.net.transfer(self.rank, self.peer, self.kind, data.nbytes)
        if end <= self.net.loop.now:
            return None
        return self.net.loop.settle_at(end)

    def send_control(self, payload: bytes) -> None:
        if len(payload) > MAX_CONTROL:
            raise ValueError(f"control message of {len(payload)} bytes (at most {MAX_CONTROL})")
        assert self.twin is not None
        self.twin.control(bytes(payload))

    def send_progress(self, seq: int) -> None:
        """Nothing: a simulated job runs one collective per rank, the executor's halves never wait."""

    def send_abort(self, reason: str) -> None:
        assert self.twin is not None
        self.twin.peer_aborted(reason)

    def send_message(self, key: MessageKey, meta: bytes, data: np.ndarray) -> "Awaitable[None] | None":
        raise NotImplementedError("simulated links carry no point-to-point messages")


class SimIntraLink(SimLink):
    kind = INTRA


class SimInterLink(SimLink):
    kind = INTER

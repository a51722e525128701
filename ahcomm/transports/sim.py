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

from ._simloop import Delay, SimDeadlock, VirtualLoop
from .base import MAX_CONTROL, Link, MemoryRunner, MessageKey, as_bytes

__all__ = ["INTER", "INTRA", "Delay", "LinkParams", "SimDeadlock", "SimLink", "SimNetwork", "VirtualLoop"]

INTRA, INTER = "sdma", "rdma"  # the link kinds the algorithms see: inside a server, between servers
# Seconds from which an idle rank sleeps (``SimNetwork.post_cpu``): on the Intel VM a pipe round
# trip to a peer idle 100 us took 67 us, 76 at 150 us, 84 at 200 us and longer (its CPU halts).
ASLEEP = 100e-6


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
    busy: dict[int, float] = field(default_factory=dict)  # port (``port()``) -> busy until
    bytes_by_kind: dict[str, int] = field(default_factory=lambda: {INTRA: 0, INTER: 0})
    puts: int = 0
    posts: int = 0
    cores: int = 0  # CPUs per server shared by its ranks' copies, reductions, puts and posts (0: unlimited)
    task: float = 0.0  # CPU seconds per post (with cores)
    cpus: dict[int, list[float]] = field(default_factory=dict)  # server -> its CPUs' busy-until
    engine: float = 0.0  # seconds a memory task of engine_bytes or more waits for its copy engine's thread
    engine_bytes: int = 1 << 62  # the executor's ENGINE_THRESHOLD (set with engine)
    crowd: float = 1.0  # a copy's time when every core of its server copies at once / alone (>= 1)
    copy: float = 0.0  # CPU seconds per byte of an sdma put (a copy into the peer's mapped buffer; 0: beta)
    copying: dict[int, list[float]] = field(default_factory=dict)  # server -> end times of its running copies
    threads: dict[int, float] = field(default_factory=dict)  # rank -> when its event loop's thread is free
    cold: float = 0.0  # CPU seconds more for a rank's first post after it moved cold_bytes (with cores)
    cold_bytes: int = 1 << 62  # bytes of memory work that leave a rank's cache cold (set with cold)
    moved: dict[int, int] = field(default_factory=dict)  # rank -> bytes of memory work since its last post

    def cpu(self, rank: int, span: float, memory: bool = False, fixed: float = 0.0, engine: bool = False) -> float:
        """Run ``fixed + span`` seconds of work on one of ``rank``'s server's CPUs, from now or
        once a CPU is free; when it ends. ``memory``: ``span`` is a copy or reduction, which
        shares the server's memory bandwidth with the copies running on its other CPUs
        (``crowd``); ``fixed`` is not (a copy engine's hand-off). Work not handed to a copy
        engine (``engine``) runs on the rank's event-loop thread, one task at a time, whichever
        of its streams submits it (a rank copies inline on a full host: an out-of-place
        broadcast root's 64 MiB copy, traced at 6.7 ms, held its 32 puts back; ring broadcast at
        2 ranks was predicted at 0.40-0.71 of the measured time: results/2026-11-26-cache-rates.md)."""
        now = self.loop.now
        if self.cores <= 0:
            return now + fixed + span
        server = rank // self.ranks_per_server
        free = self.cpus.setdefault(server, [0.0] * self.cores)
        inline = not engine
        ready = max(now, self.threads.get(rank, 0.0)) if inline else now
        # the core that has been busy longest among those free by then (the others stay free for
        # work that comes sooner), else the first to be free
        idle = [i for i, t in enumerate(free) if t <= ready]
        core = max(idle, key=free.__getitem__) if idle else min(range(len(free)), key=free.__getitem__)
        begin = max(ready, free[core])
        if memory and self.crowd > 1.0:
            span *= self.crowding(server, begin + fixed)
        end = begin + fixed + span
        free[core] = end
        if inline:
            self.threads[rank] = end
        if memory and self.crowd > 1.0:
            self.copying[server].append(end)
        return end

    def crowding(self, server: int, start: float) -> float:
        """How much longer a copy starting at ``start`` takes than alone: ``crowd`` when every
        other core of the server copies then, linear in how many do (charged for the whole
        copy, as it starts: the copies running already keep their end)."""
        running = [t for t in self.copying.get(server, ()) if t > start]
        self.copying[server] = running
        if self.cores <= 1:
            return 1.0
        return 1.0 + (self.crowd - 1.0) * min(len(running), self.cores - 1) / (self.cores - 1)

    def memory(self, rank: int, nbytes: int, span: float) -> float:
        """A memory task of ``nbytes`` taking ``span`` seconds of CPU on ``rank``'s stream: when it
        ends. One of ``engine_bytes`` or more goes to the stream's copy-engine thread (as
        ``Stream.memory`` does) and costs the hand-off too (``engine``: the thread's wake-up and
        the event loop's, CPU work on the same server: where ranks outnumber cores it waits for
        one like the copy)."""
        handed = nbytes >= self.engine_bytes
        if self.cold and not handed:  # on the event loop's thread, through its core's cache (as calibrated)
            self.moved[rank] = self.moved.get(rank, 0) + nbytes
        return self.cpu(rank, span, memory=True, fixed=self.engine if handed else 0.0, engine=handed)

    def post_cpu(self, rank: int, peer: int, kind: str = INTRA) -> float:
        """The CPU seconds of ``rank``'s half of a post to ``peer``: half of ``task``, plus ``cold``
        (pro rata up to ``cold_bytes``) where it is the rank's first post since it moved memory on
        its event loop's thread and it wakes a sleeping peer of its server (the peer's event loop
        idle for ``ASLEEP`` or longer), as ``calibrate`` measures it.
        Traced at 2 ranks on 2 cores: a ring broadcast's posts, which wake a peer idle for
        140-230 us, 17.5 us at 8 B and 51 at 2 MiB; a ring all_reduce's, whose peer is at work
        or just idle, 3.3 and 8-11 (results/2026-11-27-cold-notify.md)."""
        moved = self.moved.pop(rank, 0) if self.cold else 0
        if not moved or kind != INTRA or self.loop.now - self.threads.get(peer, 0.0) < ASLEEP:
            return self.task / 2
        return self.task / 2 + self.cold * min(1.0, moved / self.cold_bytes)

    def kind(self, a: int, b: int) -> str:
        return INTRA if a // self.ranks_per_server == b // self.ranks_per_server else INTER

    def at(self, when: float, fn: Callable[..., Any], *args: Any) -> None:
        self.loop.at(when, fn, *args)

    def transfer(self, out: int, into: int, kind: str, nbytes: int, beta: float) -> float:
        """Reserve ports ``out`` and ``into`` (``port`` numbers) for ``nbytes``; when the last byte left."""
        now = self.loop.now
        self.bytes_by_kind[kind] += nbytes
        self.puts += 1
        if not self.contention:
            return now + nbytes * beta
        busy = self.busy
        start = max(now, busy.get(out, 0.0), busy.get(into, 0.0))
        end = busy[out] = busy[into] = start + nbytes * beta
        return end

    @staticmethod
    def port(rank: int, kind: str, incoming: bool) -> int:
        """A port's key in ``busy``: per rank, link kind and direction (a port moves one thing at a time)."""
        return rank * 4 + (2 if kind == INTER else 0) + incoming


class SimLink(Link):
    """One simulated link (``INTRA`` or ``INTER`` by the subclass); the peer's end is ``twin``."""

    def __init__(self, net: SimNetwork, rank: int, peer: int, peer_buffers: tuple[np.ndarray, np.ndarray]) -> None:
        super().__init__(rank, peer, None)
        self.net = net
        self.twin: SimLink | None = None
        self._peer_buffers = peer_buffers  # the peer's (CCL_In, CCL_Out): written only in check mode
        params = net.params[self.kind]
        self.alpha, self.beta = params.alpha, params.beta
        self._out, self._in = net.port(rank, self.kind, False), net.port(peer, self.kind, True)

    def post(self, signal: int, index: int, seq: int, value: int = 0, fingerprint: int = 0) -> None:
        twin = self.twin
        assert twin is not None
        self.signals_sent += 1
        net = self.net
        net.posts += 1
        if net.task:  # half the post's CPU work here, half at the receiver when it lands (its wake-up)
            sent = net.cpu(self.rank, net.post_cpu(self.rank, self.peer, self.kind))
            net.loop.at(sent + self.alpha, self._land, signal, index, seq, value, fingerprint)
            if sent > net.loop.now:  # the posting stream is busy for its half
                return net.loop.delay(sent)  # type: ignore[return-value]
            return
        when = net.loop.now + self.alpha
        if value or twin.events is not None:  # a value, or a fingerprint to check: the full delivery
            net.loop.at(when, twin.deliver, signal, index, seq, value, fingerprint)
        else:  # the flag itself, found now: one call when it lands
            net.loop.at(when, twin.notify(signal, index, seq).post)

    def _land(self, signal: int, index: int, seq: int, value: int, fingerprint: int) -> None:
        """A post reached the peer's server (with ``task``): the peer's event loop needs a CPU for
        its half of the work (waking up, reading the signal) before the flag is set."""
        twin, net = self.twin, self.net
        assert twin is not None
        net.loop.at(net.cpu(twin.rank, net.task / 2), twin.deliver, signal, index, seq, value, fingerprint)

    def put(self, src: np.ndarray, buf: str, offset: int, seq: int, run: MemoryRunner) -> "Awaitable[Any] | None":
        net = self.net
        nbytes = src.nbytes
        self.bytes_sent += nbytes
        if net.check:
            data = as_bytes(src)
            target = self._peer_buffers[0 if buf == "in" else 1]
            target[offset:offset + nbytes] = data
        end = net.transfer(self._out, self._in, self.kind, nbytes, self.beta)
        if net.cores > 0:  # sdma: a copy into the peer's mapped memory (at the host's copy rate); rdma: a send
            if self.kind == INTRA:
                end = max(end, net.memory(self.rank, nbytes, nbytes * (net.copy or self.beta)))
            else:
                end = max(end, net.cpu(self.rank, nbytes * self.beta))
        if end <= net.loop.now:
            return None
        return net.loop.delay(end)

    def send_control(self, payload: bytes) -> None:
        self._check_size("a control message", len(payload), MAX_CONTROL)
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

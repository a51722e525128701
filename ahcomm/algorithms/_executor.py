"""The executor: runs one collective with a chosen algorithm, slice by slice.

It owns the communicator's streams and decides which half of the CCL buffers a collective
uses (by the parity of its sequence number). Collective ``seq`` may write into a half only
once every peer is known to have finished ``seq - 2``, the last user of that half. That
knowledge comes for free when a collective's result depends on every rank (all_reduce,
all_gather, reduce_scatter, barrier: completing it proves every peer started it); after
the others (broadcast, empty calls) the executor tells each peer where it stands.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from .._buffers import CclBuffers
from .._errors import PeerFailure
from .._memcopy import copy
from .._stream import Stream, engine_bytes_for
from .._trace import Tracer
from ..transports.base import Link, LinkEvents, Mailboxes
from ._push import WORDS, Gates, cause_of
from .base import ALIGN, WHOLE, Algorithm, Call, Context, Resources, Topology

RESOURCE_CACHE = 256  # entries of the per-communicator resources cache
Ready = Callable[[int, int], Awaitable[None]]  # ready(lo, hi): src[lo:hi] may be read
ALL_DEPENDENT = frozenset({"all_reduce", "all_gather", "reduce_scatter", "barrier"})


class Progress:
    """How far each peer is known to have got: ``finished[p]`` = last seq p completed."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank = rank
        self.finished = [-1] * size
        self._low = -1 if size > 1 else 1 << 62  # min of finished[] over the peers, kept current
        self._at_low = size - 1  # peers whose finished[] is _low (the min is recomputed when none is left)
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []

    def reached(self, peer: int, seq: int) -> None:
        """``peer`` has started collective ``seq`` (so it finished ``seq - 1``)."""
        finished = self.finished
        old = finished[peer]
        if seq - 1 > old:
            finished[peer] = seq - 1
            if old == self._low:
                self._at_low -= 1
                if self._at_low <= 0:  # the last peer at the old minimum moved on: one pass, once per level
                    self._relow()

    def all_started(self, seq: int) -> None:
        if seq - 1 > self._low:
            finished = self.finished
            for peer in range(len(finished)):
                if seq - 1 > finished[peer]:
                    finished[peer] = seq - 1
            self._relow()

    def _relow(self) -> None:
        """The minimum over the peers and how many are at it, then wake whoever waits for it."""
        rank = self.rank
        peers = [f for p, f in enumerate(self.finished) if p != rank]
        if peers:
            self._low = low = min(peers)
            self._at_low = peers.count(low)
        self._wake()

    def low(self) -> int:
        return self._low

    async def wait_all(self, seq: int) -> None:
        """Until every peer has finished collective ``seq``."""
        if seq < 0 or self.low() >= seq:
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append((seq, fut))
        await fut

    def _wake(self) -> None:
        if not self._waiters:
            return
        low = self.low()
        keep = []
        for seq, fut in self._waiters:
            if low >= seq:
                if not fut.done():
                    fut.set_result(None)
            else:
                keep.append((seq, fut))
        self._waiters = keep

    def fail(self, error: BaseException) -> None:
        for _, fut in self._waiters:
            if not fut.done():
                fut.set_exception(error)
        self._waiters = []


class Executor:
    """Runs collectives of one communicator, one at a time, in sequence order."""

    def __init__(self, rank: int, size: int, links: dict[int, Link], buffers: CclBuffers,
                 topo: Topology, progress: Progress) -> None:
        self.rank = rank
        self.size = size
        self.links = links
        self.buffers = buffers
        self.topo = topo
        self.progress = progress
        self.tracer = Tracer.from_env(rank, size)  # AHCOMM_TRACE; None: off, and nothing is timed
        if self.tracer is not None:
            self.run = self.tracer.runner(self.run)  # type: ignore[method-assign, assignment]
        self.main = Stream("main", inline=True, tracer=self.tracer)
        self.subs: list[Stream] = []
        self._host_floor = 0  # ranks on this host that the topology may not show (``share_host``)
        self._copy_policy()  # host_ranks, engine_bytes
        self.gates = Gates()  # mesh's push gates: in the CCL_Out's words (``bind``), posted per call
        self.bind()
        self._unmapped = [link for link in links.values() if not link.mapped]
        self._ctx: Context | None = None  # the run in progress (abort fails its local notifies)
        self._error: BaseException | None = None  # set by abort: no further slice starts
        self._scratch = np.empty(0, np.uint8)
        self._resources: dict[tuple[Any, ...], Resources] = {}
        self.mailbox: Mailboxes | None = None  # the host's mailboxes (set at init where ``topo.mailbox``)
        self.paths: dict[str, int] = {}  # runs per path where an algorithm has several (``Context.tally``)
        self._owed = False  # the peers were not told that this rank finished its last run (``_report``)

    def bind(self) -> None:
        """Views of the CCL buffers' halves (at creation, and after ``Comm.resume`` renewed them)."""
        buffers = self.buffers
        self.half = h = buffers.nbytes // 2 // ALIGN * ALIGN
        # (offset, CCL_In half, CCL_Out half) used by collectives of even and of odd sequence number
        self._halves = [(p, buffers.ccl_in.array[p:p + h], buffers.ccl_out.array[p:p + h]) for p in (0, h)]
        words = buffers.ccl_out.words
        self.gates.bind(words[1:1 + WORDS] if words.size > WORDS else None)  # word 0: their address

    def release(self) -> None:
        """Drop every view of the CCL buffers, the scratch region and the mailboxes (``Comm.suspend``)."""
        self._halves = []
        self._scratch = np.empty(0, np.uint8)
        self._resources.clear()
        self.gates.bind(None)
        self.mailbox = None
        self._let_go()

    def _let_go(self) -> None:
        """Drop the streams' error hook: the last run's context, whose views are the caller's arrays."""
        for stream in (self.main, *self.subs):
            stream.on_error = None

    def scratch(self, nbytes: int) -> np.ndarray:
        """The reusable scratch region, at least ``nbytes`` long (pre-faulted when it grows)."""
        if self._scratch.nbytes < nbytes:
            self._scratch = np.empty(max(nbytes, 2 * self._scratch.nbytes), np.uint8)
            self._scratch.fill(0)
        return self._scratch

    def set_topology(self, topo: Topology) -> None:
        self.topo = topo
        self._resources.clear()
        self._copy_policy()

    def share_host(self, ranks: int) -> None:
        """At least ``ranks`` run on this rank's host, whatever the topology says: a group's
        communicator gets its parent's count (the host runs every rank of the job, not only
        the group's)."""
        self._host_floor = ranks
        self._copy_policy()

    def _copy_policy(self) -> None:
        """Where the host's ranks fill its cores the streams copy inline (``engine_bytes_for``)."""
        self.host_ranks = max(_ranks_here(self.topo), self._host_floor)  # ranks of the job on this host
        self.engine_bytes = engine_bytes_for(self.host_ranks)
        for stream in (self.main, *self.subs):
            stream.engine_bytes = self.engine_bytes

    def _resources_for(self, algorithm: Algorithm, call: Call) -> Resources:
        """An algorithm's resources, computed once per (algorithm, op, dtype, count) and kept."""
        key = (algorithm.name, id(algorithm), call.op, call.dtype, call.count, call.counts)
        res = self._resources.get(key)
        if res is None:
            if len(self._resources) >= RESOURCE_CACHE:
                self._resources.clear()
            res = self._resources[key] = algorithm.resources(call, self.topo, self.half)
        return res

    def _substreams(self, count: int) -> list[Stream]:
        while len(self.subs) < count:
            self.subs.append(Stream(f"sub{len(self.subs)}", tracer=self.tracer, engine_bytes=self.engine_bytes))
        return self.subs[:count]

    async def run(self, call: Call, algorithm: Algorithm, src: np.ndarray, dst: np.ndarray,
                  ufunc: np.ufunc | None, *, ready: Ready | None = None) -> None:
        """Run ``call``; ``src``/``dst`` are flat, contiguous, of the call's dtype (may be one array).

        ``ready(lo, hi)``, if given, is awaited before a slice reads ``src[lo:hi]`` (an input
        still being copied to the host): slice by slice, so the copy overlaps the first slices.
        """
        inplace = src is dst
        if self.size == 1 or (call.empty and call.op != "barrier"):
            if ready is not None:
                await ready(0, src.size)
            if not inplace and src.size == dst.size:
                copy(dst, src)
            self._report(call, communicated=False)
            return
        if algorithm.waits_progress:
            if self._owed:  # tell the peers now what the last runs did not show them (``_report``)
                self._owed = False
                for link in self.links.values():
                    link.send_progress(call.seq)
            if self.progress.low() < call.seq - 2:
                await self.progress.wait_all(call.seq - 2)
        res = self._resources_for(algorithm, call)
        subs = self._substreams(res.substreams)
        step = max(1, call.count if call.op in WHOLE else (res.max_count or call.count))
        parity, ccl_in, ccl_out = self._halves[call.seq & 1]
        for a in range(0, max(call.count, 1), step):
            b = min(a + step, call.count)
            if ready is not None:
                for lo, hi in self._reads(call, src, a, b):
                    await ready(lo, hi)
            if self._error is not None:  # aborted between slices (while the input was on its way)
                raise self._error
            s, d = self._views(call, src, dst, a, b, inplace)
            ctx = Context(call=call, topo=self.topo, links=self.links, src=s, dst=d,
                          ccl_in=ccl_in, ccl_out=ccl_out, half_offset=parity, main=self.main, subs=subs,
                          ufunc=ufunc, final=b == call.count, scratch=self.scratch, mailbox=self.mailbox,
                          paths=self.paths, gates=self.gates)
            self._ctx = ctx
            try:
                await algorithm.orchestrate(ctx)
            except PeerFailure as exc:  # a link's error names the peer only: say which call it ended
                named = exc.during(call.op, call.seq)
                if named is exc:
                    raise
                raise named from exc.__cause__
            finally:
                self._ctx = None
        self._let_go()  # the run is over: its caller's arrays are not kept
        for link in self._unmapped:
            await link.flush()
        self._report(call, communicated=True, exchanged=algorithm.exchanged(call),
                     lazy=not algorithm.waits_progress)

    def _report(self, call: Call, communicated: bool, exchanged: bool = False, lazy: bool = False) -> None:
        """What the peers learn of this rank's progress: nothing where every peer heard from it in
        the run; else a progress message to each, or (``lazy``: an algorithm that does not wait
        for progress) one at the start of the next run that waits for its peers' progress."""
        if communicated and (exchanged or call.op in ALL_DEPENDENT):
            self.progress.all_started(call.seq)
        elif lazy:
            self._owed = True
        else:
            self._owed = False
            for link in self.links.values():
                link.send_progress(call.seq + 1)

    def _reads(self, call: Call, src: np.ndarray, a: int, b: int) -> list[tuple[int, int]]:
        """The ranges of ``src`` the slice [a, b) of ``call`` reads (reduce_scatter: one per rank's block)."""
        if call.op in WHOLE or (a == 0 and b == call.count):
            return [(0, src.size)]
        if call.op == "reduce_scatter":
            return [(p * call.count + a, p * call.count + b) for p in range(self.size)]
        return [(a, b)]

    def _views(self, call: Call, src: np.ndarray, dst: np.ndarray, a: int, b: int,
               inplace: bool) -> tuple[np.ndarray, np.ndarray]:
        n, count = self.size, call.count
        if call.op in WHOLE or (a == 0 and b == count and call.op not in ("all_gather", "reduce_scatter")):
            return src, dst  # one slice: the whole arrays, no new views
        if call.op == "all_gather":
            return src[a:b], dst.reshape(n, count)[:, a:b]
        if call.op == "reduce_scatter":
            return src.reshape(n, count)[:, a:b], dst[a:b]
        s = src[a:b]
        return s, (s if inplace else dst[a:b])

    async def close(self) -> None:
        for stream in (self.main, *self.subs):
            await stream.close()
        if self.tracer is not None:
            self.tracer.write()
        self._halves = []  # drop our views of the CCL buffers so they can be unmapped
        self.gates.bind(None)
        self.mailbox = None  # and of the host's mailboxes

    def attach(self, events: LinkEvents) -> None:
        """The communicator's ``events`` (a peer aborted, lost or out of protocol; a fingerprint
        or a control message arrived) on every link."""
        for link in self.links.values():
            link.attach(events)

    def send_control(self, peer: int, payload: bytes) -> bool:
        """Send a small control message to ``peer`` (best effort: False if it could not be sent)."""
        link = self.links.get(peer)
        if link is None:
            return False
        try:
            link.send_control(payload)
        except Exception:  # noqa: BLE001 - a closed or broken link: the caller copes with no answer
            return False
        return True

    def tell_peers(self, reason: str) -> None:
        """Tell every peer that this rank aborted (best effort)."""
        for link in self.links.values():
            link.send_abort(reason)

    def link_stats(self) -> dict[int, dict[str, Any]]:
        return {peer: link.stats() for peer, link in self.links.items()}

    def endpoint_stats(self) -> dict[str, int]:
        """The counters of this rank's receiving endpoint(s), once (not repeated per link)."""
        endpoints = {id(e): e for e in (link.receiver() for link in self.links.values()) if e is not None}
        out: dict[str, int] = {}
        for endpoint in endpoints.values():
            for key, value in endpoint.stats().items():
                out[key] = out.get(key, 0) + value
        return out

    def abort(self, error: BaseException) -> None:
        self._error = error
        self.gates.shut(cause_of(error))  # no peer writes into this rank's output any more, nor its own push loop
        if self._ctx is not None:
            self._ctx.fail(error)
        self.progress.fail(error)
        for link in self.links.values():
            link.fail(error)
        for stream in (self.main, *self.subs):
            stream.abort(error)
        if self.tracer is not None:  # what ran up to the failure
            self.tracer.write()


def _ranks_here(topo: Topology) -> int:
    """How many of ``topo``'s ranks share this rank's host."""
    here = topo.hosts[topo.rank] if topo.hosts else None
    return sum(1 for h in topo.hosts if h == here) if here is not None else 1

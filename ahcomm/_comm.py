"""Comm: a communicator (HCCL's comm domain) and its collectives.

Each collective method validates its arguments, takes the next sequence number and
enqueues the collective at once, returning an awaitable for the result. Collectives run
one at a time in sequence order (the communicator's stream), so several may be in flight
(``asyncio.gather(comm.all_reduce(a), comm.all_reduce(b))``) and each still meets its
twin on every rank. Cancelling the awaiting task does not withdraw an issued collective:
it completes in the background (its peers depend on it) and later ones are unaffected.

Reliability (always on):

* Mismatch detection: every signal a peer posts carries the fingerprint of its call (see
  ``Call.fingerprint``); the link hands it to ``Health.on_fingerprint`` (``_health``), which compares it with this
  rank's own call of that sequence number (a dict lookup). A fingerprint for a call not
  issued here yet is kept and checked when it is. A collective that runs longer than
  ``_watchdog.PROBE_AFTER`` also announces its fingerprint to every peer by control message, so calls
  whose signals never meet are caught too. On a difference the communicator stops at once,
  asks the peer to describe its call (control request, ``REPLY_WAIT``) and fails every rank
  with ``CollectiveMismatchError`` naming both calls.
* Timeouts: ``AHCOMM_EXEC_TIMEOUT`` or a call's ``timeout=`` (seconds from when it starts
  running). On expiry every peer is asked where it stands, and ``CollectiveTimeout`` names the
  ranks that had not arrived; the peers are told the same.
* A lost peer (``LinkEvents.on_lost``: the transport saw its socket close or its heartbeats stop)
  fails the communicator with ``PeerFailure`` naming the peer and the collective in flight.
* A call rejected after it took its sequence number (or by some ranks only) is retired:
  every rank that rejected it raises, and the peers are told (``_retire``); if some rank ran
  it instead, every rank fails with ``CollectiveMismatchError`` naming the rejecting rank.
* Every failure writes the flight recorder (``_flight``) as JSON and names the file; SIGUSR1
  prints each communicator's state to stderr.

Failures are final: pending collectives raise the error, later calls ``CommClosedError``
naming it, and every peer is told (a control message giving the kind, then an abort).
"""

from __future__ import annotations

import asyncio
import dataclasses
import difflib
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Self

import numpy as np

from . import _elastic, _flight, _groups, _suspend
from ._buffers import CclBuffers
from ._collectives import BlockedCollectives, flat_view
from ._core import Job, cancel_and_wait
from ._device_calls import device_aware, take_staging
from ._dtypes import ReduceOp, check_dtype, check_reduce, ufunc_for
from ._errors import CommClosedError, CommSuspendedError, InvalidArgument, check_timeout
from ._flight import FlightRecorder
from ._health import Health, mark
from ._objects import ObjectCollectives
from ._outputs import Results
from ._p2p import PointToPoint
from ._sync import ThreadsafeCalls
from .algorithms._executor import Executor, Progress
from .algorithms._selection import Selector
from .algorithms.base import WHOLE, Call, Topology
from .algorithms.copies import Explanation, copies
from .transports.base import Link

_UFUNCS: dict[tuple[ReduceOp, np.dtype], np.ufunc] = {}  # ufunc_for's answers (a few dozen at most)


def _as_array(x: Any, what: str) -> np.ndarray:
    if isinstance(x, np.ndarray):
        return x
    if hasattr(x, "__array__"):
        return np.asarray(x)
    raise InvalidArgument(f"{what} must be a numpy array (or expose __array__), got {type(x).__name__}")


class Comm(ThreadsafeCalls, BlockedCollectives, ObjectCollectives, PointToPoint):
    """A group of ranks that run collectives together.

    A communicator belongs to the event loop it was created on: call it from that loop
    only (another loop or thread gets ``WrongLoopError`` at once). Synchronous code in other
    threads calls in through ``call_threadsafe`` or ``sync``.
    """

    def __init__(self, *, rank: int, size: int, links: dict[int, Link], buffers: CclBuffers,
                 topo: Topology, progress: Progress, selector: Selector, exec_timeout: float,
                 on_close: Callable[[], Awaitable[None]] | None = None, parent: Comm | None = None,
                 members: Sequence[int] = (), child: bool = True) -> None:
        """A communicator of ``size`` ranks on ``links`` (``init`` makes the first one). One made
        from ``parent`` (``_derive``) has the parent ranks ``members``, shares its domain numbers,
        names world ranks in its messages and, as a ``child``, is closed before the parent."""
        self.rank = rank
        self.size = size
        if links and not topo.eager:  # what every link carries in one eager message (the eager algorithm)
            topo = dataclasses.replace(topo, eager=min(link.eager_limit for link in links.values()))
        self.topology = topo
        self._selector = selector
        self._executor = Executor(rank, size, links, buffers, topo, progress)
        self._exec_timeout = exec_timeout
        self._on_close = on_close
        self._seq = 0
        self._queue: deque[Job] = deque()
        self._worker: asyncio.Task[None] | None = None
        self._wakeup: asyncio.Future[None] | None = None
        self._closed = False
        self._closing = False  # close() passed its barrier: peers going away is expected
        self._suspended = False  # suspend() released the CCL buffers (``_suspend``)
        self._running: Job | None = None  # the collective the executor is running
        self._started = 0.0  # loop time it started
        self._done_seq = -1  # last collective completed here
        self._started_seq = -1  # last collective started here (it may have failed since)
        self._flight = FlightRecorder(rank, size)
        self._thread = threading.get_ident()
        try:
            self._loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            self._loop = None
        self._parent = parent
        self._children: list[Comm] = []  # open sub-communicators made from this one
        if parent is None:
            self.world_ranks: tuple[int, ...] = tuple(range(size))  # the first communicator's rank of each member
            self.parent_ranks: tuple[int, ...] = self.world_ranks  # the parent's rank of each member
            self._domains = _groups.Domains()
            self._results = Results()  # results handed out again once dropped (``_outputs``)
        else:
            self.parent_ranks = tuple(members)
            self.world_ranks = tuple(parent.world_ranks[p] for p in self.parent_ranks)
            self._domains = parent._domains  # one process's connections: domain numbers are shared
            self._results = parent._results
            if child:
                parent._children.append(self)
        self._health = health = Health(self, self._executor, self._flight)  # failures: mismatch, timeout, loss
        self._executor.attach(health)  # the links' events (transports.base.LinkEvents)
        self._p2p_init()
        self._sync_init()
        if self._loop is not None:
            _flight.watch(self, self._loop)

    def __repr__(self) -> str:
        group = f" world_ranks={list(self.world_ranks)}" if self._parent is not None else ""
        return f"<ahcomm.Comm rank={self.rank} size={self.size} seq={self._seq}{group}>"

    async def __aenter__(self) -> "Comm":
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: object) -> None:
        """A clean exit closes collectively; leaving on an exception aborts and tells every peer
        which rank failed and with what (they get ``PeerFailure`` carrying it)."""
        if exc is not None and not self._closed:
            self.abort(f"it left `async with` on {type(exc).__name__}: {exc}"[:2000])
        await self.close()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def seq(self) -> int:
        """Sequence number the next collective will get."""
        return self._seq

    # -- collectives ------------------------------------------------------------------------
    @device_aware(sliced=True)
    def all_reduce(self, x: Any, op: ReduceOp | str = "sum", *, out: np.ndarray | None = None,
                   algorithm: str | None = None, timeout: float | None = None) -> "asyncio.Future[np.ndarray]":
        """Elementwise reduction of ``x`` over all ranks; every rank gets the result."""
        arr, dtype = self._input(x, "all_reduce")
        redop = ReduceOp.parse(op)
        check_reduce(redop, dtype)
        return self._issue("all_reduce", arr, arr.shape, arr.size, out, redop=redop, algorithm=algorithm,
                           timeout=timeout)

    @device_aware(sliced=True)
    def all_gather(self, x: Any, *, out: np.ndarray | None = None, algorithm: str | None = None,
                   timeout: float | None = None) -> "asyncio.Future[np.ndarray]":
        """Concatenate every rank's ``x`` along axis 0, in rank order."""
        arr, _ = self._input(x, "all_gather")
        shape = (self.size * arr.shape[0], *arr.shape[1:]) if arr.ndim else (self.size,)
        return self._issue("all_gather", arr, shape, arr.size, out, algorithm=algorithm, timeout=timeout)

    @device_aware(sliced=True)
    def reduce_scatter(self, x: Any, op: ReduceOp | str = "sum", *, out: np.ndarray | None = None,
                       algorithm: str | None = None, timeout: float | None = None) -> "asyncio.Future[np.ndarray]":
        """Reduce ``x`` over ranks and give rank r block r of axis 0."""
        arr, dtype = self._input(x, "reduce_scatter")
        redop = ReduceOp.parse(op)
        check_reduce(redop, dtype)
        self._even_rows(arr, "reduce_scatter")  # names reduce_scatter_v for uneven blocks
        shape = (arr.shape[0] // self.size, *arr.shape[1:])
        return self._issue("reduce_scatter", arr, shape, arr.size // self.size, out, redop=redop,
                           algorithm=algorithm, timeout=timeout)

    @device_aware(sliced=True)
    def broadcast(self, x: Any, root: int = 0, *, out: np.ndarray | None = None,
                  algorithm: str | None = None, timeout: float | None = None) -> "asyncio.Future[np.ndarray]":
        """Every rank gets the root's ``x`` (other ranks' ``x`` gives only shape and dtype)."""
        arr, _ = self._input(x, "broadcast")
        self._check_root(root, "broadcast")
        return self._issue("broadcast", arr, arr.shape, arr.size, out, root=root, algorithm=algorithm,
                           timeout=timeout)

    def barrier(self, *, algorithm: str | None = None, timeout: float | None = None) -> "asyncio.Future[None]":
        """Wait until every rank has entered the barrier."""
        return self._barrier(algorithm, timeout)

    def _barrier(self, algorithm: str | None, timeout: float | None, caller: str = "") -> "asyncio.Future[None]":
        """``barrier``; ``caller`` names what made it in messages (``close()``'s own barrier)."""
        self._check_open("barrier", queued=True)
        call = Call(op="barrier", seq=self._seq, dtype=np.dtype(np.uint8), count=0, caller=caller)
        empty = np.empty(0, np.uint8)
        return self._submit(call, empty, empty, None, None, algorithm, timeout=timeout)

    # -- sub-communicators -----------------------------------------------------------------
    async def split(self, color: int | None, key: int | None = None, *,
                    buffsize: int | None = None) -> "Comm | None":
        """A sub-communicator of the ranks that pass the same ``color``, ordered by ``key``
        (default: this rank), then by rank; None where ``color`` is None (MPI_Comm_split).

        Every rank of this communicator must call it. The group reuses this communicator's
        connections (no new rendezvous); its collectives have their own sequence numbers and
        CCL buffers, run independently of this communicator's and match only among its members.
        ``buffsize`` is the bytes of each of its CCL buffers (default: this communicator's);
        a smaller one makes the group quicker to create and lighter on memory.
        """
        return await _groups.split(self, color, key, buffsize)

    async def new_group(self, ranks: Sequence[int], *, buffsize: int | None = None) -> "Comm | None":
        """A sub-communicator of ``ranks`` (its rank i is ``ranks[i]``); None on the other ranks.

        Every rank of this communicator must call it with the same ``ranks`` (as
        torch.distributed.new_group); see ``split``.
        """
        return await _groups.new_group(self, ranks, buffsize)

    # -- elasticity ------------------------------------------------------------------------
    async def shrink(self, *, exclude: Sequence[int] | None = None,
                     timeout: float | None = None) -> "Comm | None":
        """A communicator of the ranks still alive (ULFM's MPI_Comm_shrink, ncclCommShrink).

        Called by every survivor after a failure (this communicator stays failed), or at any
        time with ``exclude``: ranks to leave out (they need not call it; one that does gets
        None). The survivors agree on who is gone - ranks that saw different failures converge,
        and a rank that dies meanwhile is left out too - and get a communicator of the others,
        ranked in their old order, on the existing connections. ``timeout`` (default
        AHCOMM_EXEC_TIMEOUT) bounds the wait for the other survivors.
        """
        return await _elastic.shrink(self, exclude, timeout)

    async def grow(self, *, timeout: float | None = None) -> "Comm":
        """A communicator of the job's full world size again (ncclCommGrow): every member calls
        it, and each missing rank is a replacement process (``ahcomm-run --on-failure restart``)
        whose ``ahcomm.init()`` joins. Ranks are world ranks (a replacement gets the rank the
        launcher gave it). ``timeout`` (default AHCOMM_CONNECT_TIMEOUT) bounds the wait for all.
        State is the application's: e.g. ``broadcast_object`` it from a member afterwards.
        """
        from . import _grow
        return await _grow.grow(self, timeout)

    async def suspend(self, *, timeout: float | None = None) -> None:
        """Release this communicator's CCL buffers and shared memory until ``resume`` (NCCL's
        ncclCommSuspend: for idle services, RL-style sleep/wake). Every rank calls it, after
        its collectives (it waits for those issued); meanwhile collectives and send/recv raise
        ``CommSuspendedError``, and a lost peer still fails the communicator. It refuses, on
        every rank, while a sub-communicator made from this one is open and not suspended
        (suspend or close the groups first). ``stats()`` says how much was released.
        ``timeout`` (default AHCOMM_EXEC_TIMEOUT) bounds the wait for the other ranks."""
        await _suspend.suspend(self, timeout)

    async def resume(self, *, timeout: float | None = None) -> None:
        """New CCL buffers (and mailboxes) after ``suspend``, mapped by the peers again; every
        rank calls it. A peer lost while suspended makes it raise that failure (``PeerFailure``).
        ``timeout`` (default AHCOMM_EXEC_TIMEOUT) bounds the wait for the other ranks."""
        await _suspend.resume(self, timeout)

    @property
    def suspended(self) -> bool:
        """Whether ``suspend`` released the buffers (and ``resume`` has not restored them)."""
        return self._suspended

    def _derive(self, members: tuple[int, ...], *, rank: int, links: dict[int, Link], buffers: CclBuffers,
                topo: Topology, progress: Progress, label: str,
                on_close: Callable[[], Awaitable[None]] | None = None, child: bool = True) -> Self:
        """A communicator of ``members`` (ranks of this one) on ``links`` derived from this one's
        connections, with this one's selector and timeout; ``label`` names it in trace files."""
        comm = type(self)(rank=rank, size=len(members), links=links, buffers=buffers, topo=topo, progress=progress,
                          selector=self._selector, exec_timeout=self._exec_timeout, on_close=on_close, parent=self,
                          members=members, child=child)
        ex = comm._executor
        ex.share_host(self._executor.host_ranks)  # the host runs the parent's ranks too
        tracer = ex.tracer
        if tracer is not None:
            tracer.set_group(label)
        return comm

    # -- plumbing ---------------------------------------------------------------------------
    def _check_open(self, what: str = "", *, queued: bool = False) -> None:
        """Raise if this communicator cannot take a call. ``queued``: the call goes through the
        job queue, and while a failure is being diagnosed it is queued and held until the
        verdict, which it then raises (raising the first error here would name less: a mismatch's
        first error knows only the peer's fingerprint, its verdict the peer's call)."""
        self._check_loop()
        if self._closed:
            raise CommClosedError(f"communicator (rank {self.rank}) is closed")
        error = self._health.error
        if error is not None and not (queued and self._health.diagnosing):
            raise CommClosedError(f"communicator (rank {self.rank}) failed earlier: {error}") from error
        if self._suspended:
            raise CommSuspendedError(f"{what or 'call'}: communicator (rank {self.rank}) is suspended (its buffers "
                                     "are released): await comm.resume() on every rank first", op=what or None)

    def _live(self) -> bool:
        return not self._closed and self._health.error is None

    def _check_root(self, root: int, what: str) -> None:
        if not isinstance(root, (int, np.integer)) or not 0 <= int(root) < self.size:
            raise InvalidArgument(f"{what}: root {root!r} is out of range for world size {self.size}")

    def _input(self, x: Any, what: str) -> tuple[np.ndarray, np.dtype]:
        self._check_open(what, queued=True)
        arr = _as_array(x, f"{what} input")
        return arr, check_dtype(arr.dtype, f"{what} input")

    def _issue(self, op: str, arr: np.ndarray, shape: tuple[int, ...], count: int, out: np.ndarray | None, *,
               redop: ReduceOp | None = None, root: int = 0, algorithm: str | None = None,
               timeout: float | None = None) -> "asyncio.Future[Any]":
        """Queue a collective on ``arr``. A device input still being copied to the host
        (``take_staging()``, set by ``device_aware(sliced=True)``) is waited for slice by slice."""
        staged = take_staging()
        dtype = arr.dtype
        result = self._output(op, out, shape, dtype)
        inplace = result is arr and arr.flags.c_contiguous
        if op == "broadcast" and self.rank != root:
            inplace = result.flags.c_contiguous  # a non-root's x carries no data
        dst = flat_view(result)
        if inplace:
            src = dst
        elif out is not None and np.may_share_memory(result, arr):  # out overlaps x: read a copy
            if staged is not None:
                staged.wait()
                staged = None
            src = arr.reshape(-1).copy()
        else:
            src = np.ascontiguousarray(arr).reshape(-1)
        call = Call(op=op, seq=self._seq, dtype=dtype, count=count, redop=redop, root=int(root))
        return self._submit(call, src, dst, result, self._finish(dst, result, redop), algorithm, timeout=timeout,
                            ready=staged.ready if staged is not None else None)

    def _submit(self, call: Call, src: np.ndarray, dst: np.ndarray, result: Any,
                finish: Callable[[], None] | None, algorithm: str | None, *,
                prepare: Callable[[Job], None] | None = None, later: bool = False,
                timeout: float | None = None,
                ready: Callable[[int, int], Awaitable[None]] | None = None) -> "asyncio.Future[Any]":
        """Queue ``call`` (its ``seq`` is the next sequence number) and return its future.

        ``prepare(job)`` fills in the job's arrays and counts: at once, or with ``later``
        when the worker reaches the job, once every earlier collective (a count exchange)
        is done. The algorithm is chosen once the job is complete. ``timeout`` bounds the
        run (None: AHCOMM_EXEC_TIMEOUT); ``ready(lo, hi)``, if given, is awaited before the
        executor reads ``src[lo:hi]`` (a device input still on its way to the host).
        """
        assert call.seq == self._seq
        if timeout is not None:
            timeout = check_timeout(timeout, call.op)
        assert self._loop is not None  # _check_open ran
        job = Job(call, None, src, dst, result, finish, self._loop.create_future(),
                   prepare if later else None, algorithm, timeout, ready=ready)
        if not later:
            if prepare is not None:
                prepare(job)
            job.algorithm = self._selector.choose(call, self.topology, algorithm)
            call.algorithm = job.algorithm.name  # part of the fingerprint: ranks running different ones differ
        job.entry = self._flight.issue(call, timeout)
        self._seq += 1
        self._enqueue(job)
        if self.size > 1:
            if later:
                self._health.fps[call.seq] = 0  # known once prepared
            else:
                self._health.register(call.seq, call.fingerprint)
        return job.future

    def _enqueue(self, job: Job) -> None:
        self._queue.append(job)
        if self._worker is None:
            self._worker = asyncio.get_running_loop().create_task(self._work(), name=f"ahcomm-comm-{self.rank}")
        elif self._wakeup is not None and not self._wakeup.done():
            self._wakeup.set_result(None)

    def _output(self, op: str, out: np.ndarray | None, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        if out is None:
            return self._results.take(shape, dtype)
        if not isinstance(out, np.ndarray):
            raise InvalidArgument(f"{op}: out must be a numpy array, got {type(out).__name__}")
        if tuple(out.shape) != tuple(shape) or out.dtype != dtype:
            raise InvalidArgument(f"{op}: out has shape {out.shape} and dtype {out.dtype}; "
                                  f"expected shape {tuple(shape)} and dtype {dtype}")
        if not out.flags.writeable:
            raise InvalidArgument(f"{op}: out is read-only")
        return out

    async def _work(self) -> None:
        loop = asyncio.get_running_loop()
        health = self._health
        job: Job | None
        while True:
            job = None  # the last call's result is its caller's alone now (``_outputs.Results`` reuses it)
            while not self._queue:
                self._wakeup = loop.create_future()
                await self._wakeup
                self._wakeup = None
            job = self._queue.popleft()
            if health.error is not None:  # failing: the job gets the communicator's error (or its verdict)
                health.job_failed(job, health.error)
                continue
            try:
                await self._run(job)
            except asyncio.CancelledError as exc:
                task = asyncio.current_task()
                if task is not None and task.cancelling():  # the worker itself is being stopped
                    if not job.future.done():  # a failed communicator's error, not a cancellation the
                        if health.error is not None:  # caller could take for its own
                            job.future.set_exception(health.error)
                        else:
                            job.future.cancel()
                    raise
                health.job_failed(job, exc)
            except BaseException as exc:  # noqa: BLE001 - delivered to the caller
                health.job_failed(job, exc)
            else:
                seq = job.call.seq
                self._done_seq = seq
                health.fps.pop(seq, None)
                entry = job.entry
                if entry is not None:
                    entry.state, entry.ended = "done", time.monotonic()
                if job.finish is not None:  # the run is over on every rank: a failure here is this call's only
                    try:
                        job.finish()
                    except Exception as exc:  # noqa: BLE001 - delivered to the caller
                        if entry is not None:
                            mark(entry, exc)
                        if not job.future.done():
                            job.future.set_exception(exc)
                        continue
                if not job.future.done():
                    job.future.set_result(job.result)
            job.ready = None  # a device input's staging: not kept alive until the next collective

    async def _run(self, job: Job) -> None:
        call = job.call
        health = self._health
        if job.prepare is not None:
            job.prepare(job)
            job.algorithm = self._selector.choose(call, self.topology, job.override)
            call.algorithm = job.algorithm.name
            if self.size > 1:
                health.register(call.seq, call.fingerprint)
                if health.error is not None:  # its fingerprint differs from a peer's
                    raise health.error
        retired = health.retired.peers
        if retired and call.seq in retired and not retired[call.seq][3]:
            health.retired.retired_elsewhere(call.seq)
            raise health.error or CommClosedError(f"{call.op} #{call.seq} was rejected by a peer")
        assert job.algorithm is not None
        ufunc = None
        if call.redop is not None:  # checked when the call was made: remembered per (op, dtype)
            ufunc = _UFUNCS.get((call.redop, call.dtype)) or _UFUNCS.setdefault(
                (call.redop, call.dtype), ufunc_for(call.redop, call.dtype))
        loop = asyncio.get_running_loop()
        now = loop.time()
        self._running, self._started, self._started_seq = job, now, call.seq
        entry = job.entry
        if entry is not None:
            entry.state, entry.started, entry.algorithm = "running", time.monotonic(), job.algorithm.name
        watchdog = health.watchdog
        if watchdog.timer is None or job.timeout is not None:
            watchdog.arm(job, now)
        try:
            await self._executor.run(call, job.algorithm, job.src, job.dst, ufunc, ready=job.ready)
        finally:
            self._running = None

    def _drain_queue(self) -> list[Job]:
        """Take every queued job (the communicator failed: they will never run)."""
        jobs = list(self._queue)
        self._queue.clear()
        return jobs

    # -- diagnosis --------------------------------------------------------------------------
    def status_line(self) -> str:
        """One line: what this rank is doing (printed on SIGUSR1)."""
        return self._health.status_line()

    def flight_record(self) -> list[dict[str, Any]]:
        """This rank's last collectives (op, seq, dtype, count, algorithm, state, timestamps)."""
        return self._health.flight_record()

    # -- links ------------------------------------------------------------------------------
    def _p2p_links(self) -> dict[int, Link]:
        return self._executor.links

    def _set_topology(self, topo: Topology) -> None:
        self.topology = topo
        self._executor.set_topology(topo)

    def explain(self, op: str, count: int, dtype: Any = np.float32, *,
                root: int = 0) -> Explanation:
        """(the algorithm this communicator would run, {every candidate: estimated seconds})
        for ``op`` on ``count`` elements (per rank block for the blocked ops) of ``dtype``;
        ``.copies`` says how many copies per received byte it makes (``algorithms.copies``), ``.basis``
        what chose it (AHCOMM_ALGO, a pick measured by ``ahcomm-bench tune``, or the cost model)."""
        known = self._selector.registry.ops()
        if op not in known:
            close = difflib.get_close_matches(str(op), known, n=1)
            raise InvalidArgument(f"explain: unknown op {op!r}" + (f" (did you mean {close[0]!r}?)" if close else "")
                                  + f"; the ops: {', '.join(sorted(known))}")
        counts = (count,) * self.size if op in WHOLE and op != "reduce" else None
        call = Call(op=op, seq=self._seq, dtype=np.dtype(dtype), count=count, root=root, counts=counts,
                    recv_counts=counts if op.startswith("all_to_all") else None)
        name = self._selector.choose(call, self.topology).name
        return Explanation(name, self._selector.costs(call, self.topology), copies(name, call, self.topology),
                           self._selector.basis(call, self.topology))

    # -- lifecycle --------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Per-link counters (kind, bytes moved: what went over sdma vs rdma) and, once, the counters
        of this rank's receiving endpoint (refused connections, rejected messages); ``single_copy``:
        whether large one-host transfers read peers' user buffers in place (else they are staged);
        ``suspended`` and ``released_bytes``/``unmapped_bytes``: what the last ``suspend`` freed of this
        rank's own memory and unmapped of its peers' shared memory; ``paths``: runs per path where an
        algorithm has several (``direct.single_copy``: reads of peers' user buffers, ``direct.staged``:
        its fallback through the mailboxes); ``results_reused``: results (calls without ``out=``) given
        memory of an earlier result its caller had dropped, and ``results_kept_bytes`` the bytes kept
        for that (``AHCOMM_RESULT_CACHE_MB``; shared with the communicator's parent and children).
        On sdma links, ``read_bytes``: bytes read of the peer's user buffers, ``mapped`` (out of its
        ``ahcomm.alloc`` memory) and ``kernel`` (through ``process_vm_readv``); ``write_bytes``:
        ``kernel``, bytes written into the peer's user buffers (mesh's all_reduce pushes its reduced
        share, ``process_vm_writev``)."""
        return {"rank": self.rank, "size": self.size, "seq": self._seq, "single_copy": self.topology.single_copy,
                "paths": dict(self._executor.paths), "results_reused": self._results.reused,
                "results_kept_bytes": self._results.kept_bytes,
                "links": self._executor.link_stats(), "endpoint": self._executor.endpoint_stats(),
                **_suspend.stats(self)}

    def abort(self, reason: str = "aborted") -> None:
        """Fail every pending and later collective here at once, and tell every peer.
        (Safe from any thread: from another one it runs on the communicator's loop soon.)"""
        if threading.get_ident() != self._thread and self._loop is not None:
            self._loop.call_soon_threadsafe(self.abort, reason)
            return
        if self._health.final is None:
            self._health.fail(CommClosedError(f"communicator (rank {self.rank}) {reason}"), tell=("abort", reason),
                       record=False)

    async def close(self) -> None:
        """Finish pending collectives, meet the other ranks, and release every resource."""
        if self._closed:
            return
        self._check_loop()
        for child in list(self._children):  # its links ride on ours
            await child.close()
        try:
            if self._health.error is None and self.size > 1:
                await asyncio.wait_for(self._barrier(None, None, "close()"), timeout=min(self._exec_timeout, 30.0))
            elif self._queue:
                await asyncio.gather(*(j.future for j in list(self._queue)), return_exceptions=True)
        except Exception:  # noqa: BLE001 - closing regardless
            pass
        self._closing = True
        await self._health.settle()  # a verdict on its way reaches the pending calls
        self._closed = True
        while self._queue:  # anything still queued will never run now
            job = self._queue.popleft()
            if not job.future.done():
                job.future.set_exception(CommClosedError(f"communicator (rank {self.rank}) closed "
                                                         f"before {job.call.op} #{job.call.seq} ran"))
        await self._health.close()
        await cancel_and_wait(self._worker)
        if self._loop is not None:
            _flight.unwatch(self, self._loop)
        await self._executor.close()
        self._results.clear()  # shared with the parent or a child still open: they keep no more than what they make
        if self._parent is not None and self in self._parent._children:
            self._parent._children.remove(self)
        if self._on_close is not None:
            await self._on_close()

"""Comm: a communicator (HCCL's comm domain) and its collectives.

Each collective method validates its arguments, takes the next sequence number and
enqueues the collective at once, returning an awaitable for the result. Collectives run
one at a time in sequence order (the communicator's stream), so several may be in flight
(``asyncio.gather(comm.all_reduce(a), comm.all_reduce(b))``) and each still meets its
twin on every rank. Cancelling the awaiting task does not withdraw an issued collective:
it completes in the background (its peers depend on it) and later ones are unaffected.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import numpy as np

from ._buffers import CclBuffers
from ._collectives import BlockedCollectives
from ._objects import ObjectCollectives
from ._p2p import PointToPoint
from ._dtypes import ReduceOp, check_dtype, check_reduce, finish_avg, ufunc_for
from ._errors import CollectiveTimeout, CommClosedError, InvalidArgument, PeerFailure, UsageError
from .algorithms._executor import Executor, Progress
from .algorithms._selection import Selector
from .algorithms.base import WHOLE, Algorithm, Call, Topology
from .transports.base import Link


@dataclass(slots=True)
class _Job:
    call: Call
    algorithm: Algorithm | None  # None until ``prepare`` has run (it chooses)
    src: np.ndarray  # flat, contiguous
    dst: np.ndarray  # flat, contiguous (may be src itself)
    result: Any  # what the caller gets back (an array, a Gathered, or None)
    finish: Callable[[], None] | None  # after the run: avg division, copy to a strided out
    future: asyncio.Future[Any]
    prepare: Callable[["_Job"], None] | None = None  # fills the job in when its turn comes
    override: str | None = None  # the per-call algorithm= (for a job prepared later)


def _as_array(x: Any, what: str) -> np.ndarray:
    if isinstance(x, np.ndarray):
        return x
    if hasattr(x, "__array__"):
        return np.asarray(x)
    raise InvalidArgument(f"{what} must be a numpy array (or expose __array__), got {type(x).__name__}")


class Comm(BlockedCollectives, ObjectCollectives, PointToPoint):
    """A group of ranks that run collectives together."""

    def __init__(self, *, rank: int, size: int, links: dict[int, Link], buffers: CclBuffers,
                 topo: Topology, progress: Progress, selector: Selector, exec_timeout: float,
                 on_close: Callable[[], Awaitable[None]] | None = None) -> None:
        self.rank = rank
        self.size = size
        self.topology = topo
        self._selector = selector
        self._executor = Executor(rank, size, links, buffers, topo, progress)
        self._exec_timeout = exec_timeout
        self._on_close = on_close
        self._seq = 0
        self._queue: deque[_Job] = deque()
        self._worker: asyncio.Task[None] | None = None
        self._wakeup: asyncio.Future[None] | None = None
        self._error: BaseException | None = None
        self._closed = False
        self._running: _Job | None = None  # the collective the executor is running
        self._started = 0.0  # loop time it started
        self._watchdog: asyncio.TimerHandle | None = None
        self._executor.on_peer_abort(self._peer_aborted)
        self._p2p_init()

    def __repr__(self) -> str:
        return f"<ahcomm.Comm rank={self.rank} size={self.size} seq={self._seq}>"

    async def __aenter__(self) -> "Comm":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def seq(self) -> int:
        """Sequence number the next collective will get."""
        return self._seq

    # -- collectives ------------------------------------------------------------------------
    def all_reduce(self, x: Any, op: ReduceOp | str = "sum", *, out: np.ndarray | None = None,
                   algorithm: str | None = None) -> "asyncio.Future[np.ndarray]":
        """Elementwise reduction of ``x`` over all ranks; every rank gets the result."""
        arr, dtype = self._input(x, "all_reduce")
        redop = ReduceOp.parse(op)
        check_reduce(redop, dtype)
        return self._issue("all_reduce", arr, arr.shape, arr.size, out, redop=redop, algorithm=algorithm)

    def all_gather(self, x: Any, *, out: np.ndarray | None = None,
                   algorithm: str | None = None) -> "asyncio.Future[np.ndarray]":
        """Concatenate every rank's ``x`` along axis 0, in rank order."""
        arr, _ = self._input(x, "all_gather")
        shape = (self.size * arr.shape[0], *arr.shape[1:]) if arr.ndim else (self.size,)
        return self._issue("all_gather", arr, shape, arr.size, out, algorithm=algorithm)

    def reduce_scatter(self, x: Any, op: ReduceOp | str = "sum", *, out: np.ndarray | None = None,
                       algorithm: str | None = None) -> "asyncio.Future[np.ndarray]":
        """Reduce ``x`` over ranks and give rank r block r of axis 0."""
        arr, dtype = self._input(x, "reduce_scatter")
        redop = ReduceOp.parse(op)
        check_reduce(redop, dtype)
        if arr.ndim == 0 or arr.shape[0] % self.size:
            rows = arr.shape[0] if arr.ndim else "a 0-d array"
            raise InvalidArgument(
                f"reduce_scatter: x.shape[0] ({rows}) must be divisible by the world size ({self.size}); "
                f"pad x to a multiple of {self.size} rows (uneven blocks: reduce_scatter_v, planned)"
            )
        shape = (arr.shape[0] // self.size, *arr.shape[1:])
        return self._issue("reduce_scatter", arr, shape, arr.size // self.size, out, redop=redop,
                           algorithm=algorithm)

    def broadcast(self, x: Any, root: int = 0, *, out: np.ndarray | None = None,
                  algorithm: str | None = None) -> "asyncio.Future[np.ndarray]":
        """Every rank gets the root's ``x`` (other ranks' ``x`` gives only shape and dtype)."""
        arr, _ = self._input(x, "broadcast")
        self._check_root(root, "broadcast")
        return self._issue("broadcast", arr, arr.shape, arr.size, out, root=root, algorithm=algorithm)

    def barrier(self) -> "asyncio.Future[None]":
        """Wait until every rank has entered the barrier."""
        self._check_open()
        call = Call(op="barrier", seq=self._seq, dtype=np.dtype(np.uint8), count=0)
        empty = np.empty(0, np.uint8)
        return self._submit(call, empty, empty, None, None, None)

    # -- plumbing ---------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise CommClosedError(f"communicator (rank {self.rank}) is closed")
        if self._error is not None:
            raise CommClosedError(f"communicator (rank {self.rank}) failed earlier: {self._error}") from self._error

    def _check_root(self, root: int, what: str) -> None:
        if not isinstance(root, (int, np.integer)) or not 0 <= int(root) < self.size:
            raise InvalidArgument(f"{what}: root {root!r} is out of range for world size {self.size}")

    def _input(self, x: Any, what: str) -> tuple[np.ndarray, np.dtype]:
        self._check_open()
        arr = _as_array(x, f"{what} input")
        return arr, check_dtype(arr.dtype, f"{what} input")

    def _issue(self, op: str, arr: np.ndarray, shape: tuple[int, ...], count: int, out: np.ndarray | None, *,
               redop: ReduceOp | None = None, root: int = 0,
               algorithm: str | None = None) -> "asyncio.Future[Any]":
        dtype = arr.dtype
        result = self._output(op, out, shape, dtype)
        inplace = result is arr and arr.flags.c_contiguous
        if op == "broadcast" and self.rank != root:
            inplace = result.flags.c_contiguous  # a non-root's x carries no data
        dst = result.reshape(-1) if result.flags.c_contiguous else np.empty(result.size, dtype)
        if inplace:
            src = dst
        elif out is not None and np.may_share_memory(result, arr):  # out overlaps x: read a copy
            src = arr.reshape(-1).copy()
        else:
            src = np.ascontiguousarray(arr).reshape(-1)
        call = Call(op=op, seq=self._seq, dtype=dtype, count=count, redop=redop, root=int(root))
        return self._submit(call, src, dst, result, self._finisher(call, dst, result), algorithm)

    def _submit(self, call: Call, src: np.ndarray, dst: np.ndarray, result: Any,
                finish: Callable[[], None] | None, algorithm: str | None, *,
                prepare: Callable[[_Job], None] | None = None, later: bool = False) -> "asyncio.Future[Any]":
        """Queue ``call`` (its ``seq`` is the next sequence number) and return its future.

        ``prepare(job)`` fills in the job's arrays and counts: at once, or with ``later``
        when the worker reaches the job, once every earlier collective (a count exchange)
        is done. The algorithm is chosen once the job is complete.
        """
        assert call.seq == self._seq
        job = _Job(call, None, src, dst, result, finish, asyncio.get_running_loop().create_future(),
                   prepare if later else None, algorithm)
        if not later:
            if prepare is not None:
                prepare(job)
            job.algorithm = self._selector.choose(call, self.topology, algorithm)
        self._seq += 1
        self._enqueue(job)
        return job.future

    def _enqueue(self, job: _Job) -> None:
        self._queue.append(job)
        if self._worker is None:
            self._worker = asyncio.get_running_loop().create_task(self._work(), name=f"ahcomm-comm-{self.rank}")
        elif self._wakeup is not None and not self._wakeup.done():
            self._wakeup.set_result(None)

    def _output(self, op: str, out: np.ndarray | None, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        if out is None:
            return np.empty(shape, dtype)
        if not isinstance(out, np.ndarray):
            raise InvalidArgument(f"{op}: out must be a numpy array, got {type(out).__name__}")
        if tuple(out.shape) != tuple(shape) or out.dtype != dtype:
            raise InvalidArgument(f"{op}: out has shape {out.shape} and dtype {out.dtype}; "
                                  f"expected shape {tuple(shape)} and dtype {dtype}")
        if not out.flags.writeable:
            raise InvalidArgument(f"{op}: out is read-only")
        return out

    def _finisher(self, call: Call, dst: np.ndarray, result: np.ndarray) -> Callable[[], None] | None:
        avg = call.redop is ReduceOp.AVG
        strided = not result.flags.c_contiguous
        if not avg and not strided:
            return None

        def finish() -> None:
            if avg:
                finish_avg(dst, self.size)
            if strided:
                np.copyto(result, dst.reshape(result.shape))
        return finish

    async def _work(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            while not self._queue:
                self._wakeup = loop.create_future()
                await self._wakeup
                self._wakeup = None
            job = self._queue.popleft()
            try:
                if self._error is not None:
                    raise CommClosedError(f"communicator (rank {self.rank}) failed earlier: {self._error}")
                await self._run(job)
            except asyncio.CancelledError as exc:
                task = asyncio.current_task()
                if task is not None and task.cancelling():  # the worker itself is being stopped
                    if not job.future.done():
                        job.future.cancel()
                    raise
                self._collective_failed(job, exc)
            except BaseException as exc:  # noqa: BLE001 - delivered to the caller
                self._collective_failed(job, exc)
            else:
                if not job.future.done():
                    job.future.set_result(job.result)

    async def _run(self, job: _Job) -> None:
        if job.prepare is not None:
            job.prepare(job)
            job.algorithm = self._selector.choose(job.call, self.topology, job.override)
        assert job.algorithm is not None
        call = job.call
        ufunc = ufunc_for(call.redop, call.dtype) if call.redop is not None else None
        loop = asyncio.get_running_loop()
        self._running, self._started = job, loop.time()
        if self._watchdog is None:
            self._watchdog = loop.call_later(self._exec_timeout, self._check_timeout)
        try:
            await self._executor.run(call, job.algorithm, job.src, job.dst, ufunc)
        finally:
            self._running = None
        if job.finish is not None:
            job.finish()

    def _collective_failed(self, job: _Job, exc: BaseException) -> None:
        """A usage error found before anything was sent leaves the communicator usable; any
        other failure leaves peers mid-protocol, so the communicator fails and they are told."""
        if not isinstance(exc, UsageError) and self._error is None:
            self._fail(exc, tell_peers=f"{job.call.op} #{job.call.seq} failed on rank {self.rank}: {exc}")
        if not job.future.done():
            job.future.set_exception(exc)

    def _check_timeout(self) -> None:
        """The watchdog: one timer per communicator, not one per collective."""
        self._watchdog = None
        job = self._running
        if job is None or self._error is not None:
            return
        loop = asyncio.get_running_loop()
        left = self._started + self._exec_timeout - loop.time()
        if left > 0:
            self._watchdog = loop.call_later(left, self._check_timeout)
            return
        call = job.call
        message = (f"{call.op} #{call.seq} on rank {self.rank} did not complete within "
                   f"{self._exec_timeout:g} s (AHCOMM_EXEC_TIMEOUT); the communicator is now unusable")
        self._fail(CollectiveTimeout(message), tell_peers=message)

    def _p2p_links(self) -> dict[int, Link]:
        return self._executor.links

    def _set_topology(self, topo: Topology) -> None:
        self.topology = topo
        self._executor.set_topology(topo)

    def _fail(self, error: BaseException, tell_peers: str | None = None) -> None:
        self._error = error
        self._executor.abort(error)
        if tell_peers is not None:
            self._executor.tell_peers(tell_peers)
        while self._queue:
            job = self._queue.popleft()
            if not job.future.done():
                job.future.set_exception(error)

    def _peer_aborted(self, peer: int, reason: str) -> None:
        if self._error is None:
            self._fail(PeerFailure(f"rank {peer} aborted its communicator ({reason}); "
                                   f"rank {self.rank} can no longer run collectives on it", rank=peer))

    def explain(self, op: str, count: int, dtype: Any = np.float32, *,
                root: int = 0) -> tuple[str, dict[str, float | None]]:
        """(the algorithm this communicator would run, {every candidate: estimated seconds})
        for ``op`` on ``count`` elements (per rank block for the blocked ops) of ``dtype``."""
        counts = (count,) * self.size if op in WHOLE and op != "reduce" else None
        call = Call(op=op, seq=self._seq, dtype=np.dtype(dtype), count=count, root=root, counts=counts,
                    recv_counts=counts if op.startswith("all_to_all") else None)
        return self._selector.choose(call, self.topology).name, self._selector.costs(call, self.topology)

    # -- lifecycle --------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Per-link counters: kind and bytes moved (what went over sdma vs rdma)."""
        return {"rank": self.rank, "size": self.size, "seq": self._seq,
                "links": self._executor.link_stats()}

    def abort(self, reason: str = "aborted") -> None:
        """Fail every pending and later collective here at once, and tell every peer."""
        if self._error is None:
            self._fail(CommClosedError(f"communicator (rank {self.rank}) {reason}"), tell_peers=reason)

    async def close(self) -> None:
        """Finish pending collectives, meet the other ranks, and release every resource."""
        if self._closed:
            return
        try:
            if self._error is None and self.size > 1:
                await asyncio.wait_for(self.barrier(), timeout=min(self._exec_timeout, 30.0))
            elif self._queue:
                await asyncio.gather(*(j.future for j in list(self._queue)), return_exceptions=True)
        except Exception:  # noqa: BLE001 - closing regardless
            pass
        self._closed = True
        while self._queue:  # anything still queued will never run now
            job = self._queue.popleft()
            if not job.future.done():
                job.future.set_exception(CommClosedError(f"communicator (rank {self.rank}) closed "
                                                         f"before {job.call.op} #{job.call.seq} ran"))
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        if self._worker is not None:
            self._worker.cancel()
            try:
                await self._worker
            except BaseException:  # noqa: BLE001
                pass
        await self._executor.close()
        if self._on_close is not None:
            await self._on_close()

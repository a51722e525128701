"""Stream: an asyncio task that runs submitted tasks strictly in order.

As on an NPU stream, tasks are enqueued without waiting and run one after another:
memory tasks (copy, reduce), link tasks (put, post, wait) and notify tasks. Streams run
concurrently with each other and synchronise through notifies. Memory tasks of
``engine_bytes`` or more run on the stream's copy engine (one worker thread; numpy releases
the GIL), so the event loop stays responsive during large collectives and a rank's streams
copy on several cores at once. That pays only where the host has cores to spare:
``engine_bytes_for`` gives ``ENGINE_THRESHOLD`` where the host's ranks are fewer than this
process's cores, and no engine (every task inline) where they are as many or more, as the
hand-off to the thread and back (two wake-ups, each waiting for a core another rank holds)
then costs more than the copy (AHCOMM_COPY_ENGINE=on/off overrides).

An idle stream runs a task at once, inside ``submit``, when the task can finish without
waiting (a small copy, a post, a wait on a flag already set); only what must wait goes
through the runner task. Order is unchanged: nothing is queued when that happens.

A stream made with ``inline=True`` (the executor's main stream) has no runner task: what
it could not run at once is run by whoever awaits ``synchronize()``, one wake-up fewer per
collective. Such a stream must be synchronized for its queued tasks to run.

A failed task puts the stream into a failed state: later tasks are skipped until the next
``synchronize()``, which raises the error and leaves the stream usable again.

Tracing (``AHCOMM_TRACE``): a stream made with a ``tracer`` wraps each task so that its span
is recorded (``ahcomm._trace``); ``submit`` is then replaced on the instance, so a stream
without one pays one ``is None`` test per typed task (copy, reduce, post, wait, call) and
nothing else.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np

from ._binding import own_cores
from ._config import copy_engine_mode, usable_cores
from ._memcopy import copy
from ._notify import Notify
from ._trace import TaskFn as TaskFn  # a stream task; re-exported for the algorithms

if TYPE_CHECKING:
    from ._trace import Tracer

ENGINE_THRESHOLD = 256 * 1024
NO_ENGINE = 1 << 62  # ``engine_bytes`` of a stream that runs every memory task inline


def engine_bytes_for(ranks_here: int) -> int:
    """The ``engine_bytes`` of a rank's streams where ``ranks_here`` ranks share its host:
    ``ENGINE_THRESHOLD`` where they are fewer than the host's cores and this process has more
    than one core of its own (the engines copy on cores no rank needs), else ``NO_ENGINE``.
    Measured at 4 ranks on 2 cores, ring all_gather 2 MiB: 7.7-10.5 ms a call with engines,
    4.0-4.3 ms inline (CPU per rank 2.8-3.8 ms against 1.5-1.8, context switches 47-53 against
    17-20); at 2 ranks on 2 cores mesh all_reduce 64 MiB 11.4-14.6 ms inline against 15.0-17.1
    (benchmarks/results/2026-11-26-inline-copies.md).
    ``AHCOMM_COPY_ENGINE`` (``auto``, ``on``, ``off``) overrides."""
    mode = copy_engine_mode()
    if mode == "auto":
        # a rank bound to one core of its own has no spare one, however many the host has
        mode = "on" if ranks_here < usable_cores() and own_cores() > 1 else "off"
    return ENGINE_THRESHOLD if mode == "on" else NO_ENGINE


class _Started:
    """A task whose awaitable was made at submission (the stream was idle) and awaits its turn."""

    __slots__ = ("awaitable",)

    def __init__(self, awaitable: "Awaitable[Any]") -> None:
        self.awaitable = awaitable

    def __call__(self) -> "Awaitable[Any]":
        return self.awaitable


def _reached(marker: "asyncio.Future[None]", error: BaseException | None) -> None:
    """A ``synchronize()`` marker reached the head of the queue: it gets the stream's error
    since the last one, or None."""
    if not marker.done():
        if error is not None:
            marker.set_exception(error)
        else:
            marker.set_result(None)


def _discard(fn: TaskFn) -> None:
    """A dropped task: close the coroutine it already made (no 'never awaited' warning)."""
    if isinstance(fn, _Started):
        close = getattr(fn.awaitable, "close", None)
        if close is not None:
            close()


class Stream:
    """An ordered queue of tasks executed by one asyncio task."""

    def __init__(self, name: str, *, inline: bool = False, tracer: Tracer | None = None,
                 engine_bytes: int = ENGINE_THRESHOLD) -> None:
        self.name = name
        self.inline = inline
        self.engine_bytes = engine_bytes  # memory tasks this big or bigger go to the copy engine
        self._queue: deque[tuple[TaskFn, asyncio.Future[None] | None]] = deque()
        self._wakeup: asyncio.Future[None] | None = None
        self._runner: asyncio.Task[None] | None = None
        self._error: BaseException | None = None
        self._engine: ThreadPoolExecutor | None = None
        self._closed = False
        self._busy = False  # the runner is awaiting a task
        self.on_error: Callable[[BaseException], None] | None = None  # told when a task fails
        self.tracer = tracer  # records each task's span (AHCOMM_TRACE); None: off
        if tracer is not None:
            self.submit = tracer.submitter(self, self.submit)  # type: ignore[method-assign, assignment]

    # -- submission -------------------------------------------------------------------
    def submit(self, fn: TaskFn) -> None:
        """Run or enqueue ``fn``: a callable returning None or an awaitable to await in order."""
        if self._queue or self._busy or self._error is not None or self._closed:
            self._push(fn, None)
            return
        pending = self._call(fn)
        if pending is not None:
            self._push(_Started(pending), None)

    def _call(self, fn: TaskFn) -> Any:
        """Run ``fn`` now: the awaitable it returned, or None (done, or failed: the failure is
        kept for ``synchronize()``)."""
        try:
            return fn()
        except BaseException as exc:  # noqa: BLE001 - reported at synchronize()
            self._failed(exc)
            return None

    def _settled(self, fn: TaskFn, marker: asyncio.Future[None] | None) -> bool:
        """Whether a queue entry runs nothing: a ``synchronize()`` marker (reached, with the
        failure so far, which it clears) or a task after a failure (skipped, up to the next
        ``synchronize()``)."""
        if marker is not None:
            _reached(marker, self._error)
            self._error = None
            return True
        if self._error is not None:
            _discard(fn)
            return True
        return False

    def _enqueue(self, fn: TaskFn, marker: asyncio.Future[None] | None) -> None:
        if self._closed:
            raise RuntimeError(f"stream {self.name} is closed")
        self._queue.append((fn, marker))

    def _push(self, fn: TaskFn, marker: asyncio.Future[None] | None) -> None:
        self._enqueue(fn, marker)
        if self.inline:
            return
        if self._runner is None:
            self._runner = asyncio.get_running_loop().create_task(self._run(), name=f"ahcomm-stream-{self.name}")
        elif self._wakeup is not None and not self._wakeup.done():
            self._wakeup.set_result(None)

    def copy(self, dst: np.ndarray, src: np.ndarray) -> None:
        """dst[...] = src (same shape and dtype)."""
        task: TaskFn = partial(self._copy, dst, src)  # a partial: about half a closure's memory
        if self.tracer is not None:
            task = self.tracer.task(self, "copy", task, nbytes=dst.nbytes)
        self.submit(task)

    def reduce(self, ufunc: np.ufunc, dst: np.ndarray, a: np.ndarray, b: np.ndarray) -> None:
        """dst = ufunc(a, b); dst may alias a or b."""
        task: TaskFn = partial(self._reduce, ufunc, dst, a, b)
        if self.tracer is not None:
            task = self.tracer.task(self, "reduce", task, nbytes=dst.nbytes)
        self.submit(task)

    def post(self, notify: Notify) -> None:
        task: TaskFn = notify.post
        if self.tracer is not None:
            task = self.tracer.task(self, "post", task, detail=notify.name)
        self.submit(task)

    def wait(self, notify: Notify) -> None:
        task: TaskFn = notify.wait_task
        if self.tracer is not None:
            task = self.tracer.task(self, "wait", task, detail=notify.name)
        self.submit(task)

    def call(self, fn: Callable[[], Any]) -> None:
        """Run an arbitrary synchronous callable in stream order."""
        def task() -> None:
            fn()
        if self.tracer is not None:
            self.submit(self.tracer.task(self, "call", task, detail=getattr(fn, "__qualname__", None)))
            return
        self.submit(task)

    # -- execution ----------------------------------------------------------------------
    def _copy(self, dst: np.ndarray, src: np.ndarray) -> "Awaitable[Any] | None":
        return self.memory(copy, dst, src)

    def _reduce(self, ufunc: np.ufunc, dst: np.ndarray, a: np.ndarray, b: np.ndarray) -> "Awaitable[Any] | None":
        return self.memory(ufunc, a, b, out=dst)

    def memory(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> "Awaitable[Any] | None":
        """Run a numpy memory op inline if smaller than ``engine_bytes``, else on this stream's
        copy engine.

        The size that decides is that of the first argument (the destination, or the
        first operand of a reduction: every operand of one op has the same size).
        """
        first = args[0] if args else None
        nbytes = first.nbytes if isinstance(first, np.ndarray) else 0
        if nbytes < self.engine_bytes:
            fn(*args, **kwargs)
            return None
        if self._engine is None:
            self._engine = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"ahcomm-engine-{self.name}")
        return asyncio.get_running_loop().run_in_executor(self._engine, lambda: fn(*args, **kwargs))

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        queue = self._queue
        while True:
            while not queue:
                self._wakeup = loop.create_future()
                await self._wakeup
                self._wakeup = None
            fn, marker = queue.popleft()
            if self._settled(fn, marker):
                del fn
                continue
            self._busy = True
            try:  # _execute, inlined: no coroutine per task (a large share of a step's cost)
                result = fn()
                if result is not None:
                    await result
            except asyncio.CancelledError:
                self._failed(asyncio.CancelledError())
                task = asyncio.current_task()
                if self._closed or (task is not None and task.cancelling()):
                    raise
            except BaseException as exc:  # noqa: BLE001 - reported at synchronize()
                self._failed(exc)
            finally:
                self._busy = False
                del fn  # not kept while idle: its views of the CCL buffers would keep them mapped (suspend)
                result = None

    async def _execute(self, fn: TaskFn) -> None:
        """Run one task; a failure is kept for synchronize() (a cancellation also propagates)."""
        try:
            result = fn()
            if result is not None:
                await result
        except asyncio.CancelledError:
            self._failed(asyncio.CancelledError())
            raise
        except BaseException as exc:  # noqa: BLE001 - reported at synchronize()
            self._failed(exc)

    def _failed(self, exc: BaseException) -> None:
        self._error = exc
        if self.on_error is not None:
            self.on_error(exc)

    @property
    def settled(self) -> bool:
        """Nothing queued, nothing running, no failure to report: synchronize() would return at once."""
        return not self._queue and not self._busy and self._error is None

    async def synchronize(self) -> None:
        """Wait until every task submitted so far has run; raise the first failure, if any."""
        if self.inline:
            await self._drain()
        if not self._queue and not self._busy:
            error, self._error = self._error, None
            if error is not None:
                raise error
            return
        marker: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._push(lambda: None, marker)
        await marker

    async def _drain(self) -> None:
        """Run the queued tasks in the caller (inline streams)."""
        queue = self._queue
        self._busy = True
        try:
            while queue:
                fn, _ = queue.popleft()
                if self._error is not None:
                    continue
                try:  # _execute, inlined
                    result = fn()
                    if result is not None:
                        await result
                except asyncio.CancelledError:
                    self._failed(asyncio.CancelledError())
                    raise
                except BaseException as exc:  # noqa: BLE001 - reported at synchronize()
                    self._failed(exc)
        finally:
            self._busy = False

    def abort(self, error: BaseException) -> None:
        """Drop queued work and fail pending synchronize() calls with ``error``."""
        pending = [m for _, m in self._queue if m is not None]
        for fn, _ in self._queue:
            _discard(fn)
        self._queue.clear()
        for marker in pending:
            if not marker.done():
                marker.set_exception(error)

    async def close(self) -> None:
        self._closed = True
        if self._runner is not None:
            self._runner.cancel()
            try:
                await self._runner
            except BaseException:  # noqa: BLE001 - shutting down
                pass
            self._runner = None
        if self._engine is not None:
            self._engine.shutdown(wait=False)
            self._engine = None

"""``SimStream``: a ``Stream`` driven by future callbacks instead of a runner task (``ahcomm-sim``).

The real stream runs its queue in an asyncio task (the executor's main stream in whoever
awaits ``synchronize()``): every task that must wait resumes a chain of coroutines, which is
most of a simulated step's CPU time at 1,000 ranks. This one keeps the same contract (tasks
run strictly in order, an idle stream runs a task inside ``submit``, a failure skips the work
up to the next ``synchronize()``, which raises it) and runs the rest of its queue from a
callback once the task that had to wait is done: a notify wait leaves a ``_Waiter`` (no
future) in the notify's waiters, a simulated put or copy's ``Delay`` is one timer, any other
awaitable gets ``add_done_callback`` (a coroutine is wrapped in a task first). Each resumes
the stream one ready-queue turn after the event, as a future's done callback would, so events
keep their order. Every stream runs as soon as it can (there is no inline stream): in virtual
time that is the same instant as a ``synchronize()``.
"""

from __future__ import annotations

import asyncio
from types import MethodType
from typing import Any

from ._notify import Notify
from ._stream import Stream, TaskFn
from .transports._simloop import Delay

_WAIT = Notify.wait_task


class _Waiter:
    """What a SimStream blocked on a notify leaves in its waiters (instead of a future): the
    post that hands it the flag resumes the stream one ready-queue turn later, as a future's
    done callback would, with no future, no callback list and no context."""

    __slots__ = ("cancelled", "stream")

    def __init__(self, stream: "SimStream") -> None:
        self.stream, self.cancelled = stream, False

    def done(self) -> bool:
        return self.cancelled

    def set_result(self, _: None) -> None:
        self.cancelled = True  # done: a second post must not be handed to it
        stream = self.stream
        stream._loop._ready.append((stream._woken, (), None))

    def set_exception(self, error: BaseException) -> None:
        self.cancelled = True
        stream = self.stream
        stream._loop._ready.append((stream._woken_failed, (error,), None))


class SimStream(Stream):
    """A stream whose queue is run from callbacks (no runner task, never inline)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self._pending: asyncio.Future[Any] | None = None  # what the running task waits for
        self._scheduled = False  # a _pump is due (call_soon)
        self._waiter: _Waiter | None = None  # what the running task waits for, if a notify
        self._loop: Any = None  # the VirtualLoop (set on the first wait)

    def submit(self, fn: TaskFn) -> None:
        if self._queue or self._busy or self._error is not None or self._closed:
            self._push(fn, None)
            return
        self._run_task(fn)

    def _run_task(self, fn: TaskFn) -> None:
        """Run one task; leave the stream busy if it must wait."""
        if type(fn) is MethodType and fn.__func__ is _WAIT:  # a notify wait: no future
            notify: Notify = fn.__self__  # type: ignore[assignment]
            if notify._error is not None:
                self._failed(notify._error)
            elif notify._value:
                notify._value = 0
            else:
                if self._loop is None:
                    self._loop = asyncio.get_running_loop()
                self._busy = True
                self._waiter = _Waiter(self)
                notify._waiters.append(self._waiter)  # type: ignore[arg-type]
            return
        pending = self._call(fn)
        if pending is not None:
            self._await(pending)

    def _push(self, fn: TaskFn, marker: asyncio.Future[None] | None) -> None:
        self._enqueue(fn, marker)
        if not self._busy and not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._pump)

    def _await(self, pending: Any) -> None:
        if type(pending) is Delay:  # a simulated put or copy: one timer, no future
            self._busy = True
            pending.then(self._woken)
            return
        fut = pending if isinstance(pending, asyncio.Future) else asyncio.ensure_future(pending)
        self._busy, self._pending = True, fut
        fut.add_done_callback(self._resume)

    def _woken(self) -> None:
        self._busy, self._waiter = False, None
        if not self._closed and not self._scheduled:
            self._pump()

    def _woken_failed(self, error: BaseException) -> None:
        if not self._closed:
            self._failed(error)
        self._woken()

    def _resume(self, fut: asyncio.Future[Any]) -> None:
        self._busy, self._pending = False, None
        if fut.cancelled():
            if self._closed:
                return
            self._failed(asyncio.CancelledError())
        else:
            error = fut.exception()
            if error is not None:
                self._failed(error)
        if not self._scheduled:
            self._pump()

    def _pump(self) -> None:
        """Run queued tasks until one must wait (or the queue is empty)."""
        self._scheduled = False
        queue = self._queue
        while queue and not self._busy and not self._closed:
            fn, marker = queue.popleft()
            if not self._settled(fn, marker):
                self._run_task(fn)

    async def close(self) -> None:
        self._closed = True
        if self._waiter is not None:
            self._waiter.cancelled = True  # a later post skips it (the flag is set instead)
            self._waiter = None
        if self._pending is not None:
            self._pending.cancel()
            self._pending = None

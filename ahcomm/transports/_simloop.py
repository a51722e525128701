"""``VirtualLoop``: a minimal asyncio event loop in virtual time, for ``ahcomm.sim``.

Only what coroutines, futures and tasks need (``call_soon``, ``call_at``, ``create_future``,
``create_task``, ``time``...): no selector, no sockets, no threads. Ready callbacks are
``(callback, args, context)`` tuples in a deque, timers ``(when, seq, callback, args,
context)`` tuples in a heap (compared in C, no handle objects); when nothing is ready the
clock jumps to the next timer. The simulated network schedules its events with ``at``
(no context, no handle) and settles futures with ``settle_at``. Nothing ready and no timer
while the main task waits is a deadlock: ``run_sim`` raises ``SimDeadlock``.

The earlier version (an ``asyncio.SelectorEventLoop`` whose selector jumped the clock) paid a
``select`` system call, a ``Handle`` per callback and Python-level timer comparisons per event.
"""

from __future__ import annotations

import asyncio
import contextvars
import heapq
import itertools
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Generator
from typing import Any

Callback = Callable[..., Any]


class SimDeadlock(RuntimeError):
    """Every simulated rank waits and nothing is scheduled: the algorithm can never finish."""


class _Timer(asyncio.TimerHandle):
    """What ``call_at`` returns: cancellable (``asyncio.sleep`` cancels its timer)."""

    __slots__ = ()


def _run_timer(timer: _Timer) -> None:
    if not timer._cancelled:  # type: ignore[attr-defined]
        timer._run()  # type: ignore[attr-defined]


def _settle(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class Delay:
    """Virtual time until ``when``: what a simulated put or copy returns. ``SimStream`` waits for
    it with one timer (no future, no done callback); anything else awaits it as a future."""

    __slots__ = ("loop", "when")

    def __init__(self, loop: "VirtualLoop", when: float) -> None:
        self.loop, self.when = loop, when

    def __await__(self) -> Generator[Any, None, None]:
        return self.loop.settle_at(self.when).__await__()

    def then(self, callback: Callback) -> None:
        """Run ``callback()`` once the time has come, one ready-queue turn later (as a future's
        done callback would: the same order of events)."""
        loop = self.loop
        loop.at(self.when, loop._ready.append, (callback, (), None))


class VirtualLoop(asyncio.AbstractEventLoop):
    """An event loop whose ``time()`` is ``now``, which jumps to the next timer."""

    def __init__(self) -> None:
        self.now = 0.0
        self.deadlocked = False
        self._ready: deque[tuple[Callback, tuple[Any, ...], contextvars.Context | None]] = deque()
        self._heap: list[tuple[float, int, Callback, tuple[Any, ...], contextvars.Context | None]] = []
        self._seq = itertools.count()
        self._stopping = False
        self._running = False
        self._closed = False
        self.events = 0  # callbacks and timers run

    # -- what futures, tasks and asyncio.sleep use -------------------------------------------
    def time(self) -> float:
        return self.now

    def get_debug(self) -> bool:
        return False

    def is_running(self) -> bool:
        return self._running

    def is_closed(self) -> bool:
        return self._closed

    def call_soon(  # type: ignore[override]
            self, callback: Callback, *args: Any, context: contextvars.Context | None = None) -> Any:
        self._ready.append((callback, args, context))
        return None  # futures and tasks ignore it; nothing here cancels a call_soon

    def call_soon_threadsafe(  # type: ignore[override]
            self, callback: Callback, *args: Any, context: contextvars.Context | None = None) -> Any:
        return self.call_soon(callback, *args, context=context)

    def call_at(  # type: ignore[override]
            self, when: float, callback: Callback, *args: Any,
            context: contextvars.Context | None = None) -> asyncio.TimerHandle:
        timer = _Timer(when, callback, args, self, context)  # type: ignore[arg-type]
        heapq.heappush(self._heap, (max(when, self.now), next(self._seq), _run_timer, (timer,), None))
        return timer

    def call_later(  # type: ignore[override]
            self, delay: float, callback: Callback, *args: Any,
            context: contextvars.Context | None = None) -> asyncio.TimerHandle:
        return self.call_at(self.now + delay, callback, *args, context=context)

    def _timer_handle_cancelled(self, handle: asyncio.TimerHandle) -> None:
        pass  # a cancelled timer stays in the heap and is skipped when due

    def create_future(self) -> asyncio.Future[Any]:
        return asyncio.Future(loop=self)

    def create_task(self, coro: Coroutine[Any, Any, Any] | Generator[Any, None, Any], *, name: str | None = None,
                    context: contextvars.Context | None = None) -> asyncio.Task[Any]:
        return asyncio.Task(coro, loop=self, name=name, context=context)

    def call_exception_handler(self, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        if exc is not None and not isinstance(exc, Exception):
            raise exc
        message = context.get("message", "unhandled error in a simulated callback")
        import logging
        logging.getLogger("ahcomm.sim").error("%s: %r", message, exc)

    def default_exception_handler(self, context: dict[str, Any]) -> None:
        self.call_exception_handler(context)

    # -- the simulated network's fast path --------------------------------------------------
    def at(self, when: float, callback: Callback, *args: Any) -> None:
        """Run ``callback(*args)`` at virtual time ``when`` (no handle, no context)."""
        heapq.heappush(self._heap, (when, next(self._seq), callback, args, None))

    def delay(self, when: float) -> Delay:
        """``settle_at`` for a ``SimStream`` task: no future unless something else awaits it."""
        return Delay(self, when)

    def settle_at(self, when: float) -> asyncio.Future[None]:
        """A future that completes at virtual time ``when``."""
        fut: asyncio.Future[None] = asyncio.Future(loop=self)
        heapq.heappush(self._heap, (when, next(self._seq), _settle, (fut,), None))
        return fut

    # -- running -----------------------------------------------------------------------------
    def stop(self) -> None:
        self._stopping = True

    def close(self) -> None:
        self._closed = True
        self._ready.clear()
        self._heap.clear()

    def run_forever(self) -> None:
        """Run until ``stop()``, or until nothing is ready and no timer is left (``deadlocked``)."""
        ready, heap, pop, popleft = self._ready, self._heap, heapq.heappop, self._ready.popleft
        old = asyncio.events._get_running_loop()
        asyncio.events._set_running_loop(self)
        self._running, self._stopping = True, False
        events = 0
        try:
            while not self._stopping:
                if ready:
                    callback, args, context = popleft()
                elif heap:
                    when, _, callback, args, context = pop(heap)
                    if when > self.now:
                        self.now = when
                else:
                    self.deadlocked = True
                    break
                events += 1
                try:
                    if context is None:
                        callback(*args)
                    else:
                        context.run(callback, *args)
                except (SystemExit, KeyboardInterrupt):
                    raise
                except BaseException as exc:  # noqa: BLE001 - reported, as asyncio's loop does
                    self.call_exception_handler({"message": f"exception in callback {callback!r}",
                                                 "exception": exc})
        finally:
            self.events += events
            self._running = False
            asyncio.events._set_running_loop(old)

    def run_until_complete(self, future: Awaitable[Any]) -> Any:  # type: ignore[override]
        task = asyncio.ensure_future(future, loop=self)
        task.add_done_callback(lambda _: self.stop())
        self.run_forever()
        if not task.done():
            raise SimDeadlock(f"simulation deadlock at t={self.now * 1e6:.3f} us: every rank waits, nothing in flight")
        return task.result()

    def run_sim(self, main: Awaitable[Any]) -> Any:
        """Run ``main`` to completion; raise ``SimDeadlock`` if every task waits forever."""
        task = asyncio.ensure_future(main, loop=self)
        task.add_done_callback(lambda _: self.stop())
        self.run_forever()
        if not task.done():
            task.cancel()
            self.run_forever()  # let the cancellation unwind every waiting task
            raise SimDeadlock(f"simulation deadlock at t={self.now * 1e6:.3f} us: every rank waits, nothing in flight")
        return task.result()

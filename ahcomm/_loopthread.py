"""A process's background event loop, where communicators used from synchronous code live.

Engines that call collectives synchronously from their own threads (torch.distributed's
process groups, Ray's collective groups) share one ``LoopThread``: an asyncio loop in a
daemon thread. ``submit`` hands a call to the loop with ``call_soon_threadsafe`` in call
order (so collectives take their sequence numbers in the order the program issued them, as
on every other rank) and returns a ``concurrent.futures.Future``; ``run`` blocks on a
coroutine. This module imports neither torch nor ray.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from ._errors import CommunicationError

T = TypeVar("T")


class LoopThread:
    """An asyncio loop in a daemon thread, where every communicator of the backend runs."""

    _instance: "LoopThread | None" = None
    _lock = threading.Lock()

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._main, name="ahcomm-torch-loop", daemon=True)
        self._thread.start()
        self.completer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ahcomm-torch-futures")

    @classmethod
    def get(cls) -> "LoopThread":
        """The process's loop thread (started on first use)."""
        with cls._lock:
            if cls._instance is None or not cls._instance.alive:
                cls._instance = LoopThread()
            return cls._instance

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self.loop.is_closed()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and block until it returns (bounded by ``timeout``)."""
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        # not result(timeout): its TimeoutError is also what a failed collective raises (CollectiveTimeout)
        if not concurrent.futures.wait([future], timeout).done:
            future.cancel()
            raise TimeoutError(f"ahcomm torch backend: no answer within {timeout:g} s")
        return future.result()

    def submit(self, start: Callable[[], Awaitable[Any]],
               then: Callable[[Any], Any] | None = None) -> "concurrent.futures.Future[Any]":
        """Call ``start()`` on the loop (in submission order) and complete the returned future
        with its result, passed through ``then`` (on the loop) when given."""
        done: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def finished(fut: "asyncio.Future[Any]") -> None:
            if fut.cancelled():
                done.set_exception(CommunicationError("ahcomm: the collective was cancelled"))
            elif fut.exception() is not None:
                done.set_exception(fut.exception())  # type: ignore[arg-type]
            else:
                try:
                    done.set_result(then(fut.result()) if then is not None else fut.result())
                except BaseException as exc:  # noqa: BLE001 - handed to wait()
                    done.set_exception(exc)

        def issue() -> None:
            try:
                fut = asyncio.ensure_future(start())
            except BaseException as exc:  # noqa: BLE001 - a bad call: its error is wait()'s
                done.set_exception(exc)
                return
            fut.add_done_callback(finished)

        self.loop.call_soon_threadsafe(issue)
        return done

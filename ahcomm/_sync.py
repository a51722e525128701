"""Calling a communicator from other threads (a mixin of ``Comm``, and ``SyncComm``).

A communicator belongs to the event loop it was created on: its collectives take sequence
numbers in the order they are called, and every rank must call them in the same order.
``call_threadsafe`` hands a call to that loop from any thread and returns a
``concurrent.futures.Future``; ``comm.sync`` wraps it in blocking methods. Calls are issued
on the loop in the order they were handed over: calls from one thread keep their order.
Calls from two threads at once interleave in whatever order they arrive, which differs
from rank to rank, so threads that share a communicator must agree on an order (take turns
under a lock) - or give each thread its own communicator (``comm.split``), whose
collectives match only among themselves.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

from . import _flight
from ._errors import CommClosedError, UsageError, WrongLoopError


def wrong_loop(comm: Any, loop: asyncio.AbstractEventLoop | None) -> str:
    """The message of ``WrongLoopError`` for ``comm`` called from ``loop`` in this thread."""
    owner = next((t.name for t in threading.enumerate() if t.ident == comm._thread), f"id {comm._thread}")
    here = threading.current_thread().name
    where = f"another event loop ({loop!r})" if loop is not None else "a thread with no running event loop"
    return (f"communicator (rank {comm.rank}) belongs to event loop {comm._loop!r} in thread {owner!r}; it was "
            f"called from {where} in thread {here!r}. Call it from its own loop, or from another thread "
            f"through comm.call_threadsafe(...) or comm.sync")


def _copy_to(target: "concurrent.futures.Future[Any]") -> Callable[["asyncio.Future[Any]"], None]:
    def copy(source: "asyncio.Future[Any]") -> None:
        if source.cancelled():
            target.cancel()
        elif source.exception() is not None:
            target.set_exception(source.exception())
        else:
            target.set_result(source.result())
    return copy


class ThreadsafeCalls:
    """``call_threadsafe`` and ``sync``."""

    if TYPE_CHECKING:
        _loop: asyncio.AbstractEventLoop | None
        _thread: int
        rank: int

    def _check_loop(self) -> None:
        """Raise ``WrongLoopError`` unless called on this communicator's loop."""
        try:
            loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if loop is not self._loop:
            self._not_my_loop(loop)

    def _not_my_loop(self, loop: asyncio.AbstractEventLoop | None) -> None:
        if self._loop is None and loop is not None:  # made outside a loop: the first one owns it
            self._loop, self._thread = loop, threading.get_ident()
            _flight.watch(cast(Any, self), loop)
            return
        raise WrongLoopError(wrong_loop(self, loop))

    def _sync_init(self) -> None:
        self._inbox: deque[tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any],
                                 concurrent.futures.Future[Any]]] = deque()
        self._inbox_busy = False

    def call_threadsafe(self, fn: Callable[..., Any], /, *args: Any,
                        **kwargs: Any) -> "concurrent.futures.Future[Any]":
        """Call ``fn(*args, **kwargs)`` on this communicator's loop from any thread: typically a
        method (``comm.call_threadsafe(comm.all_reduce, x)``). Returns a future for its result
        (an awaitable's result once it completes; a coroutine runs to its end before later
        calls are issued). Calls are issued in the order they were made here.
        """
        loop = self._loop
        if loop is None or loop.is_closed():
            raise CommClosedError(f"communicator (rank {self.rank}) has no running event loop to call into")
        target: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._inbox.append((fn, args, kwargs, target))  # one append: the order of the calls
        loop.call_soon_threadsafe(self._drain)
        return target

    @property
    def sync(self) -> "SyncComm":
        """This communicator's blocking face for other threads: ``comm.sync.all_reduce(x)``."""
        return SyncComm(self)

    def _drain(self) -> None:
        """On the loop: issue what was handed over, in order (a coroutine holds the rest back)."""
        while self._inbox and not self._inbox_busy:
            fn, args, kwargs, target = self._inbox.popleft()
            if not target.set_running_or_notify_cancel():
                continue
            try:
                got = fn(*args, **kwargs)
            except BaseException as exc:  # noqa: BLE001 - delivered to the caller
                target.set_exception(exc)
                continue
            if asyncio.iscoroutine(got):
                self._inbox_busy = True
                task = asyncio.ensure_future(got)
                task.add_done_callback(_copy_to(target))
                task.add_done_callback(self._resume)
            elif isinstance(got, asyncio.Future):
                got.add_done_callback(_copy_to(target))
            else:
                target.set_result(got)

    def _resume(self, _: "asyncio.Future[Any]") -> None:
        self._inbox_busy = False
        self._drain()


class SyncComm:
    """Blocking calls into a communicator from threads other than its loop's:
    ``comm.sync.all_reduce(x)`` issues ``comm.all_reduce(x)`` on the communicator's loop and
    waits for the result. Attributes that are not methods (``rank``, ``size``) read through."""

    def __init__(self, comm: ThreadsafeCalls) -> None:
        self._comm = comm

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._comm, name)
        if name.startswith("_") or not callable(attr):
            return attr
        comm = self._comm

        def blocking(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() == comm._thread:
                raise UsageError(f"comm.sync.{name}() would block the communicator's own event loop; "
                                 f"await comm.{name}() there instead")
            return comm.call_threadsafe(attr, *args, **kwargs).result()
        blocking.__name__ = name
        return blocking

    def __repr__(self) -> str:
        return f"<ahcomm.SyncComm of {self._comm!r}>"

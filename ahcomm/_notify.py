"""Notify: an awaitable flag with HCCL's semantics.

``post()`` sets the flag to 1 (no change if it is already 1); ``wait()`` waits until it
is 1 and resets it to 0. A notify can be failed, which wakes its waiter with the error and
makes every later wait raise it: that is how an abort reaches a stream blocked on a peer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable


class Notify:
    __slots__ = ("_error", "_value", "_waiters", "name", "overruns")

    def __init__(self, name: str = "notify") -> None:
        self.name = name
        self._value = 0
        self._waiters: list[asyncio.Future[None]] = []  # rarely more than one; a deque costs 10x the memory
        self._error: BaseException | None = None
        self.overruns = 0  # posts that found the flag already at 1 (a protocol smell)

    @property
    def value(self) -> int:
        return self._value

    def post(self) -> None:
        """Set the flag; hand it straight to the oldest waiter if one is blocked."""
        waiters = self._waiters
        while waiters:
            fut = waiters.pop(0)
            if not fut.done():
                fut.set_result(None)  # the waiter consumes the post: the flag stays 0
                return
        if self._value:
            self.overruns += 1
        self._value = 1

    def try_wait(self) -> bool:
        """Consume the flag if it is set, without waiting; False if it is 0."""
        if self._error is not None:
            raise self._error
        if self._value:
            self._value = 0
            return True
        return False

    def wait_task(self) -> Awaitable[None] | None:
        """``wait()`` as a stream task: None when the flag was set (consumed at once), else a bare
        future the next ``post`` completes (no coroutine: a stream awaits millions of these in
        ``ahcomm-sim``). Unlike ``wait()``, a post that lands just as the awaiting task is
        cancelled is consumed: streams are cancelled only when they close (their flags are
        reset with the communicator)."""
        if self.try_wait():
            return None
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        return fut

    async def wait(self) -> None:
        """Wait for the flag, then reset it to 0."""
        if self._error is not None:
            raise self._error
        if self._value:
            self._value = 0
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            # A post that raced with the cancellation must not be lost.
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self._value = 1
            raise

    def fail(self, error: BaseException) -> None:
        """Wake every waiter with ``error``; later waits raise it too."""
        self._error = error
        while self._waiters:
            fut = self._waiters.pop(0)
            if not fut.done():
                fut.set_exception(error)

    def reset(self) -> None:
        """Back to a fresh 0 flag with no error (used between communicator lifetimes)."""
        self._value = 0
        self._error = None

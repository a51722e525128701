"""The torch backend's machinery: one event loop thread per process, its Work, bootstrap.

torch calls a process group's methods synchronously from the user's thread. Every
communicator the backend makes lives on one asyncio loop in a daemon thread (``LoopThread``);
each call is handed to that loop with ``call_soon_threadsafe`` in call order, so the
collectives take their sequence numbers in the order the user issued them, as on every
other rank. The caller gets an ``AhcommWork`` at once: ``wait()`` blocks on a
``concurrent.futures.Future`` the loop completes; ``get_future()`` is a ``torch.futures.Future``
completed from a separate completion thread, so callbacks chained on it (DDP's) never
stall the loop.

Bootstrap (``connect``): rank 0 of the group makes a root-info token
(``ahcomm.get_root_info``: its address, a free port and the job secret - AHCOMM_JOB_SECRET,
else a new random one) and puts it in the store torch hands the backend; the other ranks
read it there. No AHCOMM_* variable is needed; the store is torch's (authenticated or not
as the user set it up), and the token travels only through it.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime
import threading
from typing import Any

import torch
import torch.distributed as dist

from ._api import init as ahcomm_init
from ._bootstrap import create
from ._comm import Comm
from ._config import Config
from ._errors import CollectiveTimeout, CommunicationError
from ._loopthread import LoopThread
from ._rootinfo import config_from_root_info, get_root_info

ROOT_INFO_KEY = "ahcomm/root_info"
POLL = 1.0  # seconds between checks that the loop thread is alive while a wait() blocks
MIN_CONNECT = 30.0  # seconds a group's rendezvous may take at least, whatever its collective timeout


def torch_error(exc: BaseException) -> BaseException:
    """An ahcomm error as torch reports it: timeouts stay ``CollectiveTimeout`` (a TimeoutError);
    other communication failures (a dead peer, a mismatch) become ``DistBackendError`` with
    the ahcomm error as the cause; bad calls (ValueError / TypeError subclasses) stay as they are."""
    if isinstance(exc, CommunicationError) and not isinstance(exc, CollectiveTimeout):
        err = dist.DistBackendError(f"ahcomm: {type(exc).__name__}: {exc}")
        err.__cause__ = exc
        return err
    return exc


class AhcommWork(dist.Work):
    """One call in flight: ``wait()`` blocks until it is done (raising its error),
    ``get_future()`` is completed with ``outputs`` (the tensors the call wrote), as gloo's."""

    def __init__(self, done: "concurrent.futures.Future[Any]", outputs: list[Any], loop: LoopThread) -> None:
        super().__init__()
        self._done = done
        self._outputs = outputs
        self._loop = loop
        self._future: torch.futures.Future[Any] | None = None
        self._lock = threading.Lock()

    def wait(self, timeout: datetime.timedelta = datetime.timedelta(0)) -> bool:
        """Block until the call is done; raise its error. ``timeout`` (0: none beyond the
        process group's, which the collective itself enforces) bounds this wait."""
        limit = timeout.total_seconds() if timeout else 0.0
        waited = 0.0
        # concurrent.futures.wait, not result(step): result's TimeoutError ("not yet") is the same
        # class as a collective's own CollectiveTimeout, which must be raised, not waited on
        while not concurrent.futures.wait([self._done], POLL if not limit else min(POLL, limit - waited)).done:
            waited += POLL if not limit else min(POLL, limit - waited)
            if not self._loop.alive:
                raise dist.DistBackendError("ahcomm: the backend's event loop thread stopped")
            if limit and waited >= limit:
                raise TimeoutError(f"ahcomm: Work.wait timed out after {limit:g} s")
        exc = self._done.exception()
        if exc is not None:
            raise torch_error(exc)  # a DistBackendError keeps the ahcomm error as its __cause__
        return True

    def is_completed(self) -> bool:
        return self._done.done()

    def is_success(self) -> bool:
        return self._done.done() and self._done.exception() is None

    def exception(self) -> BaseException | None:
        if not self._done.done():
            return None
        exc = self._done.exception()
        return None if exc is None else torch_error(exc)

    def result(self) -> list[Any]:
        self.wait()
        return self._outputs

    def synchronize(self) -> None:
        self.wait()

    def get_future(self) -> "torch.futures.Future[Any]":
        with self._lock:
            if self._future is None:
                future: torch.futures.Future[Any] = torch.futures.Future()
                self._future = future
                self._done.add_done_callback(
                    lambda done: self._loop.completer.submit(self._complete, future, done))
            return self._future

    def _complete(self, future: "torch.futures.Future[Any]", done: "concurrent.futures.Future[Any]") -> None:
        exc = done.exception()
        if exc is None:
            future.set_result(self._outputs)
        else:
            future.set_exception(torch_error(exc))


def connect(store: Any, rank: int, size: int, timeout: float, *, world: bool) -> Comm:
    """A communicator for this group's ``size`` ranks, bootstrapped through torch's ``store``.

    The world group's becomes ahcomm's default communicator (``ahcomm.default_comm()``),
    on the backend's loop."""
    loop = LoopThread.get()
    base = Config.from_env()
    # the group's timeout bounds each collective; joining gets at least MIN_CONNECT seconds (a
    # short collective timeout must not fail the rendezvous of a loaded machine)
    connect = max(MIN_CONNECT, min(base.connect_timeout, timeout))
    base = dataclasses.replace(base, exec_timeout=timeout, connect_timeout=connect)
    if size == 1:
        config = dataclasses.replace(base, rank=0, world_size=1)
    else:
        if rank == 0:
            store.set(ROOT_INFO_KEY, get_root_info())
        token = bytes(store.get(ROOT_INFO_KEY)).decode()
        config = config_from_root_info(token, base)
    if world:
        return loop.run(ahcomm_init(config=config, rank=rank, world_size=size), connect + 10)
    return loop.run(create(config, rank=rank, world_size=size), connect + 10)

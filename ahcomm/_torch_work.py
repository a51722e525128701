"""The torch backend's machinery: its Work, its bootstrap, tensors as host arrays.

torch calls a process group's methods synchronously from the user's thread; the
communicators live on the process's ``LoopThread`` (``_loopthread``), which takes each call in
call order. The caller gets an ``AhcommWork`` at once: ``wait()`` blocks on the
``concurrent.futures.Future`` the loop completes; ``get_future()`` is a ``torch.futures.Future``
completed from a separate completion thread, so callbacks chained on it (DDP's) never stall
the loop. ``Host`` is a tensor's numpy view (zero copy on the CPU; a host copy written back
for a tensor on an accelerator).

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

import numpy as np
import torch
import torch.distributed as dist

from ._api import init as ahcomm_init
from ._bootstrap import create
from ._comm import Comm
from ._config import Config
from ._devices import _tensor_numpy
from ._errors import CollectiveTimeout, CommunicationError, InvalidArgument
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


class Host:
    """A tensor's host numpy view; for a tensor off the CPU, a host copy written back by ``done()``."""

    __slots__ = ("_copy", "array", "tensor")

    def __init__(self, tensor: Any, *, read: bool = True) -> None:
        if not isinstance(tensor, torch.Tensor):
            raise InvalidArgument(f"ahcomm backend: expected a tensor, got {type(tensor).__name__}")
        self.tensor = tensor
        self._copy: Any = None
        if tensor.device.type == "cpu":
            self.array = _tensor_numpy(tensor)
        else:
            self._copy = tensor.detach().to("cpu") if read else torch.empty(tensor.shape, dtype=tensor.dtype)
            self.array = _tensor_numpy(self._copy)

    def flat(self) -> np.ndarray:
        """The elements in order: a view when the tensor is contiguous (else a copy)."""
        return self.array.reshape(-1)

    def put(self, values: np.ndarray) -> None:
        """Write ``values`` (any shape of the same size) into the tensor (nothing to copy when the
        collective wrote the tensor's own memory)."""
        if values.size and not np.may_share_memory(values, self.array):
            self.array[...] = values.reshape(self.array.shape)
        self.done()

    def done(self) -> None:
        if self._copy is not None:
            self.tensor.detach().copy_(self._copy)


def out_view(h: Host) -> np.ndarray | None:
    """A flat view of ``h`` that a collective may write (None: it is not contiguous)."""
    return h.array.reshape(-1) if h.array.flags.c_contiguous else None


def rows(a: np.ndarray) -> tuple[int, int]:
    """(rows, elements per row) of ``a`` along dim 0 (a 0-d tensor is one row)."""
    rows = a.shape[0] if a.ndim else 1
    return rows, (a.size // rows if rows else int(np.prod(a.shape[1:], dtype=np.int64)))


def split_into(data: np.ndarray, outs: list[Host]) -> None:
    start = 0
    for h in outs:
        h.put(data[start:start + h.array.size])
        start += h.array.size

"""Object collectives over msgpack (never pickle): for configuration and metadata.

A mixin of ``Comm``. Objects are what msgpack encodes (None, bool, int, float, str, bytes,
lists/tuples and dicts of them); anything else is a TypeError on the calling rank before
anything is sent. Each call takes its sequence numbers when it is made, like every
collective: a length exchange first, then the bytes.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Callable

import msgpack
import numpy as np

from ._errors import InvalidArgument
from .algorithms.base import Call

if TYPE_CHECKING:
    from ._collectives import Gathered
    from ._comm import _Job

_BYTES = np.dtype(np.uint8)


def _encode(obj: Any, what: str) -> np.ndarray:
    try:
        packed = msgpack.packb(obj, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise InvalidArgument(f"{what}: the object cannot be sent with msgpack ({exc}); send plain data "
                              f"(dicts, lists, str, bytes, numbers, None) or an array collective") from None
    return np.frombuffer(bytearray(packed), np.uint8)  # writable: it may serve as a run's dst


def _decode(data: np.ndarray) -> Any:
    return msgpack.unpackb(data.tobytes(), raw=False, strict_map_key=False)


class ObjectCollectives:
    """broadcast_object, all_gather_object, gather_object."""

    rank: int
    size: int

    if TYPE_CHECKING:
        _seq: int

        def _check_root(self, root: int, what: str) -> None: ...
        def _check_open(self) -> None: ...
        def _submit(self, call: Call, src: np.ndarray, dst: np.ndarray, result: Any,
                    finish: Callable[[], None] | None, algorithm: str | None, *,
                    prepare: Callable[[_Job], None] | None = None,
                    later: bool = False, timeout: float | None = None) -> asyncio.Future[Any]: ...
        def broadcast(self, x: Any, root: int = 0, *, out: np.ndarray | None = None, algorithm: str | None = None,
                      timeout: float | None = None) -> asyncio.Future[np.ndarray]: ...
        def all_gather_v(self, x: Any, *, counts: Any = None, out: np.ndarray | None = None,
                         algorithm: str | None = None, timeout: float | None = None) -> asyncio.Future[Gathered]: ...
        def gather_v(self, x: Any, root: int = 0, *, counts: Any = None, out: np.ndarray | None = None,
                     algorithm: str | None = None,
                     timeout: float | None = None) -> asyncio.Future[Gathered | None]: ...

    def broadcast_object(self, obj: Any = None, root: int = 0, *, timeout: float | None = None) -> "asyncio.Future[Any]":
        """The root's ``obj`` on every rank (other ranks' ``obj`` is ignored)."""
        self._check_open()
        self._check_root(root, "broadcast_object")
        payload = _encode(obj, "broadcast_object") if self.rank == root else np.empty(0, _BYTES)
        length = self.broadcast(np.array([payload.size], np.int64), root, timeout=timeout)
        call = Call(op="broadcast", seq=self._seq, dtype=_BYTES, count=0, root=int(root))

        def prepare(job: _Job) -> None:
            count = int(length.result()[0])
            job.call.count = count
            job.src = job.dst = job.result = payload if self.rank == root else np.empty(count, _BYTES)

        empty = np.empty(0, _BYTES)
        done = self._submit(call, empty, empty, None, None, None, prepare=prepare, later=True, timeout=timeout)
        return asyncio.ensure_future(self._decoded(done))

    def all_gather_object(self, obj: Any, *, timeout: float | None = None) -> "asyncio.Future[list[Any]]":
        """Every rank's ``obj``, in rank order, on every rank."""
        self._check_open()
        done = self.all_gather_v(_encode(obj, "all_gather_object"), timeout=timeout)
        return asyncio.ensure_future(self._decoded_list(done))

    def gather_object(self, obj: Any, root: int = 0, *,
                      timeout: float | None = None) -> "asyncio.Future[list[Any] | None]":
        """Every rank's ``obj``, in rank order, at ``root`` (None elsewhere)."""
        self._check_open()
        done = self.gather_v(_encode(obj, "gather_object"), root, timeout=timeout)
        return asyncio.ensure_future(self._decoded_list(done))

    @staticmethod
    async def _decoded(done: "asyncio.Future[np.ndarray]") -> Any:
        return _decode(await done)

    @staticmethod
    async def _decoded_list(done: "asyncio.Future[Gathered] | asyncio.Future[Gathered | None]") -> Any:
        got = await done
        if got is None:
            return None
        bounds = Call.displs(got.counts)
        return [_decode(got.data[bounds[p]:bounds[p + 1]]) for p in range(len(got.counts))]

"""Object collectives over msgpack (never pickle): for configuration and metadata.

A mixin of ``Comm``. Objects are what msgpack encodes (None, bool, int, float, str, bytes,
lists/tuples and dicts of them). Each call takes its sequence numbers when it is made, like
every collective: a length exchange first, then the bytes. An object that cannot be encoded
is a check only its rank can make, so that rank still takes part: it sends the error in
place of the object (every payload starts with a flag byte), and every rank that receives
it raises the same ``InvalidArgument`` naming the rank (gather_object: the root and the
rank itself; the other ranks learn it from the length exchange). The job stays in step.
(Its methods see the communicator as ``_core.CommCore``.)
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgpack
import numpy as np

from ._collectives import retrieved
from ._core import FrontEnd, Gathered, Job
from ._errors import InvalidArgument
from .algorithms.base import Call

_BYTES = np.dtype(np.uint8)
_OK, _FAILED = 0, 1  # a payload's first byte: the object follows, or this rank's error (utf-8)


def _encode(obj: Any, what: str) -> tuple[np.ndarray, InvalidArgument | None]:
    """(flag byte + msgpack bytes, None), or (flag + error text, the error) when msgpack refuses."""
    try:
        packed = b"%c" % _OK + msgpack.packb(obj, use_bin_type=True)
        error = None
    except (TypeError, ValueError, OverflowError) as exc:
        error = InvalidArgument(f"{what}: the object cannot be sent with msgpack ({exc}); send plain data "
                                f"(dicts, lists, str, bytes, numbers, None) or an array collective")
        packed = b"%c" % _FAILED + str(error).encode()
    return np.frombuffer(bytearray(packed), np.uint8), error  # writable: it may serve as a run's dst


def _decode(data: np.ndarray, what: str, rank: int) -> Any:
    raw = data.tobytes()
    if not raw or raw[0] != _OK:
        text = raw[1:].decode(errors="replace") if raw else "nothing arrived"
        raise InvalidArgument(f"{what}: rank {rank} could not send its object: {text}")
    return msgpack.unpackb(raw[1:], raw=False, strict_map_key=False)


class ObjectCollectives(FrontEnd):
    """broadcast_object, all_gather_object, gather_object."""

    def broadcast_object(self, obj: Any = None, root: int = 0, *,
                         timeout: float | None = None) -> "asyncio.Future[Any]":
        """The root's ``obj`` on every rank (other ranks' ``obj`` is ignored)."""
        self._check_open("broadcast_object")
        self._check_root(root, "broadcast_object")
        payload = _encode(obj, "broadcast_object")[0] if self.rank == root else np.empty(0, _BYTES)
        length = self.broadcast(np.array([payload.size], np.int64), root, timeout=timeout)
        length.add_done_callback(retrieved)
        call = Call(op="broadcast", seq=self._seq, dtype=_BYTES, count=0, root=int(root))

        def prepare(job: Job) -> None:
            count = int(length.result()[0])
            job.call.count = count
            job.src = job.dst = job.result = payload if self.rank == root else np.empty(count, _BYTES)

        empty = np.empty(0, _BYTES)
        done = self._submit(call, empty, empty, None, None, None, prepare=prepare, later=True, timeout=timeout)
        return asyncio.ensure_future(self._decoded(done, root))

    def all_gather_object(self, obj: Any, *, timeout: float | None = None) -> "asyncio.Future[list[Any]]":
        """Every rank's ``obj``, in rank order, on every rank."""
        self._check_open("all_gather_object")
        done = self.all_gather_v(_encode(obj, "all_gather_object")[0], timeout=timeout)
        return asyncio.ensure_future(self._decoded_list(done, "all_gather_object"))

    def gather_object(self, obj: Any, root: int = 0, *,
                      timeout: float | None = None) -> "asyncio.Future[list[Any] | None]":
        """Every rank's ``obj``, in rank order, at ``root`` (None elsewhere)."""
        self._check_open("gather_object")
        self._check_root(root, "gather_object")
        payload, error = _encode(obj, "gather_object")
        table = self.all_gather(np.array([payload.size, error is not None], np.int64), timeout=timeout)
        table.add_done_callback(retrieved)

        def rows() -> tuple[int, ...]:
            return tuple(int(n) for n in table.result().reshape(self.size, 2)[:, 0])

        done = self._gather(payload, root, None, None, None, "gather_v", uneven=True, later=rows, timeout=timeout)
        return asyncio.ensure_future(self._gathered(done, table, error))

    async def _decoded(self, done: "asyncio.Future[np.ndarray]", root: int) -> Any:
        return _decode(await done, "broadcast_object", root)

    async def _decoded_list(self, done: "asyncio.Future[Gathered]", what: str) -> list[Any]:
        got = await done
        bounds = Call.displs(got.counts)
        return [_decode(got.data[bounds[p]:bounds[p + 1]], what, p) for p in range(len(got.counts))]

    async def _gathered(self, done: "asyncio.Future[Gathered | None]", table: "asyncio.Future[np.ndarray]",
                        error: InvalidArgument | None) -> list[Any] | None:
        got = await done
        if got is not None:  # the root: its errors carry their text
            return await self._decoded_list(done, "gather_object")  # type: ignore[arg-type]
        if error is not None:
            raise InvalidArgument(f"gather_object: rank {self.rank} could not send its object: {error}")
        failed = [p for p, flag in enumerate(table.result().reshape(self.size, 2)[:, 1]) if flag]
        if failed:
            raise InvalidArgument(f"gather_object: rank {failed[0]} could not send its object (its error is "
                                  f"raised there and at the root)")
        return None

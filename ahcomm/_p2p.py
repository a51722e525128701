"""Point-to-point: send, recv and batch_send_recv (HcclSend/HcclRecv, HcclBatchSendRecv).

A mixin of ``Comm``. Messages do not take the communicator's sequence numbers (only two
ranks take part) and do not wait behind collectives: they travel as link messages, matched
by (tag, per-pair order) as MPI matches (source, tag) without overtaking. A send is eager:
it never waits for the matching recv to be posted, so any order of sends and receives is
deadlock-free (batch_send_recv just issues them all). A send completes when the peer
holds the bytes; leave ``x`` alone until then. The metadata frame carries dtype and shape,
so ``recv`` can build the array itself or check ``out`` against what was sent.
(Its methods see the communicator as ``_core.CommCore``.)
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgpack
import numpy as np

from ._core import FrontEnd
from ._dtypes import SUPPORTED_DTYPES
from ._errors import CollectiveMismatchError, CollectiveTimeout, InvalidArgument, InvalidDtype, check_timeout

if TYPE_CHECKING:
    from .transports.base import Link

MAX_TAG = 0xFFFF
_REFUSED = "!refused"  # a message's dtype field when it carries the sender's error instead of data
_DTYPES = {d.name: d for d in SUPPORTED_DTYPES}


@dataclass(frozen=True)
class P2POp:
    """One operation of ``batch_send_recv``: ``P2POp("send", x, peer)`` or ``P2POp("recv", out, peer)``."""

    kind: str
    array: Any
    peer: int
    tag: int = 0


def _retrieved(future: "asyncio.Future[Any]") -> None:
    if not future.cancelled():
        future.exception()


class PointToPoint(FrontEnd):
    """send / recv / batch_send_recv on a communicator's links."""

    def _p2p_init(self) -> None:
        self._sent_count: defaultdict[tuple[int, int], int] = defaultdict(int)  # (peer, tag) -> messages sent
        self._recv_count: defaultdict[tuple[int, int], int] = defaultdict(int)

    def send(self, x: Any, dst: int, *, tag: int = 0, timeout: float | None = None) -> "asyncio.Future[None]":
        """Send ``x`` to rank ``dst``; done when ``dst`` holds the bytes (x may then be reused).

        A bad ``x`` (which only this rank can check) raises here and is sent in place of the
        message: the matching ``recv`` raises it too (naming this rank) rather than waiting.
        Bad ``dst``, ``tag`` or ``timeout`` (checked alike by ``recv``) send nothing."""
        timeout = check_timeout(timeout, "send")
        link = self._peer_link(dst, "send", tag)
        try:
            arr, _ = self._input(x, "send")
        except (InvalidArgument, InvalidDtype) as exc:
            self._send_refusal(link, int(dst), tag, exc)
            raise
        data = np.ascontiguousarray(arr)
        meta = msgpack.packb([data.dtype.name, list(data.shape)])
        key = (tag, self._sent_count[(dst, tag)])
        pending = link.send_message(key, meta, data.reshape(-1))
        self._sent_count[(dst, tag)] += 1  # only once the message is accepted: a refused one takes no number
        future: asyncio.Future[None]
        if pending is None:
            future = asyncio.get_running_loop().create_future()
            future.set_result(None)
        else:
            future = asyncio.ensure_future(self._bounded(pending, f"send to rank {dst} (tag {tag}, #{key[1]})",
                                                         timeout))
        return future

    def recv(self, src: int, *, out: np.ndarray | None = None, shape: Sequence[int] | None = None,
             dtype: Any = None, tag: int = 0, timeout: float | None = None) -> "asyncio.Future[np.ndarray]":
        """Receive the next message from ``src`` with ``tag``.

        Into ``out``, or a new array of ``shape``/``dtype`` (checked against what was
        sent), or - given neither - of the sender's shape and dtype.
        """
        self._check_open("recv")
        timeout = check_timeout(timeout, "recv")
        if out is not None:
            if not isinstance(out, np.ndarray):
                raise InvalidArgument(f"recv: out must be a numpy array, got {type(out).__name__}")
            if not out.flags.writeable:
                raise InvalidArgument("recv: out is read-only")
            self._input(out, "recv out")
        want_dtype = np.dtype(dtype) if dtype is not None else None
        link = self._peer_link(src, "recv", tag)
        key = (tag, self._recv_count[(src, tag)])
        self._recv_count[(src, tag)] += 1
        what = f"recv from rank {src} (tag {tag}, #{key[1]})"
        return asyncio.ensure_future(self._receive(link, key, what, out, shape, want_dtype, timeout))

    def batch_send_recv(self, ops: Sequence[P2POp], *,
                        timeout: float | None = None) -> "asyncio.Future[list[np.ndarray | None]]":
        """Run sends and receives together (no order among them can deadlock); results in op order
        (the received array for a recv, None for a send)."""
        futures: list[asyncio.Future[Any]] = []
        for op in ops:
            if op.kind == "send":
                futures.append(self.send(op.array, op.peer, tag=op.tag, timeout=timeout))
            elif op.kind == "recv":
                out = op.array if isinstance(op.array, np.ndarray) else None
                futures.append(self.recv(op.peer, out=out, tag=op.tag, timeout=timeout))
            else:
                raise InvalidArgument(f"batch_send_recv: op kind must be 'send' or 'recv', got {op.kind!r}")
        return asyncio.ensure_future(self._gather_all(futures))

    # -- plumbing ----------------------------------------------------------------------------
    def _send_refusal(self, link: "Link", dst: int, tag: int, exc: Exception) -> None:
        """Send the error of a refused send as its message (the receiver raises it)."""
        key = (tag, self._sent_count[(dst, tag)])
        meta = msgpack.packb([_REFUSED, f"{type(exc).__name__}: {exc}"[:4000]])
        try:
            pending = link.send_message(key, meta, np.empty(0, np.uint8))
        except Exception:  # noqa: BLE001 - the link is broken: the transport reports it
            return
        self._sent_count[(dst, tag)] += 1
        if pending is not None:
            asyncio.ensure_future(pending).add_done_callback(_retrieved)

    @staticmethod
    async def _gather_all(futures: list["asyncio.Future[Any]"]) -> list[Any]:
        return list(await asyncio.gather(*futures))

    def _peer_link(self, peer: int, what: str, tag: int) -> "Link":
        self._check_open(what)
        if not isinstance(peer, (int, np.integer)) or not 0 <= int(peer) < self.size:
            raise InvalidArgument(f"{what}: peer rank {peer!r} is out of range for world size {self.size}")
        if int(peer) == self.rank:
            raise InvalidArgument(f"{what}: rank {self.rank} cannot {what} itself")
        if not isinstance(tag, int) or not 0 <= tag <= MAX_TAG:
            raise InvalidArgument(f"{what}: tag must be an integer in 0..{MAX_TAG}, got {tag!r}")
        return self._p2p_links()[int(peer)]

    async def _bounded(self, pending: "asyncio.Future[Any] | Any", what: str, timeout: float | None = None) -> Any:
        limit = self._exec_timeout if timeout is None else timeout
        try:
            async with asyncio.timeout(limit):
                return await pending
        except TimeoutError:
            source = "AHCOMM_EXEC_TIMEOUT" if timeout is None else f"timeout={timeout:g}"
            raise CollectiveTimeout(f"{what} on rank {self.rank} did not complete within "
                                    f"{limit:g} s ({source})") from None

    async def _receive(self, link: "Link", key: tuple[int, int], what: str, out: np.ndarray | None,
                       shape: Sequence[int] | None, dtype: np.dtype | None,
                       timeout: float | None = None) -> np.ndarray:
        meta, payload = await self._bounded(link.message(key), what, timeout)
        refused = ""
        try:
            dtype_name, sent_shape = msgpack.unpackb(meta)
            if dtype_name == _REFUSED:  # the sender's error in place of the message
                refused = f"{what}: rank {link.peer} could not send it: {sent_shape}"
            sent_dtype = _DTYPES[dtype_name]
            sent_shape = tuple(int(d) for d in sent_shape)
        except Exception as exc:  # noqa: BLE001 - a peer that breaks the protocol
            if not refused:
                raise CollectiveMismatchError(f"{what}: unreadable message metadata ({exc!r})") from None
        if refused:
            raise InvalidArgument(refused)
        data = np.frombuffer(payload, dtype=sent_dtype)
        if data.size != int(np.prod(sent_shape, dtype=np.int64)):
            raise CollectiveMismatchError(f"{what}: {data.size} elements arrived for shape {sent_shape}")
        if out is not None:
            if out.dtype != sent_dtype or out.size != data.size:
                raise CollectiveMismatchError(f"{what}: out has {out.size} x {out.dtype} but rank sent "
                                              f"shape {sent_shape} of {sent_dtype}")
            np.copyto(out, data.reshape(out.shape))
            return out
        if (dtype is not None and dtype != sent_dtype) or (shape is not None and tuple(shape) != sent_shape):
            raise CollectiveMismatchError(f"{what}: expected shape {tuple(shape) if shape else sent_shape} of "
                                          f"{dtype or sent_dtype}, rank sent shape {sent_shape} of {sent_dtype}")
        return data.reshape(sent_shape).copy()

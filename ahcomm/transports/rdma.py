"""RDMA-like links: ZeroMQ tcp carries the notifies and the bytes.

A put is sent as zero-copy frames (at most ``PUT_CHUNK`` bytes each, so libzmq never
allocates huge messages, and a receiver refuses any bigger frame) and received with
``recv_into`` straight into the peer's CCL buffer region, once its header is checked
against the buffer's bounds. The receiver answers every landed put with DataAck;
``flush()`` waits for all of them, so a collective never returns while its source bytes
are still in flight.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

import numpy as np
import zmq

from .._buffers import CclBuffers
from ._wire import FRAME_LIMIT, MSG_DATA_ACK, MSG_PUT, Malformed, buffer_name
from ._zmq import Channel, ZmqLink
from .base import BUFFER_IDS, MemoryRunner, ProgressHook, as_bytes

PUT_CHUNK = FRAME_LIMIT


class RdmaLink(ZmqLink):
    kind = "rdma"
    mapped = False

    def __init__(self, rank: int, peer: int, channel: Channel, endpoint: str,
                 on_progress: ProgressHook | None, *, parent: ZmqLink | None = None, domain: int = 0,
                 buffers: CclBuffers | None = None) -> None:
        super().__init__(rank, peer, channel, endpoint, on_progress, parent=parent, domain=domain)
        self.local = buffers or channel.buffers  # where the peer's puts land
        self._unacked = 0
        self._flushed: asyncio.Future[None] | None = None

    def child(self, domain: int, rank: int, peer: int, buffers: CclBuffers, peer_buffers: dict[str, Any],
              on_progress: ProgressHook | None) -> "RdmaLink":
        return RdmaLink(rank, peer, self.channel, self.endpoint, on_progress, parent=self, domain=domain,
                        buffers=buffers)

    def put(self, src: np.ndarray, buf: str, offset: int, seq: int, run: MemoryRunner) -> "Awaitable[Any] | None":
        if self._error is not None:
            raise self._error
        data = as_bytes(src)
        buf_id = BUFFER_IDS[buf]
        for start in range(0, max(data.nbytes, 1), PUT_CHUNK):
            piece = data[start:start + PUT_CHUNK]
            self._send(MSG_PUT, buf_id, 0, seq, piece.nbytes, offset + start, piece)
            self._unacked += 1
        self.bytes_sent += data.nbytes
        return None

    async def flush(self) -> None:
        """Wait until every put sent so far has landed in the peer's buffer (DataAck)."""
        while self._unacked:
            if self._error is not None:
                raise self._error
            if self._flushed is None or self._flushed.done():
                self._flushed = asyncio.get_running_loop().create_future()
            await self._flushed

    def on_data_message(self, kind: int, a: int, index: int, nbytes: int, seq: int, offset: int,
                        sock: zmq.Socket[Any]) -> None:
        if kind == MSG_PUT:
            region = self.local.get(buffer_name(a)).array
            if nbytes > PUT_CHUNK or offset + nbytes > region.nbytes:
                raise Malformed(f"rdma link {self.peer}->{self.rank}: a put of {nbytes} bytes at {offset}, outside "
                                f"the CCL buffer ({region.nbytes} bytes) or over {PUT_CHUNK} bytes")
            if not sock.getsockopt(zmq.RCVMORE):
                raise Malformed(f"rdma link {self.peer}->{self.rank}: a put without its data")
            if nbytes:
                got = sock.recv_into(region[offset:offset + nbytes].data, flags=zmq.NOBLOCK)
            else:
                got = len(sock.recv(zmq.NOBLOCK))
            if got != nbytes:
                raise Malformed(f"rdma link {self.peer}->{self.rank}: put of {got} bytes, header said {nbytes}")
            if sock.getsockopt(zmq.RCVMORE):
                raise Malformed(f"rdma link {self.peer}->{self.rank}: a put with extra frames")
            self.bytes_received += nbytes
            self._send(MSG_DATA_ACK, 0, 0, seq)
            self.progress(seq)
        elif kind == MSG_DATA_ACK:
            if self._unacked <= 0:
                raise Malformed(f"rdma link {self.peer}->{self.rank}: a DataAck for no put in flight")
            if sock.getsockopt(zmq.RCVMORE):
                raise Malformed(f"rdma link {self.peer}->{self.rank}: a DataAck with extra frames")
            self._unacked -= 1
            if self._unacked <= 0 and self._flushed is not None and not self._flushed.done():
                self._flushed.set_result(None)
        else:
            raise Malformed(f"rdma link {self.peer}->{self.rank}: unknown message kind {kind}")

    def fail(self, error: BaseException) -> None:
        super().fail(error)
        if self._flushed is not None and not self._flushed.done():
            self._flushed.set_exception(error)

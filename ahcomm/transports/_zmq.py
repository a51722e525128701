"""ZeroMQ plumbing shared by the sdma and rdma transports.

Each rank binds one ROUTER (on ipc for peers on its host, on tcp for the others) and
opens one DEALER per peer whose identity is the sender's rank. Incoming messages are
drained by a reader callback on the ROUTER's file descriptor: no future per message, no
polling thread, no busy loop. Every message starts with a fixed 24-byte header.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import struct
from abc import abstractmethod
from typing import Any

import zmq

from .._buffers import CclBuffers
from .._errors import TransportError
from .base import BUFFER_NAMES, MAX_CONTROL, Link, ProgressHook

# kind, signal-or-buffer, index, nbytes, seq, offset (a signal's value travels as its offset,
# the fingerprint of the sender's call as its nbytes)
HEADER = struct.Struct("<BBHIqQ")
MSG_SIGNAL, MSG_PUT, MSG_DATA_ACK, MSG_PROGRESS, MSG_ABORT, MSG_P2P, MSG_P2P_ACK, MSG_CONTROL = 1, 2, 3, 4, 5, 6, 7, 8
MAX_REASON = 1024
MAX_META = 4096  # bytes of a point-to-point message's metadata frame
RANK_ID = struct.Struct("<I")
COPY_THRESHOLD = 64 * 1024  # frames at least this big are sent zero-copy


def _context() -> zmq.Context[Any]:
    ctx: zmq.Context[Any] = zmq.Context.instance()
    return ctx


class Channel:
    """This rank's receiving socket and the reader that dispatches to links."""

    def __init__(self, rank: int, buffers: CclBuffers, *, ipc: bool = True, tcp_host: str | None = None) -> None:
        self.rank = rank
        self.buffers = buffers
        self.links: dict[int, ZmqLink] = {}
        self.rejected = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self.router = _context().socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.setsockopt(zmq.RCVHWM, 0)
        self.endpoints: dict[str, str] = {}
        try:
            if ipc:
                address = f"ipc://@ahcomm-{os.getpid()}-{rank}-{secrets.token_hex(6)}"
                self.router.bind(address)
                self.endpoints["ipc"] = address
            if tcp_host is not None:
                self.router.bind(f"tcp://{tcp_host}:0")
                self.endpoints["tcp"] = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as exc:
            self.router.close(0)
            raise TransportError(f"rank {rank}: cannot bind its link endpoint: {exc}") from exc

    def dealer(self, endpoint: str) -> zmq.Socket[Any]:
        sock: zmq.Socket[Any] = _context().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.IDENTITY, RANK_ID.pack(self.rank))
        sock.connect(endpoint)
        return sock

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self.router.getsockopt(zmq.FD), self._on_readable)
        self._on_readable()  # messages that arrived before the reader was installed

    def _on_readable(self) -> None:
        router, links, unpack = self.router, self.links, HEADER.unpack
        while router.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            frames_left = True
            link = None
            try:
                ident = router.recv(zmq.NOBLOCK)
                header = router.recv(zmq.NOBLOCK)  # a one-frame message raises Again here
                link = links.get(RANK_ID.unpack(ident)[0]) if len(ident) == RANK_ID.size else None
                if link is None or len(header) != HEADER.size:
                    self.rejected += 1
                else:
                    kind, a, index, nbytes, seq, offset = unpack(header)
                    if kind == MSG_SIGNAL:  # the hot path: no further frames by protocol
                        link.deliver(a, index, seq, offset, nbytes)
                        frames_left = False
                    else:
                        frames_left = link.on_message(kind, a, index, nbytes, seq, offset, router)
            except zmq.Again:
                self.rejected += 1
                continue
            except Exception as exc:  # noqa: BLE001 - a bad message must not kill the reader
                self.rejected += 1
                if link is not None:  # a known peer broke the protocol: its waiters must hear of it
                    link.fail(exc if isinstance(exc, TransportError) else TransportError(
                        f"link {link.peer}->{self.rank}: {exc!r}"))
            if frames_left:
                while router.getsockopt(zmq.RCVMORE):
                    router.recv(zmq.NOBLOCK)

    def close(self) -> None:
        if self._loop is not None and not self.router.closed:
            try:
                self._loop.remove_reader(self.router.getsockopt(zmq.FD))
            except (ValueError, RuntimeError, zmq.ZMQError):
                pass
        for link in self.links.values():
            link.close()
        self.links.clear()
        if not self.router.closed:
            self.router.close(0)


class ZmqLink(Link):
    """A link whose notifies travel as ZeroMQ messages on the peer's channel."""

    def __init__(self, rank: int, peer: int, channel: Channel, endpoint: str,
                 on_progress: ProgressHook | None) -> None:
        super().__init__(rank, peer, on_progress)
        self.channel = channel
        self.endpoint = endpoint
        self.sock = channel.dealer(endpoint)
        channel.links[peer] = self
        self._p2p_sent: dict[tuple[int, int], asyncio.Future[None]] = {}

    def _send(self, kind: int, a: int, index: int, seq: int, nbytes: int = 0, offset: int = 0,
              data: Any = None) -> None:
        header = HEADER.pack(kind, a, index, nbytes, seq, offset)
        try:
            if data is None:
                self.sock.send(header, zmq.NOBLOCK)
            else:
                self.sock.send(header, zmq.NOBLOCK | zmq.SNDMORE)
                self.sock.send(data, zmq.NOBLOCK, copy=nbytes < COPY_THRESHOLD)
        except zmq.ZMQError as exc:
            raise TransportError(f"link {self.rank}->{self.peer}: send failed: {exc}") from exc

    def post(self, signal: int, index: int, seq: int, value: int = 0, fingerprint: int = 0) -> None:
        if self._error is not None:
            raise self._error
        self.signals_sent += 1
        self._send(MSG_SIGNAL, signal, index, seq, fingerprint, value)

    def send_control(self, payload: bytes) -> None:
        if len(payload) > MAX_CONTROL:
            raise TransportError(f"link {self.rank}->{self.peer}: control message of {len(payload)} bytes "
                                 f"(at most {MAX_CONTROL})")
        self._send(MSG_CONTROL, 0, 0, 0, len(payload), 0, payload)

    def send_progress(self, seq: int) -> None:
        if self._error is None:
            self._send(MSG_PROGRESS, 0, 0, seq)

    def send_message(self, key: tuple[int, int], meta: bytes, data: Any) -> "asyncio.Future[None]":
        """Header, metadata and payload (zero-copy when big); done when the peer acknowledged."""
        if self._error is not None:
            raise self._error
        tag, counter = key
        payload = memoryview(data).cast("B")
        header = HEADER.pack(MSG_P2P, 0, tag, payload.nbytes, counter, 0)
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._p2p_sent[key] = done
        try:
            self.sock.send_multipart([header, meta, payload], zmq.NOBLOCK, copy=payload.nbytes < COPY_THRESHOLD)
        except zmq.ZMQError as exc:
            del self._p2p_sent[key]
            raise TransportError(f"link {self.rank}->{self.peer}: send failed: {exc}") from exc
        self.bytes_sent += payload.nbytes
        return done

    def _on_p2p(self, tag: int, counter: int, nbytes: int, sock: zmq.Socket[Any]) -> None:
        meta = sock.recv(zmq.NOBLOCK) if sock.getsockopt(zmq.RCVMORE) else b""
        if len(meta) > MAX_META or not sock.getsockopt(zmq.RCVMORE):
            raise TransportError(f"link {self.peer}->{self.rank}: malformed point-to-point message")
        frame = sock.recv(zmq.NOBLOCK, copy=False)
        if len(frame.buffer) != nbytes:
            raise TransportError(f"link {self.peer}->{self.rank}: message of {len(frame.buffer)} bytes, "
                                 f"header said {nbytes}")
        self._send(MSG_P2P_ACK, 0, tag, counter)
        self.deliver_message((tag, counter), bytes(meta), frame.buffer)

    def fail(self, error: BaseException) -> None:
        super().fail(error)
        for fut in self._p2p_sent.values():
            if not fut.done():
                fut.set_exception(error)
        self._p2p_sent.clear()

    def send_abort(self, reason: str) -> None:
        data = reason.encode()[:MAX_REASON]
        try:
            self._send(MSG_ABORT, 0, 0, 0, len(data), 0, data)
        except Exception:  # noqa: BLE001 - best effort on the way down
            pass

    def on_message(self, kind: int, a: int, index: int, nbytes: int, seq: int, offset: int,
                   sock: zmq.Socket[Any]) -> bool:
        """Handle one message; return True if frames of it are left unread."""
        if kind == MSG_SIGNAL:
            self.deliver(a, index, seq, offset, nbytes)
        elif kind == MSG_PROGRESS:
            self.progress(seq)
        elif kind == MSG_ABORT:
            reason = sock.recv(zmq.NOBLOCK) if sock.getsockopt(zmq.RCVMORE) else b""
            self.peer_aborted(bytes(reason[:MAX_REASON]).decode(errors="replace"))
        elif kind == MSG_CONTROL:
            payload = sock.recv(zmq.NOBLOCK) if sock.getsockopt(zmq.RCVMORE) else b""
            if len(payload) > MAX_CONTROL or len(payload) != nbytes:
                raise TransportError(f"link {self.peer}->{self.rank}: malformed control message")
            self.control(bytes(payload))
        elif kind == MSG_P2P:
            self._on_p2p(index, seq, nbytes, sock)
            return False
        elif kind == MSG_P2P_ACK:
            done = self._p2p_sent.pop((index, seq), None)
            if done is not None and not done.done():
                done.set_result(None)
        else:
            return self.on_data_message(kind, a, index, nbytes, seq, offset, sock)
        return True

    @abstractmethod
    def on_data_message(self, kind: int, a: int, index: int, nbytes: int, seq: int, offset: int,
                        sock: zmq.Socket[Any]) -> bool:
        """Messages specific to the transport (puts, data acks)."""

    def close(self) -> None:
        if not self.sock.closed:
            self.sock.close(0)


def buffer_name(buf_id: int) -> str:
    if buf_id >= len(BUFFER_NAMES):
        raise TransportError(f"unknown buffer id {buf_id}")
    return BUFFER_NAMES[buf_id]

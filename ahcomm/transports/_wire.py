"""What travels on a link connection, and how it is read.

Every message starts with the fixed ``HEADER``; payloads follow as further frames of at most
``FRAME_LIMIT`` bytes. ``frame``/``last`` read a message's frames with their bounds checked
(raising ``Malformed`` before anything is acted on). ``Monitor`` reads a socket's monitor
events on the event loop (connection up, closed, handshake refused).
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Callable
from typing import Any

import zmq

from .._errors import TransportError
from ._auth import HANDSHAKE_FAILED, fd, readable
from .base import BUFFER_NAMES

# kind, signal-or-buffer, index, nbytes, seq, offset, domain (a signal's value travels as its
# offset, the fingerprint of the sender's call as its nbytes; domain 0 is the communicator the
# connection was made for, others its sub-communicators, see ``ZmqLink.child``)
HEADER = struct.Struct("<BBHIqQH")
MSG_SIGNAL, MSG_PUT, MSG_DATA_ACK, MSG_PROGRESS, MSG_ABORT, MSG_P2P, MSG_P2P_ACK, MSG_CONTROL = 1, 2, 3, 4, 5, 6, 7, 8
MSG_BYE = 9  # the sender closed its communicator: nothing more will come from it
MSG_EAGER = 10  # a call's eager message (``Link.send_eager``): seq, the fingerprint as offset, its bytes
MAX_SIGNAL = 2  # Signal.DATA_ACK
MAX_REASON = 1024
MAX_META = 4096  # bytes of a point-to-point message's metadata frame
RANK_ID = struct.Struct("<I")
COPY_THRESHOLD = 64 * 1024  # frames at least this big are sent zero-copy
FRAME_LIMIT = 4 << 20  # the largest frame a link sends (an rdma put piece, a piece of a message)
WIRE_SLACK = 4096  # CURVE wraps each frame in a command a few dozen bytes longer
MAX_MESSAGE_LIMIT = 0xFFFFFFFF  # the header's nbytes field

DEALER_EVENTS = int(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED) | sum(HANDSHAKE_FAILED)
ROUTER_EVENTS = int(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
_EVENT = struct.Struct("=hi")


class Malformed(TransportError):
    """A message that breaks the link protocol; it is dropped and counted, never acted on."""


def frame(sock: zmq.Socket[Any], limit: int, what: str) -> zmq.Frame:
    """The next frame of the current message, which must exist and hold at most ``limit`` bytes."""
    if not sock.getsockopt(zmq.RCVMORE):
        raise Malformed(f"{what} is missing")
    frame: zmq.Frame = sock.recv(zmq.NOBLOCK, copy=False)
    if len(frame) > limit:
        raise Malformed(f"{what} of {len(frame)} bytes (at most {limit})")
    return frame


def last(sock: zmq.Socket[Any], what: str) -> None:
    """The current message must have no frames left."""
    if sock.getsockopt(zmq.RCVMORE):
        raise Malformed(f"{what} with extra frames")


class Monitor:
    """A socket's monitor events, read on the event loop (a reader on the PAIR's descriptor)."""

    def __init__(self, sock: zmq.Socket[Any], events: int, handler: Callable[[int, int], None]) -> None:
        self.owner = sock
        self.pair: zmq.Socket[Any] = sock.get_monitor_socket(events)
        self.pair.setsockopt(zmq.LINGER, 0)
        self.handler = handler
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._loop is None and not self.pair.closed:
            loop.add_reader(fd(self.pair), self._on_readable)
            self._loop = loop
            self._on_readable()  # events from before the reader was installed

    def _on_readable(self) -> None:
        pair = self.pair
        while readable(pair):
            try:
                frames = pair.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            if len(frames[0]) == _EVENT.size:
                event, value = _EVENT.unpack(frames[0])
                self.handler(event, value)

    def stop(self) -> None:
        if self._loop is not None and not self.pair.closed:
            try:
                self._loop.remove_reader(fd(self.pair))
            except Exception:  # noqa: BLE001 - the loop may be closed already
                pass
        self._loop = None
        if not self.owner.closed:
            try:
                self.owner.disable_monitor()
            except zmq.ZMQError:
                pass
        if not self.pair.closed:
            self.pair.close(0)


def buffer_name(buf_id: int) -> str:
    if buf_id >= len(BUFFER_NAMES):
        raise Malformed(f"unknown buffer id {buf_id}")
    return BUFFER_NAMES[buf_id]

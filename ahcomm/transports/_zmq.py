"""ZeroMQ plumbing shared by the sdma and rdma transports.

Each rank binds one ROUTER (on ipc for peers on its host, on tcp for the others) and
opens one DEALER per peer whose identity is the sender's rank. Incoming messages are
drained by a reader callback on the ROUTER's file descriptor: no future per message, no
polling thread, no busy loop. Every message starts with a fixed 26-byte header (``_wire``);
its domain field lets sub-communicators share the connection (``ZmqLink`` child links).

Security and robustness (see ``_auth`` for the handshake):

* Every connection is authenticated with the job secret (PLAIN, or CURVE with
  ``AHCOMM_ENCRYPT=1``) before any of its messages is decoded.
* Decoding is bounded. libzmq refuses any frame over ``FRAME_LIMIT`` (plus the CURVE
  overhead) before allocating it (``ZMQ_MAXMSGSIZE``); larger payloads (rdma puts,
  point-to-point messages) travel as several frames of at most ``FRAME_LIMIT`` bytes.
  Every header is checked (size, kind, signal, buffer, bounds, frame count, sizes against
  the frames that came); a point-to-point message is at most ``max_message`` bytes
  (``AHCOMM_MAX_MESSAGE``). A message that fails a check is counted in ``rejected``.
  From an identity that is not a peer of this communicator it is dropped; from a peer
  it fails that peer's link with ``TransportError`` (the peer is out of step with the
  protocol, so nothing later from it can be trusted to match) and calls the link's
  ``peer_broke_protocol``: the communicator fails on every rank.
* Pending handshakes are bounded in time: a connection that has not authenticated within
  ``HANDSHAKE_TIMEOUT`` seconds is closed by libzmq (``ZMQ_HANDSHAKE_IVL``), so idle
  connections cannot pile up towards the descriptor limit. (libzmq has no cap on the number
  of connections a socket accepts; its kernel backlog, ``ZMQ_BACKLOG``, only bounds those
  not accepted yet, and libzmq accepts at once.)
* Peer loss. A socket monitor on each DEALER, read on the event loop, reports the
  connection to the peer's endpoint closing (a dead process's sockets close at once);
  ZMTP heartbeats (``heartbeat`` seconds, timeout three of them) close the connection of
  a peer that vanished without closing it. A peer that closes its communicator first
  says goodbye (``MSG_BYE``, after everything else it sent us), so its disconnection is
  not a loss; otherwise, after ``LOSS_GRACE`` seconds without a goodbye, the link calls
  ``peer_lost(reason)`` and fails its waiters with ``PeerFailure(rank=peer)``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import time
from abc import abstractmethod
from collections.abc import Callable
from typing import Any

import numpy as np
import zmq

from .._buffers import CclBuffers
from .._errors import ConfigError, ConnectError, PeerFailure, TransportError
from ._auth import AUTH, HANDSHAKE_FAILED, Credentials, context
from ._notify_ring import Inbox
from ._notify_ring import usable as shm_notify_usable
from ._wire import (
    COPY_THRESHOLD,
    DEALER_EVENTS,
    FRAME_LIMIT,
    HEADER,
    MAX_MESSAGE_LIMIT,
    MAX_META,
    MAX_REASON,
    MAX_SIGNAL,
    MSG_ABORT,
    MSG_BYE,
    MSG_CONTROL,
    MSG_EAGER,
    MSG_P2P,
    MSG_P2P_ACK,
    MSG_PROGRESS,
    MSG_SIGNAL,
    RANK_ID,
    ROUTER_EVENTS,
    WIRE_SLACK,
    Malformed,
    Monitor,
    frame,
    last,
)
from .base import EAGER_BYTES, MAX_CONTROL, DomainInUse, Link, ProgressHook, as_bytes

DEFAULT_MAX_MESSAGE = 1 << 30  # AHCOMM_MAX_MESSAGE default: bytes of one point-to-point message
LOSS_GRACE = 0.5  # seconds a disconnected peer has for its goodbye to arrive before it counts as lost
BYE_LINGER_MS = 500  # a closing link's last messages (its goodbye) may still leave for this long
LOG_EVERY = 10.0  # seconds between two warnings about messages from one identity
# Seconds a connection to a link endpoint has to complete its ZMTP handshake (authentication
# included) before the endpoint closes it (ZMQ_HANDSHAKE_IVL; libzmq's default is 30 s). Peers
# need milliseconds; connections that stay silent (a flood of idle TCP connections) hold a
# descriptor each only this long, so pending handshakes stay under rate x HANDSHAKE_TIMEOUT.
HANDSHAKE_TIMEOUT = 2.0
# A connection attempt that fails its handshake without a refusal (the server's timer above,
# a CURVE key it cannot read) is retried by libzmq; this many in a row fail the link.
HANDSHAKE_ATTEMPTS = 5

log = logging.getLogger("ahcomm.transport")
security_log = logging.getLogger("ahcomm.security")


def _context() -> zmq.Context[Any]:
    return context()


class Channel:
    """This rank's receiving socket and the reader that dispatches to links.

    ``creds`` (default: none) authenticate every connection; ``heartbeat`` (seconds, 0 =
    off) sets the ZMTP heartbeats of the DEALERs to the peers; ``max_message`` caps a
    point-to-point message. ``rejected`` counts messages dropped as malformed or from a
    stranger, ``rejected_handshakes`` connections refused before any message was read.
    """

    def __init__(self, rank: int, buffers: CclBuffers, *, ipc: bool = True, tcp_host: str | None = None,
                 creds: Credentials | None = None, heartbeat: float = 0.0,
                 max_message: int = DEFAULT_MAX_MESSAGE, notify_rings: int = 0) -> None:
        self.rank = rank
        # notifies from the ranks of this host through shared memory (``_notify_ring``): a ring per
        # rank of the host (``notify_rings``; ``bind_notifies`` says whose), where ipc is on and the host allows it
        self.inbox: Inbox | None = None
        self._rings = notify_rings if ipc and notify_rings > 1 and shm_notify_usable() else 0
        self._host_ranks: list[int] = []
        self.buffers = buffers
        self.creds = creds or Credentials("null")
        self.heartbeat = heartbeat
        self.max_message = min(max_message, MAX_MESSAGE_LIMIT)
        self.links: dict[tuple[int, int], ZmqLink] = {}  # (domain, peer's rank on the wire) -> link
        self.rejected = 0
        self.late = 0  # messages for a sub-communicator that is closed here (dropped quietly)
        self.closing = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stranger_log = (-LOG_EVERY, 0)  # (time of the last warning about strangers, drops since)
        self.domain = AUTH.register(f"rank {rank}'s link endpoint", self.creds)
        self.router = _context().socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.setsockopt(zmq.RCVHWM, 0)
        self.router.setsockopt(zmq.MAXMSGSIZE, FRAME_LIMIT + WIRE_SLACK)
        self.router.setsockopt(zmq.HANDSHAKE_IVL, int(HANDSHAKE_TIMEOUT * 1000))
        self.creds.server(self.router, self.domain)
        self._monitor = Monitor(self.router, ROUTER_EVENTS, self._on_router_event)
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
            self._monitor.stop()
            self.router.close(0)
            AUTH.unregister(self.domain)
            raise TransportError(f"rank {rank}: cannot bind its link endpoint: {exc}") from exc
        self._make_inbox()  # once nothing above can fail: a failed init leaks no names

    def _make_inbox(self) -> None:
        if not self._rings:
            return
        try:
            self.inbox = Inbox(self.rank, self._rings)
        except (OSError, TransportError, ConfigError) as exc:  # a full or missing /dev/shm: ZeroMQ carries them
            log.warning("rank %d: notifies go through ZeroMQ only: no shared-memory inbox (%s)", self.rank, exc)
            return
        if self._host_ranks:
            self.inbox.senders = self._host_ranks

    def bind_notifies(self, host_ranks: list[int]) -> None:
        """The wire ranks of this host in rank order: ring i of the inbox carries the i-th's posts."""
        self._host_ranks = list(host_ranks)
        if self.inbox is not None:
            self.inbox.senders = self._host_ranks

    def renew_notifies(self) -> None:
        """A new inbox where ``release_notifies`` closed the last (``Comm.resume``), read at once."""
        if self.inbox is not None or self.closing:
            return
        self._make_inbox()
        if self.inbox is not None and self._loop is not None:
            self.inbox.start(self._loop, self._on_notify)

    def release_notifies(self) -> int:
        """Hand on every notify the inbox holds, then close it (every peer posts over ZeroMQ by now:
        ``Link.release_shared_notifies``); its bytes, or 0 where there is none any more."""
        inbox, self.inbox = self.inbox, None
        if inbox is None:
            return 0
        inbox.drain(self._on_notify)
        nbytes = inbox.region.nbytes
        inbox.close()
        return nbytes

    def notify_description(self) -> dict[str, Any] | None:
        """What a peer on this host needs to post into this rank's inbox (None: no inbox)."""
        return self.inbox.describe() if self.inbox is not None else None

    def unlink(self) -> None:
        """Remove the inbox's names (once every peer has opened them)."""
        if self.inbox is not None:
            self.inbox.unlink()

    @property
    def rejected_handshakes(self) -> int:
        return self.domain.rejected_handshakes

    def _on_router_event(self, event: int, value: int) -> None:
        """A connection failed its handshake before authentication (no or other credentials)."""
        self.domain.refused(None, HANDSHAKE_FAILED.get(event, "the handshake failed"))

    def dealer(self, endpoint: str, on_event: Callable[[int, int], None] | None = None
               ) -> tuple[zmq.Socket[Any], Monitor | None]:
        """A DEALER to ``endpoint`` with our identity and credentials (and a monitor, if asked)."""
        sock: zmq.Socket[Any] = _context().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.IDENTITY, RANK_ID.pack(self.rank))
        sock.setsockopt(zmq.MAXMSGSIZE, FRAME_LIMIT + WIRE_SLACK)  # a DEALER receives nothing by protocol
        if self.heartbeat > 0:
            ivl = max(1, int(self.heartbeat * 1000))
            sock.setsockopt(zmq.HEARTBEAT_IVL, ivl)
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3 * ivl)
            sock.setsockopt(zmq.HEARTBEAT_TTL, min(3 * ivl, 6_553_500))
        self.creds.client(sock)
        monitor = Monitor(sock, DEALER_EVENTS, on_event) if on_event is not None else None  # before connect
        sock.connect(endpoint)
        return sock, monitor

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self.router.getsockopt(zmq.FD), self._on_readable)
        self._monitor.start(self._loop)
        for link in list(self.links.values()):
            link.watch(self._loop)
        if self.inbox is not None:
            self.inbox.start(self._loop, self._on_notify)
        self._on_readable()  # messages that arrived before the reader was installed

    def drain(self) -> None:
        """Handle whatever has arrived now (used before judging a peer lost)."""
        if self._loop is not None and not self.router.closed:
            self._on_readable()

    def _on_notify(self, sender: int, domain: int, signal: int, index: int, seq: int, value: int,
                   fingerprint: int) -> None:
        """A notify from the inbox (``_notify_ring``), as a ZeroMQ signal message would deliver it."""
        link = self.links.get((domain, sender))
        if link is None:
            if (0, sender) in self.links:  # for a sub-communicator closed here
                self.late += 1
            return
        try:
            if not 0 <= signal <= MAX_SIGNAL:
                raise Malformed(f"unknown signal {signal}")
            link.deliver(signal, index, seq, value, fingerprint)
        except Exception as exc:  # noqa: BLE001 - a bad record must not kill the reader
            self._reject(link, exc)

    def _on_readable(self) -> None:
        router, links, unpack = self.router, self.links, HEADER.unpack
        while not router.closed and router.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            link = None
            try:
                ident = router.recv(zmq.NOBLOCK)
                header = router.recv(zmq.NOBLOCK)  # a ROUTER message has at least identity and one frame
                peer = RANK_ID.unpack(ident)[0] if len(ident) == RANK_ID.size else -1
                if self.inbox is not None:  # what the peer put in its ring before this message comes first
                    self.inbox.drain_from(peer, self._on_notify)
                if len(header) == HEADER.size:
                    kind, a, index, nbytes, seq, offset, domain = unpack(header)
                    link = links.get((domain, peer))
                    if link is not None:
                        if kind == MSG_SIGNAL and a <= MAX_SIGNAL and not router.getsockopt(zmq.RCVMORE):
                            link.deliver(a, index, seq, offset, nbytes)  # the hot path
                            continue
                        link.on_message(kind, a, index, nbytes, seq, offset, router)  # reads exactly its frames
                        continue
                    if (0, peer) in links:  # a peer's message for a sub-communicator closed here
                        self.late += 1
                    else:
                        self._stranger(ident)
                else:
                    link = links.get((0, peer))
                    if link is None:
                        self._stranger(ident)
                    else:
                        raise Malformed(f"a header of {len(header)} bytes (expected {HEADER.size})")
            except zmq.Again:
                break
            except Exception as exc:  # noqa: BLE001 - a bad message must not kill the reader
                self._reject(link, exc)
            while not router.closed and router.getsockopt(zmq.RCVMORE):  # whatever is left of a dropped message
                router.recv(zmq.NOBLOCK, copy=False)

    def _stranger(self, ident: bytes) -> None:
        """A message from an identity that is not a peer of this communicator: dropped."""
        self.rejected += 1
        now = time.monotonic()
        last, since = self._stranger_log
        if now - last >= LOG_EVERY:
            security_log.warning("rank %d dropped a message from identity %s: not a peer of this communicator%s",
                                 self.rank, ident[:16].hex() or "(empty)",
                                 f" ({since} more since the last warning)" if since else "")
            self._stranger_log = (now, 0)
        else:
            self._stranger_log = (last, since + 1)

    def _reject(self, link: "ZmqLink | None", exc: BaseException) -> None:
        """A message from a peer broke the protocol (or its handling failed): the link fails."""
        self.rejected += 1
        if link is None:
            return
        link.rejected += 1
        error = exc if isinstance(exc, TransportError) else TransportError(f"{exc!r}")
        if link._error is None:
            security_log.warning("link %d->%d: rejected a message from rank %d: %s; the link is failed",
                                 link.peer, self.rank, link.peer, error)
            link.fail(TransportError(f"link {link.peer}->{self.rank}: rejected a message from rank {link.peer} "
                                     f"({error}); rank {link.peer} no longer follows the link protocol"))
            try:  # the communicator fails on every rank: waiting on other links would hang
                link.peer_broke_protocol(str(error))
            except Exception:
                log.exception("rank %d: the on_broken event failed for rank %d", self.rank, link.peer)

    def close(self) -> None:
        """Say goodbye on every link, then release the sockets (no loss is reported from now on)."""
        self.closing = True
        if self._loop is not None and not self.router.closed:
            try:
                self._loop.remove_reader(self.router.getsockopt(zmq.FD))
            except (ValueError, RuntimeError, zmq.ZMQError):
                pass
        self._monitor.stop()
        for link in list(self.links.values()):
            link.say_goodbye()
        for link in list(self.links.values()):
            link.close()
        self.links.clear()
        if not self.router.closed:
            self.router.close(0)
        AUTH.unregister(self.domain)
        if self.inbox is not None:
            self.inbox.close()
            self.inbox = None

    def stats(self) -> dict[str, int]:
        return {"rejected_messages": self.rejected, "rejected_handshakes": self.rejected_handshakes,
                "late_messages": self.late}


class ZmqLink(Link):
    """A link whose notifies travel as ZeroMQ messages on the peer's channel."""

    wire_peer: int  # the peer's rank on the connection (its DEALER identity)
    eager_limit = EAGER_BYTES
    domain: int  # 0: the connection's own communicator; else a sub-communicator's (see ``child``)

    def __init__(self, rank: int, peer: int, channel: Channel, endpoint: str,
                 on_progress: ProgressHook | None, *, parent: "ZmqLink | None" = None, domain: int = 0) -> None:
        wire_peer: int = parent.wire_peer if parent is not None else peer  # the peer's DEALER identity
        if (domain, wire_peer) in channel.links:
            raise DomainInUse(f"link {rank}->{peer}: domain {domain} is in use on rank {wire_peer}'s connection")
        super().__init__(rank, peer, on_progress)
        self.channel = channel
        self.endpoint = endpoint
        self.rejected = 0  # messages from this peer rejected as malformed
        self.up = parent is not None  # the handshake with the peer's endpoint succeeded
        self._failed_handshakes = 0  # handshakes with the peer's endpoint that failed before it did
        self.peer_closed = False  # the peer said goodbye: it closed its communicator
        self.lost_reason: str | None = None  # set when the peer is judged lost
        self.lost_at: float | None = None  # time.time() of that judgement
        self._closing = False
        self._grace: asyncio.TimerHandle | None = None
        self._p2p_sent: dict[tuple[int, int], asyncio.Future[None]] = {}
        self._said_goodbye = False
        # A sub-communicator's link shares the connection of the link it was opened from: its
        # messages carry its domain, and the connection's loss or goodbye reaches it too.
        self.domain = domain
        self.root: ZmqLink = parent.root if parent is not None else self
        self.children: list[ZmqLink] = []  # (root link only) the sub-communicators' links on this connection
        self.wire_peer = wire_peer
        if parent is None:
            self.sock, self._monitor = channel.dealer(endpoint, self._on_event)
        else:
            self.sock, self._monitor = self.root.sock, None
            self.root.children.append(self)
        channel.links[(domain, self.wire_peer)] = self
        if channel._loop is not None:
            self.watch(channel._loop)

    # -- liveness ---------------------------------------------------------------------------
    def watch(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start reading this link's socket events (the channel does it when it starts)."""
        if self._monitor is not None:
            self._monitor.start(loop)

    def _on_event(self, event: int, value: int) -> None:
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.up = True
        elif event == zmq.EVENT_DISCONNECTED:
            if self.up:
                self._suspect("its connection closed (the process exited or died, or stopped answering "
                              "heartbeats)")
        elif event in HANDSHAKE_FAILED and not self.up and self._error is None:
            self._failed_handshakes += 1
            if event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL and self._failed_handshakes < HANDSHAKE_ATTEMPTS:
                return  # perhaps the peer's handshake timer ran out (its loop was busy): libzmq reconnects
            self.fail(ConnectError(
                f"link {self.rank}->{self.peer}: rank {self.peer}'s endpoint {self.endpoint} refused the "
                f"connection: {HANDSHAKE_FAILED[event]}; every rank needs the same AHCOMM_JOB_SECRET "
                "and AHCOMM_ENCRYPT"))

    def _suspect(self, reason: str) -> None:
        if self._closing or self.peer_closed or self.lost_reason is not None or self.channel.closing:
            return
        self.channel.drain()  # its goodbye may be waiting already
        if self.peer_closed or self._closing or self._grace is not None:
            return
        self._grace = asyncio.get_running_loop().call_later(LOSS_GRACE, self._lose, reason)

    def _lose(self, reason: str) -> None:
        self._grace = None
        if self._closing or self.peer_closed or self.lost_reason is not None or self.channel.closing:
            return
        self.channel.drain()
        if self.peer_closed or self._closing:
            return
        log.warning("rank %d lost rank %d: %s", self.rank, self.peer, reason)
        self._stop_watching()
        for link in (self, *self.children):
            link._lost(reason)

    def _lost(self, reason: str) -> None:
        if self.lost_reason is not None or self._closing:
            return
        self.lost_reason, self.lost_at = reason, time.time()
        try:
            self.peer_lost(reason)
        except Exception:
            log.exception("rank %d: the on_lost event failed for rank %d", self.rank, self.peer)
        self.fail(PeerFailure(f"rank {self.peer} is lost: {reason} (noticed by rank {self.rank})", rank=self.peer))

    def _peer_said_goodbye(self) -> None:
        """The peer closed this link's communicator (the root link: its whole endpoint, so every
        sub-communicator on the connection too)."""
        if self.root is not self:
            self._goodbye()
            return
        if self._grace is not None:
            self._grace.cancel()
            self._grace = None
        self._stop_watching()
        for link in (self, *self.children):
            link._goodbye()

    def _goodbye(self) -> None:
        self.peer_closed = True
        if self._error is None:  # everything it sent came before the goodbye: no waiter can be served now
            self.fail(PeerFailure(f"rank {self.peer} closed its communicator", rank=self.peer))

    def _stop_watching(self) -> None:
        if self.root is not self:
            return
        if self._monitor is not None:
            self._monitor.stop()
        if not self.sock.closed:
            try:
                self.sock.disconnect(self.endpoint)  # no reconnection attempts to a closed endpoint
            except zmq.ZMQError:
                pass

    # -- sending ----------------------------------------------------------------------------
    def _send(self, kind: int, a: int, index: int, seq: int, nbytes: int = 0, offset: int = 0,
              data: Any = None) -> None:
        header = HEADER.pack(kind, a, index, nbytes, seq, offset, self.domain)
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

    def send_eager(self, seq: int, fingerprint: int, data: np.ndarray | None) -> None:
        """One message: the header (the fingerprint as its offset) and, if any, the bytes, copied."""
        if self._error is not None:
            raise self._error
        nbytes = 0 if data is None else data.nbytes
        self._check_size("an eager message", nbytes, EAGER_BYTES)
        header = HEADER.pack(MSG_EAGER, 0, 0, nbytes, seq, fingerprint, self.domain)
        try:
            if data is None or not nbytes:
                self.sock.send(header, zmq.NOBLOCK)
            else:
                self.sock.send(header, zmq.NOBLOCK | zmq.SNDMORE)
                self.sock.send(as_bytes(data).data, zmq.NOBLOCK, copy=True)
        except zmq.ZMQError as exc:
            raise TransportError(f"link {self.rank}->{self.peer}: send failed: {exc}") from exc
        self.bytes_sent += nbytes

    def send_control(self, payload: bytes) -> None:
        self._check_size("a control message", len(payload), MAX_CONTROL)
        self._send(MSG_CONTROL, 0, 0, 0, len(payload), 0, payload)

    def send_progress(self, seq: int) -> None:
        if self._error is None:
            self._send(MSG_PROGRESS, 0, 0, seq)

    def send_message(self, key: tuple[int, int], meta: bytes, data: Any) -> "asyncio.Future[None]":
        """Header, metadata and payload (in frames of at most FRAME_LIMIT, zero-copy when big);
        done when the peer acknowledged."""
        if self._error is not None:
            raise self._error
        tag, counter = key
        payload = memoryview(data).cast("B")
        limit = self.channel.max_message
        if payload.nbytes > limit:
            raise TransportError(f"link {self.rank}->{self.peer}: a message of {payload.nbytes} bytes is over the "
                                 f"limit of {limit} bytes (AHCOMM_MAX_MESSAGE)")
        if len(meta) > MAX_META:
            raise TransportError(f"link {self.rank}->{self.peer}: message metadata of {len(meta)} bytes "
                                 f"(at most {MAX_META})")
        header = HEADER.pack(MSG_P2P, 0, tag, payload.nbytes, counter, 0, self.domain)
        pieces = [payload[i:i + FRAME_LIMIT] for i in range(0, max(payload.nbytes, 1), FRAME_LIMIT)]
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._p2p_sent[key] = done
        try:
            self.sock.send_multipart([header, meta, *pieces], zmq.NOBLOCK, copy=payload.nbytes < COPY_THRESHOLD)
        except zmq.ZMQError as exc:
            del self._p2p_sent[key]
            raise TransportError(f"link {self.rank}->{self.peer}: send failed: {exc}") from exc
        self.bytes_sent += payload.nbytes
        return done

    def send_abort(self, reason: str) -> None:
        data = reason.encode()[:MAX_REASON]
        try:
            self._send(MSG_ABORT, 0, 0, 0, len(data), 0, data)
        except Exception:  # noqa: BLE001 - best effort on the way down
            pass

    def say_goodbye(self) -> None:
        """Tell the peer this rank closes its communicator (after everything sent so far)."""
        if self.lost_reason is None and not self.sock.closed and not self._said_goodbye:
            self._said_goodbye = True
            try:
                self.sock.send(HEADER.pack(MSG_BYE, 0, 0, 0, 0, 0, self.domain), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass

    # -- receiving --------------------------------------------------------------------------
    def on_message(self, kind: int, a: int, index: int, nbytes: int, seq: int, offset: int,
                   sock: zmq.Socket[Any]) -> None:
        """Handle one message whose header was read: read exactly its frames, or raise Malformed
        before acting on it."""
        if kind == MSG_EAGER:
            self._on_eager(seq, nbytes, offset, sock)
        elif kind == MSG_SIGNAL:
            if a > MAX_SIGNAL:
                raise Malformed(f"unknown signal {a}")
            last(sock, "a signal")
            self.deliver(a, index, seq, offset, nbytes)
        elif kind == MSG_PROGRESS:
            last(sock, "a progress message")
            self.progress(seq)
        elif kind == MSG_ABORT:
            reason = frame(sock, MAX_REASON, "an abort's reason")
            last(sock, "an abort")
            self.peer_aborted(bytes(reason.bytes).decode(errors="replace"))
        elif kind == MSG_CONTROL:
            if nbytes > MAX_CONTROL:
                raise Malformed(f"a control message of {nbytes} bytes (at most {MAX_CONTROL})")
            payload = frame(sock, MAX_CONTROL, "a control message's payload")
            if len(payload) != nbytes:
                raise Malformed(f"a control message of {len(payload)} bytes, header said {nbytes}")
            last(sock, "a control message")
            self.control(payload.bytes)
        elif kind == MSG_P2P:
            self._on_p2p(index, seq, nbytes, sock)
        elif kind == MSG_P2P_ACK:
            last(sock, "a message acknowledgement")
            done = self._p2p_sent.pop((index, seq), None)
            if done is not None and not done.done():
                done.set_result(None)
        elif kind == MSG_BYE:
            last(sock, "a goodbye")
            self._peer_said_goodbye()
        else:
            self.on_data_message(kind, a, index, nbytes, seq, offset, sock)

    def _on_eager(self, seq: int, nbytes: int, fingerprint: int, sock: zmq.Socket[Any]) -> None:
        if nbytes > EAGER_BYTES or fingerprint > 0xFFFFFFFF:
            raise Malformed(f"an eager message of {nbytes} bytes (at most {EAGER_BYTES}), fingerprint {fingerprint:#x}")
        if nbytes:
            if not sock.getsockopt(zmq.RCVMORE):
                raise Malformed("an eager message's bytes are missing")
            data: Any = sock.recv(zmq.NOBLOCK)
            if len(data) != nbytes:
                raise Malformed(f"an eager message of {len(data)} bytes, header said {nbytes}")
        else:
            data = b""
        last(sock, "an eager message")
        try:
            self.deliver_eager(seq, fingerprint, data)
        except TransportError as exc:
            raise Malformed(str(exc)) from None

    def _on_p2p(self, tag: int, counter: int, nbytes: int, sock: zmq.Socket[Any]) -> None:
        limit = self.channel.max_message
        if nbytes > limit:
            raise Malformed(f"a message of {nbytes} bytes (at most {limit}, AHCOMM_MAX_MESSAGE)")
        meta = frame(sock, MAX_META, "a message's metadata")
        pieces: list[zmq.Frame] = []
        total, most = 0, nbytes // FRAME_LIMIT + 1
        while sock.getsockopt(zmq.RCVMORE):
            if len(pieces) == most:
                raise Malformed(f"a message of {nbytes} bytes in more than {most} frames")
            piece = frame(sock, FRAME_LIMIT, "a piece of a message")
            total += len(piece)
            pieces.append(piece)
        if not pieces or total != nbytes:
            raise Malformed(f"a message of {total} bytes in {len(pieces)} frames, header said {nbytes}")
        if len(pieces) == 1:
            data: Any = pieces[0].buffer
        else:
            data = np.empty(total, np.uint8)
            start = 0
            for piece in pieces:
                data[start:start + len(piece)] = np.frombuffer(piece.buffer, np.uint8)
                start += len(piece)
        self._send(MSG_P2P_ACK, 0, tag, counter)
        self.deliver_message((tag, counter), meta.bytes, data)

    @abstractmethod
    def on_data_message(self, kind: int, a: int, index: int, nbytes: int, seq: int, offset: int,
                        sock: zmq.Socket[Any]) -> None:
        """Messages specific to the transport (puts, data acks); raise Malformed for others."""

    # -- lifecycle --------------------------------------------------------------------------
    def fail(self, error: BaseException) -> None:
        super().fail(error)
        for fut in self._p2p_sent.values():
            if not fut.done():
                fut.set_exception(error)
        self._p2p_sent.clear()

    def close(self) -> None:
        self._closing = True
        if self.root is not self:  # a sub-communicator's link: the connection stays with its root
            self.say_goodbye()
            if self.channel.links.get((self.domain, self.wire_peer)) is self:
                del self.channel.links[(self.domain, self.wire_peer)]
            if self in self.root.children:
                self.root.children.remove(self)
            return
        if self._grace is not None:
            self._grace.cancel()
            self._grace = None
        if self._monitor is not None:
            self._monitor.stop()
        if not self.sock.closed:
            gone = self.lost_reason is not None or self.peer_closed
            self.sock.close(0 if gone else BYE_LINGER_MS)  # queued messages (the goodbye) may still leave

    def stats(self) -> dict[str, Any]:
        out = super().stats()
        state = ("lost" if self.lost_reason is not None else "closed by peer" if self.peer_closed
                 else "up" if self.up else "connecting")
        out.update(state=state, domain=self.domain, rejected_messages=self.rejected)
        return out

    def receiver(self) -> Channel:
        return self.channel

"""Job-secret authentication of every ZeroMQ connection (ZAP), and ahcomm's ZeroMQ context.

A job shares one secret (``AHCOMM_JOB_SECRET``; ``ahcomm-run`` makes one per job). Every
socket that accepts connections (rank 0's rendezvous ROUTER, each rank's link ROUTER) is
a ZeroMQ security *server*, every connecting socket a *client*:

* PLAIN (default): the password is HMAC-SHA256(secret, "ahcomm/plain-password/v1"),
  so the secret itself never crosses the wire. PLAIN does not encrypt: it keeps out every
  peer that does not hold the secret, not an eavesdropper on the network path.
* CURVE (``AHCOMM_ENCRYPT=1``): the 32 bytes HMAC-SHA256(secret, "ahcomm/curve-key/v1")
  are a Curve25519 secret key; every rank derives the same key pair, is a server with it,
  and connects as a client that presents it. Traffic is encrypted and authenticated.

Servers hand every handshake to a ZAP handler (RFC 27) on ``inproc://zeromq.zap.01``,
driven by the event loop (a reader on the REP socket's descriptor; no thread). It accepts
only the job's PLAIN password or CURVE public key, for the ZAP domain its socket
registered. A refusal happens inside the ZMTP handshake, before any message of the peer
is decoded; it is logged (``ahcomm.security``, a warning naming the peer's address) and
counted on the ``Domain`` of the socket. Peers with the wrong mechanism (no credentials
at all) are refused by libzmq before ZAP is asked; socket monitors count those.

ahcomm keeps its own ZeroMQ context (not ``zmq.Context.instance()``), so its ZAP endpoint
cannot collide with an application's own use of ZeroMQ.
"""

from __future__ import annotations

import asyncio
import atexit
import hashlib
import hmac
import logging
import os
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio
import zmq.utils.z85

from .._errors import ConfigError

log = logging.getLogger("ahcomm.security")

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
PLAIN_USER = b"ahcomm"
_PLAIN_INFO = b"ahcomm/plain-password/v1"
_CURVE_INFO = b"ahcomm/curve-key/v1"
MIN_SECRET = 16  # characters of AHCOMM_JOB_SECRET
SHUTDOWN_LINGER_MS = 500  # at exit: how long queued messages (a last signal, a goodbye) may still flush
LOG_EVERY = 10.0  # seconds between two warnings about the same peer address

_ctx: zmq.Context[Any] | None = None
_actx: zmq.asyncio.Context | None = None
_ctx_pid = 0


def context() -> "zmq.Context[Any]":
    """ahcomm's private ZeroMQ context (one per process; a forked child makes its own)."""
    global _ctx, _actx, _ctx_pid
    if _ctx is None or _ctx.closed or _ctx_pid != os.getpid():
        _ctx, _actx, _ctx_pid = zmq.Context(), None, os.getpid()
        atexit.register(_shutdown, _ctx, _ctx_pid)
    return _ctx


def async_context() -> zmq.asyncio.Context:
    """The same libzmq context for asyncio sockets (the rendezvous): one ZAP handler serves both."""
    global _actx
    ctx = context()
    if _actx is None:
        _actx = zmq.asyncio.Context.shadow(ctx.underlying)
    return _actx


def _shutdown(ctx: "zmq.Context[Any]", pid: int) -> None:
    """At interpreter exit: give queued messages a bounded chance to leave, then end the context."""
    if pid == os.getpid() and not ctx.closed:
        try:
            ctx.destroy(linger=SHUTDOWN_LINGER_MS)
        except Exception:  # noqa: BLE001 - exiting anyway
            pass


# -- credentials ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Credentials:
    """What a socket presents (client) and accepts (server), derived from the job secret."""

    mechanism: str  # "null" (no secret: AHCOMM_INSECURE=1), "plain" or "curve"
    password: bytes = field(default=b"", repr=False)  # PLAIN
    public_key: bytes = b""  # CURVE, Z85 (40 bytes)
    secret_key: bytes = field(default=b"", repr=False)  # CURVE, Z85

    @classmethod
    def derive(cls, secret: str | None, encrypt: bool = False) -> "Credentials":
        if not secret:
            return cls("null")
        key = secret.encode()
        if encrypt:
            if not zmq.has("curve"):
                raise ConfigError("AHCOMM_ENCRYPT=1 needs a libzmq built with CURVE (the pyzmq wheels have it)")
            seed = hmac.new(key, _CURVE_INFO, hashlib.sha256).digest()  # 32 bytes: a Curve25519 secret key
            secret_key = zmq.utils.z85.encode(seed)
            return cls("curve", public_key=zmq.curve_public(secret_key), secret_key=secret_key)
        return cls("plain", password=hmac.new(key, _PLAIN_INFO, hashlib.sha256).hexdigest().encode())

    @property
    def secure(self) -> bool:
        return self.mechanism != "null"

    def client(self, sock: "zmq.Socket[Any]") -> None:
        """Make ``sock`` present these credentials when it connects."""
        if self.mechanism == "plain":
            sock.setsockopt(zmq.PLAIN_USERNAME, PLAIN_USER)
            sock.setsockopt(zmq.PLAIN_PASSWORD, self.password)
        elif self.mechanism == "curve":
            sock.setsockopt(zmq.CURVE_SERVERKEY, self.public_key)
            sock.setsockopt(zmq.CURVE_PUBLICKEY, self.public_key)
            sock.setsockopt(zmq.CURVE_SECRETKEY, self.secret_key)

    def server(self, sock: "zmq.Socket[Any]", domain: "Domain") -> None:
        """Make ``sock`` accept only peers with these credentials (checked by ``domain``)."""
        if self.mechanism == "null":
            return
        if self.mechanism == "plain":
            sock.setsockopt(zmq.PLAIN_SERVER, 1)
        else:
            sock.setsockopt(zmq.CURVE_SERVER, 1)
            sock.setsockopt(zmq.CURVE_SECRETKEY, self.secret_key)
        sock.setsockopt(zmq.ZAP_DOMAIN, domain.name.encode())

    def accepts(self, mechanism: bytes, creds: list[bytes]) -> bool:
        if self.mechanism == "plain":
            return (mechanism == b"PLAIN" and len(creds) == 2 and hmac.compare_digest(creds[0], PLAIN_USER)
                    and hmac.compare_digest(creds[1], self.password))
        if self.mechanism == "curve":
            return (mechanism == b"CURVE" and len(creds) == 1
                    and hmac.compare_digest(creds[0], zmq.utils.z85.decode(self.public_key)))
        return mechanism == b"NULL"


# -- refusals: counted and logged (throttled per address) -------------------------------------


class Domain:
    """One server socket's ZAP domain: its credentials and its count of refused handshakes."""

    def __init__(self, what: str, creds: Credentials) -> None:
        self.name = f"ahcomm-{secrets.token_hex(8)}"
        self.what = what  # e.g. "rank 1's link endpoint", for the log
        self.creds = creds
        self.rejected_handshakes = 0
        self._last_log: dict[str, tuple[float, int]] = {}  # address -> (time of last warning, refusals since)

    def refused(self, address: str | None, why: str) -> None:
        """Count a refused handshake; warn (at most every LOG_EVERY seconds per address).

        ``address`` is the peer's (ZAP tells it; "" for a local ipc peer), None when libzmq
        refused the connection before asking ZAP (no credentials, another mechanism)."""
        self.rejected_handshakes += 1
        address = "an unknown address" if address is None else address or "a local process"
        now = time.monotonic()
        last, since = self._last_log.get(address, (-LOG_EVERY, 0))
        if now - last >= LOG_EVERY:
            more = f" ({since} more since the last warning)" if since else ""
            log.warning("refused a connection to %s from %s: %s%s", self.what, address, why, more)
            if len(self._last_log) > 1024:  # a bounded table, even under a flood of addresses
                self._last_log.clear()
            self._last_log[address] = (now, 0)
        else:
            self._last_log[address] = (last, since + 1)


# -- the ZAP handler ----------------------------------------------------------------------------


class Authenticator:
    """The process's ZAP handler: a REP socket read by the event loop of the latest registration."""

    def __init__(self) -> None:
        self.domains: dict[bytes, Domain] = {}
        self._sock: zmq.Socket[Any] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.requests = 0

    def register(self, what: str, creds: Credentials) -> Domain:
        """A domain for one server socket; the handler runs on the caller's event loop."""
        domain = Domain(what, creds)
        if creds.secure:
            self.domains[domain.name.encode()] = domain
            self._attach(asyncio.get_running_loop())
        return domain

    def unregister(self, domain: Domain) -> None:
        """Forget ``domain``; with none left, the loop stops watching (the endpoint stays bound:
        libzmq releases an inproc name asynchronously, so closing it would race a new bind)."""
        if self.domains.pop(domain.name.encode(), None) is not None and not self.domains:
            self._detach()

    def _attach(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._sock is None or self._sock.closed or self._sock.context is not context():
            sock = context().socket(zmq.REP)
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind(ZAP_ENDPOINT)
            self._sock, self._loop = sock, None
        if self._loop is not loop:
            self._detach()
            loop.add_reader(fd(self._sock), self._on_readable)
            self._loop = loop
            self._on_readable()  # requests queued before the reader was installed

    def _detach(self) -> None:
        if self._loop is not None and self._sock is not None and not self._sock.closed:
            try:
                self._loop.remove_reader(fd(self._sock))
            except Exception:  # noqa: BLE001 - the old loop may be closed already
                pass
        self._loop = None

    def _on_readable(self) -> None:
        sock = self._sock
        while sock is not None and readable(sock):
            try:
                request = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            sock.send_multipart(self._answer(request))

    def _answer(self, request: list[bytes]) -> list[bytes]:
        """RFC 27: version, request id, domain, address, identity, mechanism, credentials..."""
        self.requests += 1
        if len(request) < 6 or request[0] != b"1.0":
            return [b"1.0", request[1] if len(request) > 1 else b"", b"500", b"malformed ZAP request", b"", b""]
        request_id, name, address, mechanism, creds = request[1], request[2], request[3], request[5], request[6:]
        domain = self.domains.get(name)
        if domain is None:
            return [b"1.0", request_id, b"400", b"unknown domain", b"", b""]
        if domain.creds.accepts(mechanism, creds):
            return [b"1.0", request_id, b"200", b"OK", b"ahcomm", b""]
        why = ("its key is not this job's key (a different AHCOMM_JOB_SECRET)" if mechanism == b"CURVE" else
               "its password is not derived from this job's AHCOMM_JOB_SECRET" if mechanism == b"PLAIN" else
               f"mechanism {mechanism.decode(errors='replace')[:16]} is not allowed")
        domain.refused(address.decode(errors="replace")[:64], why)
        return [b"1.0", request_id, b"400", b"not a member of this job", b"", b""]


AUTH = Authenticator()


HANDSHAKE_FAILED: dict[int, str] = {
    int(zmq.EVENT_HANDSHAKE_FAILED_AUTH): "the peer refused our credentials",
    int(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL): "the security handshake failed (different mechanism or not ZMTP)",
    int(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL): "the handshake failed",
}


def fd(sock: "zmq.Socket[Any]") -> int:
    """The descriptor an event loop watches for ``sock`` (edge-triggered: drain while EVENTS says POLLIN)."""
    return int(sock.getsockopt(zmq.FD))


def readable(sock: "zmq.Socket[Any]") -> bool:
    return not sock.closed and bool(int(sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN)

"""The transport contract: what an algorithm may do with a link to a peer.

A ``Link`` joins this rank to one peer. It carries HCCL's link notifies (Ack, DataSignal
and, on RDMA-like links, DataAck) and gives access to the peer's CCL buffers:

* ``post(signal, index, seq)`` sets the peer's flag for this link; ``wait(...)`` waits for
  the flag the peer set on us (then resets it). Flags are keyed by (signal, index, seq
  parity) so that a fast peer's next collective cannot collide with this one.
* ``put(src, buf, offset, seq, run)`` writes bytes into the peer's CCL_In/CCL_Out. When
  the peer is later told DATA for the same ``seq``, the bytes have landed.
* ``remote(buf)`` is the peer's buffer mapped here (``mapped`` links only): algorithms
  such as mesh read and reduce straight out of it.
* ``read(dst, addr, run)`` copies from the peer's own memory at ``addr`` (``single_copy``
  links only): a peer posts the address of its user buffer with a signal's ``value``, and
  the reader fetches the bytes in one copy, with no staging through CCL buffers.
* ``view(addr, nbytes)`` is the peer's memory at ``addr`` mapped here, where the peer made it
  with ``ahcomm.alloc`` (else None): an algorithm reduces straight out of it, and ``read``
  copies from it instead of going through the kernel.
* ``pipe()`` (``single_copy`` links only) copies with the peer's own memory by address, both
  ways, piece after piece (``Pipe``: how an algorithm writes into a peer's memory);
  ``read_word(addr)`` reads one int64 of the peer's (a flag), ``words(addr, count)`` maps such
  flags where they are the words after the peer's CCL_Out (``Region.words``).
* ``send_message(key, meta, data)`` / ``message(key)`` carry point-to-point messages
  (send/recv), outside the collectives' buffers: a message is matched by its key
  (user tag, per-pair sequence number), whether it arrives before or after it is asked for.
  Negative sequence numbers are the communicator's own (``Comm.resume``'s exchange).
* ``send_eager(seq, fingerprint, data)`` / ``eager(seq)`` carry one small message per call
  and peer (at most ``eager_limit`` bytes, ``EAGER_BYTES`` on the links that have them), matched
  by the collective's sequence number, with no acknowledgement: the bytes are copied on the
  way, so the sender may reuse them at once, and one that arrives before it is asked for waits
  in the link (at most ``EAGER_AHEAD`` of them: a peer is never more than a call ahead).

The contract has three faces (Gloo's ``transport::Pair`` is the model of the first):

* ``DataLink``: the data plane above - notify/wait/post/value, put/remote/read/flush and
  what the link can do (``mapped``, ``single_copy``). Algorithms see only this.
* ``Connection``: the connection itself - control messages, progress and abort notices,
  point-to-point messages, child links for sub-communicators, stats, failure and close.
  The communicator and the executor use it.
* ``LinkEvents``: what a link tells the communicator (a peer aborted, lost, broke the
  protocol; a fingerprint or a control message arrived), one object given with ``attach``.

``Link`` is the base class of the concrete transports (``inproc``, ``sdma``, ``rdma``): it
implements both faces (a new transport writes ``post``, ``put``, ``send_control``,
``send_progress``, ``send_abort`` and ``send_message``; the rest has defaults).
"""

from __future__ import annotations

import asyncio
import enum
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import numpy as np

from .._buffers import CclBuffers
from .._errors import TransportError
from .._memcopy import copy
from .._notify import Notify


class DomainInUse(TransportError):
    """``Link.child``: the connection already carries a sub-communicator with that domain."""


class Signal(enum.IntEnum):
    """The link notifies of HCCL: Ack (ready/credit), DataSignal (data landed), DataAck."""

    ACK = 0
    DATA = 1
    DATA_ACK = 2


class MemoryRunner(Protocol):
    """Runs a numpy memory op, inline or on a copy engine (``Stream.memory``)."""

    def __call__(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> "Awaitable[Any] | None": ...


class Pipe(Protocol):
    """Copies with a peer's memory by address, piece after piece, from one thread (a push loop):
    ``DataLink.read``/``write`` without their per-call work (arrays, views, bounce checks made
    anew), and counted in the link's stats as theirs are."""

    def read(self, local: int, remote: int, nbytes: int) -> None: ...  # peer's ``remote`` -> ``local`` here
    def write(self, local: int, remote: int, nbytes: int) -> None: ...  # ``local`` here -> peer's ``remote``


ProgressHook = Callable[[int, int], None]  # (peer, seq of the peer's latest message)


class LinkEvents(Protocol):
    """What links tell the communicator above them (``Link.attach``). Each is called with the
    peer's rank; ``on_lost`` may come from a transport's thread, the others on the event loop."""

    def on_abort(self, peer: int, reason: str) -> None:
        """The peer aborted its communicator."""
    def on_fingerprint(self, peer: int, seq: int, fp: int) -> None:
        """A signal of the peer's call ``seq`` carried that call's fingerprint (the hot path)."""
    def on_control(self, peer: int, payload: bytes) -> None:
        """The peer sent a control message."""
    def on_lost(self, peer: int, reason: str) -> None:
        """The peer is gone (its socket closed, its heartbeats stopped)."""
    def on_broken(self, peer: int, reason: str) -> None:
        """The peer sent a message this link cannot accept: it no longer follows the protocol."""
MAX_CONTROL = 64 * 1024  # bytes of one control message
EAGER_BYTES = 64 * 1024  # the largest eager message a link sends or accepts (``Link.send_eager``)
EAGER_AHEAD = 4  # eager messages a link keeps for calls not asked for yet; more breaks the protocol
MAX_DOMAIN = 0xFFFF  # the largest domain number of a sub-communicator's links (``Link.child``)
MessageKey = tuple[int, int]  # (user tag, per-pair sequence number) of a point-to-point message
Message = tuple[bytes, Any]  # (metadata, bytes-like payload)

BUFFER_IDS = {"in": 0, "out": 1}
BUFFER_NAMES = ("in", "out")


class Endpoint(Protocol):
    """What receives this rank's messages on a transport (one for all of a rank's links)."""

    def stats(self) -> dict[str, int]:
        """Counters of the whole endpoint (e.g. refused connections), not of any one link."""
        ...


class SpinPolicy(Protocol):
    """How long a mailbox waiter may poll before it sleeps (``transports.mailbox.Spin``), and
    whether it gives its core away between looks (``yields``)."""

    yields: bool

    def allowed(self) -> float: ...
    def result(self, found: bool) -> None: ...


class Mailboxes(Protocol):
    """The host's small-message mailboxes as algorithms see them (``transports.mailbox.Mailbox``
    implements it): publish into this rank's slot, look at and read the peers' slots, and
    sleep until a publisher wakes this rank (``on_wake``)."""

    capacity: int
    rechecks: int
    loose: tuple[int, int, int] | None  # (tick, seq, fingerprint): a publication not yet seen from every peer

    @property
    def spin(self) -> SpinPolicy: ...
    on_wake: Callable[[], None] | None

    def publish(self, seq: int, fingerprint: int, data: np.ndarray | None = None,
                skip: tuple[int, int] | None = None) -> tuple[int, np.ndarray]:
        """``data`` into this rank's next slot, less the [start, stop) range ``skip`` of its first
        axis, which no peer reads; returns (the publication's tick, the slot's payload)."""
    def arrived(self, owner: int, tick: int) -> tuple[int, int] | None: ...
    def payload(self, owner: int, tick: int) -> np.ndarray: ...
    def sleep(self) -> None: ...
    def awake(self) -> None: ...


class DataLink(Protocol):
    """The data plane of a link to ``peer``: all an algorithm may use (``algorithms.base.Context``)."""

    @property
    def peer(self) -> int: ...
    @property
    def mapped(self) -> bool: ...  # remote() works
    @property
    def single_copy(self) -> bool: ...  # read() works

    def notify(self, signal: int, index: int, seq: int) -> Notify: ...
    async def wait(self, signal: int, index: int, seq: int) -> None: ...
    def post(self, signal: int, index: int, seq: int, value: int = 0, fingerprint: int = 0) -> None: ...
    def value(self, signal: int, index: int, seq: int) -> int: ...
    def put(self, src: np.ndarray, buf: str, offset: int, seq: int, run: MemoryRunner) -> Awaitable[Any] | None: ...
    def remote(self, buf: str) -> np.ndarray: ...
    def read(self, dst: np.ndarray, addr: int, run: MemoryRunner) -> Awaitable[Any] | None: ...
    def read_word(self, addr: int) -> int: ...
    def words(self, addr: int, count: int) -> np.ndarray | None: ...
    def pipe(self) -> Pipe | None: ...
    def view(self, addr: int, nbytes: int) -> np.ndarray | None: ...
    async def flush(self) -> None: ...
    def check_fingerprint(self, seq: int, fingerprint: int) -> None: ...
    @property
    def eager_limit(self) -> int: ...  # bytes of one eager message (0: send_eager does not work)
    def send_eager(self, seq: int, fingerprint: int, data: np.ndarray | None) -> None: ...
    def eager(self, seq: int) -> asyncio.Future[Any]: ...


class Connection(Protocol):
    """The connection-level face of a link: what the communicator and the executor use."""

    @property
    def peer(self) -> int: ...
    @property
    def mapped(self) -> bool: ...

    def attach(self, events: LinkEvents | None) -> None: ...
    def send_control(self, payload: bytes) -> None: ...
    def send_progress(self, seq: int) -> None: ...
    def send_abort(self, reason: str) -> None: ...
    def send_message(self, key: MessageKey, meta: bytes, data: np.ndarray) -> Awaitable[None] | None: ...
    def message(self, key: MessageKey) -> asyncio.Future[Message]: ...
    def describe_buffers(self, buffers: CclBuffers) -> dict[str, Any]: ...
    def child(self, domain: int, rank: int, peer: int, buffers: CclBuffers, peer_buffers: dict[str, Any],
              on_progress: ProgressHook | None) -> Link: ...
    def unmap_peer_buffers(self) -> int: ...
    def map_peer_buffers(self, peer_buffers: dict[str, Any]) -> None: ...
    def stop_shared_notifies(self) -> None: ...
    def release_shared_notifies(self) -> int: ...
    def renew_shared_notifies(self) -> None: ...
    def settle_shared_notifies(self) -> None: ...
    def receiver(self) -> Endpoint | None: ...
    def stats(self) -> dict[str, Any]: ...
    def fail(self, error: BaseException) -> None: ...
    def close(self) -> None: ...


class Link(ABC):
    """One direction-agnostic connection between this rank and ``peer`` (both ``DataLink`` and
    ``Connection``; the communicator's ``LinkEvents`` are attached with ``attach``)."""

    kind: ClassVar[str] = "abstract"
    mapped: ClassVar[bool] = False
    single_copy: bool = False  # read() works on this link (set once probed)
    eager_limit: ClassVar[int] = 0  # bytes of one eager message (0: the transport has none)

    def __init__(self, rank: int, peer: int, on_progress: ProgressHook | None = None) -> None:
        self.rank = rank
        self.peer = peer
        self._notifies: dict[tuple[int, int, int], Notify] = {}
        self._values: dict[tuple[int, int, int], int] = {}
        self._on_progress = on_progress
        self._error: BaseException | None = None
        self.events: LinkEvents | None = None  # the communicator's (``attach``)
        self.bytes_sent: int = 0
        self.bytes_received = 0
        self.signals_sent = 0
        self._mail: dict[MessageKey, asyncio.Future[Message]] = {}
        self._eager: dict[int, asyncio.Future[Any]] = {}  # seq -> its eager message (asked for or arrived)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.rank}->{self.peer}>"

    def attach(self, events: LinkEvents | None) -> None:
        """Tell ``events`` what happens on this link from now on (None: nobody)."""
        self.events = events

    # -- notifies -------------------------------------------------------------------------
    def notify(self, signal: int, index: int, seq: int) -> Notify:
        key = (int(signal), index, seq & 1)
        flag = self._notifies.get(key)
        if flag is None:
            flag = Notify(f"{Signal(signal).name}[{index}] {self.peer}->{self.rank}")
            if self._error is not None:
                flag.fail(self._error)
            self._notifies[key] = flag
        return flag

    def deliver(self, signal: int, index: int, seq: int, value: int = 0, fingerprint: int = 0) -> None:
        """Called by the transport when the peer posted ``signal`` (carrying ``value``) on us.

        ``fingerprint`` (nonzero) summarises the peer's call ``seq``; the communicator's
        ``on_fingerprint`` compares it with its own before the flag is set.
        """
        events = self.events
        if fingerprint and events is not None:
            events.on_fingerprint(self.peer, seq, fingerprint)
        self._values[(int(signal), index, seq & 1)] = value
        self.notify(signal, index, seq).post()
        self.progress(seq)

    def check_fingerprint(self, seq: int, fingerprint: int) -> None:
        """The fingerprint of the peer's call ``seq`` arrived another way (a mailbox): have
        the communicator check it, as if a signal of this link had carried it."""
        events = self.events
        if events is not None:
            events.on_fingerprint(self.peer, seq, fingerprint)

    def value(self, signal: int, index: int, seq: int) -> int:
        """The value carried by the last post of (signal, index) for ``seq``'s parity."""
        return self._values.get((int(signal), index, seq & 1), 0)

    def progress(self, seq: int) -> None:
        if self._on_progress is not None:
            self._on_progress(self.peer, seq)

    async def wait(self, signal: int, index: int, seq: int) -> None:
        await self.notify(signal, index, seq).wait()

    @abstractmethod
    def post(self, signal: int, index: int, seq: int, value: int = 0, fingerprint: int = 0) -> None:
        """Set the peer's flag for this link; ``value`` (e.g. a buffer address) and the
        32-bit ``fingerprint`` of this rank's call travel with it."""

    @abstractmethod
    def send_control(self, payload: bytes) -> None:
        """Send a small control message (at most ``MAX_CONTROL`` bytes) to the peer's
        ``LinkEvents.on_control``: status queries, call descriptions, heartbeats of the layers above."""

    def _check_size(self, what: str, nbytes: int, limit: int) -> None:
        """``TransportError`` for an outgoing ``what`` of more than ``limit`` bytes (every transport
        refuses alike)."""
        if nbytes > limit:
            raise TransportError(f"link {self.rank}->{self.peer}: {what} of {nbytes} bytes (at most {limit})")

    def control(self, payload: bytes) -> None:
        """Called by the transport when the peer sent a control message."""
        if self.events is not None:
            self.events.on_control(self.peer, payload)

    @abstractmethod
    def send_progress(self, seq: int) -> None:
        """Tell the peer that this rank has reached collective ``seq`` (no flag is set)."""

    @abstractmethod
    def send_abort(self, reason: str) -> None:
        """Tell the peer that this rank aborted its communicator."""

    def peer_aborted(self, reason: str) -> None:
        """Called by the transport when the peer aborted."""
        if self.events is not None:
            self.events.on_abort(self.peer, reason)

    def peer_lost(self, reason: str) -> None:
        """Called by the transport when the peer is gone (its socket closed, heartbeats stopped)."""
        if self.events is not None:
            self.events.on_lost(self.peer, reason)

    def peer_broke_protocol(self, reason: str) -> None:
        """Called by the transport when the peer sent a message it cannot accept (``reason``
        says what was wrong). The peer is alive but out of step (another ahcomm version, a
        bug), so nothing later from it can be trusted: the communicator fails on every rank."""
        if self.events is not None:
            self.events.on_broken(self.peer, reason)

    # -- data -----------------------------------------------------------------------------
    def remote(self, buf: str) -> np.ndarray:
        """The peer's CCL buffer ``buf`` ("in" or "out") as uint8, if this link maps it."""
        raise NotImplementedError(f"{self.kind} links do not map the peer's buffers")

    @abstractmethod
    def put(self, src: np.ndarray, buf: str, offset: int, seq: int, run: MemoryRunner) -> "Awaitable[Any] | None":
        """Write ``src`` (contiguous) into the peer's buffer ``buf`` at byte ``offset``."""

    def read(self, dst: np.ndarray, addr: int, run: MemoryRunner) -> "Awaitable[Any] | None":
        """Copy ``dst.nbytes`` bytes from the peer's memory at ``addr`` into ``dst``."""
        raise NotImplementedError(f"{self.kind} links cannot read a peer's memory")

    def read_word(self, addr: int) -> int:
        """The int64 at ``addr`` (8-aligned) in the peer's memory, now (where ``single_copy``):
        a flag of the peer's, not data (not counted as bytes received)."""
        raise NotImplementedError(f"{self.kind} links cannot read a peer's memory")

    def words(self, addr: int, count: int) -> np.ndarray | None:
        """The peer's ``count`` int64 words at ``addr`` (an address in the peer's process) mapped
        here, live and read-only, where they are the words of the peer's CCL_Out that this link
        maps (``Region.words``); else None (``read_word`` reads them). A look is then a load, not
        a system call. Flags, not data: not counted as bytes."""
        return None

    def pipe(self) -> Pipe | None:
        """A ``Pipe`` for one thread's loop of reads and writes, where ``single_copy`` (a transport
        that sets it gives one), else None."""
        return None

    def view(self, addr: int, nbytes: int) -> np.ndarray | None:
        """The peer's memory at ``addr`` (``nbytes``, uint8) mapped here, where the peer allocated
        it with ``ahcomm.alloc`` and this link can map it; else None."""
        return None

    async def flush(self) -> None:
        """Wait until every put so far has landed at the peer (no-op where puts are copies)."""

    # -- point-to-point messages ------------------------------------------------------------
    @abstractmethod
    def send_message(self, key: MessageKey, meta: bytes, data: np.ndarray) -> "Awaitable[None] | None":
        """Send one message; the awaitable (if any) is done when ``data`` may be reused."""

    def message(self, key: MessageKey) -> "asyncio.Future[Message]":
        """The message with ``key`` from the peer (already arrived, or a future for it)."""
        return self._claim(self._mail, key)

    def _claim(self, table: "dict[Any, asyncio.Future[Any]]", key: Any) -> "asyncio.Future[Any]":
        """The entry of ``table`` (messages by key) that arrived, or a future left there for it
        (failed at once if the link is)."""
        fut = table.pop(key, None)
        if fut is None:
            fut = asyncio.get_running_loop().create_future()
            if self._error is not None:
                fut.set_exception(self._error)
            else:
                table[key] = fut
        return fut

    def deliver_message(self, key: MessageKey, meta: bytes, data: Any) -> None:
        """Called by the transport when a message arrived (``data``: a bytes-like object)."""
        fut = self._mail.pop(key, None)
        if fut is None:  # nobody asked yet: keep it until they do
            fut = asyncio.get_running_loop().create_future()
            self._mail[key] = fut
        if not fut.done():
            fut.set_result((meta, data))
        self.bytes_received += len(memoryview(data).cast("B"))

    # -- eager messages (one per call and peer) ---------------------------------------------
    def send_eager(self, seq: int, fingerprint: int, data: np.ndarray | None) -> None:
        """Send this rank's message of call ``seq`` (``data``: contiguous, at most ``eager_limit``
        bytes, copied before this returns; None: no bytes), with the call's ``fingerprint``."""
        raise NotImplementedError(f"{self.kind} links carry no eager messages")

    def eager(self, seq: int) -> "asyncio.Future[Any]":
        """The peer's eager message of call ``seq`` (a bytes-like payload): arrived, or a future for it."""
        return self._claim(self._eager, seq)

    def deliver_eager(self, seq: int, fingerprint: int, data: Any) -> None:
        """Called by the transport when the peer's eager message of call ``seq`` arrived; its
        ``fingerprint`` is checked by the communicator first, as a signal's is. Raises
        ``TransportError`` for a second message of one call, or one too many ahead."""
        events = self.events
        if fingerprint and events is not None:
            events.on_fingerprint(self.peer, seq, fingerprint)
        fut = self._eager.pop(seq, None)
        if fut is None:  # nobody asked yet: keep it until they do
            if len(self._eager) >= EAGER_AHEAD:
                raise TransportError(f"link {self.peer}->{self.rank}: eager message of call {seq} while "
                                     f"{len(self._eager)} others wait (at most {EAGER_AHEAD})")
            fut = asyncio.get_running_loop().create_future()
            self._eager[seq] = fut
        elif fut.cancelled():  # its waiter gave up (the run was cancelled): keep the message
            fut = asyncio.get_running_loop().create_future()
            self._eager[seq] = fut
        elif fut.done():
            self._eager[seq] = fut
            raise TransportError(f"link {self.peer}->{self.rank}: a second eager message of call {seq}")
        fut.set_result(data)
        self.bytes_received += len(data)
        self.progress(seq)

    # -- sub-communicators -----------------------------------------------------------------
    def describe_buffers(self, buffers: CclBuffers) -> dict[str, Any]:
        """What a peer needs to reach ``buffers`` (this rank's CCL buffers for a new
        sub-communicator) over this kind of link: a small msgpack-able dict."""
        return {"buffsize": buffers.nbytes}

    def child(self, domain: int, rank: int, peer: int, buffers: CclBuffers, peer_buffers: dict[str, Any],
              on_progress: ProgressHook | None) -> "Link":
        """A link of a sub-communicator to the same peer over this link's connection.

        ``domain`` (1..65535, agreed by both ends) keeps its notifies, messages and puts apart
        from every other communicator's on the connection; ``rank``/``peer`` are the two ends'
        ranks in the sub-communicator; ``buffers`` are this rank's CCL buffers for it and
        ``peer_buffers`` the peer's ``describe_buffers`` of its own.
        """
        raise NotImplementedError(f"{self.kind} links cannot carry sub-communicators")

    # -- suspend / resume ------------------------------------------------------------------
    def unmap_peer_buffers(self) -> int:
        """Drop whatever this link holds of the peer's CCL buffers (``Comm.suspend``: the peer
        releases them); the bytes of shared memory unmapped here. Puts land in this rank's own
        buffers through the ``CclBuffers`` object, which the communicator renews in place."""
        return 0

    def map_peer_buffers(self, peer_buffers: dict[str, Any]) -> None:
        """Reach the peer's new CCL buffers, as its ``describe_buffers`` gave them (``Comm.resume``)."""

    def stop_shared_notifies(self) -> None:
        """Post every later notify over the connection itself, not through shared memory (``Comm.suspend``,
        before its last collective: the memory is about to go); a no-op where notifies have one path."""

    def release_shared_notifies(self) -> int:
        """Once every peer posts over the connection (the last collective completed), hand on what the
        shared-memory path still holds and release it; the bytes released (``Comm.suspend``)."""
        return 0

    def renew_shared_notifies(self) -> None:
        """Make the shared-memory path again where ``release_shared_notifies`` took it (``Comm.resume``,
        before ``describe_buffers``: the peers learn it with the buffers)."""

    def settle_shared_notifies(self) -> None:
        """Every peer has opened what ``renew_shared_notifies`` made: remove its names (``Comm.resume``)."""

    def hello(self, index: int) -> None:
        """Post the connection handshake's ACK ``index`` for sequence 0 over the connection itself."""
        self.post(Signal.ACK, index, 0)

    # -- lifecycle ------------------------------------------------------------------------
    def close(self) -> None:
        """Release what the link owns (sockets, mappings)."""

    def fail(self, error: BaseException) -> None:
        """Fail every waiter on this link (peer died, abort, close)."""
        self._error = error
        for flag in self._notifies.values():
            flag.fail(error)
        for fut in (*self._mail.values(), *self._eager.values()):
            if not fut.done():
                fut.set_exception(error)

    def receiver(self) -> Endpoint | None:
        """The endpoint this link receives on, if the transport has one (shared by every link)."""
        return None

    def stats(self) -> dict[str, Any]:
        return {
            "peer": self.peer,
            "kind": self.kind,
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
            "signals_sent": self.signals_sent,
        }


class MappedAccess:
    """Mixin for links whose peer buffers are mapped here: a put is a local memory copy.

    The concrete class sets ``_remote`` to the peer's (CCL_In, CCL_Out) uint8 arrays, and
    ``_remote_words`` to the peer's CCL_Out words (``Region.words``) where it maps them.
    """

    mapped = True
    _remote: tuple[np.ndarray, np.ndarray]
    _remote_words: np.ndarray = np.zeros(0, np.int64)
    bytes_sent: int

    def remote(self, buf: str) -> np.ndarray:
        return self._remote[BUFFER_IDS[buf]]

    def words(self, addr: int, count: int) -> np.ndarray | None:
        """The peer's words at ``addr`` (its address), where they are its CCL_Out's words, mapped
        here: word 0 says where they lie in the peer's process."""
        words = self._remote_words
        if words.size == 0:
            return None
        index, rest = divmod(addr - int(words[0]), 8)  # word 0 is the address itself, never a flag
        if rest or count <= 0 or not 1 <= index <= words.size - count:
            return None
        view = words[index:index + count]
        view.flags.writeable = False  # the owner's flags: a peer only looks
        return view

    def unmap_peer_buffers(self) -> int:
        self._remote = (np.empty(0, np.uint8), np.empty(0, np.uint8))
        self._remote_words = np.zeros(0, np.int64)
        return 0

    def put(self, src: np.ndarray, buf: str, offset: int, seq: int, run: MemoryRunner) -> "Awaitable[Any] | None":
        data = as_bytes(src)
        self.bytes_sent += data.nbytes
        dst = self._remote[BUFFER_IDS[buf]][offset:offset + data.nbytes]
        return run(copy, dst, data)


def as_bytes(array: np.ndarray) -> np.ndarray:
    """A flat uint8 view of a C-contiguous array (no copy)."""
    if not array.flags.c_contiguous:
        raise ValueError("put needs a contiguous source")
    return array.reshape(-1).view(np.uint8)



if TYPE_CHECKING:  # mypy checks that a Link is both faces of the contract
    def _faces(link: Link) -> tuple[DataLink, Connection]:
        return link, link

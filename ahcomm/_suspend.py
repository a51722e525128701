"""Suspending a communicator: ``Comm.suspend()`` releases its CCL buffers and shared memory,
``Comm.resume()`` makes them again (NCCL 2.29's ncclCommSuspend/ncclCommResume).

suspend is collective. It runs an all_gather of one byte per rank (does it have an open
sub-communicator that is not suspended?) behind every collective issued before it; when that
completes, no peer will touch this rank's buffers again (a collective returns only once its
puts have landed). Every rank then learns the same verdict: if any rank has busy groups, all
refuse alike. Otherwise each rank, on its own, drops the executor's views of its buffers,
unmaps its peers' buffers (sdma links' mappings), closes its own (their names were unlinked
at creation: the memory goes when the last mapping does) and its host mailbox. Its notifies
go over the connections from the verdict on (``Link.stop_shared_notifies``), and a
communicator that owns its connections closes its notify inbox once the verdict is in (every
peer's earlier records handed on first); resume makes a new inbox, described with the new
buffers, and the first post through it follows resume's last round.

The connections stay up: the transport still watches every peer, so a peer lost meanwhile
fails the communicator (``PeerFailure``) as at any other time, and ``resume`` raises it.

resume is collective too, but cannot run a collective (there are no buffers to run it in):
two rounds of link messages keyed by negative sequence numbers (the user's are >= 0):

1. each rank makes new buffers (same size and kind) and a new mailbox, adopts them in place
   (the ``CclBuffers`` object that rdma links and the channel hold, so puts land in them),
   and sends every peer how to reach them (``Link.describe_buffers``) - or why it could not;
2. each maps every peer's (``Link.map_peer_buffers``, the mailbox's ``attach``) and says
   whether it could; then the names are unlinked (every peer holds its mapping).

A rank that cannot make or map its part says so in its message: every rank raises and
stays suspended (resume may be tried again). In-process communicators (tests) keep their
mailbox (plain memory shared by the ranks' objects); their buffers are released like others.
A group's (or shrunk communicator's) mailbox, derived from its parent's, is released with its
box, and resume makes the group a host mailbox of its own (the parent's may be suspended).
"""

from __future__ import annotations

import asyncio
import dataclasses
import weakref
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

import msgpack
import numpy as np

from ._buffers import CclBuffers
from ._errors import (
    CollectiveTimeout,
    CommClosedError,
    CommunicationError,
    TransportError,
    UsageError,
)
from ._health import Health
from ._outputs import Results
from .algorithms._executor import Executor
from .algorithms.base import Topology
from .transports._host_mailbox import HostMailbox
from .transports.base import Link, Mailboxes
from .transports.mailbox import Mailbox, box_bytes


class Suspendable(Protocol):
    """What suspend and resume use of a communicator (``Comm``)."""

    rank: int
    size: int
    topology: Topology
    _executor: Executor
    _results: Results
    _health: Health
    _closed: bool
    _suspended: bool
    _exec_timeout: float
    _loop: asyncio.AbstractEventLoop | None
    _on_close: Callable[[], Awaitable[None]] | None
    world_ranks: tuple[int, ...]

    @property
    def _children(self) -> Sequence[Suspendable]: ...
    def _check_open(self, what: str = "") -> None: ...
    def _check_loop(self) -> None: ...
    def _set_topology(self, topo: Topology) -> None: ...
    def all_gather(self, x: Any, *, out: np.ndarray | None = None, algorithm: str | None = None,
                   timeout: float | None = None) -> asyncio.Future[np.ndarray]: ...


@dataclasses.dataclass
class _State:
    """One communicator's suspensions."""

    shared: bool = False  # its buffers were in shared memory
    nbytes: int = 0  # bytes of each CCL buffer
    capacity: int = 0  # its host mailbox's slot capacity (0: it had none)
    inproc_mailbox: Mailboxes | None = None  # an in-process mailbox, kept while suspended
    released: int = 0  # bytes of this rank's own memory the last suspend freed
    unmapped: int = 0  # bytes of the peers' shared memory it unmapped
    own_mailbox: bool = False  # its close closes the host mailbox resume makes it (it had a derived one)
    attempts: int = 0  # resumes begun (the same count on every rank: it keys their messages)


_states: "weakref.WeakKeyDictionary[Suspendable, _State]" = weakref.WeakKeyDictionary()
_host_mailboxes: "weakref.WeakKeyDictionary[Suspendable, HostMailbox]" = weakref.WeakKeyDictionary()


def keep_mailbox(comm: Suspendable, box: HostMailbox | None) -> None:
    """``comm`` owns the host mailbox ``box`` (init's; resume's replaces it)."""
    if box is None:
        _host_mailboxes.pop(comm, None)
    else:
        _host_mailboxes[comm] = box


def host_mailbox(comm: Suspendable) -> HostMailbox | None:
    """The host mailbox ``comm`` owns now (None while suspended, or where it has none)."""
    return _host_mailboxes.get(comm)


def _close_own_mailbox(comm: Suspendable) -> None:
    """From now on ``comm``'s close also closes the host mailbox a resume makes it (a group's,
    whose own close knows only the mailbox derived at its creation). Chained to its
    ``_on_close``, so a shrunk communicator sharing it defers it alike."""
    inner = comm._on_close

    async def on_close() -> None:
        if inner is not None:
            await inner()
        box = _host_mailboxes.pop(comm, None)
        if box is not None:
            box.close()

    comm._on_close = on_close


def buffer_spec(comm: Suspendable) -> tuple[bool, int]:
    """(in shared memory, bytes of each) of ``comm``'s CCL buffers, released or not (``shrink``
    of a communicator that failed while suspended makes its new ones alike)."""
    state = _states.get(comm)
    if comm._suspended and state is not None and state.nbytes:
        return state.shared, state.nbytes
    buffers = comm._executor.buffers
    return buffers.in_shared_memory, buffers.nbytes


def stats(comm: Suspendable) -> dict[str, Any]:
    state = _states.get(comm)
    return {"suspended": comm._suspended, "released_bytes": state.released if state else 0,
            "unmapped_bytes": state.unmapped if state else 0}


# -- suspend ---------------------------------------------------------------------------------
async def suspend(comm: Suspendable, timeout: float | None) -> None:
    comm._check_open("suspend")  # closed, failed, or suspended already: raises
    busy = any(not child._closed and not child._suspended for child in comm._children)
    for link in comm._executor.links.values():  # the verdict's posts, and every later one, over the connections
        link.stop_shared_notifies()
    verdict = comm.all_gather(np.array([busy], np.uint8), timeout=timeout)  # behind every earlier call
    comm._suspended = True  # calls made from now on raise
    try:
        flags = await asyncio.shield(verdict)
    except asyncio.CancelledError:  # it completes in the background (the peers depend on it), so does this
        verdict.add_done_callback(lambda done: _conclude(comm, done.result()) if _succeeded(done) else None)
        raise
    except BaseException:
        comm._suspended = False
        raise
    _conclude(comm, flags)
    if not comm._suspended:
        refusing = [r for r, flag in enumerate(flags) if flag]
        raise UsageError(f"suspend: rank{'s' if len(refusing) > 1 else ''} {', '.join(map(str, refusing))} "
                         "of this communicator ha{} open sub-communicators (split/new_group) that are not "
                         "suspended: suspend or close them first".format("ve" if len(refusing) > 1 else "s"))


def _succeeded(done: "asyncio.Future[Any]") -> bool:
    if done.cancelled():
        return False
    return done.exception() is None


def _conclude(comm: Suspendable, flags: np.ndarray) -> None:
    """The all_gather's verdict: release everything, or (some rank has busy groups) nothing."""
    if comm._closed or any(flags):
        comm._suspended = False
        return
    state = _states.setdefault(comm, _State())
    executor = comm._executor
    box = _host_mailboxes.pop(comm, None)
    mailbox = executor.mailbox
    # A group's (or shrunk communicator's) mailbox is derived from its parent's host mailbox,
    # which the parent's suspend closes: it is released here and resume makes a host mailbox
    # of the communicator's own, as init and grow do.
    derived = isinstance(mailbox, Mailbox) and mailbox.derived_in_shared_memory
    state.inproc_mailbox = mailbox if box is None and not derived else None
    executor.release()  # its views first: a mapping with views alive cannot be closed
    unmapped = sum(link.unmap_peer_buffers() for link in executor.links.values())
    state.shared, state.nbytes = executor.buffers.in_shared_memory, executor.buffers.nbytes
    released = executor.buffers.release()
    # every peer posted the verdict over its connection, after any notify it put in this rank's
    # inbox: those are handed on, and the inbox goes (a communicator that owns its connections)
    released += sum(link.release_shared_notifies() for link in executor.links.values())
    state.capacity = 0
    if box is not None:
        state.capacity = box.capacity
        released += box.region.nbytes
        unmapped += box_bytes(box.capacity) * (comm.size - 1)
        box.close()
    elif derived:
        assert isinstance(mailbox, Mailbox) and mailbox.own_box is not None
        state.capacity = mailbox.capacity
        released += box_bytes(mailbox.capacity)
        unmapped += box_bytes(mailbox.capacity) * (comm.size - 1)
        own = mailbox.own_box
        mailbox.close()
        own.close()  # closing the communicator closes it again: harmless
        executor.mailbox = None
        if not state.own_mailbox:
            state.own_mailbox = True
            _close_own_mailbox(comm)
    released += comm._results.clear()  # results kept to be handed out again (``_outputs``)
    state.released, state.unmapped = released, unmapped


# -- resume ----------------------------------------------------------------------------------
async def resume(comm: Suspendable, timeout: float | None) -> None:
    comm._check_loop()
    if comm._closed:
        raise CommClosedError(f"resume: communicator (rank {comm.rank}) is closed")
    error = comm._health.error
    if isinstance(error, CommunicationError):  # a peer was lost (or aborted) while suspended
        raise error
    if error is not None:
        raise CommClosedError(f"resume: communicator (rank {comm.rank}) failed earlier: {error}") from error
    state = _states.get(comm)
    if not comm._suspended or state is None:
        raise UsageError(f"resume: communicator (rank {comm.rank}) is not suspended")
    limit = comm._exec_timeout if timeout is None else float(timeout)
    if not limit > 0:
        from ._errors import InvalidArgument
        raise InvalidArgument(f"resume: timeout {timeout!r} must be a positive number of seconds")
    attempt = state.attempts
    state.attempts += 1
    executor = comm._executor
    fresh, box, problem = _make(comm, state)
    if fresh is not None:
        executor.buffers.adopt(fresh)  # peers' puts land in them from now on
        for link in executor.links.values():  # a new notify inbox, described with the buffers
            link.renew_shared_notifies()
    exchange = _Exchange(comm, attempt)
    try:
        async with asyncio.timeout(limit):
            rows = await exchange.round(0, {"err": problem, "about": _about(executor.links, executor.buffers),
                                            "mbox": box.describe() if box is not None else None})
            _raise_first(comm, rows, "could not make its new CCL buffers")
            box = _attach(comm, rows, box, state)
            problem = _map(executor.links, rows)
            rows = await exchange.round(1, {"err": problem})
            _raise_first(comm, rows, "could not map its peers' new CCL buffers")
    except BaseException as exc:
        for link in executor.links.values():
            link.unmap_peer_buffers()
            link.stop_shared_notifies()
        executor.buffers.release()
        for link in executor.links.values():  # nobody posts through it: the resume failed on every rank
            link.release_shared_notifies()
        if box is not None:
            box.close()
        if isinstance(exc, TimeoutError):  # the ranks are out of step now: the communicator fails on every rank
            missing = exchange.missing()
            error = CollectiveTimeout(f"resume on rank {comm.rank} did not complete within {limit:g} s: no word "
                                      f"from rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} "
                                      "(did every rank call resume?)", op="resume", missing=tuple(missing))
            comm._health.fail(error, tell=("timeout", str(error)))
            raise error from None
        if isinstance(exc, asyncio.CancelledError) and comm._health.error is None:
            comm._health.fail(CommClosedError(f"communicator (rank {comm.rank}): its resume was cancelled"),
                              tell=("abort", "its resume was cancelled"))
        raise
    executor.buffers.unlink()  # every peer maps them now: no name left to leak
    for link in executor.links.values():  # and has opened the new notify inbox
        link.settle_shared_notifies()
    executor.bind()
    if box is not None:
        box.unlink()
        assert comm._loop is not None
        box.start(comm._loop)
        _host_mailboxes[comm] = box
        executor.mailbox = box.mailbox
    else:
        executor.mailbox = state.inproc_mailbox
    state.inproc_mailbox = None
    comm._suspended = False


def _make(comm: Suspendable, state: _State) -> tuple[CclBuffers | None, HostMailbox | None, str | None]:
    """New buffers like the released ones, and a host mailbox where there was one; or why not."""
    tag = f"r{comm.world_ranks[comm.rank]}z"
    try:
        fresh = (CclBuffers.shared(state.nbytes, tag, prefault=False) if state.shared
                 else CclBuffers.local(state.nbytes, prefault=False))
    except Exception as exc:  # noqa: BLE001 - told to every rank
        return None, None, f"{type(exc).__name__}: {exc}"
    box = None
    if state.capacity:
        try:
            box = HostMailbox(comm.rank, state.capacity)  # its Mailbox indexes this communicator's ranks
        except Exception:  # noqa: BLE001 - then no rank gets one (``_attach``): the other algorithms run instead
            box = None
    return fresh, box, None


def _about(links: dict[int, Link], buffers: CclBuffers) -> dict[str, Any]:
    """How to reach ``buffers`` over each kind of link (sdma: shared-memory names)."""
    about: dict[str, Any] = {}
    for link in {type(link): link for link in links.values()}.values():
        about.update(link.describe_buffers(buffers))
    return about


def _raise_first(comm: Suspendable, rows: dict[int, dict[str, Any]], what: str) -> None:
    failed = sorted((r, row["err"]) for r, row in rows.items() if row.get("err"))
    if failed:
        rank, text = failed[0]
        who = "this rank" if rank == comm.rank else f"rank {rank}"
        raise TransportError(f"resume: {who} {what}: {text}; the communicator stays suspended on every rank")


def _attach(comm: Suspendable, rows: dict[int, dict[str, Any]], box: HostMailbox | None,
            state: _State) -> HostMailbox | None:
    """Map every peer's new mailbox where every rank made one of one capacity (every rank sees
    the same rows, so all decide alike); else none, and the topology says so."""
    if not state.capacity:  # it had none (or an in-process one, kept)
        return None
    boxes = [rows[r].get("mbox") for r in range(comm.size)]
    if box is not None and all(isinstance(b, dict) and b.get("capacity") == box.capacity for b in boxes):
        box.attach([{"rank": r, "mailbox": boxes[r]} for r in range(comm.size)])
        return box
    if box is not None:
        box.close()
    comm._set_topology(dataclasses.replace(comm.topology, mailbox=0))
    return None


def _map(links: dict[int, Link], rows: dict[int, dict[str, Any]]) -> str | None:
    try:
        for peer, link in links.items():
            link.map_peer_buffers(rows[peer]["about"])
    except Exception as exc:  # noqa: BLE001 - told to every rank
        return f"{type(exc).__name__}: {exc}"
    return None


def _retrieved(done: "asyncio.Future[Any]") -> None:
    if not done.cancelled():
        done.exception()


class _Exchange:
    """Resume's rounds: a message to every peer, and every peer's, on the links themselves."""

    def __init__(self, comm: Suspendable, attempt: int) -> None:
        self.comm, self.attempt = comm, attempt
        self.waiting: list[int] = []  # the peers whose message of this round has not come yet

    async def round(self, number: int, msg: dict[str, Any]) -> dict[int, dict[str, Any]]:
        key = (0, -1 - 2 * self.attempt - number)  # negative: never a user's message
        payload = np.frombuffer(msgpack.packb(msg, use_bin_type=True), np.uint8)
        links = self.comm._executor.links
        for link in links.values():
            sent = link.send_message(key, b"", payload)
            if sent is not None:
                asyncio.ensure_future(sent).add_done_callback(_retrieved)
        futures = {peer: link.message(key) for peer, link in links.items()}
        self.waiting = list(futures)
        rows = {self.comm.rank: msg}
        try:
            for peer, fut in futures.items():
                _, data = await fut
                self.waiting.remove(peer)
        except BaseException:
            for fut in futures.values():  # not awaited any more: a failure set on them later is not an error
                fut.add_done_callback(_retrieved)
            raise
        for peer, fut in futures.items():
            _, data = fut.result()
            row = msgpack.unpackb(bytes(memoryview(data).cast("B")), raw=False)
            if not isinstance(row, dict):
                raise TransportError(f"resume: rank {peer} sent an unreadable message")
            rows[peer] = row
        return rows

    def missing(self) -> list[int]:
        return sorted(self.waiting)

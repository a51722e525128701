"""Elastic communicators: ``Comm.shrink()`` makes a communicator of the ranks still alive.

Called by the survivors after a failure (or at any time, with ``exclude=``). The survivors
agree on who is alive with control messages over the old communicator's connections (they
still work after the communicator failed; only the dead peers' links are gone):

* every participant broadcasts a *join* to every peer it believes alive - the ranks it knows
  are gone (links lost or closed, ``exclude``), a domain proposal and how to reach its new CCL
  buffers - and repeats it every ``RESEND`` seconds until it is done (a peer that has not
  called ``shrink`` yet drops it; a later one reaches it), at once when what it knows changes;
* the set of gone ranks only grows: each rank merges every set it hears, so ranks that saw
  different failures converge on the union;
* the *coordinator* is the lowest rank not known gone. Once it holds a join from every rank it
  believes alive, it sends a *decision* (members, domain, its gone set); a member accepts it
  only if it agrees on the members (else its own join, with more gone ranks, is on the way
  and the coordinator decides again), opens its links of the new domain and says *ok*;
  after every ok the coordinator says *go*, and only then does anyone send on the new
  domain (no message can reach a rank before its link exists);
* a rank that dies meanwhile - a member or the coordinator - is seen by the transport (its
  link is lost) and the round starts over without it: a bounded number of rounds, at most
  one per rank of the old communicator.

The new communicator's links are children of the old one's (``Link.child``, as ``split``'s:
no new connection), under a fresh domain; its ranks are the survivors in their old order.
The old communicator is left as it is (failed, if a failure brought us here); closing it
releases the shared connections only once the new one is closed too.
"""

from __future__ import annotations

import asyncio
import random
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgpack
import numpy as np

from . import _suspend
from ._buffers import CclBuffers
from ._errors import CollectiveTimeout, InvalidArgument, TransportError
from ._groups import derive_mailbox, offer_box
from .algorithms._executor import Progress
from .algorithms.base import Topology
from .transports.base import MAX_DOMAIN, DomainInUse, Link, LinkEvents
from .transports.mailbox import Box, Mailbox

if TYPE_CHECKING:
    from ._comm import Comm

_MAGIC = b"AHe1"  # prefix of this module's control messages (msgpack follows)
RESEND = 0.05  # seconds between repeats of a join
RETRY_SPREAD = 64  # a domain collision retries with a random one of the next this many


def _pack(msg: dict[str, Any]) -> bytes:
    packed: bytes = msgpack.packb(msg, use_bin_type=True)
    return _MAGIC + packed


def gone_peers(comm: "Comm") -> set[int]:
    """Peers whose link the transport judged lost, or that closed their end."""
    return {p for p, link in comm._executor.links.items()
            if getattr(link, "lost_reason", None) is not None or getattr(link, "peer_closed", False)}


class _Hooks:
    """One communicator's elastic message handling: installed on its links at the first shrink,
    in front of the communicator's own handlers."""

    def __init__(self, comm: "Comm") -> None:
        self.gen = 0  # shrinks begun here
        self.sessions: dict[int, _Session] = {}
        self.early: dict[int, list[tuple[int, dict[str, Any]]]] = {}  # gen -> messages before it began here
        for link in comm._executor.links.values():
            self._install(link)

    def _install(self, link: Link) -> None:
        link.attach(_ElasticEvents(self, link.events))

    def _message(self, peer: int, payload: bytes) -> None:
        try:
            msg = msgpack.unpackb(payload[len(_MAGIC):], raw=False)
            gen = int(msg["g"])
        except Exception:  # noqa: BLE001 - a malformed message must not break the transport's reader
            return
        session = self.sessions.get(gen)
        if session is not None:
            session.inbox.append((peer, msg))
            session.wake()
        elif gen >= self.gen and len(self.early.get(gen, ())) < 4096:
            self.early.setdefault(gen, []).append((peer, msg))


class _ElasticEvents:
    """A link's events with the elastic messages taken out first: shrink's control messages go to
    the sessions, a lost peer also wakes them; everything else reaches the communicator's own."""

    def __init__(self, hooks: _Hooks, inner: LinkEvents | None) -> None:
        self.hooks, self.inner = hooks, inner

    def on_abort(self, peer: int, reason: str) -> None:
        if self.inner is not None:
            self.inner.on_abort(peer, reason)

    def on_fingerprint(self, peer: int, seq: int, fp: int) -> None:
        if self.inner is not None:
            self.inner.on_fingerprint(peer, seq, fp)

    def on_control(self, peer: int, payload: bytes) -> None:
        if payload.startswith(_MAGIC):
            self.hooks._message(peer, payload)
        elif self.inner is not None:
            self.inner.on_control(peer, payload)

    def on_lost(self, peer: int, reason: str) -> None:
        if self.inner is not None:
            self.inner.on_lost(peer, reason)
        for session in list(self.hooks.sessions.values()):
            session.wake()

    def on_broken(self, peer: int, reason: str) -> None:
        if self.inner is not None:
            self.inner.on_broken(peer, reason)


_hooks: "weakref.WeakKeyDictionary[Comm, _Hooks]" = weakref.WeakKeyDictionary()


@dataclass
class _Session:
    """This rank's side of one shrink."""

    comm: "Comm"
    gen: int
    gone: set[int]
    join: dict[str, Any]
    buffers: CclBuffers
    inbox: list[tuple[int, dict[str, Any]]] = field(default_factory=list)
    held: list[tuple[int, dict[str, Any]]] = field(default_factory=list)  # decisions waiting for joins
    finished: bool = False
    joins: dict[int, dict[str, Any]] = field(default_factory=dict)
    event: asyncio.Event = field(default_factory=asyncio.Event)
    decision: tuple[int, int] | None = None  # (coordinator, attempt) accepted here
    members: tuple[int, ...] = ()
    domain: int = 0
    links: dict[int, Link] = field(default_factory=dict)
    progress: Progress | None = None
    attempt: int = 0  # as coordinator: decisions sent
    sent: tuple[tuple[int, ...], int] | None = None  # as coordinator: (members, domain) of the last decision
    oks: dict[int, str | None] = field(default_factory=dict)
    collided: int = 0
    offer: Box | None = None  # this rank's box for the new communicator's mailbox (``_groups.offer_box``)
    mailbox: Mailbox | None = None  # the new communicator's, derived with the links

    def wake(self) -> None:
        self.event.set()

    @property
    def me(self) -> int:
        return self.comm.rank

    def alive(self) -> list[int]:
        return [r for r in range(self.comm.size) if r not in self.gone]

    def send(self, peer: int, msg: dict[str, Any]) -> None:
        self.comm._executor.send_control(peer, _pack({"g": self.gen, **msg}))

    def broadcast_join(self) -> None:
        self.join["gone"] = sorted(self.gone)
        for peer in self.alive():
            if peer != self.me:
                self.send(peer, self.join)

    def drop_links(self) -> None:
        for link in self.links.values():
            link.close()
        self.links = {}
        self.decision = None
        if self.mailbox is not None:
            self.mailbox.close()
            self.mailbox = None


async def shrink(comm: "Comm", exclude: Iterable[int] | None, timeout: float | None) -> "Comm | None":
    """The survivors' communicator (see the module docstring); None on a rank in ``exclude``."""
    if comm._closed:
        from ._errors import CommClosedError
        raise CommClosedError(f"shrink: communicator (rank {comm.rank}) is closed")
    excluded = _check_exclude(exclude, comm.size)
    limit = comm._exec_timeout if timeout is None else float(timeout)
    if not limit > 0:
        raise InvalidArgument(f"shrink: timeout {timeout!r} must be a positive number of seconds")
    if comm.rank in excluded:
        return None
    hooks = _hooks.get(comm)
    if hooks is None:
        hooks = _hooks[comm] = _Hooks(comm)
    gen = hooks.gen
    hooks.gen += 1
    gone = excluded | gone_peers(comm)
    buffers = _make_buffers(comm, gone)
    about: dict[str, Any] = {}
    for link in {type(link): link for p, link in comm._executor.links.items() if p not in gone}.values():
        about.update(link.describe_buffers(buffers))
    offer = offer_box(comm._executor.mailbox, comm.size - len(gone))
    about["mailbox"] = offer.describe() if offer is not None else None
    join = {"t": "join", "dom": comm._domains.reserve(), "about": about}
    session = _Session(comm, gen, gone, join, buffers, offer=offer)
    hooks.sessions[gen] = session
    session.inbox.extend(hooks.early.pop(gen, ()))
    try:
        return await asyncio.wait_for(_run(session), limit)
    except TimeoutError:
        session.drop_links()
        missing = [r for r in session.alive() if r not in session.joins and r != comm.rank]
        who = f"; no word from rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))}" if missing else ""
        raise CollectiveTimeout(f"shrink on rank {comm.rank} did not complete within {limit:g} s (ranks known "
                                f"gone: {sorted(session.gone)}{who})", op="shrink", missing=tuple(missing)) from None
    except BaseException:
        session.drop_links()
        raise
    finally:
        del hooks.sessions[gen]
        if not session.finished:
            buffers.close()
            if offer is not None:
                offer.close()


def _check_exclude(exclude: Iterable[int] | None, size: int) -> set[int]:
    if exclude is None:
        return set()
    try:
        ranks = list(exclude)
    except TypeError:
        raise InvalidArgument(f"shrink: exclude must be a sequence of ranks, got {type(exclude).__name__}") from None
    for r in ranks:
        if not isinstance(r, (int, np.integer)) or isinstance(r, bool) or not 0 <= int(r) < size:
            raise InvalidArgument(f"shrink: exclude names rank {r!r}, out of range for a communicator of {size} ranks")
    return {int(r) for r in ranks}


def _make_buffers(comm: "Comm", gone: set[int]) -> CclBuffers:
    links = comm._executor.links
    shared, nbytes = _suspend.buffer_spec(comm)  # a communicator suspended when it failed has none now
    # not pre-faulted: making them would take most of a recovery (0.3 to 1 s for 2 x 64 MiB on a
    # busy host); the first collectives fault in the pages they use
    if shared and any(link.mapped for p, link in links.items() if p not in gone):
        return CclBuffers.shared(nbytes, f"r{comm.world_ranks[comm.rank]}s", prefault=False)
    return CclBuffers.local(nbytes, prefault=False)


async def _run(s: _Session) -> "Comm":
    loop = asyncio.get_running_loop()
    next_join = 0.0
    known: set[int] = set()
    while True:
        s.gone |= gone_peers(s.comm)
        inbox, s.inbox = s.held + s.inbox, []
        s.held = []
        done = False
        for peer, msg in inbox:
            done = _handle(s, peer, msg) or done
        if done:
            return _finish(s)
        if s.decision is not None and (s.decision[0] in s.gone or any(m in s.gone for m in s.members)):
            s.drop_links()  # a member or the coordinator died: that decision is void, start over
        if s.me in s.gone:
            raise TransportError(f"shrink: rank {s.me} was judged gone by another rank")
        alive = s.alive()
        # until done: a peer that had not begun its shrink dropped the earlier ones, and may
        # need this rank's join to accept a decision this rank has accepted already
        if s.gone != set(s.join.get("gone", ())) or set(s.joins) != known or loop.time() >= next_join:
            s.broadcast_join()
            next_join = loop.time() + RESEND
            known = set(s.joins)
        if alive[0] == s.me and _coordinate(s, alive):
            return _finish(s)
        s.event.clear()
        if not s.inbox:
            try:
                await asyncio.wait_for(s.event.wait(), max(0.0, next_join - loop.time()))
            except TimeoutError:
                pass


def _handle(s: _Session, peer: int, msg: dict[str, Any]) -> bool:
    """One message; True when it completes the shrink here (a go)."""
    kind = msg.get("t")
    if peer in s.gone:
        return False
    if kind == "join":
        s.gone |= {int(r) for r in msg.get("gone", ())}
        s.joins[peer] = msg
    elif kind == "dec":
        s.gone |= {int(r) for r in msg.get("gone", ())}
        members = tuple(int(r) for r in msg["members"])
        alive = s.alive()
        if alive[0] != peer or members != tuple(alive):
            return False  # not the view here: our join tells the coordinator, who decides again
        if not all(p in s.joins or p == s.me for p in members):  # their joins are on the way
            s.held.append((peer, msg))
            return False
        s.drop_links()
        s.decision = (peer, int(msg["a"]))
        status = _open(s, members, int(msg["dom"]))
        s.send(peer, {"t": "ok", "a": s.decision[1], "err": status})
    elif kind == "ok" and s.sent is not None and int(msg.get("a", -1)) == s.attempt:
        s.oks[peer] = msg.get("err")
    elif kind == "go" and s.decision == (peer, int(msg.get("a", -1))):
        return True
    elif kind == "err":
        raise TransportError(f"shrink: rank {peer} could not open its links of the new communicator: {msg.get('err')}")
    return False


def _open(s: _Session, members: tuple[int, ...], domain: int) -> str | None:
    """Open this rank's links of the new communicator; None, or what went wrong."""
    s.comm._domains.seen(domain)
    s.members, s.domain = members, domain
    rank = members.index(s.me)
    s.progress = Progress(rank, len(members))
    if domain > MAX_DOMAIN:
        return f"no domain left (this process made {MAX_DOMAIN} sub-communicators)"
    try:
        for g, p in enumerate(members):
            if p != s.me:
                s.links[g] = s.comm._executor.links[p].child(domain, rank, g, s.buffers, s.joins[p]["about"],
                                                             s.progress.reached)
        s.mailbox = derive_mailbox(s.comm._executor.mailbox, members,
                                   [s.join["about"] if p == s.me else s.joins[p]["about"] for p in members], s.offer)
    except DomainInUse:
        return "collision"
    except Exception as exc:  # noqa: BLE001 - told to the coordinator
        return f"{type(exc).__name__}: {exc}"
    return None


def _coordinate(s: _Session, alive: list[int]) -> bool:
    """The coordinator's step; True when it said go (done here too)."""
    members = tuple(alive)
    if not all(p in s.joins for p in members if p != s.me):
        return False
    if s.sent is None or s.sent[0] != members:
        domain = max([int(s.join["dom"]), *(int(s.joins[p]["dom"]) for p in members if p != s.me)])
        if s.sent is not None:
            domain = max(domain, s.sent[1] + 1)
        _decide(s, members, domain)
        return False
    if any(p not in s.oks for p in members if p != s.me):
        return False
    errors = {p: e for p, e in s.oks.items() if e and e != "collision"}
    if errors:
        p, text = next(iter(errors.items()))
        for q in members:
            if q != s.me:
                s.send(q, {"t": "err", "err": f"rank {p}: {text}"})
        raise TransportError(f"shrink: rank {p} could not open its links of the new communicator: {text}")
    if "collision" in s.oks.values():
        s.collided += 1
        _decide(s, members, s.sent[1] + 1 + random.randrange(RETRY_SPREAD))
        return False
    for q in members:
        if q != s.me:
            s.send(q, {"t": "go", "a": s.attempt})
    return True


def _decide(s: _Session, members: tuple[int, ...], domain: int) -> None:
    s.attempt += 1
    s.sent = (members, domain)
    s.oks = {}
    s.drop_links()
    s.decision = (s.me, s.attempt)
    s.oks[s.me] = _open(s, members, domain)
    for q in members:
        if q != s.me:
            s.send(q, {"t": "dec", "a": s.attempt, "members": list(members), "dom": domain, "gone": sorted(s.gone)})


def _finish(s: _Session) -> "Comm":
    """The new communicator on the links opened for the decision everyone accepted."""
    old, members, links, buffers, mailbox, offer = s.comm, s.members, s.links, s.buffers, s.mailbox, s.offer
    assert s.progress is not None
    buffers.unlink()  # every member has mapped them
    if offer is not None:
        offer.unlink()
        if mailbox is None:  # not every member offered one
            offer.close()
            offer = None
    rank = members.index(old.rank)
    topo = old.topology
    kinds = tuple("self" if p == old.rank else topo.link_kinds[p] for p in members)
    sub_topo = Topology(rank=rank, size=len(members), hosts=tuple(topo.hosts[p] for p in members), link_kinds=kinds,
                        all_mapped=all(link.mapped for link in links.values()), single_copy=topo.single_copy,
                        mailbox=mailbox.capacity if mailbox is not None else 0)
    # Not one of old's children: closing the failed old communicator keeps the new one.
    new = old._derive(members, rank=rank, links=links, buffers=buffers, topo=sub_topo, progress=s.progress,
                      label=f"s{s.domain}", child=False)
    share_connections(old, new, links, buffers, channel_of(old),
                      tuple(x.close for x in (mailbox, offer) if x is not None))
    new._executor.mailbox = mailbox
    _shrunk.add(new)
    s.links, s.mailbox, s.offer = {}, None, None  # the new communicator owns them now
    s.finished = True
    return new


_shrunk: "weakref.WeakSet[Comm]" = weakref.WeakSet()
_channels: "weakref.WeakKeyDictionary[Comm, Any]" = weakref.WeakKeyDictionary()


def is_whole(comm: "Comm") -> bool:
    """A job-wide communicator: the first one, or one shrunk (again and again) from it."""
    parent = comm._parent
    return parent is None or (comm in _shrunk and is_whole(parent))


def remember_channel(comm: "Comm", channel: Any) -> None:
    _channels[comm] = channel


def channel_of(comm: "Comm") -> Any:
    """The transport channel under ``comm``'s connections (None for an in-process communicator)."""
    for link in comm._executor.links.values():
        root = getattr(link, "root", None)
        if root is not None:
            return root.channel
    return _channels.get(comm)


def share_connections(old: "Comm", new: "Comm", links: dict[int, Link], buffers: CclBuffers,
                      channel: Any = None, closers: tuple[Callable[[], None], ...] = ()) -> None:
    """The new communicator rides on the old one's connections: whichever of the two closes last
    releases them (the old one's own close), so closing the failed old one first is fine.
    ``closers``: what the new one releases on its own (its mailbox)."""
    if channel is not None:
        remember_channel(new, channel)
    release = old._on_close
    open_ = {"old": True, "new": True}

    async def closed(which: str) -> None:
        open_[which] = False
        if not any(open_.values()) and release is not None:
            await release()

    async def close_old() -> None:
        await closed("old")

    async def close_new() -> None:
        for link in links.values():
            link.close()
        for close in closers:
            close()
        buffers.close()
        await closed("new")

    old._on_close, new._on_close = close_old, close_new

"""Sub-communicators: ``Comm.split(color, key)`` and ``Comm.new_group(ranks)``.

Both are collective over the parent (every rank of the parent calls them, as with
MPI_Comm_split and torch.distributed.new_group) and make no new connection and no new
rendezvous. A sub-communicator is a ``Comm`` of its own - its own sequence numbers, queue,
executor and CCL buffers - whose links are *children* of the parent's: they travel on the
parent's connections under a *domain* number, so their notifies, puts, messages and control
traffic never meet the parent's or another group's. A group's collectives therefore run
independently of the parent's (both may be in flight at once, in any order across ranks)
and are matched only among its members.

Making one takes three of the parent's ``all_gather_object`` calls: the arguments (color,
key, ranks, buffsize: checked alike on every rank, so a bad one raises everywhere), then a
domain proposal and how to reach each member's new CCL buffers (sdma: shared-memory names),
then whether each rank opened its child links - which also guarantees that no message of
the new domain reaches a rank before its link for that domain exists. The domain is the
largest number proposed; each rank reserves its proposals, so creations in flight together
never agree on the same number. Two creations from *overlapping* communicators issued in
different orders can still meet on one connection; the rank that finds its domain taken
says so in the last round, and the creation tries again with a fresh domain.

Where the parent has the host's mailboxes (every rank on one host), a group of more than
one rank gets a mailbox of its own (``Mailbox.derive``: a new box per member, described in
the second round and mapped before the third), so its small calls run ``oneshot`` too.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol, TypeVar

import numpy as np

from ._buffers import CclBuffers
from ._core import Members
from ._errors import InvalidArgument, TransportError, UsageError
from .algorithms._executor import Executor, Progress
from .algorithms.base import Topology
from .transports.base import MAX_DOMAIN, DomainInUse, Link
from .transports.mailbox import Box, Mailbox

SMALL_BUFFERS = 4096  # bytes of CCL_In/CCL_Out of a one-rank group (it never communicates)
MIN_BUFFSIZE = 1024  # bytes of each CCL buffer of a group, at least (AHCOMM_BUFFSIZE's floor)
DOMAIN_ATTEMPTS = 8  # rounds to find a domain free on every connection
COLLISION = "domain in use"
RETRY_SPREAD = 64  # a retry proposes a random one of the next this many domains


class Domains:
    """Domain numbers of one process's connections (shared by a communicator and every
    sub-communicator made from it): each proposal is reserved at once, so creations in
    flight together never propose the same number, and every agreed number is skipped."""

    def __init__(self) -> None:
        self.next = 1

    def reserve(self, spread: int = 0) -> int:
        """A fresh number (``spread``: a random one of the next ``spread``, which breaks the tie
        of two creations that keep meeting on the same number)."""
        number = self.next + (random.randrange(spread) if spread else 0)
        self.next = number + 1
        return number

    def seen(self, number: int) -> None:
        self.next = max(self.next, number + 1)


class Parent(Members, Protocol):
    """What making a sub-communicator uses of its parent (``Comm``): its ranks, its connections
    (the executor's links and buffers), an object collective, and ``_derive``, the constructor
    path of a communicator made from it."""

    @property
    def topology(self) -> Topology: ...
    @property
    def _executor(self) -> Executor: ...
    @property
    def _domains(self) -> Domains: ...

    def _check_open(self, what: str = "") -> None: ...
    def all_gather_object(self, obj: Any, *, timeout: float | None = None) -> asyncio.Future[list[Any]]: ...
    def _derive(self: P, members: tuple[int, ...], *, rank: int, links: dict[int, Link], buffers: CclBuffers,
                topo: Topology, progress: Progress, label: str,
                on_close: Callable[[], Awaitable[None]] | None = None, child: bool = True) -> P: ...


P = TypeVar("P", bound=Parent)


def _check_color(color: Any, key: Any, rank: int) -> tuple[int | None, int]:
    if color is not None and (not isinstance(color, (int, np.integer)) or isinstance(color, bool) or color < 0):
        raise InvalidArgument(f"split: color {color!r} must be a non-negative int (or None: no group)")
    key = rank if key is None else key
    if not isinstance(key, (int, np.integer)) or isinstance(key, bool):
        raise InvalidArgument(f"split: key {key!r} must be an int")
    return (None if color is None else int(color)), int(key)


def _check_ranks(ranks: Any, size: int) -> tuple[int, ...]:
    try:
        members = tuple(ranks)
    except TypeError:
        raise InvalidArgument(f"new_group: ranks must be a sequence of ints, got {type(ranks).__name__}") from None
    if not members:
        raise InvalidArgument("new_group: ranks is empty")
    for r in members:
        if not isinstance(r, (int, np.integer)) or isinstance(r, bool) or not 0 <= int(r) < size:
            raise InvalidArgument(f"new_group: rank {r!r} is out of range for a communicator of {size} ranks")
    members = tuple(int(r) for r in members)
    if len(set(members)) != len(members):
        raise InvalidArgument(f"new_group: ranks {list(members)} name a rank twice")
    return members


async def split(parent: P, color: Any, key: Any = None, buffsize: int | None = None) -> P | None:
    """The sub-communicator of the parent's ranks that gave the same ``color`` (ordered by
    ``key``, then parent rank); None where ``color`` is None."""
    parent._check_open("split")
    try:
        color, key = _check_color(color, key, parent.rank)
        nbytes = _check_buffsize(buffsize, parent)
    except InvalidArgument as exc:  # still take part, so every rank raises it, none hangs
        return await _create(parent, None, 0, None, 0, str(exc))
    return await _create(parent, color, key, None, nbytes)


async def new_group(parent: P, ranks: Sequence[int], buffsize: int | None = None) -> P | None:
    """The sub-communicator of ``ranks`` (group rank i is ``ranks[i]``); None on other ranks.
    Every rank of the parent calls it with the same ``ranks``."""
    parent._check_open("new_group")
    try:
        members = _check_ranks(ranks, parent.size)
        nbytes = _check_buffsize(buffsize, parent)
    except InvalidArgument as exc:
        return await _create(parent, None, 0, None, 0, str(exc))
    mine = members.index(parent.rank) if parent.rank in members else None
    return await _create(parent, None if mine is None else 0, mine or 0, members, nbytes)


def _check_buffsize(buffsize: Any, parent: Parent) -> int:
    if buffsize is None:
        return parent._executor.buffers.nbytes
    if not isinstance(buffsize, (int, np.integer)) or isinstance(buffsize, bool) or buffsize < MIN_BUFFSIZE:
        raise InvalidArgument(f"split: buffsize {buffsize!r} must be an int of at least {MIN_BUFFSIZE} bytes")
    return int(buffsize)


def _make_buffers(parent: Parent, group: tuple[int, ...], nbytes: int) -> CclBuffers:
    links = parent._executor.links
    if len(group) == 1:
        return CclBuffers.local(SMALL_BUFFERS)
    if any(links[p].mapped and parent._executor.buffers.ccl_in.name for p in group if p != parent.rank):
        return CclBuffers.shared(nbytes, f"r{parent.world_ranks[parent.rank]}g")  # same-host members map them
    return CclBuffers.local(nbytes)


async def _create(parent: P, color: int | None, key: int, members: tuple[int, ...] | None,
                  nbytes: int, problem: str | None = None) -> P | None:
    """Three rounds of the parent's all_gather_object: the arguments (checked alike on every
    rank), then the domain and how to reach each member's buffers, then whether every rank
    opened its links (a domain already used on some connection - two creations from
    overlapping communicators at once - takes another round with a fresh domain)."""
    rows = await parent.all_gather_object([color, key, members and list(members), problem, nbytes])
    _check_rows(rows, color, members, parent.rank)
    group: tuple[int, ...] = ()
    if color is not None:
        group = tuple(p for _, p in sorted((int(row[1]), p) for p, row in enumerate(rows) if row[0] == color))
    rank = group.index(parent.rank) if group else -1
    buffers: CclBuffers | None = None
    offer: Box | None = None
    broken: Exception | None = None  # this rank could not make its buffers (/dev/shm full): every rank hears it
    try:
        buffers = _make_buffers(parent, group, nbytes) if group else None
    except Exception as exc:  # noqa: BLE001 - raised here after the status round, named on every rank
        broken = exc
    if buffers is not None:
        offer = offer_box(parent._executor.mailbox, len(group))
    try:
        # what each kind of link needs (sdma: shared-memory names); None: this rank has no buffers
        about: dict[str, Any] | None = None if broken is not None else {}
        if about is not None and buffers is not None and len(group) > 1:
            for link in {type(parent._executor.links[p]): parent._executor.links[p] for p in group
                         if p != parent.rank}.values():
                about.update(link.describe_buffers(buffers))
            about["mailbox"] = offer.describe() if offer is not None else None
        for attempt in range(DOMAIN_ATTEMPTS):
            progress = Progress(rank, len(group)) if group else None
            domain, opened, mailbox = await _open(parent, group, rank, buffers, about, progress,
                                                  RETRY_SPREAD * (attempt > 0), broken, offer)
            if opened is not None:
                break
        else:
            raise UsageError(f"split: no domain free on every connection after {DOMAIN_ATTEMPTS} attempts")
    except BaseException:
        if buffers is not None:
            buffers.close()
        if offer is not None:
            offer.close()
        raise
    if buffers is None or progress is None or opened is None:
        if offer is not None:
            offer.close()
        return None
    buffers.unlink()  # every member has mapped them
    if offer is not None:
        offer.unlink()
        if mailbox is None:
            offer.close()
            offer = None
    return _comm(parent, group, rank, opened, buffers, progress, domain, mailbox, offer)


def offer_box(mailbox: object, members: int) -> Box | None:
    """This rank's box for the mailbox of a communicator of ``members`` ranks made from one
    with the host's mailboxes (``mailbox``: its executor's); shrink uses it too."""
    if members < 2 or not isinstance(mailbox, Mailbox):
        return None
    try:
        return mailbox.offer()
    except Exception as exc:  # noqa: BLE001 - /dev/shm full: the communicator runs without mailboxes
        logging.getLogger("ahcomm").warning("no mailbox for the new communicator's small collectives (%s)", exc)
        return None


def derive_mailbox(mailbox: object, group: tuple[int, ...], abouts: list[Any], offer: Box | None) -> Mailbox | None:
    """The group's mailbox derived from ``mailbox`` (the parent's), where every member offered a
    box (``abouts[i]``: member i's description; decided from them alike on every member)."""
    descriptions = [about.get("mailbox") if isinstance(about, dict) else None for about in abouts]
    if offer is None or not isinstance(mailbox, Mailbox):
        return None
    found = [d for d in descriptions if isinstance(d, dict)]
    return mailbox.derive(group, offer, found) if len(found) == len(group) else None


async def _open(parent: Parent, group: tuple[int, ...], rank: int, buffers: CclBuffers | None,
                about: dict[str, Any] | None, progress: Progress | None, spread: int,
                broken: Exception | None = None,
                offer: Box | None = None) -> tuple[int, dict[int, Link] | None, Mailbox | None]:
    """One attempt: agree on a domain, open this rank's child links (and map the members'
    mailbox boxes), and learn whether every rank could. Returns (domain, links, mailbox), or
    (domain, None, None) when the domain must be retried.
    ``broken``: why this rank has no buffers (its ``about`` is None, so no member opens links
    to it); it still takes part in both rounds, so every rank raises (this one its own
    exception, the others a TransportError naming it)."""
    proposal = parent._domains.reserve(spread)
    rows = await parent.all_gather_object([proposal, about])
    domain = max(int(row[0]) for row in rows)
    parent._domains.seen(domain)
    opened: dict[int, Link] = {}
    mailbox: Mailbox | None = None
    status: str | None = None
    if broken is not None:
        status = f"could not create its CCL buffers for the new sub-communicator: {type(broken).__name__}: {broken}"
    elif any(rows[p][1] is None for p in group):
        pass  # a member has no buffers: its own status says why
    elif domain > MAX_DOMAIN:
        status = f"has no domain left (its process made {MAX_DOMAIN} sub-communicators)"
    else:
        try:
            for g, p in enumerate(group):
                if p != parent.rank:
                    assert buffers is not None and progress is not None
                    opened[g] = parent._executor.links[p].child(domain, rank, g, buffers, rows[p][1],
                                                                progress.reached)
            mailbox = derive_mailbox(parent._executor.mailbox, group, [rows[p][1] for p in group], offer)
        except DomainInUse:
            status = COLLISION
        except Exception as exc:  # noqa: BLE001 - told to every rank below
            status = f"could not open its links of the new sub-communicator: {type(exc).__name__}: {exc}"
    try:
        statuses = await parent.all_gather_object(status)  # also: every member's links exist now
    except BaseException:
        _close(opened, mailbox)
        raise
    failed = [(p, text) for p, text in enumerate(statuses) if text and text != COLLISION]
    if failed or COLLISION in statuses:
        _close(opened, mailbox)
        if broken is not None:
            raise broken
        if failed:
            p, text = failed[0]
            raise TransportError(f"split: rank {p} {text}")
        return domain, None, None
    return domain, opened, mailbox


def _close(links: dict[int, Link], mailbox: Mailbox | None = None) -> None:
    for link in links.values():
        link.close()
    if mailbox is not None:
        mailbox.close()  # the offer stays: a retry derives again


def _check_rows(rows: list[list[Any]], color: int | None, members: tuple[int, ...] | None, me: int) -> None:
    """The arguments every rank gave, checked alike on every rank (all raise, none hangs)."""
    for p, row in enumerate(rows):
        if row[3]:
            raise InvalidArgument(row[3] if p == me else f"{row[3]} (on rank {p})")
    if members is not None or any(row[2] for row in rows):
        _agree(rows, members)
    for col in sorted({row[0] for row in rows if row[0] is not None}):
        sizes = {p: row[4] for p, row in enumerate(rows) if row[0] == col}
        if len(set(sizes.values())) > 1:  # a group's ranks must slice calls alike
            raise InvalidArgument(f"split: the members of group {col} asked for different buffsize: {sizes}")


def _agree(rows: list[list[Any]], members: tuple[int, ...] | None) -> None:
    """new_group: every rank must have named the same ranks (checked on every rank alike)."""
    first = rows[0][2]
    for p, row in enumerate(rows):
        if row[2] != first:
            mine = "split()" if members is None else list(members)
            raise InvalidArgument(f"new_group: the ranks differ across ranks: rank 0 gave {first or 'split()'}, "
                                  f"rank {p} gave {row[2] or 'split()'} (this rank: {mine})")


def _comm(parent: P, group: tuple[int, ...], rank: int, links: dict[int, Link], buffers: CclBuffers,
          progress: Progress, domain: int, mailbox: Mailbox | None = None, offer: Box | None = None) -> P:
    topo = parent.topology
    kinds = tuple("self" if p == parent.rank else topo.link_kinds[p] for p in group)
    sub_topo = Topology(rank=rank, size=len(group), hosts=tuple(topo.hosts[p] for p in group), link_kinds=kinds,
                        all_mapped=all(link.mapped for link in links.values()), single_copy=topo.single_copy,
                        mailbox=mailbox.capacity if mailbox is not None else 0)

    async def on_close() -> None:
        for link in links.values():
            link.close()
        if mailbox is not None:
            mailbox.close()
        if offer is not None:
            offer.close()
        buffers.close()

    comm = parent._derive(group, rank=rank, links=links, buffers=buffers, topo=sub_topo, progress=progress,
                          label=f"g{domain}", on_close=on_close)
    comm._executor.mailbox = mailbox
    return comm

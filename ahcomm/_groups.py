"""Sub-communicators: ``Comm.split(color, key)`` and ``Comm.new_group(ranks)``.

Both are collective over the parent (every rank of the parent calls them, as with
MPI_Comm_split and torch.distributed.new_group) and make no new connection and no new
rendezvous. A sub-communicator is a ``Comm`` of its own - its own sequence numbers, queue,
executor and CCL buffers - whose links are *children* of the parent's: they travel on the
parent's connections under a *domain* number, so their notifies, puts, messages and control
traffic never meet the parent's or another group's. A group's collectives therefore run
independently of the parent's (both may be in flight at once, in any order across ranks)
and are matched only among its members.

Making one takes two of the parent's collectives: an ``all_gather_object`` of each rank's
(color, key, next free domain, how to reach its new buffers), then - once every member has
opened its child links - a ``barrier``, so no message of the new domain can reach a rank
before its link for that domain exists. The domain is the largest next-free number any rank
proposed, so it is unused on every connection involved (nested groups included).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from ._buffers import CclBuffers
from ._errors import InvalidArgument, UsageError
from .algorithms._executor import Progress
from .algorithms.base import Topology
from .transports.base import MAX_DOMAIN, Link

if TYPE_CHECKING:
    from ._comm import Comm

SMALL_BUFFERS = 4096  # bytes of CCL_In/CCL_Out of a one-rank group (it never communicates)
MIN_BUFFSIZE = 1024  # bytes of each CCL buffer of a group, at least (AHCOMM_BUFFSIZE's floor)


class Domains:
    """The next free domain number of one process's connections (shared by a communicator
    and every sub-communicator made from it)."""

    def __init__(self) -> None:
        self.next = 1


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


async def split(parent: "Comm", color: Any, key: Any = None, buffsize: int | None = None) -> "Comm | None":
    """The sub-communicator of the parent's ranks that gave the same ``color`` (ordered by
    ``key``, then parent rank); None where ``color`` is None."""
    parent._check_open()
    try:
        color, key = _check_color(color, key, parent.rank)
        nbytes = _check_buffsize(buffsize, parent)
    except InvalidArgument as exc:  # still take part, so every rank raises it, none hangs
        return await _create(parent, None, 0, None, 0, str(exc))
    return await _create(parent, color, key, None, nbytes)


async def new_group(parent: "Comm", ranks: Sequence[int], buffsize: int | None = None) -> "Comm | None":
    """The sub-communicator of ``ranks`` (group rank i is ``ranks[i]``); None on other ranks.
    Every rank of the parent calls it with the same ``ranks``."""
    parent._check_open()
    try:
        members = _check_ranks(ranks, parent.size)
        nbytes = _check_buffsize(buffsize, parent)
    except InvalidArgument as exc:
        return await _create(parent, None, 0, None, 0, str(exc))
    mine = members.index(parent.rank) if parent.rank in members else None
    return await _create(parent, None if mine is None else 0, mine or 0, members, nbytes)


def _check_buffsize(buffsize: Any, parent: "Comm") -> int:
    if buffsize is None:
        return parent._executor.buffers.nbytes
    if not isinstance(buffsize, (int, np.integer)) or isinstance(buffsize, bool) or buffsize < MIN_BUFFSIZE:
        raise InvalidArgument(f"split: buffsize {buffsize!r} must be an int of at least {MIN_BUFFSIZE} bytes")
    return int(buffsize)


def _make_buffers(parent: "Comm", nbytes: int) -> CclBuffers:
    if parent._executor.buffers.ccl_in.name:  # same-host peers map our buffers: the group's are shared too
        return CclBuffers.shared(nbytes, f"r{parent.world_ranks[parent.rank]}g")
    return CclBuffers.local(nbytes)


async def _create(parent: "Comm", color: int | None, key: int, members: tuple[int, ...] | None,
                  nbytes: int, problem: str | None = None) -> "Comm | None":
    links = parent._executor.links
    buffers = _make_buffers(parent, nbytes) if color is not None and links else None
    opened: dict[int, Link] = {}
    try:
        about: dict[str, Any] = {}
        if buffers is not None:  # what each kind of link needs (sdma: the shared-memory names)
            for link in {type(link): link for link in links.values()}.values():
                about.update(link.describe_buffers(buffers))
        rows = await parent.all_gather_object([color, key, parent._domains.next, about,
                                               members and list(members), problem, nbytes])
        for p, row in enumerate(rows):  # a bad argument anywhere fails every rank alike
            if row[5]:
                raise InvalidArgument(row[5] if p == parent.rank else f"{row[5]} (on rank {p})")
        domain = max(int(row[2]) for row in rows)
        if domain > MAX_DOMAIN:
            raise UsageError(f"split: this process made {MAX_DOMAIN} sub-communicators already (no domain left)")
        parent._domains.next = domain + 1
        if members is not None or any(row[4] for row in rows):
            _agree(rows, members)
        if len({row[6] for row in rows if row[0] == color}) > 1:  # a group's ranks slice calls alike
            sizes = {p: row[6] for p, row in enumerate(rows) if row[0] == color}
            raise InvalidArgument(f"split: the members of group {color} asked for different buffsize: {sizes}")
        if color is None:
            await parent.barrier()
            return None
        order = sorted((int(row[1]), p) for p, row in enumerate(rows) if row[0] == color)
        group = tuple(p for _, p in order)
        rank, size = group.index(parent.rank), len(group)
        progress = Progress(rank, size)
        for g, p in enumerate(group):
            if p != parent.rank:
                assert buffers is not None
                opened[g] = links[p].child(domain, rank, g, buffers, rows[p][3], progress.reached)
        await parent.barrier()  # every member's links for the domain exist now
    except BaseException:
        for link in opened.values():
            link.close()
        if buffers is not None:
            buffers.close()
        raise
    if buffers is None or size == 1:
        if buffers is not None:
            buffers.close()
        buffers = CclBuffers.local(SMALL_BUFFERS)
    buffers.unlink()  # every member has mapped them
    return _comm(parent, group, rank, opened, buffers, progress)


def _agree(rows: list[list[Any]], members: tuple[int, ...] | None) -> None:
    """new_group: every rank must have named the same ranks (checked on every rank alike)."""
    first = rows[0][4]
    for p, row in enumerate(rows):
        if row[4] != first:
            mine = "split()" if members is None else list(members)
            raise InvalidArgument(f"new_group: the ranks differ across ranks: rank 0 gave {first or 'split()'}, "
                                  f"rank {p} gave {row[4] or 'split()'} (this rank: {mine})")


def _comm(parent: "Comm", group: tuple[int, ...], rank: int, links: dict[int, Link], buffers: CclBuffers,
          progress: Progress) -> "Comm":
    topo = parent.topology
    kinds = tuple("self" if p == parent.rank else topo.link_kinds[p] for p in group)
    sub_topo = Topology(rank=rank, size=len(group), hosts=tuple(topo.hosts[p] for p in group), link_kinds=kinds,
                        all_mapped=all(link.mapped for link in links.values()), single_copy=topo.single_copy)

    async def on_close() -> None:
        for link in links.values():
            link.close()
        buffers.close()

    comm = type(parent)(rank=rank, size=len(group), links=links, buffers=buffers, topo=sub_topo, progress=progress,
                        selector=parent._selector, exec_timeout=parent._exec_timeout, on_close=on_close)
    comm.world_ranks = tuple(parent.world_ranks[p] for p in group)
    comm.parent_ranks = group
    comm._domains = parent._domains
    comm._parent = parent
    parent._children.append(comm)
    return comm

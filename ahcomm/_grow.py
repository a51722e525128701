"""Growing a communicator back: ``Comm.grow()`` on the members, ``ahcomm.init()`` in a replacement.

A replacement is a process ``ahcomm-run --on-failure restart`` started again for a rank that
died: it has that rank's environment plus ``AHCOMM_RESTART_COUNT`` (1, 2, ...), and its
``init()`` joins the running job instead of starting one. The members (the survivors, after
``shrink()``) call ``grow()``; together they make one communicator of the job's full world
size again, every rank at its world rank (the replacement at the rank the launcher gave it).

They meet at the job's rendezvous address (AHCOMM_MASTER_ADDR/PORT), served by world rank 0
(a member, or the replacement itself) in two rounds on one socket
(``_rendezvous.serve_rounds``): the table (endpoints, new CCL buffers, domain proposals), then a
barrier once everyone opened its links, so nothing reaches a link before it exists. Members
keep their connections to each other (links of a fresh domain on them, as ``shrink``'s); each
replacement gets new connections to everyone (its root links).
"""

from __future__ import annotations

import asyncio
import os
from typing import TYPE_CHECKING, Any

from . import _bootstrap, _elastic
from ._buffers import CclBuffers
from ._config import Config
from ._errors import ConfigError, ConnectError, UsageError
from ._rendezvous import host_identity, local_address, register, serve_rounds
from .algorithms import REGISTRY
from .algorithms._executor import Progress
from .algorithms._selection import Selector
from .algorithms.base import Topology
from .algorithms.cost import CostModel
from .transports._auth import Credentials
from .transports._host_mailbox import HostMailbox
from .transports._zmq import Channel
from .transports.base import Link

if TYPE_CHECKING:
    from ._comm import Comm

RESTART_VAR = "AHCOMM_RESTART_COUNT"
ROUNDS = 2  # the table, then the barrier


def restart_count(env: "dict[str, str] | os._Environ[str] | None" = None) -> int:
    """AHCOMM_RESTART_COUNT: how many times the launcher restarted this rank (0: a first start)."""
    value = (os.environ if env is None else env).get(RESTART_VAR, "") or "0"
    try:
        count = int(value)
    except ValueError:
        raise ConfigError(f"{RESTART_VAR}={value!r} is not a number") from None
    return max(count, 0)


class _Rounds:
    """This rank's side of the grow rendezvous (world rank 0 also serves it)."""

    def __init__(self, rank: int, size: int, port: int, cfg: Config, creds: Credentials, timeout: float) -> None:
        self.rank, self.size, self.port, self.cfg, self.creds, self.timeout = rank, size, port, cfg, creds, timeout
        self.server: asyncio.Future[None] | None = None
        if rank == 0:
            self.server = asyncio.ensure_future(serve_rounds(cfg.master_addr, port, size, ROUNDS, timeout, creds))

    async def round(self, info: dict[str, Any], number: int) -> list[dict[str, Any]]:
        client = asyncio.ensure_future(register(self.cfg.master_addr, self.port, {**info, "round": number},
                                                self.timeout + 5.0, self.creds))
        if self.server is not None:
            both: set[asyncio.Future[Any]] = {client, self.server}
            done, _ = await asyncio.wait(both, return_when=asyncio.FIRST_COMPLETED)
            if self.server in done and self.server.exception() is not None and not client.done():
                client.cancel()
                await asyncio.gather(client, return_exceptions=True)
                raise self.server.exception()  # type: ignore[misc]
        return await client

    async def close(self) -> None:
        if self.server is not None:
            if not self.server.done():
                self.server.cancel()
            await asyncio.gather(self.server, return_exceptions=True)


def _entry(rank: int, size: int, host: str, channel: Channel, buffers: CclBuffers, **extra: Any) -> dict[str, Any]:
    return {"rank": rank, "size": size, "host": host, "endpoints": channel.endpoints,
            "shm": [buffers.ccl_in.name, buffers.ccl_out.name] if buffers.ccl_in.name else None,
            "buffsize": buffers.nbytes, "pid": os.getpid(), "probe": int(buffers.ccl_in.array.ctypes.data), **extra}


def _about(entry: dict[str, Any]) -> dict[str, Any]:
    """A table entry as ``Link.describe_buffers`` would have said it."""
    return {"buffsize": entry["buffsize"], "shm": entry["shm"]}


def _grown_domain(table: list[dict[str, Any]]) -> int:
    return max(int(e.get("dom", 0)) for e in table if e.get("member"))


def _check_sizes(table: list[dict[str, Any]]) -> None:
    sizes = {int(e["buffsize"]) for e in table}
    if len(sizes) > 1:
        raise ConnectError(f"grow: the ranks' CCL buffers differ in size ({sorted(sizes)} bytes): the replacement "
                           "needs the job's AHCOMM_BUFFSIZE")


def _topology(rank: int, table: list[dict[str, Any]], links: dict[int, Link], mbox: HostMailbox | None) -> Topology:
    size = len(table)
    kinds = tuple("self" if p == rank else links[p].kind for p in range(size))
    return Topology(rank=rank, size=size, hosts=tuple(str(e["host"]) for e in table), link_kinds=kinds,
                    all_mapped=all(link.mapped for link in links.values()),
                    mailbox=mbox.capacity if mbox is not None else 0)


def _attach(mbox: HostMailbox | None, table: list[dict[str, Any]], links: dict[int, Link]) -> HostMailbox | None:
    """The grown communicator's mailboxes, fresh on every rank (the replacement could not open
    the members' old FIFOs, whose names are gone), as ``init`` makes them: where every rank
    offered one on one host over sdma; else this rank's closed."""
    if mbox is not None and HostMailbox.usable(table) and all(link.kind == "sdma" for link in links.values()):
        mbox.attach(table)
        mbox.start(asyncio.get_running_loop())
        return mbox
    if mbox is not None:
        mbox.close()
    return None


async def grow(comm: "Comm", timeout: float | None) -> "Comm":
    """The members' side: a communicator of the job's full world size with the replacements."""
    comm._check_open("grow")
    cfg, _, size, port = _bootstrap._resolve_config(None, None, None, None, None)
    members = set(comm.world_ranks)
    me = comm.world_ranks[comm.rank]
    if not _elastic.is_whole(comm):
        raise UsageError("grow: a sub-communicator (split/new_group) cannot grow; grow the communicator it came from")
    if len(members) >= size:
        raise UsageError(f"grow: every rank of the job (world size {size}) is a member already")
    channel = _elastic.channel_of(comm)
    if channel is None:
        raise UsageError("grow: this communicator has no connections to grow from (an in-process one?)")
    limit = cfg.connect_timeout if timeout is None else float(timeout)
    by_world = {comm.world_ranks[p]: link for p, link in comm._executor.links.items()}
    shared = bool(comm._executor.buffers.ccl_in.name) or (cfg.transport != "rdma" and comm.size == 1)
    nbytes = comm._executor.buffers.nbytes
    buffers = (CclBuffers.shared(nbytes, f"r{me}g", prefault=False) if shared
               else CclBuffers.local(nbytes, prefault=False))
    host = comm.topology.hosts[comm.rank]
    mbox = _bootstrap._host_mailbox(me) if shared and comm._executor.mailbox is not None else None
    extra: dict[str, Any] = {"member": True, "dom": comm._domains.reserve(),
                             "mailbox": mbox.describe() if mbox is not None else None}
    if me == min(members):
        extra["tuning"] = comm._selector.model.to_dict()
    info = _entry(me, size, host, channel, buffers, **extra)
    rounds = _Rounds(me, size, port, cfg, Credentials.derive(cfg.job_secret, cfg.encrypt), limit)
    links: dict[int, Link] = {}
    roots: dict[int, Link] = {}  # the new connections to the replacements
    try:
        table = await rounds.round(info, 0)
        _check_sizes(table)
        domain = _grown_domain(table)
        comm._domains.seen(domain)
        progress = Progress(me, size)
        for w in range(size):
            if w == me:
                continue
            if w in members:
                links[w] = by_world[w].child(domain, me, w, buffers, _about(table[w]), progress.reached)
            else:  # a new connection; its traffic goes on the grown domain too (rdma puts land in
                _forget(channel, w)  # the buffers of the link's domain, not the channel's)
                roots[w] = _bootstrap._connect(me, [table[w]], channel, cfg, host, progress)[w]
                links[w] = roots[w].child(domain, me, w, buffers, _about(table[w]), progress.reached)
        mbox = _attach(mbox, table, links)
        await rounds.round(info, 1)
    except BaseException:
        for link in (*links.values(), *roots.values()):
            link.close()
        buffers.close()
        if mbox is not None:
            mbox.close()
        raise
    finally:
        await rounds.close()
    buffers.unlink()
    if mbox is not None:
        mbox.unlink()  # every rank has opened it
    topo = _topology(me, table, links, mbox)
    new = type(comm)(rank=me, size=size, links=links, buffers=buffers, topo=topo, progress=progress,
                     selector=comm._selector, exec_timeout=comm._exec_timeout)
    new._domains = comm._domains
    new._executor.mailbox = mbox.mailbox if mbox is not None else None
    _elastic.share_connections(comm, new, {**links, **{-1 - w: root for w, root in roots.items()}}, buffers, channel,
                               (mbox.close,) if mbox is not None else ())
    return new


def _forget(channel: Channel, wire: int) -> None:
    """Drop the dead rank's links from the channel: its replacement connects with the same identity."""
    old = channel.links.get((0, wire))
    if old is None:
        return
    for link in (*old.children, old):
        if channel.links.get((link.domain, wire)) is link:
            del channel.links[(link.domain, wire)]
    if old.lost_reason is None and not old.peer_closed:
        raise ConnectError(f"grow: world rank {wire} is still connected to this rank; only a rank that died "
                           "can be replaced")
    old.close()


async def rejoin(cfg: Config | None = None) -> "Comm":
    """A replacement's ``init()``: join the running job at this rank (the launcher's AHCOMM_RANK)."""
    cfg, rank, size, port = _bootstrap._resolve_config(cfg, None, None, None, None)
    host = host_identity(cfg.server_id)
    shared = cfg.transport != "rdma" and size > 1
    if shared:
        buffers = CclBuffers.shared(cfg.buffsize, f"r{rank}", local_ranks=cfg.local_world_size or size,
                                    shrink=not os.environ.get("AHCOMM_BUFFSIZE"), prefault=False)
    else:
        buffers = CclBuffers.local(cfg.buffsize, prefault=False)
    creds = Credentials.derive(cfg.job_secret, cfg.encrypt)
    tcp_host = cfg.if_ip or _bootstrap._interface(cfg) or local_address(cfg.master_addr)
    channel = Channel(rank, buffers, ipc=shared, tcp_host=tcp_host, creds=creds, heartbeat=cfg.heartbeat,
                      max_message=cfg.max_message)
    rounds = _Rounds(rank, size, port, cfg, creds, cfg.connect_timeout)
    mbox = _bootstrap._host_mailbox(rank) if shared else None
    info = _entry(rank, size, host, channel, buffers, member=False, dom=0,
                  mailbox=mbox.describe() if mbox is not None else None)
    try:
        table = await rounds.round(info, 0)
        _check_sizes(table)
        progress = Progress(rank, size)
        roots = _bootstrap._connect(rank, table, channel, cfg, host, progress)
        domain = _grown_domain(table)  # the members' links to this rank are on it
        links = {p: root.child(domain, rank, p, buffers, _about(table[p]), progress.reached)
                 if table[p].get("member") else root for p, root in roots.items()}
        mbox = _attach(mbox, table, links)
        channel.start()
        await rounds.round(info, 1)
        tuning = next((e.get("tuning") for e in table if e.get("tuning")), None) or {}
        model = CostModel.from_dict(tuning)
    except BaseException:
        channel.close()
        buffers.close()
        if mbox is not None:
            mbox.close()
        raise
    finally:
        await rounds.close()
    buffers.unlink()
    if mbox is not None:
        mbox.unlink()

    async def on_close() -> None:
        if mbox is not None:
            mbox.close()
        channel.close()
        buffers.close()

    from ._comm import Comm
    comm = Comm(rank=rank, size=size, links=links, buffers=buffers, topo=_topology(rank, table, links, mbox),
                progress=progress, selector=Selector(REGISTRY, cfg.algo, model), exec_timeout=cfg.exec_timeout,
                on_close=on_close)
    comm._executor.mailbox = mbox.mailbox if mbox is not None else None
    comm._domains.seen(domain)
    _elastic.remember_channel(comm, channel)
    return comm


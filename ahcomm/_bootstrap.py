"""Building a communicator: rendezvous, CCL buffers, one link per peer, a first handshake.

The transport of each peer is chosen from ``TRANSPORTS``, a table of (name, can connect,
open) entries tried in order, as NCCL tries ``ncclTransports[]``: the first whose predicate
accepts the peer opens its link. sdma takes a peer on this host whose CCL buffers are in
shared memory and that listens on ipc (unless AHCOMM_TRANSPORT=rdma), rdma any peer with a
tcp endpoint. AHCOMM_TRANSPORT=sdma with a peer on another host is a ConfigError.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from . import _clock, _suspend
from ._buffers import CclBuffers
from ._comm import Comm
from ._config import Config
from ._errors import ConfigError, ConnectError
from ._peer_memory import table_name
from ._rendezvous import (
    LINGER,
    REPLY_SLACK,
    failure,
    host_identity,
    interface_addresses,
    local_address,
    match_interface,
    register,
    serve,
)
from ._torchrun import StorePort
from .algorithms import REGISTRY
from .algorithms._executor import Progress
from .algorithms._selection import Selector
from .algorithms.base import Topology
from .algorithms.cost import CostModel
from .algorithms.cost import load as load_cost_model
from .transports import _cma
from .transports._auth import Credentials
from .transports._host_mailbox import HostMailbox
from .transports._notify_ring import MAX_RINGS
from .transports._zmq import Channel
from .transports.base import Link, Signal
from .transports.inproc import InprocWorld
from .transports.mailbox import InprocMailboxes, capacity_from_env
from .transports.rdma import RdmaLink
from .transports.sdma import SdmaLink

HELLO_INDEX = 0xFFFF  # notify index of the connection handshake (never used by algorithms)
REPORT_AFTER = 2.0  # seconds a rank that failed during init waits for rank 0 before it logs its error
log = logging.getLogger("ahcomm.security")


def _interface(cfg: Config) -> str | None:
    """The address AHCOMM_SOCKET_IFNAME selects (None when it is not set)."""
    if not cfg.socket_ifname:
        return None
    interfaces = interface_addresses()
    addr = match_interface(cfg.socket_ifname, interfaces)
    if addr is None:
        have = ", ".join(f"{n} ({a})" for n, a in interfaces) or "none"
        raise ConfigError(f"AHCOMM_SOCKET_IFNAME={cfg.socket_ifname!r} matches no interface with an IPv4 "
                          f"address; this host has: {have}")
    return addr


def _resolve_config(config: Config | None, rank: int | None, world_size: int | None,
                    master_addr: str | None, master_port: int | None) -> tuple[Config, int, int, int]:
    cfg = config or Config.from_env()
    rank = cfg.rank if rank is None else rank
    size = cfg.world_size if world_size is None else world_size
    port = cfg.master_port if master_port is None else master_port
    if master_addr is not None:
        cfg = dataclasses.replace(cfg, master_addr=master_addr)
    if cfg.master_addr.strip() in ("0.0.0.0", "*", "::", "[::]", ""):
        raise ConfigError(f"master address {cfg.master_addr!r} is a wildcard: rank 0 binds the master address "
                          "itself, so name the address of one interface (AHCOMM_MASTER_ADDR)")
    if size is None or rank is None:
        raise ConfigError("rank and world size are unknown: run under ahcomm-run (or torchrun, mpirun, srun), "
                          "set AHCOMM_RANK/AHCOMM_WORLD_SIZE, or pass rank= and world_size= to init()")
    if not 0 <= rank < size:
        raise ConfigError(f"rank {rank} is out of range for world size {size}")
    if size > 1 and port is None:
        raise ConfigError("the rendezvous port is unknown: set AHCOMM_MASTER_PORT (or MASTER_PORT) "
                          "or pass master_port= to init()")
    cfg.check_security(size)
    return cfg, rank, size, port or 0


async def create(config: Config | None = None, *, rank: int | None = None, world_size: int | None = None,
                 master_addr: str | None = None, master_port: int | None = None) -> Comm:
    """Join the job described by ``config`` (default: the environment) and return a Comm."""
    cfg, rank, size, port = _resolve_config(config, rank, world_size, master_addr, master_port)
    use_store = cfg.torch_store and master_port is None  # torchrun's agent holds MASTER_PORT
    host = host_identity(cfg.server_id)
    shared = cfg.transport != "rdma" and size > 1
    creds = Credentials.derive(cfg.job_secret, cfg.encrypt)
    store = StorePort(cfg.master_addr, port, cfg.connect_timeout) if use_store and size > 1 else None
    try:
        if shared:  # the default size shrinks to fit a small /dev/shm; a chosen one is kept or refused
            chosen = bool(os.environ.get("AHCOMM_BUFFSIZE")) or cfg.buffsize != Config.buffsize
            buffers = CclBuffers.shared(cfg.buffsize, f"r{rank}", local_ranks=cfg.local_world_size or size,
                                        shrink=not chosen)
        else:
            buffers = CclBuffers.local(cfg.buffsize)
    except Exception as exc:
        await _abandon(rank, size, port, cfg, creds, store, host, exc)
        raise
    channel: Channel | None = None
    mbox: HostMailbox | None = None
    grant = _cma.Grant("not asked")  # Yama's scope, lifted for this communicator until it closes
    links: dict[int, Link] = {}
    progress = Progress(rank, size)
    cost_model = load_cost_model()
    if size > 1 and not creds.secure and rank == 0:
        log.warning("AHCOMM_INSECURE=1 and no AHCOMM_JOB_SECRET: this job's connections are not authenticated")
    try:
        if size > 1:
            try:
                tcp_host = cfg.if_ip or _interface(cfg) or local_address(cfg.master_addr)
                rings = min(size, cfg.local_world_size or size, MAX_RINGS) if shared else 0  # one per rank of the host
                channel = Channel(rank, buffers, ipc=shared, tcp_host=tcp_host, creds=creds, heartbeat=cfg.heartbeat,
                                  max_message=cfg.max_message, notify_rings=rings)
                mbox = _host_mailbox(rank) if shared else None
            except Exception as exc:
                await _abandon(rank, size, port, cfg, creds, store, host, exc)
                raise
            if shared and cfg.single_copy and (cfg.local_world_size or size) > 1:  # before peers probe us:
                grant = _cma.allow_peers()  # Yama's scope 1 would refuse them
                log.debug("rank %d: single-copy reads by peers: %s", rank, grant.said)
            info = {
                "rank": rank, "size": size, "host": host, "endpoints": channel.endpoints,
                "shm": [buffers.ccl_in.name, buffers.ccl_out.name] if shared else None,
                "buffsize": buffers.nbytes, "pid": os.getpid(),
                "probe": int(buffers.ccl_in.array.ctypes.data),  # lets same-host peers test single-copy reads
                "mailbox": mbox.describe() if mbox is not None else None,
                "notify": channel.notify_description(),  # this rank's shared-memory inbox for notifies
                "memory": table_name() if shared else None,  # where peers find its ahcomm.alloc memory
            }
            if rank == 0:  # every rank selects algorithms with rank 0's cost model
                info["tuning"] = cost_model.to_dict()
            table = await _rendezvous(rank, size, port, cfg, info, creds, store)
            links = _connect(rank, table, channel, cfg, host, progress)
            if mbox is not None and HostMailbox.usable(table) and all(link.kind == "sdma" for link in links.values()):
                mbox.attach(table)
                mbox.start(asyncio.get_running_loop())
            elif mbox is not None:
                mbox.close()
                mbox = None
            channel.start()
            await _handshake(rank, links, cfg.connect_timeout)
            buffers.unlink()  # every peer has mapped our buffers: no name left to leak
            channel.unlink()  # and opened our inbox
            if mbox is not None:
                mbox.unlink()
            hosts = tuple(e["host"] for e in table)
            try:
                cost_model = CostModel.from_dict(table[0].get("tuning") or {})
            except (TypeError, ValueError, KeyError) as exc:
                raise ConnectError(f"rank {rank}: rank 0's cost model is malformed: {exc}") from None
        else:
            hosts = (host,)
    except BaseException:
        if mbox is not None:
            mbox.close()
        if channel is not None:
            channel.close()
        buffers.close()
        grant.release()
        raise
    kinds = tuple("self" if p == rank else links[p].kind for p in range(size))
    mailbox = mbox.mailbox if mbox is not None else None
    topo = Topology(rank=rank, size=size, hosts=hosts, link_kinds=kinds,
                    all_mapped=all(link.mapped for link in links.values()),
                    mailbox=mailbox.capacity if mailbox is not None else 0)

    async def on_close() -> None:
        box = _suspend.host_mailbox(comm)  # init's, or the one a resume made (none while suspended)
        if box is not None:
            box.close()
        if channel is not None:
            channel.close()
        buffers.close()
        grant.release()

    comm = Comm(rank=rank, size=size, links=links, buffers=buffers, topo=topo, progress=progress,
                selector=Selector(REGISTRY, cfg.algo, cost_model), exec_timeout=cfg.exec_timeout,
                on_close=on_close)
    comm._executor.mailbox = mailbox
    _suspend.keep_mailbox(comm, mbox)
    tracing = _clock.tracer_of(comm) is not None
    if size > 1:
        single_copy = cfg.single_copy and all(link.single_copy for link in links.values())
        single, every_rank_traces = await _agree(comm, single_copy, tracing)
        comm._set_topology(dataclasses.replace(comm.topology, single_copy=single))
        if not single:  # no rank reads another's memory in this job
            grant.release()
        if tracing and not every_rank_traces:
            logging.getLogger("ahcomm.trace").warning(
                "rank %d: AHCOMM_TRACE is set here but not on every rank: the trace files get no clock offsets", rank)
        elif tracing:  # this rank's clock offset to rank 0's, for merged timelines
            await _clock.estimate_offsets(comm)
    return comm


def _host_mailbox(rank: int) -> HostMailbox | None:
    """This rank's mailbox (AHCOMM_MAILBOX_BYTES; None where off or where /dev/shm refuses it)."""
    capacity = capacity_from_env()
    if capacity <= 0:
        return None
    try:
        return HostMailbox(rank, capacity)
    except OSError as exc:
        logging.getLogger("ahcomm").warning("rank %d: no mailbox for small collectives (%s)", rank, exc)
        return None


async def _agree(comm: Comm, single_copy: bool, tracing: bool) -> tuple[bool, bool]:
    """Collective decisions, one all_reduce: single-copy reads only if every rank can read every
    peer; clock offsets for traces only if every rank traces."""
    agreed = await comm.all_reduce(np.array([single_copy, tracing], np.uint8), "min")
    return bool(agreed[0]), bool(agreed[1])


async def _abandon(rank: int, size: int, port: int, cfg: Config, creds: Credentials, store: StorePort | None,
                   host: str, exc: Exception) -> None:
    """This rank failed before it registered (its /dev/shm full, say): tell every rank through
    the rendezvous, so none waits out AHCOMM_CONNECT_TIMEOUT (rank 0 serves nothing but this
    error; another rank registers it with rank 0). Best effort: the caller raises ``exc`` next."""
    if size <= 1:
        return
    entry = failure(rank, size, host, f"{type(exc).__name__}: {exc}")
    told = asyncio.ensure_future(_rendezvous(rank, size, port, cfg, entry, creds, store, failed=True))
    try:
        done, _ = await asyncio.wait({told}, timeout=REPORT_AFTER)
        if not done:  # rank 0 is not there (yet): say why this rank stops while it waits
            logging.getLogger("ahcomm").error("rank %d failed during init (%s: %s); telling the other ranks "
                                              "through rank 0's rendezvous", rank, type(exc).__name__, exc)
        await asyncio.gather(told, return_exceptions=True)
    finally:
        told.cancel()
        await asyncio.gather(told, return_exceptions=True)


async def _rendezvous(rank: int, size: int, port: int, cfg: Config, info: dict[str, Any],
                      creds: Credentials, store: StorePort | None = None,
                      failed: bool = False) -> list[dict[str, Any]]:
    """Register with rank 0 (rank 0 also serves); a failure of either side surfaces at once.
    Rank 0's server names what went wrong, so a rank waits a little longer than it does and
    rank 0's own registration waits for its server's verdict. With ``store`` (torchrun's),
    rank 0 serves on a free port and publishes it there. ``failed``: ``info`` is this rank's
    error (``failure()``), which rank 0 serves to every rank instead of registering."""
    if rank != 0:
        if store is not None:
            port = await store.fetch(rank)
        return await register(cfg.master_addr, port, info, cfg.connect_timeout + REPLY_SLACK, creds)
    bound: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    server = asyncio.ensure_future(serve(cfg.master_addr, 0 if store else port, size, cfg.connect_timeout, creds,
                                         bound=bound, failed=str(info["error"]) if failed else ""))
    try:
        first: list[asyncio.Future[Any]] = [bound, server]
        await asyncio.wait(first, return_when=asyncio.FIRST_COMPLETED)
        if not bound.done():
            await server  # it failed before it bound: raises why
        port = bound.result()
        if store is not None:
            await store.publish(port)
        if failed:
            await server  # answers each rank with rank 0's error, then ends
            return []
    except BaseException:
        server.cancel()
        await asyncio.gather(server, return_exceptions=True)
        raise
    client = asyncio.ensure_future(register(cfg.master_addr, port, info, None, creds))
    done, _ = await asyncio.wait({client, server}, return_when=asyncio.FIRST_EXCEPTION)
    if server in done and server.exception() is not None:
        client.cancel()
        await asyncio.gather(client, return_exceptions=True)
        raise server.exception()  # type: ignore[misc]
    if client.done() and client.exception() is not None:
        # rank 0's verdict: its server still tells ranks that register late, then ends
        await asyncio.wait({server}, timeout=LINGER + 1)
        server.cancel()
        await asyncio.gather(server, return_exceptions=True)
        raise client.exception()  # type: ignore[misc]
    await server
    return await client


@dataclasses.dataclass(frozen=True)
class Peer:
    """What this rank knows about a peer when it picks the peer's transport."""

    rank: int  # this rank
    entry: dict[str, Any]  # the peer's rendezvous entry (rank, host, endpoints, shm, ...)
    same_host: bool
    cfg: Config
    channel: Channel
    progress: Progress
    notify_ring: int = -1  # this rank's place among its host's ranks (its ring in their inboxes)

    @property
    def peer(self) -> int:
        return int(self.entry["rank"])


@dataclasses.dataclass(frozen=True)
class Transport:
    """One entry of ``TRANSPORTS``: a name, whether it can reach a peer, and how to open the link."""

    name: str
    can_connect: Callable[[Peer], bool]
    open: Callable[[Peer], Link]


def _sdma_can_connect(p: Peer) -> bool:
    return (p.same_host and p.cfg.transport != "rdma" and bool(p.entry.get("shm"))
            and "ipc" in p.entry["endpoints"])


def _open_sdma(p: Peer) -> Link:
    shm_in, shm_out = p.entry["shm"]
    return SdmaLink(p.rank, p.peer, p.channel, p.entry["endpoints"]["ipc"], shm_in, shm_out,
                    int(p.entry["buffsize"]), p.progress.reached, int(p.entry.get("pid", 0)),
                    int(p.entry.get("probe", 0)), notify=p.entry.get("notify"), notify_ring=p.notify_ring,
                    memory=p.entry.get("memory"))


def _open_rdma(p: Peer) -> Link:
    return RdmaLink(p.rank, p.peer, p.channel, p.entry["endpoints"]["tcp"], p.progress.reached)


TRANSPORTS: tuple[Transport, ...] = (
    Transport("sdma", _sdma_can_connect, _open_sdma),
    Transport("rdma", lambda p: "tcp" in p.entry["endpoints"], _open_rdma),
)


def _connect(rank: int, table: list[dict[str, Any]], channel: Channel, cfg: Config, host: str,
             progress: Progress) -> dict[int, Link]:
    """One link per peer, each by the first entry of ``TRANSPORTS`` that can connect it."""
    links: dict[int, Link] = {}
    here = sorted(int(e["rank"]) for e in table if e["host"] == host)  # ring i of an inbox: here[i]'s posts
    if rank in here:  # the whole table (grow connects a replacement with its entry alone: no rings then)
        channel.bind_notifies(here)
    for entry in table:
        peer = int(entry["rank"])
        if peer == rank:
            continue
        same_host = entry["host"] == host
        if cfg.transport == "sdma" and not same_host:
            raise ConfigError(f"AHCOMM_TRANSPORT=sdma but rank {peer} is on another host ({entry['host']})")
        reach = Peer(rank, entry, same_host, cfg, channel, progress, here.index(rank) if rank in here else -1)
        transport = next((t for t in TRANSPORTS if t.can_connect(reach)), None)
        if transport is None:
            tried = ", ".join(t.name for t in TRANSPORTS)
            raise ConnectError(f"rank {rank}: no transport can reach rank {peer} (endpoints: "
                               f"{', '.join(entry['endpoints']) or 'none'}; tried {tried})")
        links[peer] = transport.open(reach)
    return links


async def _handshake(rank: int, links: dict[int, Link], timeout: float) -> None:
    """Post a hello on every link and wait for every peer's: all links are up."""
    for link in links.values():
        link.hello(HELLO_INDEX)  # over the connection itself: a peer that cannot reach it fails here
    try:
        async with asyncio.timeout(timeout):
            for link in links.values():
                await link.wait(Signal.ACK, HELLO_INDEX, 0)
    except TimeoutError:
        silent = [p for p, link in links.items() if link.notify(Signal.ACK, HELLO_INDEX, 0).value == 0]
        raise ConnectError(f"rank {rank}: links to ranks {silent} did not come up within {timeout:g} s "
                           "(a rank with another AHCOMM_JOB_SECRET is refused: see the ahcomm.security warnings)"
                           ) from None


async def create_inprocess(size: int, *, buffsize: int | None = None, algo: str = "",
                           single_copy: bool = True) -> list[Comm]:
    """``size`` communicators in this event loop, joined by in-process links (for tests)."""
    cfg = dataclasses.replace(Config.from_env({}), single_copy=single_copy)
    nbytes = buffsize or cfg.buffsize
    world = InprocWorld(size)
    capacity = capacity_from_env() if size > 1 else 0
    boxes = InprocMailboxes(size, capacity).boxes if capacity else None
    cost_model = load_cost_model()
    for r in range(size):
        world.register(r, CclBuffers.local(nbytes))
    comms = []
    for r in range(size):
        progress = Progress(r, size)
        links: dict[int, Link] = dict(world.connect(r, progress.reached))
        kinds = tuple("self" if p == r else "inproc" for p in range(size))
        topo = Topology(rank=r, size=size, hosts=("inproc",) * size, link_kinds=kinds, all_mapped=True,
                        single_copy=cfg.single_copy, mailbox=capacity if boxes else 0)
        comm = Comm(rank=r, size=size, links=links, buffers=world.buffers[r], topo=topo, progress=progress,
                    selector=Selector(REGISTRY, algo, cost_model), exec_timeout=cfg.exec_timeout)
        comm._executor.mailbox = boxes[r] if boxes else None
        comms.append(comm)
    return comms

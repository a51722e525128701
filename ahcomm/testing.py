"""Checking a collective algorithm against numpy: ``check_algorithm``, and ``local_world``.

    from ahcomm.testing import check_algorithm
    check_algorithm(MyAllGather(), world_sizes=(2, 3, 5), counts=(0, 1, 1000, 100_000))

``check_algorithm`` registers the algorithm (for the check only), then runs every op it
supports (or ``ops``) on jobs of every world size, for every dtype and count, with the
algorithm forced per call, and compares each rank's result with numpy's. A wrong result,
an exception or a hang (``timeout``) raises ``AssertionError`` naming the algorithm, op,
dtype, count, world size, rank and the first wrong element. The data are small integers,
so every sum is exact in every dtype and results compare bit for bit.

``local_world(size, transport=...)`` makes the job: ``size`` communicators in this event
loop joined by in-process links (``"inproc"``) or by real ``"sdma"`` (ZeroMQ ipc + shared
memory) or ``"rdma"`` (ZeroMQ tcp on 127.0.0.1) links, built the way ``ahcomm.init`` builds
them, so an algorithm can be checked over each transport without starting processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import secrets
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any

import numpy as np

from . import _bootstrap
from ._buffers import CclBuffers
from ._comm import Comm
from ._config import Config
from ._peer_memory import table_name
from .algorithms import REGISTRY, Algorithm, Call, Topology
from .algorithms._executor import Progress
from .algorithms._selection import Selector
from .algorithms.cost import load as load_cost_model
from .transports._auth import Credentials
from .transports._zmq import Channel
from .transports.base import Link
from .transports.inproc import InprocWorld
from .transports.mailbox import InprocMailboxes, Mailbox, capacity_from_env

__all__ = ["REDOPS", "TRANSPORTS", "LocalLinks", "acheck_algorithm", "check_algorithm", "local_links", "local_world",
           "reduce_reference"]

TRANSPORTS = ("inproc", "sdma", "rdma")
REDOPS = ("sum", "max")  # reductions checked by default: exact on small integers in every dtype
REDUCE_UFUNCS = {"sum": np.add, "prod": np.multiply, "max": np.maximum, "min": np.minimum, "avg": np.add,
                 "band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor}
BOOL_UFUNCS = {"sum": np.logical_or, "prod": np.logical_and, "max": np.logical_or, "min": np.logical_and,
               "band": np.logical_and, "bor": np.logical_or, "bxor": np.logical_xor}
ROOTED = frozenset({"broadcast", "reduce", "gather", "gather_v", "scatter", "scatter_v"})
REDUCING = frozenset({"all_reduce", "reduce", "reduce_scatter", "reduce_scatter_v"})


def reduce_reference(xs: Sequence[np.ndarray], op: str) -> np.ndarray:
    """numpy's reduction of ``xs`` across ranks, in rank order, in the inputs' dtype."""
    dtype = xs[0].dtype
    ufunc = BOOL_UFUNCS[op] if dtype == np.bool_ else REDUCE_UFUNCS[op]
    out = xs[0].copy()
    for x in xs[1:]:
        out = ufunc(out, x).astype(dtype, copy=False)
    if op == "avg":
        out = (out / len(xs)).astype(dtype)
    return out


# -- jobs in one process ---------------------------------------------------------------------------
@dataclasses.dataclass
class LocalLinks:
    """The links of ``size`` ranks in this event loop: ``links[r][p]`` joins rank r to rank p."""

    links: list[dict[int, Link]]
    buffers: list[CclBuffers]
    progress: list[Progress]
    channels: list[Channel]
    single_copy: bool  # every link can read its peer's memory

    def close(self) -> None:
        """Close every link, channel and buffer (what the communicators' close does)."""
        for links in self.links:
            for link in links.values():
                link.close()
        for channel in self.channels:
            channel.close()
        for b in self.buffers:
            b.close()


async def local_links(size: int, *, transport: str = "inproc", buffsize: int = 1 << 16,
                      timeout: float = 30.0, shm_notify: bool = True) -> LocalLinks:
    """Links between ``size`` ranks in this event loop over ``transport`` (one of ``TRANSPORTS``),
    made as ``ahcomm.init`` makes them (``_bootstrap``'s transport table and handshake) and up.
    ``shm_notify=False``: sdma notifies over ZeroMQ only (no shared-memory inboxes)."""
    if transport not in TRANSPORTS:
        raise ValueError(f"transport {transport!r}: expected one of {', '.join(TRANSPORTS)}")
    progress = [Progress(r, size) for r in range(size)]
    if transport == "inproc":
        world = InprocWorld(size)
        for r in range(size):
            world.register(r, CclBuffers.local(buffsize))
        inproc: list[dict[int, Link]] = [dict(world.connect(r, progress[r].reached)) for r in range(size)]
        return LocalLinks(inproc, [world.buffers[r] for r in range(size)], progress, [], True)
    cfg = dataclasses.replace(Config.from_env({}), transport=transport)
    creds = Credentials.derive(secrets.token_hex(16))
    shared = transport == "sdma"
    buffers = [CclBuffers.shared(buffsize, f"r{r}") if shared else CclBuffers.local(buffsize) for r in range(size)]
    channels: list[Channel] = []
    try:
        for r in range(size):
            channels.append(Channel(r, buffers[r], ipc=shared, tcp_host="127.0.0.1", creds=creds,
                                    notify_rings=size if shared and shm_notify else 0))
        table = [{"rank": r, "host": "local", "endpoints": channels[r].endpoints, "pid": os.getpid(),
                  "shm": [buffers[r].ccl_in.name, buffers[r].ccl_out.name] if shared else None,
                  "buffsize": buffsize, "probe": int(buffers[r].ccl_in.array.ctypes.data),
                  "notify": channels[r].notify_description(),
                  "memory": table_name() if shared else None} for r in range(size)]
        links = [_bootstrap._connect(r, table, channels[r], cfg, "local", progress[r]) for r in range(size)]
        for channel in channels:
            channel.start()
        await asyncio.gather(*(_bootstrap._handshake(r, links[r], timeout) for r in range(size)))
    except BaseException:
        for channel in channels:
            channel.close()
        for b in buffers:
            b.close()
        raise
    for b in buffers:
        b.unlink()
    for channel in channels:
        channel.unlink()
    single = cfg.single_copy and all(link.single_copy for ls in links for link in ls.values())
    return LocalLinks(links, buffers, progress, channels, single)


async def local_world(size: int, *, transport: str = "inproc", buffsize: int = 1 << 16, algo: str = "",
                      hosts: Sequence[str] | None = None, timeout: float = 30.0,
                      single_copy: bool = True) -> list[Comm]:
    """``size`` communicators in this event loop over ``transport`` (one of ``TRANSPORTS``).

    ``hosts`` (one name per rank) fakes servers in the topology the algorithms see (the links
    stay what ``transport`` makes): two-level algorithms run in one process that way.
    ``single_copy=False`` (in-process links only): ranks that cannot read each other's memory.
    """
    if not single_copy and transport != "inproc":
        raise ValueError("single_copy=False is an option of in-process links")
    if hosts is not None and len(hosts) != size:
        raise ValueError(f"hosts names {len(hosts)} ranks, the world has {size}")
    if transport == "inproc":
        comms = await _bootstrap.create_inprocess(size, buffsize=buffsize, algo=algo, single_copy=single_copy)
        if hosts is not None:
            for c in comms:
                c._set_topology(dataclasses.replace(c.topology, hosts=tuple(hosts)))
        return comms
    made = await local_links(size, transport=transport, buffsize=buffsize, timeout=timeout)
    model = load_cost_model()
    names = tuple(hosts) if hosts is not None else ("local",) * size
    # One host over sdma: the host's mailboxes too (in-process ones: the same slots and flags as
    # the shared-memory ones, woken without a FIFO), so oneshot runs as it does between processes.
    capacity = capacity_from_env() if transport == "sdma" and size > 1 and len(set(names)) == 1 else 0
    boxes = InprocMailboxes(size, capacity).boxes if capacity else [None] * size
    return [_comm(r, size, made.links[r], made.buffers[r], made.channels[r], made.progress[r],
                  Selector(REGISTRY, algo, model), made.single_copy, names, boxes[r]) for r in range(size)]


def _comm(rank: int, size: int, links: dict[int, Link], buffers: CclBuffers, channel: Channel, progress: Progress,
          selector: Selector, single_copy: bool, hosts: tuple[str, ...], mailbox: Mailbox | None = None) -> Comm:
    kinds = tuple("self" if p == rank else links[p].kind for p in range(size))
    topo = Topology(rank=rank, size=size, hosts=hosts, link_kinds=kinds,
                    all_mapped=all(link.mapped for link in links.values()), single_copy=single_copy,
                    mailbox=mailbox.capacity if mailbox is not None else 0)

    async def on_close() -> None:
        channel.close()
        buffers.close()

    comm = Comm(rank=rank, size=size, links=links, buffers=buffers, topo=topo, progress=progress,
                selector=selector, exec_timeout=Config.from_env({}).exec_timeout, on_close=on_close)
    comm._executor.mailbox = mailbox
    return comm


# -- the check -------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Case:
    op: str
    dtype: np.dtype
    count: int
    redop: str = ""
    root: int = 0

    def describe(self, algorithm: str, size: int, transport: str) -> str:
        op = f"{self.op}({self.redop})" if self.redop else self.op
        root = f", root {self.root}" if self.op in ROOTED else ""
        return f"{algorithm} {op} of {self.count} {self.dtype.name} on {size} ranks ({transport}{root})"


def _vcounts(count: int, size: int) -> list[int]:
    """Uneven blocks (some empty) for the _v ops: count, count // 2, count // 3, ..."""
    return [count // (p + 1) for p in range(size)]


def _pair_count(count: int, src: int, dst: int) -> int:
    """all_to_all_v: what rank ``src`` sends to rank ``dst``."""
    return (count + 3 * src + dst) % (count + 2) if count else (src + dst) % 2


def _data(case: _Case, rank: int, n: int) -> np.ndarray:
    """Small integers, different on every rank (exact under sum in every dtype)."""
    values = (np.arange(n) * 7 + rank * 3 + case.count) % 5
    if case.dtype == np.bool_:
        return (values % 2).astype(np.bool_)
    return values.astype(case.dtype)


def _expected(case: _Case, xs: list[np.ndarray], rank: int, size: int) -> np.ndarray | None:
    """What ``rank`` must get (flattened), or None where the op gives it nothing to check."""
    op, c = case.op, case.count
    if op == "all_reduce":
        return reduce_reference(xs, case.redop)
    if op == "reduce":
        return reduce_reference(xs, case.redop) if rank == case.root else None
    if op == "reduce_scatter":
        return reduce_reference(xs, case.redop)[rank * c:(rank + 1) * c]
    if op == "reduce_scatter_v":
        d = np.cumsum([0, *_vcounts(c, size)])
        return reduce_reference(xs, case.redop)[d[rank]:d[rank + 1]]
    if op in ("all_gather", "all_gather_v"):
        return np.concatenate(xs)
    if op in ("gather", "gather_v"):
        return np.concatenate(xs) if rank == case.root else None
    if op == "broadcast":
        return xs[case.root]
    if op == "scatter":
        return xs[case.root][rank * c:(rank + 1) * c]
    if op == "scatter_v":
        d = np.cumsum([0, *_vcounts(c, size)])
        return xs[case.root][d[rank]:d[rank + 1]]
    if op == "all_to_all":
        return np.concatenate([x[rank * c:(rank + 1) * c] for x in xs])
    if op == "all_to_all_v":
        parts = []
        for src, x in enumerate(xs):
            d = np.cumsum([0, *(_pair_count(c, src, p) for p in range(size))])
            parts.append(x[d[rank]:d[rank + 1]])
        return np.concatenate(parts)
    if op == "barrier":
        return None
    raise ValueError(f"check_algorithm cannot check op {op!r}")


def _input_size(case: _Case, rank: int, size: int) -> int:
    op, c = case.op, case.count
    if op in ("reduce_scatter", "scatter", "all_to_all"):
        return c * size
    if op in ("reduce_scatter_v", "scatter_v"):
        return sum(_vcounts(c, size))
    if op in ("all_gather_v", "gather_v"):
        return _vcounts(c, size)[rank]
    if op == "all_to_all_v":
        return sum(_pair_count(c, rank, p) for p in range(size))
    return c


def _call(comm: Comm, case: _Case, x: np.ndarray, name: str) -> Awaitable[Any]:
    """The collective ``case`` on ``comm`` with ``x`` as this rank's input, forced to ``name``."""
    op, c, n, r = case.op, case.count, comm.size, comm.rank
    kw: dict[str, Any] = {"algorithm": name}
    calls: dict[str, Callable[[], Awaitable[Any]]] = {
        "all_reduce": lambda: comm.all_reduce(x, case.redop, **kw),
        "reduce": lambda: comm.reduce(x, case.redop, case.root, **kw),
        "reduce_scatter": lambda: comm.reduce_scatter(x, case.redop, **kw),
        "reduce_scatter_v": lambda: comm.reduce_scatter_v(x, _vcounts(c, n), case.redop, **kw),
        "all_gather": lambda: comm.all_gather(x, **kw),
        "all_gather_v": lambda: comm.all_gather_v(x, counts=_vcounts(c, n), **kw),
        "gather": lambda: comm.gather(x, case.root, **kw),
        "gather_v": lambda: comm.gather_v(x, case.root, counts=_vcounts(c, n), **kw),
        "broadcast": lambda: comm.broadcast(x, case.root, **kw),
        "scatter": lambda: comm.scatter(x, case.root, **kw),
        "scatter_v": lambda: comm.scatter_v(x, _vcounts(c, n), case.root, **kw),
        "all_to_all": lambda: comm.all_to_all(x, **kw),
        "all_to_all_v": lambda: comm.all_to_all_v(x, [_pair_count(c, r, p) for p in range(n)],
                                                  recv_counts=[_pair_count(c, p, r) for p in range(n)], **kw),
        "barrier": lambda: comm.barrier(),  # the one barrier algorithm: no per-call choice
    }
    if op not in calls:
        raise ValueError(f"check_algorithm cannot check op {op!r}")
    return calls[op]()


def _compare(what: str, rank: int, got: Any, want: np.ndarray) -> None:
    if isinstance(got, tuple) and hasattr(got, "data"):  # Gathered(data, counts)
        got = got.data
    if got is None:
        raise AssertionError(f"check_algorithm: {what}: rank {rank} got no result")
    flat = np.asarray(got).reshape(-1)
    if flat.dtype != want.dtype:
        raise AssertionError(f"check_algorithm: {what}: rank {rank} got dtype {flat.dtype}, numpy {want.dtype}")
    if flat.size != want.size:
        raise AssertionError(f"check_algorithm: {what}: rank {rank} got {flat.size} elements, numpy {want.size}")
    wrong = np.flatnonzero(flat != want)
    if wrong.size:
        i = int(wrong[0])
        raise AssertionError(f"check_algorithm: {what}: rank {rank} differs from numpy at {wrong.size} of "
                             f"{want.size} elements, first at [{i}]: got {flat[i]!r}, numpy {want[i]!r}")


def _cases(algorithm: Algorithm, ops: Sequence[str] | None, dtypes: Sequence[Any], counts: Sequence[int],
           redops: Sequence[str], size: int) -> Iterator[_Case]:
    for op in sorted(algorithm.ops) if ops is None else ops:
        if op == "barrier":  # no data: one case
            yield _Case(op, np.dtype(np.uint8), 0)
            continue
        for dtype in (np.dtype(d) for d in dtypes):
            for count in counts:
                for redop in (redops if op in REDUCING else ("",)):
                    if redop and dtype == np.bool_ and redop not in BOOL_UFUNCS:
                        continue
                    for root in sorted({0, size - 1}) if op in ROOTED else (0,):
                        yield _Case(op, dtype, count, redop, root)


async def _check_world(algorithm: Algorithm, size: int, transport: str, cases: list[_Case], buffsize: int,
                       timeout: float, hosts: Callable[[int], Sequence[str]] | None) -> int:
    comms = await local_world(size, transport=transport, buffsize=buffsize,
                              hosts=None if hosts is None else hosts(size))
    checked = 0
    try:
        for case in cases:
            if not algorithm.select(Call(op=case.op, seq=0, dtype=case.dtype, count=case.count), comms[0].topology):
                continue  # not on this topology (mesh over unmapped links, hier on one host, ...)
            what = case.describe(algorithm.name, size, transport)
            xs = [_data(case, r, _input_size(case, r, size)) for r in range(size)]
            try:
                got = await asyncio.wait_for(
                    asyncio.gather(*(_call(c, case, xs[c.rank], algorithm.name) for c in comms)), timeout)
            except TimeoutError:
                raise AssertionError(f"check_algorithm: {what}: no result within {timeout:g} s") from None
            except Exception as exc:
                raise AssertionError(f"check_algorithm: {what}: raised {exc!r}") from exc
            for r in range(size):
                want = _expected(case, xs, r, size)
                if want is not None:
                    _compare(what, r, got[r], want)
            checked += 1
    finally:  # together: a rank's close waits for its peers'
        await asyncio.gather(*(c.close() for c in comms), return_exceptions=True)
    return checked


@contextlib.contextmanager
def _registered(algorithm: Algorithm) -> Iterator[None]:
    """``algorithm`` selectable by name for the check; the registry as it was afterwards."""
    before = dict(REGISTRY.algorithms)
    REGISTRY.register(algorithm)
    try:
        yield
    finally:
        REGISTRY.algorithms.clear()
        REGISTRY.algorithms.update(before)


def check_algorithm(algorithm: Algorithm | str, *, ops: Sequence[str] | None = None,
                    world_sizes: Sequence[int] = (2, 3, 4), dtypes: Sequence[Any] = ("float32", "int32"),
                    counts: Sequence[int] = (0, 1, 7, 1000, 40_000), redops: Sequence[str] = REDOPS,
                    transports: Sequence[str] = ("inproc",), buffsize: int = 1 << 16,
                    hosts: Callable[[int], Sequence[str]] | None = None, timeout: float = 60.0) -> int:
    """Check ``algorithm`` (an instance, or a registered name) against numpy; return how many
    cases ran.

    Every op of ``ops`` (default: all the algorithm's) runs on jobs of each of ``world_sizes``
    over each of ``transports``, for every dtype of ``dtypes``, every count of ``counts``
    (elements per rank; blocks of the _v ops are count, count // 2, ...), every reduction of
    ``redops`` and roots 0 and size - 1. ``hosts(size)`` names each rank's host (fake servers,
    for two-level algorithms). Cases the algorithm's ``select`` refuses on the topology are
    skipped; none left is a failure. Runs its own event loop: call it from synchronous code
    (``acheck_algorithm`` inside a running loop). Raises ``AssertionError`` at the first
    wrong result, exception or hang.
    """
    return asyncio.run(acheck_algorithm(algorithm, ops=ops, world_sizes=world_sizes, dtypes=dtypes, counts=counts,
                                        redops=redops, transports=transports, buffsize=buffsize, hosts=hosts,
                                        timeout=timeout))


async def acheck_algorithm(algorithm: Algorithm | str, *, ops: Sequence[str] | None = None,
                           world_sizes: Sequence[int] = (2, 3, 4), dtypes: Sequence[Any] = ("float32", "int32"),
                           counts: Sequence[int] = (0, 1, 7, 1000, 40_000), redops: Sequence[str] = REDOPS,
                           transports: Sequence[str] = ("inproc",), buffsize: int = 1 << 16,
                           hosts: Callable[[int], Sequence[str]] | None = None, timeout: float = 60.0) -> int:
    """``check_algorithm`` for code already inside an event loop."""
    if isinstance(algorithm, str):
        if algorithm not in REGISTRY.algorithms:
            raise ValueError(f"check_algorithm: no algorithm named {algorithm!r}; registered: "
                             f"{', '.join(REGISTRY.names())}")
        algorithm = REGISTRY.algorithms[algorithm]
    unknown = set(ops or ()) - algorithm.ops
    if unknown:
        raise ValueError(f"check_algorithm: {algorithm.name} does not run {', '.join(sorted(unknown))} "
                         f"(its ops: {', '.join(sorted(algorithm.ops))})")
    checked = 0
    with _registered(algorithm):
        for transport in transports:
            for size in world_sizes:
                cases = list(_cases(algorithm, ops, dtypes, counts, redops, size))
                checked += await _check_world(algorithm, size, transport, cases, buffsize, timeout, hosts)
    if not checked:
        raise AssertionError(f"check_algorithm: {algorithm.name} selected none of its cases on "
                             f"{', '.join(transports)} links (its select() refuses every topology tried)")
    return checked

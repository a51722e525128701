"""Direct (one host, single copy): every receiver reads the sender's user buffer itself.

For broadcast and all_gather on one host, OpenMPI's CMA idea: each byte is copied once,
by the rank that receives it, straight out of the sender's user buffer into its own
destination (``DataLink.read``: ``process_vm_readv`` between processes, a memmove in one
process). Nothing is staged in a CCL buffer or mailbox slot.

A run is two mailbox publications (``transports.mailbox``, as ``oneshot`` uses them):

1. every rank publishes the address of its input (broadcast: the root only; the others a
   header), and waits until every peer's publication is there (the fingerprints checked);
2. each receiver reads what it needs - the root's vector, or every peer's block - in
   slices of ``SLICE_BYTES``, on up to two threads where the host's cores allow (ctypes
   releases the GIL); a rank's reads below ``INLINE_BYTES`` (16 MiB) inline on the event
   loop's thread, in one piece each;
3. every rank publishes "done" and waits for every peer's: no rank returns, and so reuses
   or frees the buffer its peers read, before every reader has finished.

Where a rank cannot read its peers' memory (``Topology.single_copy`` false: the kernel's
ptrace policy, a container, ``AHCOMM_SINGLE_COPY=0``) the run falls back to ``oneshot``'s
staged path in slot-sized slices; the selector does not pick direct there (no estimate),
but a call that names it still runs. ``comm.stats()["paths"]`` counts which path ran
(``direct.single_copy``, ``direct.staged``).

A peer that dies fails the run: a read of a dead process raises ``PeerFailure``, and the
executor fails the mailbox wait of every other rank (as for oneshot).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import numpy as np

from ..transports.base import DataLink
from . import _mailbox_sync as sync
from .base import Algorithm, Call, Context, Resources, Topology
from .cost import CostModel, Work
from .oneshot import STEP, OneShot

OPS = frozenset({"broadcast", "all_gather"})
# One read task's bytes at most (a failed peer is noticed between slices). Measured at 64 MiB,
# np=2, load 1-2: slices of 4 MiB 11.5-12.0 GB/s, of 32 MiB 13.6-13.9 (mesh's two halves 13.1-14.0).
SLICE_BYTES = 32 << 20
MIN_SLICE = 512 << 10  # a read is not cut below this to feed a second thread
# A rank's reads (and local copy) below this run inline on the event loop's thread: every hand-off
# to a copy thread and back is a wake-up on each side, and two threads reading one source contend.
# Measured (np=2, blocks of calls interleaved in one job, load 1.5-2.4, us per call): broadcast
# 2 MiB inline 410-533 vs two threads 660-1294 (one thread 935), 4 MiB 567 vs 968 (one: 526),
# 8 MiB 1050 vs 1262; 16 MiB threads ahead (1241 vs 1404), 64 MiB too (5479 vs 6699); all_gather
# 2 MiB 162 vs 511, np=4 1591 vs 2989 (results/2026-11-25-bw2.md).
INLINE_BYTES = 16 << 20
# Per-rank bytes up to which the selector leaves an op to the others (oneshot's slots): a 2 MiB
# copy through the kernel (4 KiB pages) takes 160-210 us, two in-cache copies through 1 MiB slots
# far less. Measured (np=2, blocks interleaved in one job, load 2.5, us/call, oneshot / direct /
# mesh): broadcast 2 MiB 124 / 353 / 376, 4 MiB 182 / 389 / 622 (the model prices oneshot's
# copies as out-of-cache and picks direct there, still ahead of mesh), 8 MiB 414-1473 / 630-940 /
# 1157; all_gather (in all) 2 MiB 180 / 188, 4 MiB 541 / 402, 8 MiB 1256 / 752; np=4 (load 3.3)
# broadcast 2 MiB 736 / 916, 4 MiB 1465 / 1348, 8 MiB 2169 / 1655; all_gather 2 MiB 670 / 939,
# 4 MiB 1204 / 1325, 8 MiB 2517 / 2614 (results/2026-11-25-bw2.md).
MIN_BYTES = {"all_gather": 1 << 20, "broadcast": 2 << 20}
THREADS = 2  # copy threads per rank at most (AHCOMM_DIRECT_THREADS), used where cores allow

_FALLBACK = OneShot()
_POOLS: dict[int, ThreadPoolExecutor] = {}


def max_threads() -> int:
    """AHCOMM_DIRECT_THREADS (default ``THREADS``), at least 1."""
    raw = os.environ.get("AHCOMM_DIRECT_THREADS", "").strip()
    return max(1, int(raw)) if raw.isdigit() else THREADS


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def readers(call: Call, topo: Topology) -> int:
    """Ranks of the host that read at once in ``call``."""
    return topo.size - 1 if call.op == "broadcast" else topo.size


def threads(call: Call, topo: Topology, cores: int = 0, most: int = 0) -> int:
    """Copy threads of one reader: up to ``max_threads()``, as many as keep the host's copy
    threads within four times its cores (a thread waiting on its pages leaves the core to
    another). Measured on 2 cores, 3 interleaved rounds, medians: np=4 64 MiB broadcast 3.99
    GB/s with two threads per reader vs 3.62 with one (mesh, two engines: 3.70); np=2 all_gather
    two threads per rank, as mesh's two engines. ``cores`` and ``most`` default to this process's
    cores and ``max_threads()``; the cost estimate passes the model's (rank 0's) and ``THREADS``,
    so that every rank prices a call alike."""
    return max(1, min(most or max_threads(), 4 * (cores or _cores()) // max(1, readers(call, topo))))


def _pool(n: int) -> ThreadPoolExecutor:
    pool = _POOLS.get(n)
    if pool is None:
        pool = _POOLS[n] = ThreadPoolExecutor(max_workers=n, thread_name_prefix=f"ahcomm-direct{n}")
    return pool


def _inline(fn: Any, *args: Any, **kwargs: Any) -> None:
    fn(*args, **kwargs)


def _address(array: np.ndarray) -> np.ndarray:
    return np.array([array.ctypes.data], np.int64)


class Direct(Algorithm):
    name = "direct"
    ops = OPS
    exchanges = True  # every rank hears from every peer in every run (two publications)

    def select(self, call: Call, topo: Topology) -> bool:
        return call.op in OPS and call.counts is None and (topo.size == 1 or topo.mailbox > 0)

    def resources(self, call: Call, topo: Topology, half_bytes: int) -> Resources:
        """Single copy: the whole call in one run (it slices its reads itself); staged: oneshot's slices."""
        if topo.single_copy:
            return Resources()
        return _FALLBACK.resources(call, topo, half_bytes)

    def cost(self, call: Call, topo: Topology, model: CostModel) -> float | None:
        """None (never picked by the selector) where ranks cannot read each other's memory, and
        where a rank's input fits one mailbox slot: there oneshot's single publication beats
        direct's two (measured np=2/4 at 64 KiB: 140-300 vs 280-2100 us on the loaded host); nor
        below ``MIN_BYTES`` per rank."""
        nbytes = call.count * call.itemsize
        if topo.size > 1 and (not topo.single_copy or nbytes <= max(topo.mailbox, MIN_BYTES.get(call.op, 0))):
            return None
        return super().cost(call, topo, model)

    def work(self, call: Call, topo: Topology, model: CostModel, whole: float, block: float) -> Work:
        """Two mailbox steps (publish and wait, ``STEP`` of a link's alpha each); a receiver copies
        what it receives once: broadcast ``m`` (the readers work, the root only publishes),
        all_gather ``n m`` (its own block locally, the peers' through the kernel); reads of at
        least ``INLINE_BYTES`` are handed to threads (one engine hand-off), spread over
        ``threads`` of them."""
        busy = topo.size - 1 if call.op == "broadcast" else None
        copied = whole
        return Work(rounds=2 * STEP, copied=copied, engines=1 if copied >= INLINE_BYTES else 0, busy=busy,
                    streams=threads(call, topo, model.cores or 1, THREADS))

    async def orchestrate(self, ctx: Context) -> None:
        if not ctx.topo.single_copy:
            ctx.tally("direct.staged")
            await _FALLBACK.orchestrate(ctx)
            await sync.settle(ctx)  # a broadcast's non-root waited for the root only: direct's runs are exchanged
            return
        ctx.tally("direct.single_copy")
        box = ctx.mailbox
        assert box is not None, "direct runs only where the executor has a mailbox"
        call, n, r = ctx.call, ctx.size, ctx.rank
        src, dst = ctx.src, ctx.dst
        root = call.root
        mine = None if call.op == "broadcast" and r != root else _address(src)
        tick, _ = await sync.publish(ctx, mine)
        await sync.arrivals(ctx, tick)
        jobs: list[tuple[DataLink, np.ndarray, int]] = []
        if call.op == "broadcast":
            if r != root:
                jobs.append((ctx.links[root], dst, int(box.payload(root, tick).view(np.int64)[0])))
        else:  # dst: (n, count), rows contiguous
            for p in range(n):
                if p != r:
                    jobs.append((ctx.links[p], dst[p], int(box.payload(p, tick).view(np.int64)[0])))
        local = (dst[r], src) if call.op == "all_gather" else (dst, src) if r == root else None
        if local is not None and np.shares_memory(*local):
            local = None  # in place
        await _read_all(jobs, local, threads(call, ctx.topo))
        tick, _ = box.publish(call.seq, ctx.fingerprint)  # done reading: the owners may go on (nothing loose)
        # A broadcast's root waits here for the whole read: sleeping at once keeps its spin for short waits
        await sync.arrivals(ctx, tick, may_spin=call.op != "broadcast" or r != root)


async def _read_all(jobs: list[tuple[DataLink, np.ndarray, int]], local: tuple[np.ndarray, np.ndarray] | None,
                    lanes: int) -> None:
    """Read every job (link, destination, peer's address) and make the ``local`` copy (dst, src):
    inline if small, else in slices on ``lanes`` threads, the local copy among them; waits for
    every slice (none still writes once this returns)."""
    total = sum(dst.nbytes for _, dst, _ in jobs) + (local[0].nbytes if local is not None else 0)
    if total < INLINE_BYTES:
        if local is not None:
            np.copyto(*local)
        for link, dst, addr in jobs:
            link.read(dst, addr, _inline)
        return
    piece = max(MIN_SLICE, min(SLICE_BYTES, -(-total // lanes)))
    pool = _pool(lanes)
    tasks: list[Future[Any]] = []

    def run(fn: Any, *args: Any, **kwargs: Any) -> "asyncio.Future[Any]":
        tasks.append(pool.submit(fn, *args, **kwargs))
        return asyncio.wrap_future(tasks[-1])

    futures: list[Awaitable[Any]] = []
    if local is not None:  # on the threads too: it overlaps the reads
        to, of = (a.reshape(-1).view(np.uint8) for a in local)
        futures += [run(np.copyto, to[lo:lo + piece], of[lo:lo + piece]) for lo in range(0, to.nbytes, piece)]
    for link, dst, addr in jobs:
        raw = dst.reshape(-1).view(np.uint8)
        for lo in range(0, raw.nbytes, piece):
            fut = link.read(raw[lo:lo + piece], addr + lo, run)
            assert fut is not None
            futures.append(fut)
    try:
        await asyncio.gather(*futures)
    except BaseException:
        for task in tasks:
            task.cancel()  # slices not started yet never start
        wait(tasks)  # those running finish (one slice at most each): nothing writes into dst after we return
        raise

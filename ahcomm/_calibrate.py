"""``ahcomm-bench calibrate``: measure the cost model's numbers on this host and cache them.

The host's rates in this process (copy and reduction, out of cache, in cache, with every core
copying; a copy engine's hand-off), then a 2-rank job per link kind that times
``CALIBRATION_CASES`` (the links' alpha and beta, a notify's and a call's CPU, a notify after a
big copy), fitted into a ``CostModel`` and saved where ``cost.load`` finds it.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import statistics
import sys
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from ._bench_case import BLOCKED, Case, measure, runnable
from ._config import last_level_cache, usable_cores

if TYPE_CHECKING:
    from .algorithms.call import Topology
    from .algorithms.cost import CostModel, LinkCost

PRIVATE = "_calibrate"  # what `calibrate` starts on each of its ranks (``ahcomm-bench _calibrate``); not in --help


# What the calibration times on 2 ranks, per link kind: (algorithm, op, bytes per rank's block).
# Only ops whose result depends on every rank (no progress message afterwards, as the executor
# sends after a broadcast or an all_to_all), with different mixes of steps, notifies and bytes.
CALIBRATION_CASES = (
    ("ring", "all_reduce", 8), ("ring", "all_reduce", 64 << 10), ("ring", "all_gather", 8),
    ("ring", "all_gather", 256 << 10), ("ring", "all_gather", 2 << 20), ("ring", "all_gather", 8 << 20),
    ("rhd", "all_reduce", 8), ("mesh", "all_reduce", 8), ("mesh", "all_gather", 8),
)
# Each case is timed this often; the median of the tries counts. The fastest of 3 (as before)
# let one lucky try set a point: ten calibrations in a row fitted sdma at 4.6-12.6 GB/s; six with
# the median of 5, 6.0-8.9 GB/s (one calibration takes 7-8 s on 2 cores, 10.5 s on one);
# results/2026-11-25-sim-fidelity-4.md.
CALIBRATION_REPEATS = 5
CPU_CASE_BYTES = 64 << 10  # cases up to this size also time their CPU per call (``fit_cpu``)
CPU_CALLS = 50  # calls per CPU timing; the median of ``CALIBRATION_REPEATS`` timings counts


async def calibrate_rank(out_path: str) -> None:
    """In a 2-rank job: time each ``CALIBRATION_CASES`` entry this link kind can run (median per
    op, the slower rank's, the median of ``CALIBRATION_REPEATS`` tries); rank 0 writes them
    to ``out_path`` with its core count and whether single-copy reads work."""
    import ahcomm

    async with await ahcomm.init() as comm:
        dtype = np.dtype(np.float32)
        points = []
        for algorithm, op, nbytes in CALIBRATION_CASES:
            if algorithm not in runnable(comm, op, dtype):
                continue
            total = nbytes * (comm.size if op in BLOCKED else 1)
            case = Case(comm, op, total, dtype, "sum", 0, algorithm, False)
            tries = []
            for _ in range(CALIBRATION_REPEATS):
                _, median_us, _ = await measure(case, 3, 30, 0.3)
                slowest = await comm.all_reduce(np.array([median_us]), "max")
                tries.append(float(slowest[0]) * 1e-6)
            point = {"algorithm": algorithm, "op": op, "count": case.block, "seconds": statistics.median(tries)}
            if nbytes <= CPU_CASE_BYTES and "sdma" in comm.topology.link_kinds:  # what fit_cpu reads
                point["cpu"] = statistics.median([await cpu_per_call(case) for _ in range(CALIBRATION_REPEATS)])
            points.append(point)
        cold = await cold_notify(comm) if "sdma" in comm.topology.link_kinds else 0.0
        if comm.rank == 0:
            with open(out_path, "w") as f:
                json.dump({"points": points, "cores": usable_cores(), "cold_notify": cold,
                           "single_copy": comm.topology.single_copy}, f)


async def cpu_per_call(case: Case) -> float:
    """The CPU seconds a call of ``case`` costs its process (every thread: the event loop's, the
    copy engines', ZeroMQ's), averaged over the ranks: what ranks sharing cores take from each
    other, where a call's wall time at 2 ranks on 2 cores is also its latency."""
    comm = case.comm
    await comm.barrier()
    start = time.process_time()
    for _ in range(CPU_CALLS):
        await case.issue()
    mine = (time.process_time() - start) / CPU_CALLS
    total = await comm.all_reduce(np.array([mine]), "sum")
    return float(total[0]) / int(comm.size)


COLD_CALLS = 50  # 8-byte broadcasts per timing of ``cold_notify`` (after 10 more to warm up)


async def cold_notify(comm: Any) -> float:
    """Rank 0's seconds more per 8-byte ring broadcast (one notify each way) when it has just
    copied ``COLD_BYTES`` than when it has spun as long: the model's ``cold_notify`` (the median of
    ``CALIBRATION_REPEATS`` pairs of timings, in alternating order; at least 0). Either way rank 0
    starts the call at least ``ASLEEP`` after the last, so the peer it wakes sleeps, as the
    simulator charges it. Only rank 0's figure means anything."""
    from .algorithms.cost import COLD_BYTES
    from .transports.sim import ASLEEP

    src = np.ones(COLD_BYTES // 4, np.float32)
    dst = src.copy()
    start = time.perf_counter()
    for _ in range(10):
        np.copyto(dst, src)
    pause = max((time.perf_counter() - start) / 10, ASLEEP)
    x = np.zeros(2, np.float32)
    extra = []
    for repeat in range(CALIBRATION_REPEATS):
        medians = {}
        for cold in ((False, True) if repeat % 2 == 0 else (True, False)):
            await comm.barrier()
            times = []
            for i in range(COLD_CALLS + 10):
                if comm.rank == 0:
                    end = time.perf_counter() + pause
                    if cold:
                        np.copyto(dst, src)
                    while time.perf_counter() < end:  # the rest of the pause touching no memory
                        pass
                t0 = time.perf_counter()
                await comm.broadcast(x, root=0, algorithm="ring")
                if i >= 10:
                    times.append(time.perf_counter() - t0)
            medians[cold] = statistics.median(times)
        extra.append(medians[True] - medians[False])
    return max(0.0, statistics.median(extra))


PROBE_BYTES = (32 << 20, 128 << 20)  # each memory-bound probe array: at least, at most


def probe_bytes(cache: int | None = None) -> int:
    """Bytes of each of ``local_rates``' three arrays: a quarter of the last-level cache, from 32 MiB
    (the three exceed a 32 MiB cache) to 128 MiB (below glibc's non-temporal threshold, 181 MiB on
    the Intel VM: its ordinary stores, as a collective's copies make). With 32 MiB arrays on the
    Intel VM (480 MiB of it) the copy ran at 14.6 GB/s, in cache; with 128 MiB at 7.2, as the
    ring's 64 MiB calls copy there (results/2026-11-27-shm-notify.md)."""
    cache = last_level_cache() if cache is None else cache
    low, high = PROBE_BYTES
    return max(low, min(cache // 4, high)) // 64 * 64


def local_rates() -> tuple[float, float, float]:
    """(seconds per byte reduced, seconds per byte copied, seconds per copy-engine hand-off),
    each the best of several passes (noise only adds), over arrays larger than the cache
    (``probe_bytes``): memory-bound, as big calls are."""
    from concurrent.futures import ThreadPoolExecutor

    a, b, c = (np.ones(probe_bytes() // 4, np.float32) for _ in range(3))
    best_add = best_copy = math.inf
    for _ in range(7):
        t0 = time.perf_counter()
        np.add(a, b, out=c)
        t1 = time.perf_counter()
        np.copyto(c, a)
        t2 = time.perf_counter()
        best_add, best_copy = min(best_add, t1 - t0), min(best_copy, t2 - t1)

    async def handoffs() -> float:  # a tiny task through a one-thread engine, as Stream.memory runs one
        loop = asyncio.get_running_loop()
        with ThreadPoolExecutor(max_workers=1) as engine:
            times = []
            for _ in range(200):
                t0 = time.perf_counter()
                await loop.run_in_executor(engine, np.copyto, c[:16], a[:16])
                times.append(time.perf_counter() - t0)
        return float(np.median(times))

    return best_add / c.nbytes, best_copy / c.nbytes, asyncio.run(handoffs())


STAGED_SLOT = 2 << 20  # bytes of the slot ``slot_rate`` rewrites before each piece (ring's pieces)


def slot_rate(reduce: bool = True, passes: int = 5) -> float:
    """Seconds per byte reduced in place out of a slot just written, as a ring's receiver does
    (``dst += slot``), or (``reduce`` False) copied out of it: a destination of ``probe_bytes``
    from memory, piece by piece, a ``STAGED_SLOT`` slot rewritten before each piece (the peer's
    put); the best of ``passes``, the reductions or copies alone timed."""
    dst = np.ones(probe_bytes() // 4, np.float32)
    slot, fresh = np.ones(STAGED_SLOT // 4, np.float32), np.ones(STAGED_SLOT // 4, np.float32)
    piece = slot.size
    best = math.inf
    for _ in range(passes):
        spent = 0.0
        for lo in range(0, dst.size - piece + 1, piece):
            np.copyto(slot, fresh)
            t0 = time.perf_counter()
            if reduce:
                np.add(dst[lo:lo + piece], slot, out=dst[lo:lo + piece])
            else:
                np.copyto(dst[lo:lo + piece], slot)
            spent += time.perf_counter() - t0
        best = min(best, spent)
    return best / (dst.size // piece * piece * 4)


SHARED_COPIERS = 8  # threads at most for the shared copy rate (each holds 64 MiB of arrays)


def shared_copy_rate(cores: int, passes: int = 5, copies: int = 6) -> float:
    """Seconds per byte that each of ``cores`` threads copies while all copy at once (numpy
    releases the GIL: ranks of one server copying together share its memory bandwidth). Each
    thread copies 32 MiB ``copies`` times from a common start; a pass counts the threads' CPU
    time (``thread_time``: time waiting for a core that another program holds does not count,
    time stalled on memory does) over the bytes; the best of ``passes`` (noise only adds)."""
    import threading

    def copier(src: np.ndarray, dst: np.ndarray, start: threading.Barrier, spent: list[float]) -> None:
        start.wait()
        t0 = time.thread_time()
        for _ in range(copies):
            np.copyto(dst, src)
        spent.append(time.thread_time() - t0)

    cores = max(1, cores)
    arrays = [(np.ones(8 << 20, np.float32), np.empty(8 << 20, np.float32)) for _ in range(cores)]
    nbytes = arrays[0][1].nbytes
    best = math.inf
    for _ in range(passes):
        spent: list[float] = []
        start = threading.Barrier(cores)
        threads = [threading.Thread(target=copier, args=(*pair, start, spent), daemon=True) for pair in arrays]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        best = min(best, sum(spent) / (cores * copies * nbytes))
    return best


HOT_PIECE = 1 << 20  # bytes each thread copies or reduces per round in ``hot_rates``


def hot_rates(threads: int, rounds: int = 100, passes: int = 5) -> tuple[float, float]:
    """(seconds per byte copied, per byte reduced) where the data is in cache but was written by
    another core, as a rank reads what a peer just wrote: ``threads`` threads (at most 2) copy,
    then add, 1 MiB pieces in lock-step, each round reading the piece another thread wrote in
    the round before. Per pass, the median of every operation's CPU time (``thread_time``):
    outliers only move the tail (a pass's summed CPU time once read 2.6 GB/s against 36; wall
    times read 28-45 GB/s over five runs, CPU-time medians 37-42). The fastest pass's median
    counts: a whole pass runs in about 10 ms, and on this VM a stolen stretch (CPU time counts
    the hypervisor's) once slowed every operation of the three passes pooled then to 3.1 GB/s."""
    import threading

    threads = max(1, min(2, threads))
    count = HOT_PIECE // 4
    pieces = [[np.ones(count, np.float32) for _ in range(threads)] for _ in range(2)]
    own = [np.ones(count, np.float32) for _ in range(threads)]

    def worker(t: int, reduce: bool, step: threading.Barrier, took: list[float]) -> None:
        step.wait()
        for r in range(rounds):
            src, dst = pieces[r % 2][(t + 1) % threads], pieces[(r + 1) % 2][t]
            t0 = time.thread_time()
            if reduce:
                np.add(src, own[t], out=dst)
            else:
                np.copyto(dst, src)
            took.append(time.thread_time() - t0)
            step.wait()

    rates = []
    for reduce in (False, True):
        medians = []
        for _ in range(passes):
            took: list[float] = []
            step = threading.Barrier(threads)
            workers = [threading.Thread(target=worker, args=(t, reduce, step, took), daemon=True)
                       for t in range(threads)]
            for w in workers:
                w.start()
            for w in workers:
                w.join()
            for row in pieces:  # sums grow: every pass starts from ones
                for piece in row:
                    piece.fill(1.0)
            medians.append(statistics.median(took))
        rates.append(min(medians) / HOT_PIECE)
    return rates[0], rates[1]


def _pair(kind: str, single_copy: bool) -> "Topology":
    """The calibration job's topology: 2 ranks on one host joined by ``kind`` links."""
    from .algorithms import Topology

    return Topology(rank=0, size=2, hosts=("calibration",) * 2, link_kinds=("self", kind),
                    all_mapped=kind != "rdma", single_copy=single_copy and kind != "rdma")


def fit_link(kind: str, points: list[dict[str, Any]], model: CostModel, single_copy: bool) -> tuple[LinkCost, float]:
    """(LinkCost, latency scale) for ``kind`` from timed ``points``.

    The algorithms' own ``cost()`` gives each point's coefficients: evaluated with a model
    whose only nonzero number is the step (``alpha``) and notify (``task``) cost in the
    ratio of ``model``'s, then with only ``beta``; the host's gamma, copy and engine costs
    are known (engine hand-offs only where the 2 ranks leave ``model.cores`` a core to spare:
    the streams copy inline otherwise). Weighted least squares (relative error) then fits t = s * latency + beta *
    bytes + known, s scaling alpha and task. There is no intercept: the step-wise cases differ
    little in steps, and a free per-call constant would swallow them (what every collective
    costs alike lands in the latency, which all candidates pay). A fit that comes out
    negative keeps the model's numbers for that term.
    """
    import dataclasses

    from .algorithms import REGISTRY, Call
    from .algorithms.cost import CostModel, LinkCost, call_bytes

    topo = _pair(kind, single_copy)
    base = model.links[kind]
    zero = {k: LinkCost(0.0, 0.0) for k in model.links}
    latency = CostModel(links={**zero, kind: LinkCost(base.alpha, 0.0)}, gamma=0.0, copy=0.0, task=model.task,
                        engine=0.0)
    per_byte = CostModel(links={**zero, kind: LinkCost(0.0, 1.0)}, gamma=0.0, copy=0.0, task=0.0, engine=0.0)
    known = dataclasses.replace(model, links={**zero, kind: LinkCost(0.0, 0.0)}, task=0.0, cores=0,
                                engine=model.engine_cost(topo))  # none where 2 ranks fill the cores
    rows, y = [], []
    for p in points:
        call = Call(op=p["op"], seq=0, dtype=np.dtype(np.float32), count=int(p["count"]))
        algorithm = REGISTRY.algorithms[p["algorithm"]]
        rates = model.for_call(2, call_bytes(call, 2)[0])  # in cache where the call's data fits
        host = dataclasses.replace(known, copy=rates.copy, gamma=rates.gamma, copy_shared=rates.copy_shared)
        costs = [algorithm.cost(call, topo, m) or 0.0 for m in (latency, per_byte, host)]
        rows.append([costs[0], costs[1]])
        y.append(p["seconds"] - costs[2])
    a, t = np.array(rows), np.array(y)
    w = 1.0 / np.maximum(np.array([p["seconds"] for p in points]), 1e-6)
    (scale, beta), *_ = np.linalg.lstsq(a * w[:, None], t * w, rcond=None)
    if scale <= 0:  # keep the model's latency; refit the bytes
        scale = 1.0
        beta = float(np.sum((t - a[:, 0]) * a[:, 1] * w * w) / max(np.sum(a[:, 1] ** 2 * w * w), 1e-30))
    if beta <= 0:
        beta = base.beta
    return LinkCost(alpha=base.alpha * float(scale), beta=float(beta)), float(scale)


def fit_cpu(points: list[dict[str, Any]], single_copy: bool) -> tuple[float, float]:
    """(CPU seconds per notify, CPU seconds per call beside its notifies) from the CPU per call
    of ``points`` that have it: least squares of ``cpu = launch + tasks * notify`` over them, a
    case's notifies from its algorithm's own estimate (a model whose only cost is one second per
    notify, 2 ranks on sdma links). Measured on the 2-core Intel VM: 27 us per notify and 49 us
    per call, where the fitted ``task`` (CPU and latency, which 2 ranks on 2 cores cannot tell
    apart) was 51 us; 4 ranks on those cores spent 27 us of CPU per extra notify
    (results/2026-11-27-cpu-per-call.md). No launch where the fit gives a negative one; (0, 0)
    (not measured) where the cases do not differ in notifies (the two cannot be told apart) or
    without a positive per-notify cost. A case whose algorithm gives no estimate is left out."""
    from .algorithms import REGISTRY, Call
    from .algorithms.cost import CostModel, LinkCost

    topo = _pair("sdma", single_copy)
    per_notify = CostModel(links={k: LinkCost(0.0, 0.0) for k in CostModel().links}, gamma=0.0, copy=0.0,
                           task=1.0, engine=0.0)
    tasks, cpu = [], []
    for p in points:
        if "cpu" in p:
            call = Call(op=p["op"], seq=0, dtype=np.dtype(np.float32), count=int(p["count"]))
            notifies = REGISTRY.algorithms[p["algorithm"]].cost(call, topo, per_notify)
            if notifies is not None:
                tasks.append(notifies)
                cpu.append(float(p["cpu"]))
    if len(set(tasks)) < 2:
        return 0.0, 0.0
    x, y = np.array(tasks), np.array(cpu)
    (launch, notify), *_ = np.linalg.lstsq(np.stack([np.ones_like(x), x], axis=1), y, rcond=None)
    if launch < 0:
        launch, notify = 0.0, float(x @ y / max(float(x @ x), 1e-30))
    return (float(notify), float(launch)) if notify > 0 else (0.0, 0.0)


def calibrate() -> None:
    """Measure the cost model's numbers on this host and cache them for every later job."""
    import dataclasses
    import tempfile

    from .algorithms import cost as _cost
    from .run import launch

    gamma, copy, engine = local_rates()
    cores = usable_cores()  # the cores the job's ranks run on (as direct's copy threads count them)
    copiers = min(SHARED_COPIERS, cores)
    shared = copy * shared_copy_rate(copiers) / shared_copy_rate(1)  # the ratio of like measurements
    print(f"reduce: {1 / gamma / 1e9:.2f} GB/s, copy: {1 / copy / 1e9:.2f} GB/s "
          f"({1 / shared / 1e9:.2f} GB/s each with {copiers} copying at once), engine hand-off: {engine * 1e6:.0f} us")
    gamma_staged = slot_rate()
    print(f"reduce in place out of a slot just written: {1 / gamma_staged / 1e9:.2f} GB/s")
    copy_hot, gamma_hot = hot_rates(cores)
    cache = last_level_cache()
    print(f"in cache ({cache >> 20} MiB last-level; calls whose data fits a third of it with a core per rank, "
          f"the share that fits of bigger ones): "
          f"copy {1 / copy_hot / 1e9:.2f} GB/s, reduce {1 / gamma_hot / 1e9:.2f} GB/s")
    picks = _cost.load().picks  # what `tune` measured stays: it is timings, not the model's numbers
    model = dataclasses.replace(_cost.CostModel(), gamma=gamma, copy=copy, engine=engine, copy_shared=shared,
                                cores=cores, cache=cache, copy_hot=copy_hot, gamma_hot=gamma_hot,
                                gamma_staged=gamma_staged, picks=picks)
    links, scales = dict(model.links), []
    task_cpu = call_cpu = cold = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("sdma", "rdma"):
            out = os.path.join(tmp, f"{kind}.json")
            env = {**os.environ, "AHCOMM_TRANSPORT": kind}
            status = asyncio.run(launch(2, [sys.executable, "-m", "ahcomm.bench", PRIVATE, "--json", out],
                                        env=env))
            if status != 0:
                sys.exit(f"ahcomm-bench calibrate: the {kind} run failed with status {status}")
            with open(out) as f:
                measured = json.load(f)
            cores = int(measured.get("cores", cores))
            links[kind], scale = fit_link(kind, measured["points"], model, bool(measured.get("single_copy")))
            scales.append(scale)
            if kind == "sdma":  # the notifies between ranks of a host, as the simulator's --cpu runs them
                task_cpu, call_cpu = fit_cpu(measured["points"], bool(measured.get("single_copy")))
                cold = float(measured.get("cold_notify", 0.0))
            print(f"{kind}: alpha {links[kind].alpha * 1e6:.1f} us, beta {1 / links[kind].beta / 1e9:.2f} GB/s "
                  f"(latency x{scale:.2f} of the defaults)")
    model = dataclasses.replace(model, links=links, task=model.task * float(np.mean(scales)), cores=cores,
                                task_cpu=task_cpu, launch=call_cpu, cold_notify=cold,
                                source=f"calibrated {time.strftime('%Y-%m-%d')}")
    cpu_part = f" ({model.notify_cpu * 1e6:.0f} us of it CPU)" if task_cpu > 0 else ""
    print(f"notify: {model.task * 1e6:.0f} us{cpu_part}"
          + (f", a call's own CPU: {call_cpu * 1e6:.0f} us" if call_cpu > 0 else "")
          + (f", {cold * 1e6:.0f} us more after a {_cost.COLD_BYTES >> 20} MiB copy" if cold > 0 else "")
          + f", cores: {cores}")
    print(f"saved {_cost.save(model)}" + (f" (with the {len(picks)} picks `ahcomm-bench tune` measured before)"
                                           if picks else ""))

"""The alpha-beta cost model that picks an algorithm per call (HCCL's level-1 choice, NCCL's tuning).

Each algorithm estimates its time for a call from a ``CostModel`` and a ``Work``, what the
busiest rank does on the critical path:

    (rounds * hop + handoffs * (hop - 1)) * alpha + tasks * notify_wait
        + (tasks * notify_cpu + engines * engine + link_bytes * beta + reduced_bytes * gamma
           + (copied_bytes + staged_bytes * staged) * copy + pinned_bytes * PIN) * slowdown

Of the slowest link kind the call crosses: ``alpha``, seconds per dependent one-way step (a
notify that wakes a peer's event loop), and ``beta``, seconds per byte a rank sends or
receives through a link's slots (put, DataSignal, credit, piece by piece, as ring and the
``Channels`` algorithms move data; ``link_bytes`` counts both directions, which both load
the host). Of the host: ``gamma``, seconds per byte reduced; ``copy``, per byte copied
(staging, and reads or writes of a peer's mapped buffer or, single copy, of its memory, as
mesh and star move data); ``task``, per link notify a rank posts (DataSignal, Ack: the
sender's and the woken receiver's event-loop work; a pipelined transfer posts one DataSignal
and one Ack per piece; ``notify_cpu`` of it is CPU - ``task_cpu`` where a calibration measured
it, else all of it - and ``notify_wait`` the rest); ``engine``, per memory task big enough (``ENGINE_BYTES``) to go to a
stream's copy engine (the hand-off to the thread and the wake-up when it is done; none
where a host has as many ranks as cores or more, as its streams then copy inline). A copy
into or out of a mailbox slot, which stays in the cache, sends half its traffic through memory
(``staged_bytes``, at ``STAGED`` of a copy); a single-copy read of another process's memory pays
the kernel's page pinning on top of its copy (``pinned_bytes``, ``PIN`` seconds a byte).

Oversubscription: with more working ranks on a host than it has cores (``CostModel.cores``,
which rank 0 hands to every rank with the rest of the model), ranks wait for a core. With
``active = min(busy, ranks on the most crowded host)`` - ``busy`` is how many ranks work at
once, all of them (None) for the symmetric algorithms, fewer where one rank does most of
the work (star) or a chain keeps only a few busy - a step costs ``hop = active / cores``
(at least 1) times more, a hand-off between a rank's own streams (a local notify, as a
step-wise algorithm forwards what it just received) is no longer free but costs ``hop - 1``
steps, and CPU work takes ``slowdown = active / cores`` times longer. Where cores are left
over, a rank that spreads its memory work over several copy engines (``streams``) gets up
to that many of them (``slowdown`` < 1).

In cache: a call whose data fits a third of the host's last-level cache (``CACHE_USABLE``),
where every rank has a core, is priced at the in-cache rates ``copy_hot`` and ``gamma_hot`` (``CostModel.hot``;
``Algorithm.cost`` applies ``for_call``), which only a calibration provides; a staged copy
there costs no more than out of cache (``in_cache``). A bigger call runs the share of its
bytes that that part holds at those rates and the rest at memory's (``cache_share``).

The simulator (``ahcomm-sim --cpu``) also charges CPU where ranks share cores: of a notify's
``task``, ``task_cpu`` is CPU work (the rest makes it land later), and ``launch`` is CPU each
rank spends per call beside its notifies and copies (checks, the pick, setting the run up).
``calibrate`` measures both from the CPU time of its small cases. Where every rank has a core,
a rank's first notify after it moved ``COLD_BYTES`` through its cache costs ``cold_notify``
more CPU (pro rata below that) where it wakes a sleeping peer: the wake-up's system call and
the event loop's next steps run from a cold cache (results/2026-11-27-cold-notify.md). A
reduction in place out of a staging slot a peer just wrote (a ring's ``dst += slot``) costs
``gamma_staged`` a byte there, where measured: one operand is in the cache and the output's lines
are read anyway (10.4-11.4 GB/s on the Intel VM against ``gamma``'s 4.9-5.4;
results/2026-11-27-alloc-and-staged.md). The selector prices a notify's
CPU share as CPU (longer where ranks share cores) and the rest as latency, and leaves ``launch``
out (every candidate pays it alike): on the Intel VM's tune sweep (48 points, np=2 and 4,
2-64 MiB) the calibrated pick was within 10% of the fastest at 39 points either way, its worst
1.65x the fastest against 2.93x (np=4 2 MiB broadcast: mesh, not ring;
``benchmarks/selection_replay.py``, results/2026-11-27-cpu-per-call.md).

The numbers come from a calibration on the host (``ahcomm-bench calibrate``, cached in a JSON
file) or, without one, from defaults fitted to sweeps on a 2-core x86 host. The same file
carries ``picks``, the algorithms ``ahcomm-bench tune`` measured fastest here, which the
selector takes before the model (``_tuned``). Rank 0's model
is handed to every rank at init, so every rank computes the same costs and picks the same
algorithm; a cost must not depend on what differs between ranks (the rank, all_to_all_v's
per-rank counts).
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import asdict, dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any

from .._config import usable_cores
from .._stream import ENGINE_THRESHOLD as ENGINE_BYTES
from ._tuned import MeasuredPick, nearest, parse
from .call import Call, Topology

MODEL_VERSION = 2  # calibrations written with another meaning of the numbers are ignored
HALF_BYTES = 32 << 20  # a CCL half at the default AHCOMM_BUFFSIZE: how the executor slices big calls
FOOTPRINT = 3  # bytes of data a rank touches per byte of its call (input, output, a staging copy)
# Of the last-level cache, the share a call's data can count on (``cache_share``). The Intel VM
# reports 480 MiB, shared with other guests: 3 x 32 MiB of arrays copied at the in-cache rate there,
# 3 x 128 MiB at memory's. With half, the simulator put the 2-rank 64 MiB calls at 0.76-0.88 of
# their measured time in five runs; with a third at 0.88-1.13 (docs/sim.md); the selector's picks
# on the 48-point tune sweep did not change (4 of 180 points between its sizes did, at 2 ranks).
CACHE_USABLE = 1 / 3
# A copy between a user buffer and a mailbox slot (``Work.staged``), as a share of a copy from
# memory to memory: the slot stays in the cache, so half of the copy's traffic goes through
# memory. Measured on 2 ranks (results/2026-11-26-staged-copies.md): oneshot's all_gather of 16
# and 32 MiB, less its slices' steps, took 0.52-0.60 of the time the default model gives its
# copies; two processes at once copying 16 MiB through a 1 MiB slot, 0.6-0.7 of a plain copy's
# time each (benchmarks/staged_probe.py, the in-cache side included). In cache (``in_cache``) a
# staged copy costs an in-cache copy, and never more than out of cache.
STAGED = 0.5
# Seconds per byte a single-copy read (process_vm_readv) costs on top of the copy: the kernel
# pins every 4 KiB page of the peer's buffer. Measured (benchmarks/staged_probe.py, two processes
# at once): 4 MiB read in 0.28-0.34 ms against a local copy's 0.12-0.14, 16 MiB 2.3-2.9 against
# 1.7-2.6 (0.02-0.05 ns a byte).
PIN = 0.035e-9
# Bytes a rank moves (copies, reductions, puts) that leave its next notify's work with a cold cache
# (``CostModel.cold_notify``): about twice a core's L2. On the Intel VM a pipe write that wakes a
# peer took 12 us, 24 after a 1 MiB copy, 38 after a 2 MiB one (results/2026-11-27-cold-notify.md).
COLD_BYTES = 2 << 20


@dataclass(frozen=True)
class LinkCost:
    alpha: float  # seconds per dependent step on this link kind
    beta: float  # seconds per byte moved over it


def _default_links() -> dict[str, LinkCost]:
    return {
        "inproc": LinkCost(alpha=25e-6, beta=1 / 5.0e9),
        "sdma": LinkCost(alpha=150e-6, beta=0.3e-9),
        "rdma": LinkCost(alpha=150e-6, beta=0.75e-9),
    }


@dataclass(frozen=True)
class CostModel:
    links: dict[str, LinkCost] = field(default_factory=_default_links)
    gamma: float = 0.12e-9  # seconds per byte reduced (one ufunc pass over two operands)
    copy: float = 0.12e-9  # seconds per byte copied locally
    task: float = 175e-6  # seconds per link notify posted (the sender's and the receiver's loop work)
    engine: float = 150e-6  # seconds per memory task handed to a copy engine (thread hand-off, wake-up)
    cores: int = 0  # CPU cores of the host (rank 0's, see ``load``); 0: unknown, oversubscription not modelled
    source: str = "defaults"
    copy_shared: float = 0.0  # seconds per byte copied by each core while every core copies (0: as ``copy``)
    cache: int = 0  # bytes of the host's last-level cache (0: unknown; no call is priced in cache)
    copy_hot: float = 0.0  # seconds per byte copied where a call's data stays in cache (``hot``; 0: as ``copy``)
    gamma_hot: float = 0.0  # the same for a byte reduced (0: as ``gamma``)
    staged: float = STAGED  # a staged copy's share of ``copy`` (``Work.staged``; 1 in ``in_cache``)
    # What ``ahcomm-sim --cpu`` charges as CPU work (``calibrate`` measures both; 0: not measured):
    task_cpu: float = 0.0  # of ``task``, the seconds of CPU (the rest is latency); 0: all of it
    launch: float = 0.0  # CPU seconds a rank spends per call beside its notifies and copies
    cold_notify: float = 0.0  # CPU seconds more for a notify after ``COLD_BYTES`` that wakes a peer (simulator)
    gamma_staged: float = 0.0  # seconds per byte reduced in place out of a slot a peer just wrote (simulator;
    # 0: as ``gamma``)
    picks: tuple[MeasuredPick, ...] = ()  # fastest algorithms measured here (``ahcomm-bench tune``)

    def measured(self, call: Call, topo: Topology) -> MeasuredPick | None:
        """The pick measured on this host for a call like ``call`` on ``topo`` (``_tuned.nearest``),
        keyed as the model prices it: one server, its slowest link kind (``link``), the agreed
        single-copy ability. None where none was measured near its size, and for all_to_all_v,
        whose bytes differ from rank to rank (every rank must pick alike)."""
        if not self.picks or topo.servers != 1 or topo.size < 2 or call.op == "all_to_all_v":
            return None
        return nearest(self.picks, call.op, topo.size, self.link_kind(topo), topo.single_copy,
                       call_bytes(call, topo.size)[0])

    def cache_share(self, ranks_here: int, whole: float) -> float:
        """The share of a call's copies and reductions that run at the in-cache rates, where
        ``ranks_here`` of its ranks share a host and the call moves ``whole`` bytes.

        1 where every rank has a core of its own and the ranks' data (``FOOTPRINT`` times the
        call's bytes each: input, output, staging) fits ``CACHE_USABLE`` of the last-level cache;
        beyond that, that part over the footprint (the share of data passed over again and again that
        stays in the cache: on the Intel VM, whose reported 480 MiB hold part of a 2-rank 64 MiB
        call, a binary rule priced those calls at memory's rates, 1.18-1.34x their measured time;
        results/2026-11-27-cache-share.md). 0 where ranks share cores (they evict each other's
        caches between steps: traced at 2 MiB, np=2 on 2 cores copied at 25 GB/s and reduced at
        17.7, np=4 copied at 10.3, as at 64 MiB; results/2026-11-26-cache-rates.md), and where
        the cache size, the in-cache rates or the cores are unknown."""
        if not (self.cache > 0 and (self.copy_hot > 0 or self.gamma_hot > 0) and 0 < ranks_here <= self.cores):
            return 0.0
        footprint, usable = ranks_here * FOOTPRINT * whole, self.cache * CACHE_USABLE
        return 1.0 if footprint <= usable else usable / footprint

    def hot(self, ranks_here: int, whole: float) -> bool:
        """Whether all of a call's data stays in cache (``cache_share`` 1)."""
        return self.cache_share(ranks_here, whole) >= 1.0

    @cached_property
    def in_cache(self) -> "CostModel":
        """This model with the in-cache rates for copies and reductions (and no memory crowding).
        A rate in cache is never slower than from memory: a calibration whose in-cache pass was
        disturbed (one read 3.1 GB/s against 12.8 from memory, and the simulator then put a
        2 MiB all_gather at 2.8x its measured time) keeps the memory rate."""
        copy = _faster(self.copy_hot, self.copy)
        return replace(self, copy=copy, gamma=_faster(self.gamma_hot, self.gamma), copy_shared=0.0,
                       staged=min(1.0, self.staged * self.copy / copy) if copy > 0 else self.staged)

    def for_call(self, ranks_here: int, whole: float) -> "CostModel":
        """The model that prices a call of ``whole`` bytes: ``in_cache`` where it is ``hot``, this
        one where none of it is, else per byte the mix of the two by ``cache_share`` (in cache
        without memory crowding)."""
        share = self.cache_share(ranks_here, whole)
        if share >= 1.0:
            return self.in_cache
        if share <= 0.0:
            return self
        hot = self.in_cache

        def mix(warm: float, cold: float) -> float:
            return share * warm + (1.0 - share) * cold

        copy = mix(hot.copy, self.copy)
        shared = mix(hot.copy, self.copy_shared) if self.copy_shared > 0 else 0.0
        staged = mix(hot.staged * hot.copy, self.staged * self.copy) / copy if copy > 0 else self.staged
        return replace(self, copy=copy, gamma=mix(hot.gamma, self.gamma), copy_shared=shared, staged=staged)

    @property
    def notify_cpu(self) -> float:
        """CPU seconds per notify, the sender's and the receiver's together: ``task_cpu`` where
        measured (at most ``task``), else all of ``task``."""
        return min(self.task_cpu, self.task) if self.task_cpu > 0 else self.task

    @property
    def notify_wait(self) -> float:
        """Of a notify's ``task``, the seconds that are not CPU: latency, which no core sharing
        stretches (0 where ``task_cpu`` is not measured)."""
        return self.task - self.notify_cpu

    @property
    def crowd(self) -> float:
        """How much longer a copy takes while every core copies than alone (>= 1; 1: not measured).
        The selector leaves it out; ``ahcomm-sim --cpu`` shares a server's memory bandwidth by it."""
        return max(1.0, self.copy_shared / self.copy) if self.copy_shared > 0 and self.copy > 0 else 1.0

    def link(self, topo: Topology) -> LinkCost:
        """The slowest link kind among ``topo``'s links (what a flat algorithm is bound by)."""
        kind = self.link_kind(topo)
        return self.links.get(kind, self.links["rdma"]) if kind else self.links.get("inproc", LinkCost(0.0, 0.0))

    def link_kind(self, topo: Topology) -> str:
        """The name of ``link``'s kind ("" where ``topo`` has no link)."""
        def slowness(kind: str) -> tuple[float, float]:
            cost = self.links.get(kind, self.links["rdma"])
            return cost.beta, cost.alpha

        return max(sorted({k for k in topo.link_kinds if k != "self"}), key=slowness, default="")

    def per_host(self, topo: Topology) -> int:
        """Ranks on the most crowded host."""
        counts: dict[str, int] = {}
        for host in topo.hosts:
            counts[host] = counts.get(host, 0) + 1
        return max(counts.values(), default=1)

    def engines_on(self, topo: Topology) -> bool:
        """Whether the streams hand big memory tasks to copy engines on ``topo``'s most crowded host."""
        return self.engines_at(self.per_host(topo))

    def engines_at(self, ranks_here: int) -> bool:
        """Whether the streams of ``ranks_here`` ranks sharing a host hand big memory tasks to copy
        engines: not where they are as many as its cores or more (they copy inline:
        ``ahcomm._stream.engine_bytes_for``); always where the cores are unknown. (A rank that
        ``--bind-to core`` left one core of its own, on a host with cores to spare, copies inline
        where this says engines: the model prices every rank alike.)"""
        return self.cores <= 0 or ranks_here < self.cores

    def engine_cost(self, topo: Topology) -> float:
        """Seconds per memory task handed to a stream's copy engine: ``engine``, or nothing where
        the streams copy inline (``engines_on``)."""
        return self.engine if self.engines_on(topo) else 0.0

    def active(self, topo: Topology, busy: float | None = None) -> float:
        """Ranks of the most crowded host that work at once (``busy``; None: all of them)."""
        here = self.per_host(topo)
        return float(here) if busy is None else max(1.0, min(float(busy), here))

    def hop(self, topo: Topology, busy: float | None = None) -> float:
        """How much longer a dependent step takes because ``busy`` ranks of a host (None: all)
        wait for its cores (>= 1)."""
        if self.cores <= 0:
            return 1.0
        return max(1.0, self.active(topo, busy) / self.cores)

    def slowdown(self, topo: Topology, busy: float | None = None, streams: int = 1) -> float:
        """How much longer (< 1: shorter) CPU work takes than on one core of its own, when
        ``busy`` ranks of a host work at once (None: all of them) and the busiest one spreads
        its memory work over ``streams`` copy engines."""
        if self.cores <= 0:
            return 1.0
        share = self.cores / self.active(topo, busy)  # cores per working rank
        return 1.0 / min(max(1, streams), share) if share >= 1 else 1.0 / share

    def to_dict(self) -> dict[str, Any]:
        return {"version": MODEL_VERSION, "links": {k: asdict(v) for k, v in self.links.items()},
                "gamma": self.gamma, "copy": self.copy, "task": self.task, "engine": self.engine, "cores": self.cores,
                "copy_shared": self.copy_shared, "cache": self.cache, "copy_hot": self.copy_hot,
                "gamma_hot": self.gamma_hot, "staged": self.staged, "task_cpu": self.task_cpu,
                "launch": self.launch, "cold_notify": self.cold_notify, "gamma_staged": self.gamma_staged,
                "source": self.source,
                "picks": [p.to_dict() for p in self.picks]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "CostModel":
        """The model in ``data``; the defaults where ``data`` lacks a number or comes from an older
        calibration (another meaning of alpha), keeping its ``cores`` and its measured picks."""
        default = cls()
        cores = int(data.get("cores", 0) or 0)
        picks = parse(data.get("picks"))
        if int(data.get("version", 1)) != MODEL_VERSION:
            return replace(default, cores=cores, picks=picks)
        links = _default_links()
        for kind, values in dict(data.get("links", {})).items():
            links[str(kind)] = LinkCost(alpha=float(values["alpha"]), beta=float(values["beta"]))
        return cls(links=links, gamma=float(data.get("gamma", default.gamma)),
                   copy=float(data.get("copy", default.copy)), task=float(data.get("task", default.task)),
                   engine=float(data.get("engine", default.engine)),
                   cores=cores, source=str(data.get("source", "file")),
                   copy_shared=float(data.get("copy_shared", 0.0)),  # absent in older files: not measured
                   cache=int(data.get("cache", 0) or 0), copy_hot=float(data.get("copy_hot", 0.0)),
                   gamma_hot=float(data.get("gamma_hot", 0.0)), staged=float(data.get("staged", STAGED)),
                   task_cpu=float(data.get("task_cpu", 0.0)), launch=float(data.get("launch", 0.0)),
                   cold_notify=float(data.get("cold_notify", 0.0)),
                   gamma_staged=float(data.get("gamma_staged", 0.0)), picks=picks)


def cache_path() -> Path:
    """Where the calibration lives: AHCOMM_TUNING_FILE, else ~/.cache/ahcomm/calibration.json."""
    override = os.environ.get("AHCOMM_TUNING_FILE")
    if override:
        return Path(override)
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "ahcomm" / "calibration.json"


def load() -> CostModel:
    """The cached calibration, or the defaults when there is none (or it cannot be read: then a
    warning names the file and the problem, since an ``AHCOMM_TUNING_FILE`` that points at the
    wrong file would otherwise go unnoticed).

    Where the file does not say how many cores the host has, the host's cores for its ranks are
    taken (``usable_cores``: AHCOMM_CORES, else this process's affinity), as calibrate counts
    them and as ``engine_bytes_for`` decides whether the streams copy inline; only rank 0's model
    is used by a job, so every rank still agrees.
    """
    path = cache_path()
    try:
        model = CostModel.from_dict(json.loads(path.read_text()))
    except FileNotFoundError:  # not calibrated here
        model = CostModel()
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        logging.getLogger("ahcomm.cost").warning(
            "the calibration %s cannot be read (%s: %s); using the default cost model "
            "(`ahcomm-bench calibrate` writes a new one)", path, type(exc).__name__, exc)
        model = CostModel()
    if model.cores <= 0:
        model = replace(model, cores=usable_cores())
    return model


def save(model: CostModel, path: Path | None = None) -> Path:
    """Write ``model`` to ``path``, by default where ``load`` reads it. An uncalibrated model
    (measured picks on the defaults) keeps only its picks: later defaults, and this host's cores,
    still apply."""
    path = path or cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    data = model.to_dict()
    if model.source == "defaults":
        data = {"version": MODEL_VERSION, "source": model.source, "picks": data["picks"]}
    path.write_text(json.dumps(data, indent=1))
    return path


@dataclass(frozen=True)
class Work:
    """What the busiest rank does in a call, in the model's units (see the module docstring)."""

    rounds: float = 0.0  # dependent one-way steps (notifies on the critical path)
    handoffs: float = 0.0  # hand-offs between this rank's streams on the critical path (local notifies)
    link: float = 0.0  # bytes this rank sends plus bytes it receives through links' slots
    reduced: float = 0.0  # bytes of reduction
    copied: float = 0.0  # bytes copied in memory (staging, reads out of mapped peer buffers)
    tasks: float = 0.0  # link notifies posted (DataSignal, Ack, ...), each waking a peer
    engines: float = 0.0  # memory tasks of at least ENGINE_BYTES (copy-engine hand-offs)
    busy: float | None = None  # ranks working as hard as this one at once (None: all of them)
    streams: int = 1  # copy engines the busiest rank keeps busy at once
    threads: bool = False  # ``engines`` and ``streams`` are the algorithm's own threads (direct), not the streams'
    staged: float = 0.0  # bytes copied into or out of a slot the cache keeps (``STAGED``)
    pinned: float = 0.0  # of ``copied``, bytes read out of another process (``PIN`` more each; sdma links)

    def seconds(self, model: CostModel, topo: Topology) -> float:
        """Where the streams copy inline (``CostModel.engines_on``) their memory tasks pay no
        hand-off; an algorithm's own threads (``threads``: direct's) hand off all the same."""
        engines_on = self.threads or model.engines_on(topo)
        link = model.link(topo)
        cpu = (self.tasks * model.notify_cpu + self.engines * (model.engine if engines_on else 0.0)
               + self.link * link.beta + self.reduced * model.gamma
               + (self.copied + self.staged * model.staged) * model.copy
               + (self.pinned * PIN if self.pinned and "sdma" in topo.link_kinds else 0.0))  # in a process: memmove
        hop = model.hop(topo, self.busy)
        return ((self.rounds * hop + self.handoffs * (hop - 1.0)) * link.alpha + self.tasks * model.notify_wait
                + cpu * model.slowdown(topo, self.busy, self.streams))


def log2up(n: int) -> int:
    """ceil(log2 n) for n >= 1."""
    return max(0, (n - 1).bit_length())


def engine_tasks(nbytes: float, piece: int = 0) -> int:
    """Memory tasks that go to a copy engine when ``nbytes`` is handled in pieces of at most
    ``piece`` bytes (0: in one task)."""
    p = npieces(nbytes, piece) if piece else 1
    return p if nbytes / p >= ENGINE_BYTES else 0


def npieces(nbytes: float, piece: int) -> int:
    """Pieces of at most ``piece`` bytes that ``nbytes`` is cut into (at least 1)."""
    return max(1, math.ceil(nbytes / piece)) if piece > 0 else 1


def call_bytes(call: Call, n: int) -> tuple[float, float]:
    """(whole bytes, largest per-rank block bytes) of a call.

    Whole: the vector (all_reduce, broadcast, reduce), all blocks together (all_gather,
    reduce_scatter, gather, scatter and their v variants) or, for all_to_all, the larger of
    what this rank sends and receives. Block: the largest block one rank owns.
    """
    item = call.itemsize
    if call.counts is None:
        if call.op in ("all_gather", "reduce_scatter"):
            return float(call.count * item * n), float(call.count * item)
        return float(call.count * item), float(call.count * item / max(1, n))
    if call.op.startswith("all_to_all"):
        recv = call.recv_counts or call.counts
        blocks = max(max(call.counts, default=0), max(recv, default=0))
        return float(max(sum(call.counts), sum(recv)) * item), float(blocks * item)
    return float(sum(call.counts) * item), float(max(call.counts, default=0) * item)


def _faster(hot: float, cold: float) -> float:
    """The smaller of two seconds-per-byte rates, where ``hot`` is measured (nonzero)."""
    return min(hot, cold) if hot > 0 else cold

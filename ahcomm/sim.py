"""``ahcomm-sim``: run the real algorithms over a simulated cluster in virtual time.

    ahcomm-sim all_reduce --ranks 1024 --ranks-per-server 8 --size 64MiB --algorithm ring

Every simulated rank gets the communicator's executor, streams and notifies, and the real
algorithm class (select, resources, orchestrate) runs unchanged on an event loop in virtual
time (``ahcomm.transports.sim``). Links are simulated: a post lands ``alpha`` later, a put
holds the sender's and the receiver's port of its link kind for ``bytes * beta``; copies and
reductions cost ``copy`` and ``gamma`` seconds per byte on the stream that runs them. No data
moves unless ``check``: then every rank has real (small) buffers and the result is compared
with numpy. See docs/sim.md for the model and the reference cluster.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ._dtypes import ReduceOp
from ._simform import closed_form
from ._simstream import SimStream
from ._stream import ENGINE_THRESHOLD, NO_ENGINE, Stream
from .algorithms import REGISTRY, Algorithm, Call, CostModel, LinkCost, Topology
from .algorithms._executor import Executor, Progress
from .algorithms._selection import Selector
from .algorithms.cost import COLD_BYTES
from .transports._simloop import Delay
from .transports.base import Link
from .transports.sim import INTER, INTRA, LinkParams, SimInterLink, SimIntraLink, SimLink, SimNetwork, VirtualLoop

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
BUFFSIZE = 64 << 20  # the default AHCOMM_BUFFSIZE: big calls are sliced as on a real job
CHECK_BUFFSIZE = 1 << 16  # small buffers in check mode: slicing is exercised
FAST_STREAMS = True  # SimStream (callbacks) rather than the executor's Stream (tasks): same order, less CPU


def reference_model() -> CostModel:
    """The documented reference cluster: 8 ranks per server, 200 GB/s and 2 us inside a server
    (``sdma``), 25 GB/s and 5 us between servers (``rdma``), copies and reductions at 100 GB/s,
    1 us of CPU per notify; no oversubscription (cores = 0)."""
    return CostModel(links={"inproc": LinkCost(2e-6, 1 / 200e9), INTRA: LinkCost(2e-6, 1 / 200e9),
                            INTER: LinkCost(5e-6, 1 / 25e9)},
                     gamma=1e-11, copy=1e-11, task=1e-6, engine=0.0, cores=0, source="reference cluster")


def load_model(path: str | None) -> CostModel:
    """``--model FILE`` (``ahcomm-bench calibrate``'s JSON, or the same shape), else the reference."""
    if path is None:
        return reference_model()
    try:
        return CostModel.from_dict(json.loads(Path(path).read_text()))
    except OSError as exc:
        raise ValueError(f"--model {path}: cannot read it ({exc.strerror or exc})") from None
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"--model {path}: not a calibration (ahcomm-bench calibrate writes one): "
                         f"{type(exc).__name__}: {exc}") from None


class _Kinds:
    """``Topology.link_kinds`` of one rank without a tuple per rank: 'self', then by server."""

    __slots__ = ("k", "n", "rank")

    def __init__(self, rank: int, n: int, k: int) -> None:
        self.rank, self.n, self.k = rank, n, k

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, p: int) -> str:
        if p < 0:
            p += self.n
        if not 0 <= p < self.n:
            raise IndexError(p)
        return "self" if p == self.rank else INTRA if p // self.k == self.rank // self.k else INTER

    def __iter__(self) -> Iterator[str]:
        return (self[p] for p in range(self.n))

    def __hash__(self) -> int:
        return hash((self.n, self.k, self.rank))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Kinds) and (self.rank, self.n, self.k) == (other.rank, other.n, other.k)


class _Links(dict[int, Link]):
    """A rank's links, made on first use (a ring rank touches 2 of its N - 1 peers)."""

    def __init__(self, world: "World", rank: int) -> None:
        super().__init__()
        self.world, self.rank = world, rank

    def __missing__(self, peer: int) -> Link:
        link = self[peer] = self.world.link(self.rank, peer)
        return link


class _Done(Progress):
    """Progress with every earlier collective finished (a simulated job runs one)."""

    def low(self) -> int:
        return 1 << 62

    def all_started(self, seq: int) -> None:
        pass

    def reached(self, peer: int, seq: int) -> None:
        pass


class _Buffers:
    """What the executor reads of ``CclBuffers``: ``nbytes``, the two arrays and the words."""

    class _Region:
        def __init__(self, array: np.ndarray) -> None:
            self.array = array
            self.words = np.zeros(0, np.int64)  # no peer maps them: the gates stay private

    def __init__(self, ccl_in: np.ndarray, ccl_out: np.ndarray) -> None:
        self.nbytes = ccl_in.nbytes
        self.ccl_in, self.ccl_out = self._Region(ccl_in), self._Region(ccl_out)


@dataclass
class Result:
    op: str
    ranks: int
    ranks_per_server: int
    bytes: int
    algorithm: str
    time_us: float
    algbw_gbs: float
    busbw_gbs: float
    intra_bytes: int
    inter_bytes: int
    puts: int
    posts: int
    pick: str
    straggler: str = ""
    contention: bool = True
    checked: bool = False
    wall_s: float = 0.0


class World:
    """``n`` simulated ranks, ``k`` per server, on one ``VirtualLoop``."""

    def __init__(self, n: int, k: int, model: CostModel, *, check: bool, contention: bool, cpu: bool = False) -> None:
        self.n, self.k, self.model = n, k, model
        self.loop = VirtualLoop()  # type: ignore[abstract]
        host = cpu and model.cores > 0  # this host's costs: shared cores, posts, engine hand-offs, memory bandwidth
        wait = model.notify_wait if host else 0.0  # a notify's cost beside its CPU: it lands that much later
        params = {kind: LinkParams(c.alpha + wait, c.beta) for kind, c in model.links.items()}
        self.launch = model.launch if host else 0.0  # CPU per call on each rank, before its first task
        here = min(n, k)  # ranks of the fullest server (the cost model's per_host): engines where cores are left
        self.net = SimNetwork(self.loop, k, params, contention=contention, check=check,
                              cores=model.cores if cpu else 0, task=model.notify_cpu if host else 0.0,
                              engine=model.engine if host else 0.0,
                              engine_bytes=ENGINE_THRESHOLD if model.engines_at(here) else NO_ENGINE,
                              crowd=model.crowd if host else 1.0, copy=model.copy if host else 0.0,
                              # measured where every rank has a core: elsewhere the predictions are over already
                              cold=model.cold_notify if host and here <= model.cores else 0.0, cold_bytes=COLD_BYTES)
        size = CHECK_BUFFSIZE if check else BUFFSIZE
        if check:
            self.buffers = [(np.zeros(size, np.uint8), np.zeros(size, np.uint8)) for _ in range(n)]
        else:  # one shared, never-touched pair: the executor slices views of it, nothing is written
            shared = (np.empty(size, np.uint8), np.empty(size, np.uint8))
            self.buffers = [shared] * n
        self.hosts = tuple(f"s{r // k}" for r in range(n))
        self._links: dict[tuple[int, int], SimLink] = {}
        self._scratch = np.empty(0, np.uint8)

    def link(self, rank: int, peer: int) -> SimLink:
        if not 0 <= peer < self.n or peer == rank:
            raise KeyError(peer)
        link = self._links.get((rank, peer))
        if link is None:
            cls = SimIntraLink if rank // self.k == peer // self.k else SimInterLink
            link = self._links[(rank, peer)] = cls(self.net, rank, peer, self.buffers[peer])
            twin = self._links.get((peer, rank))
            if twin is not None:
                link.twin, twin.twin = twin, link
            else:
                self.link(peer, rank)
        return link

    def scratch(self, nbytes: int) -> np.ndarray:
        if self._scratch.nbytes < nbytes:
            self._scratch = np.empty(nbytes, np.uint8)
        return self._scratch

    def topology(self, rank: int) -> Topology:
        return Topology(rank=rank, size=self.n, hosts=self.hosts,
                        link_kinds=_Kinds(rank, self.n, self.k),  # type: ignore[arg-type]
                        all_mapped=False, single_copy=False)

    def executor(self, rank: int) -> Executor:
        ccl_in, ccl_out = self.buffers[rank]
        ex = Executor(rank, self.n, _Links(self, rank), _Buffers(ccl_in, ccl_out),  # type: ignore[arg-type]
                      self.topology(rank), _Done(rank, 1))
        ex._unmapped = []  # puts complete when their bytes left: nothing to flush
        if not self.net.check:  # one shared scratch, never written (the executor's is pre-faulted per rank)
            ex.scratch = self.scratch  # type: ignore[method-assign]
        if FAST_STREAMS:  # streams run from callbacks, not tasks (ahcomm._simstream)
            ex.main = SimStream("main")
        _simulate_memory(ex.main, self, rank)
        make = ex._substreams

        def substreams(count: int) -> list[Stream]:
            if FAST_STREAMS:
                while len(ex.subs) < count:
                    ex.subs.append(SimStream(f"sub{len(ex.subs)}"))
            for stream in make(count):
                _simulate_memory(stream, self, rank)
            return ex.subs[:count]
        ex._substreams = substreams  # type: ignore[method-assign]
        return ex


def _simulate_memory(stream: Stream, world: World, rank: int) -> None:
    """Charge a stream's copies and reductions in virtual time (and do them in check mode): a
    reduction in place with an operand in this rank's CCL buffers (a slot a peer just wrote) at
    ``gamma_staged`` where measured (and faster than ``gamma``), any other at ``gamma``."""
    if getattr(stream, "_sim", False):
        return
    net, model = world.net, world.model
    staged = model.gamma_staged if 0 < model.gamma_staged < model.gamma else 0.0
    ccl = world.buffers[rank]

    def gamma(out: Any, operands: tuple[Any, ...]) -> float:
        if staged and isinstance(out, np.ndarray):
            ins = [a for a in operands if isinstance(a, np.ndarray)]
            if (any(np.may_share_memory(out, a) for a in ins)
                    and any(np.may_share_memory(a, buf) for a in ins for buf in ccl)):
                return staged
        return model.gamma

    def memory(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Delay | None:
        first = args[0] if args else None
        nbytes = first.nbytes if isinstance(first, np.ndarray) else 0
        if net.check:
            fn(*args, **kwargs)
        span = nbytes * (gamma(kwargs.get("out"), args) if isinstance(fn, np.ufunc) else model.copy)
        if span <= 0:
            return None
        return net.loop.delay(net.memory(rank, nbytes, span))

    stream.memory = memory  # type: ignore[method-assign]
    stream._sim = True  # type: ignore[attr-defined]


def _shapes(op: str, n: int, count: int) -> tuple[int, int]:
    """(src elements, dst elements) per rank for ``count`` (the call's per-rank block)."""
    if op == "all_gather":
        return count, n * count
    if op == "reduce_scatter":
        return n * count, count
    return count, count


def _data(rank: int, size: int, dtype: np.dtype) -> np.ndarray:
    return ((np.arange(size) * 7 + rank * 3) % 5).astype(dtype)


def simulate(op: str, n: int, k: int, nbytes: int, algorithm: str | None = None, *, dtype: str = "float32",
             model: CostModel | None = None, straggler: tuple[int, float] | None = None, check: bool = False,
             contention: bool = True, cpu: bool = False) -> Result:
    """Simulate one ``op`` of ``nbytes`` (per rank: the vector, or its block for all_gather and
    reduce_scatter) on ``n`` ranks, ``k`` per server; ``algorithm`` None: the selector's pick."""
    import time

    if op not in OPS:
        raise ValueError(f"ahcomm-sim: op {op!r} is not simulated; expected one of {', '.join(OPS)}")
    if n < 1 or k < 1:
        raise ValueError(f"ahcomm-sim: ranks ({n}) and ranks per server ({k}) must be at least 1")
    if straggler is not None and not 0 <= straggler[0] < n:
        raise ValueError(f"ahcomm-sim: straggler rank {straggler[0]} is not one of the {n} ranks")
    started = time.perf_counter()
    model = model or reference_model()
    dt = np.dtype(dtype)
    count = nbytes // dt.itemsize
    whole = count * dt.itemsize * (n if op in ("all_gather", "reduce_scatter") else 1)
    # the host's rates for this call (in cache where its data fits: ``CostModel.hot``); the selector
    # below prices every call alike from ``model``
    rates = model.for_call(min(n, k), whole) if cpu else model
    world = World(n, k, rates, check=check, contention=contention, cpu=cpu)
    redop = ReduceOp.SUM if op in ("all_reduce", "reduce_scatter") else None
    call = Call(op=op, seq=0, dtype=dt, count=count, redop=redop, root=0)
    selector = Selector(REGISTRY, "", model)
    topo0 = world.topology(0)
    pick = selector.choose(call, topo0).name
    algo: Algorithm = selector.choose(call, topo0, algorithm) if algorithm else selector.choose(call, topo0)
    s_n, d_n = _shapes(op, n, count)
    if check:
        srcs = [_data(r, s_n, dt) for r in range(n)]
        dsts = [srcs[r] if op == "broadcast" else np.zeros(d_n, dt) for r in range(n)]
    else:  # one shared, never-touched pair of user arrays
        src = np.empty(s_n, dt)
        dst = src if op == "broadcast" else np.empty(d_n, dt)
        srcs, dsts = [src] * n, [dst] * n
    executors = [world.executor(r) for r in range(n)]
    finish = [0.0] * n
    ufunc = np.add if redop is not None else None

    async def rank(r: int) -> None:
        if straggler is not None and straggler[0] == r:
            await asyncio.sleep(straggler[1])
        if world.launch > 0:  # the call's own CPU work (checks, picks, setup) on this rank's thread
            await world.net.loop.settle_at(world.net.cpu(r, world.launch))
        await executors[r].run(call, algo, srcs[r], dsts[r], ufunc)
        finish[r] = world.loop.now

    async def job() -> None:
        try:
            await asyncio.gather(*(rank(r) for r in range(n)))
        finally:
            for ex in executors:
                await ex.close()

    collecting = gc.isenabled()
    gc.disable()  # millions of live tasks and closures at scale: the cyclic GC's passes cost more than the run
    try:
        world.loop.run_sim(job())
    finally:
        world.loop.close()
        if collecting:
            gc.enable()
    if check:
        _verify(op, algo.name, srcs if op != "broadcast" else [_data(r, s_n, dt) for r in range(n)], dsts, n, count)
    seconds = max(finish)
    moved = nbytes * (n if op in ("all_gather", "reduce_scatter") else 1)
    algbw = moved / seconds / 1e9 if seconds > 0 else 0.0
    factor = {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n,
              "broadcast": 1.0}[op]
    return Result(op=op, ranks=n, ranks_per_server=k, bytes=nbytes, algorithm=algo.name, time_us=seconds * 1e6,
                  algbw_gbs=algbw, busbw_gbs=algbw * factor, intra_bytes=world.net.bytes_by_kind[INTRA],
                  inter_bytes=world.net.bytes_by_kind[INTER], puts=world.net.puts, posts=world.net.posts, pick=pick,
                  straggler=f"{straggler[0]}:{straggler[1] * 1e6:g}" if straggler else "", contention=contention,
                  checked=check, wall_s=time.perf_counter() - started)


def _verify(op: str, name: str, srcs: Sequence[np.ndarray], dsts: Sequence[np.ndarray], n: int, count: int) -> None:
    total = srcs[0].copy()
    for x in srcs[1:]:
        total = total + x
    for r in range(n):
        want = {"all_reduce": total, "reduce_scatter": total[r * count:(r + 1) * count],
                "all_gather": np.concatenate(list(srcs)), "broadcast": srcs[0]}[op]
        if not np.array_equal(dsts[r], want):
            raise AssertionError(f"ahcomm-sim --check: {name} {op} on {n} ranks: rank {r} differs from numpy")


def candidates(op: str, n: int, k: int, nbytes: int, dtype: str = "float32") -> list[str]:
    """The registered algorithms that can run ``op`` on the simulated topology."""
    dt = np.dtype(dtype)
    redop = ReduceOp.SUM if op in ("all_reduce", "reduce_scatter") else None
    call = Call(op=op, seq=0, dtype=dt, count=nbytes // dt.itemsize, redop=redop)
    topo = Topology(rank=0, size=n, hosts=tuple(f"s{r // k}" for r in range(n)),
                    link_kinds=_Kinds(0, n, k), all_mapped=False, single_copy=False)  # type: ignore[arg-type]
    return [name for name, a in REGISTRY.algorithms.items() if a.select(call, topo)]


# -- the command line ------------------------------------------------------------------------------
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20, "mib": 1 << 20,
          "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30}


def parse_size(text: str) -> int:
    s = text.strip().lower()
    digits = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(digits):]
    if not digits or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"size {text!r}: expected a number with an optional unit (B, KiB, MiB, GiB)")
    return int(float(digits) * _UNITS[unit])


def _straggler(text: str) -> tuple[int, float]:
    rank, _, us = text.partition(":")
    try:
        return int(rank), float(us) * 1e-6
    except ValueError:
        raise argparse.ArgumentTypeError(f"straggler {text!r}: expected RANK:MICROSECONDS") from None


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ahcomm-sim", description="Simulate a collective of the real algorithms "
                                "over a simulated cluster in virtual time.")
    p.add_argument("op", choices=OPS)
    p.add_argument("--ranks", type=int, required=True, help="ranks in the simulated job")
    p.add_argument("--ranks-per-server", type=int, default=8)
    p.add_argument("--size", type=parse_size, required=True, help="bytes per rank (e.g. 64MiB)")
    p.add_argument("--algorithm", default=None, help="an algorithm name, or 'all' (default: the selector's pick)")
    p.add_argument("--dtype", default="float32", help="element type (numpy's name; default float32)")
    p.add_argument("--model", default=None, help="link model JSON (ahcomm-bench calibrate output)")
    p.add_argument("--straggler", type=_straggler, default=None, metavar="RANK:US",
                   help="rank RANK starts the call US microseconds late")
    p.add_argument("--no-contention", action="store_true", help="ports never queue (closed-form comparisons)")
    p.add_argument("--cpu", action="store_true", help="the model's cores per server are shared by copies, "
                   "reductions, puts and posts (its task seconds each): a host like this one")
    p.add_argument("--check", action="store_true", help="move real data and compare with numpy (64 KiB buffers a "
                   "rank: big calls run in many slices, so the times are not a prediction)")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    args = p.parse_args(argv)
    try:
        model = load_model(args.model)
        names = [args.algorithm] if args.algorithm != "all" else candidates(args.op, args.ranks,
                                                                            args.ranks_per_server, args.size)
        for name in names:
            r = simulate(args.op, args.ranks, args.ranks_per_server, args.size, name, dtype=args.dtype, model=model,
                         straggler=args.straggler, check=args.check, contention=not args.no_contention, cpu=args.cpu)
            if args.json:
                print(json.dumps(r.__dict__), flush=True)
            else:
                print(f"{r.op} {r.bytes} B on {r.ranks} ranks ({r.ranks_per_server}/server), {r.algorithm}: "
                      f"{r.time_us:.1f} us, algbw {r.algbw_gbs:.2f} GB/s, busbw {r.busbw_gbs:.2f} GB/s; "
                      f"bytes inside servers {r.intra_bytes}, between {r.inter_bytes}; selector picks {r.pick}"
                      f"{'; checked (64 KiB buffers: not a prediction)' if r.checked else ''} "
                      f"[{r.wall_s:.1f} s wall]", flush=True)
    except (ValueError, AssertionError, RuntimeError) as exc:
        print(f"ahcomm-sim: {exc}", file=sys.stderr)
        return 1
    return 0


__all__ = ["OPS", "Result", "World", "candidates", "closed_form", "load_model", "main", "reference_model", "simulate"]


if __name__ == "__main__":
    raise SystemExit(main())

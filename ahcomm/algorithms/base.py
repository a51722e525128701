"""The algorithm-development framework: the ``Algorithm`` base, a run's ``Context``, the registry.

An algorithm is written in HCCL's three steps:

1. ``select(call, topo)`` - can it run this call here? and ``work(...)`` - at what cost
   (the base ``cost()`` prices it with the ``cost.CostModel``);
2. ``resources(call, topo, half_bytes)`` - how many sub-streams it needs and how many
   elements of the call fit one run (the executor slices larger calls, as HCCL loops over
   CCL buffers);
3. ``runs[op](self, ctx)`` (what the base ``orchestrate`` calls) - submit tasks (copy,
   reduce, put, post, wait) to the main stream and sub-streams in ``ctx``, then
   ``await ctx.synchronize()``.

Protocol rules every algorithm keeps (the executor relies on them):

* every link notify posted during a run is waited for during the same run, so all flags
  are back at 0 when ``orchestrate`` returns;
* a run writes only into this collective's half of the CCL buffers (``ctx.ccl_in``,
  ``ctx.ccl_out``, peer offsets from ``ctx.put``/``ctx.remote``); the executor makes sure
  no rank still uses that half from two collectives ago.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, ClassVar

import numpy as np

from .._config import usable_cores
from .._memcopy import streams
from .._notify import Notify
from .._stream import Stream, TaskFn
from ..transports.base import DataLink, Mailboxes, Signal
from ._push import Gates
from .call import WHOLE, Call, Resources, Topology
from .cost import CostModel, Work, call_bytes

ALIGN = 64  # byte alignment of every region an algorithm carves from a CCL buffer
__all__ = [
    "ALIGN",
    "WHOLE",
    "Algorithm",
    "Call",
    "Context",
    "OpRun",
    "Registry",
    "Resources",
    "Topology",
    "align_up",
    "aligned",
    "fold",
    "pieces",
    "split",
]


class Context:
    """Everything ``orchestrate`` touches for one run (one slice of one collective)."""

    def __init__(self, *, call: Call, topo: Topology, links: Mapping[int, DataLink], src: np.ndarray,
                 dst: np.ndarray, ccl_in: np.ndarray, ccl_out: np.ndarray, half_offset: int, main: Stream,
                 subs: Sequence[Stream], ufunc: np.ufunc | None, final: bool = True,
                 scratch: Callable[[int], np.ndarray] | None = None, mailbox: Mailboxes | None = None,
                 paths: dict[str, int] | None = None, gates: Gates | None = None) -> None:
        self.call = call
        self.topo = topo
        self.rank = topo.rank
        self.size = topo.size
        self.links = links
        self.src = src  # input of this run: 1-D, or 2-D (size, n) where the op is blocked
        self.dst = dst  # output of this run, same convention
        self.ccl_in = ccl_in  # this collective's half of our CCL_In (uint8)
        self.ccl_out = ccl_out  # ... and of our CCL_Out
        self.half_offset = half_offset  # byte offset of those halves in the whole buffers
        self.main = main
        self.subs = list(subs)
        self.ufunc = ufunc
        self.final = final  # the last slice of this collective
        self._scratch = scratch
        self.mailbox = mailbox  # the host's mailboxes (one-shot algorithms), where ``topo.mailbox``
        self.fingerprint = call.fingerprint
        self.gates = gates  # the communicator's words for writes into peers' outputs (``_push``)
        self._paths = paths  # the executor's counts of the paths runs took (``comm.stats()["paths"]``)
        self._locals: dict[Hashable, Notify] = {}
        self._error: BaseException | None = None
        for stream in (main, *self.subs):
            stream.on_error = self.fail  # a stream that fails must not leave the others waiting

    def stream_output(self) -> bool:
        """Whether this run's copies into the call's output should bypass the cache
        (``_memcopy.streams``: the whole output is large), counted in ``comm.stats()["paths"]``
        as ``copy.non_temporal``. For ``copy(..., stream=...)``."""
        if not streams(call_bytes(self.call, self.size)[0]):  # all_gather: every block; broadcast: the vector
            return False
        self.tally("copy.non_temporal")
        return True

    def tally(self, path: str) -> None:
        """Count one run of ``path`` (e.g. ``"direct.single_copy"``) in ``comm.stats()["paths"]``."""
        if self._paths is not None:
            self._paths[path] = self._paths.get(path, 0) + 1

    # -- notifies ---------------------------------------------------------------------------
    def local(self, key: Hashable) -> Notify:
        """A rank-local notify between this run's streams (created on first use)."""
        flag = self._locals.get(key)
        if flag is None:
            flag = self._locals[key] = Notify(f"local {key}")
            if self._error is not None:
                flag.fail(self._error)
        return flag

    def forget(self, keys: Iterable[Hashable]) -> None:
        """Drop local notifies whose one post and one wait are both done (a long pipeline keeps
        O(window) of them rather than one per piece of the run: 2 (n - 1) per ring rank)."""
        locals_ = self._locals
        for key in keys:
            locals_.pop(key, None)

    def fail(self, error: BaseException) -> None:
        """Wake every stream of this run that waits on a local notify (a stream failed, or abort)."""
        if self._error is None:
            self._error = error
            for flag in self._locals.values():
                flag.fail(error)

    def post(self, stream: Stream, peer: int, signal: Signal, index: int = 0, value: int = 0) -> None:
        """Enqueue: set ``peer``'s flag (signal, index) for this collective, carrying ``value``
        (and the call's fingerprint, which the peer checks against its own call)."""
        link, seq, fp = self.links[peer], self.call.seq, self.fingerprint
        task: TaskFn = partial(link.post, signal, index, seq, value, fp)  # lighter than a closure
        if stream.tracer is not None:
            task = stream.tracer.task(stream, "post", task, peer=peer, detail=signal, index=index, seq=seq)
        stream.submit(task)

    def wait(self, stream: Stream, peer: int, signal: Signal, index: int = 0) -> None:
        """Enqueue: wait for the flag ``peer`` posts on us."""
        task: TaskFn = self.links[peer].notify(signal, index, self.call.seq).wait_task  # no coroutine if set
        if stream.tracer is not None:
            task = stream.tracer.task(stream, "wait", task, peer=peer, detail=signal, index=index, seq=self.call.seq)
        stream.submit(task)

    def put(self, stream: Stream, peer: int, src: np.ndarray, buf: str, offset: int) -> None:
        """Enqueue: write ``src`` into ``peer``'s buffer at ``offset`` within this collective's half."""
        link, seq, at = self.links[peer], self.call.seq, self.half_offset + offset
        task: TaskFn = partial(link.put, src, buf, at, seq, stream.memory)
        if stream.tracer is not None:
            task = stream.tracer.task(stream, "put", task, nbytes=src.nbytes, peer=peer, seq=seq)
        stream.submit(task)

    def read(self, stream: Stream, peer: int, dst: np.ndarray, signal: Signal, index: int = 0,
             offset: int = 0) -> None:
        """Enqueue: copy from ``peer``'s memory at (the value it posted with signal) + ``offset``.

        The address is looked up when the task runs, so enqueue it after the matching wait.
        """
        link, seq = self.links[peer], self.call.seq
        task: TaskFn = lambda: link.read(dst, link.value(signal, index, seq) + offset, stream.memory)
        if stream.tracer is not None:
            task = stream.tracer.task(stream, "read", task, nbytes=dst.nbytes, peer=peer, seq=seq)
        stream.submit(task)

    def posted(self, peer: int, signal: Signal, index: int = 0) -> int:
        """The value ``peer`` posted with (signal, index) in this collective (after the wait)."""
        return self.links[peer].value(signal, index, self.call.seq)

    def remote(self, peer: int, buf: str) -> np.ndarray:
        """This collective's half of ``peer``'s buffer, mapped (uint8)."""
        whole = self.links[peer].remote(buf)
        return whole[self.half_offset:self.half_offset + self.ccl_in.nbytes]

    def typed(self, region: np.ndarray, offset: int, count: int) -> np.ndarray:
        """``count`` elements of the call's dtype at byte ``offset`` of a uint8 region."""
        nbytes = count * self.call.itemsize
        return region[offset:offset + nbytes].view(self.call.dtype)

    def scratch(self, count: int) -> np.ndarray:
        """A private array of ``count`` elements of the call's dtype for this run.

        It is the communicator's reusable scratch (grown, never shrunk): no allocation per
        call once warm. One region per run: a second call returns the same memory.
        """
        nbytes = count * self.call.itemsize
        whole = self._scratch(nbytes) if self._scratch is not None else np.empty(nbytes, np.uint8)
        return whole[:nbytes].view(self.call.dtype)

    async def synchronize(self) -> None:
        """Wait for the main stream and every sub-stream to drain; raise the first failure."""
        first: BaseException | None = None
        for stream in (self.main, *self.subs):
            if stream.settled:
                continue
            try:
                await stream.synchronize()
            except Exception as exc:  # noqa: BLE001 - drain the others, then raise
                first = first or exc
        if first is None:  # aborted while a task ran (a copy engine's): the queue was dropped, not failed
            first = self._error
        if first is not None:
            raise first


OpRun = Callable[[Any, Context], Awaitable[None]]  # one op's orchestration: run(algorithm, ctx)


class Algorithm:
    """Base class of every registered algorithm.

    An algorithm lists its ops in ``runs``, a table from op name to the function that
    orchestrates it (its keys are the supported ``ops``); the base ``orchestrate`` looks the
    call's op up there. One that overrides ``orchestrate`` itself declares ``ops`` instead.
    """

    name: ClassVar[str]
    ops: ClassVar[frozenset[str]] = frozenset()
    exchanges: ClassVar[bool] = False  # every rank hears from every peer in every run (see the executor)
    # The executor first waits until every peer finished the collective two before: no peer still
    # uses the call's half of the CCL buffers, and no peer runs more than two calls ahead (eager's
    # bound on early messages). False: an algorithm with neither need (oneshot: its mailbox
    # publications keep their own rule).
    waits_progress: ClassVar[bool] = True
    runs: ClassVar[Mapping[str, OpRun]] = {}

    _estimates: ClassVar[bool] = False  # the class gives ``work`` (set for each subclass)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "runs" in cls.__dict__ and "ops" not in cls.__dict__:
            cls.ops = frozenset(cls.runs)
        cls._estimates = cls.work is not Algorithm.work

    def select(self, call: Call, topo: Topology) -> bool:
        """Whether this algorithm can run ``call`` on ``topo``."""
        return call.op in self.ops

    def cost(self, call: Call, topo: Topology, model: CostModel) -> float | None:
        """Estimated seconds for ``call`` (alpha-beta, see ``ahcomm.algorithms.cost``); None: no estimate.

        The selector runs the cheapest algorithm that can run a call; one without an
        estimate is chosen only when no candidate has one. The shared opening of every
        estimate lives here: one rank costs nothing, otherwise ``work`` gets the call's sizes
        and its ``Work`` is priced with ``model``. Algorithms override ``work``, not this.
        """
        if not self._estimates:
            return None
        n = topo.size
        if n == 1:
            return 0.0
        whole, block = call_bytes(call, n)
        model = model.for_call(model.per_host(topo), whole)  # in-cache rates for a call whose data fits
        work = self.work(call, topo, model, whole, block)
        return work.seconds(model, topo) if isinstance(work, Work) else work

    def work(self, call: Call, topo: Topology, model: CostModel, whole: float, block: float) -> Work | float:
        """What the busiest rank does in ``call`` on ``topo`` (2 ranks or more); ``whole`` and
        ``block`` are ``cost.call_bytes``. Seconds instead of a ``Work`` where the algorithm
        prices parts of the call at different link kinds itself."""
        raise NotImplementedError

    def exchanged(self, call: Call) -> bool:
        """Whether every rank hears from every peer in every run of ``call`` (``exchanges``, per op
        where it differs); the executor then knows every peer started it without being told."""
        return self.exchanges

    def resources(self, call: Call, topo: Topology, half_bytes: int) -> Resources:
        """Streams and slice size for ``call``; ``half_bytes`` is the usable CCL half."""
        return Resources()

    def orchestrate(self, ctx: Context) -> Awaitable[None]:
        """Submit this run's tasks and wait for them: ``runs[op](self, ctx)``, awaited by the executor
        (returned, not awaited here: no extra coroutine per run). Overridable as ``async def``."""
        try:
            run = self.runs[ctx.call.op]
        except KeyError:
            raise NotImplementedError(f"algorithm {self.name!r} has no run for {ctx.call.op}") from None
        return run(self, ctx)


def oversubscribed(topo: Topology, cores: int | None = None) -> bool:
    """Whether the host's ranks outnumber ``cores`` (default: this process's usable cores), for the
    algorithms that run on one host (direct, mesh's single-copy path)."""
    return topo.size > (usable_cores() if cores is None else cores)


def fold(ufunc: np.ufunc, parts: Sequence[np.ndarray], out: np.ndarray) -> None:
    """out = parts[0] op parts[1] op ... in this order (2 parts or more; the same bits on every
    rank that folds the same parts). ``out`` may be the first or the second part (one ufunc
    call: numpy gives the result it would without the overlap), not a later one."""
    ufunc(parts[0], parts[1], out=out)
    for part in parts[2:]:
        ufunc(out, part, out=out)


def fold_may_read(index: int, part: np.ndarray, out: np.ndarray) -> bool:
    """Whether ``fold`` may take ``part`` as its part number ``index`` while it writes ``out``:
    the first two go into its first ufunc call (numpy gives the result it would without the
    overlap); a later one must not overlap ``out``, which fold has written by then (bounds only,
    as cheap as a hot path wants: a part that might overlap counts as overlapping)."""
    return index <= 1 or not np.may_share_memory(part, out)


def split(count: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous [start, stop) ranges covering ``count``, sizes differing by <= 1."""
    base, extra = divmod(count, parts)
    out, start = [], 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        out.append((start, stop))
        start = stop
    return out


def pieces(start: int, stop: int, step: int) -> list[tuple[int, int]]:
    """[start, stop) cut into ranges of at most ``step`` (one empty range if start == stop)."""
    if stop <= start:
        return [(start, start)]
    return [(a, min(a + step, stop)) for a in range(start, stop, step)]


def align_up(nbytes: int) -> int:
    """Round ``nbytes`` up to a multiple of ALIGN."""
    return -(-nbytes // ALIGN) * ALIGN


def aligned(nbytes: int, itemsize: int) -> int:
    """Round ``nbytes`` down to a multiple of ALIGN and of ``itemsize``."""
    unit = ALIGN * itemsize // math.gcd(ALIGN, itemsize)
    return nbytes // unit * unit


@dataclass
class Registry:
    """Algorithms by name, in preference order."""

    algorithms: dict[str, Algorithm] = field(default_factory=dict)
    version: int = 0  # bumped by every register (a pick remembered under an older one is not used)

    def register(self, algorithm: Algorithm) -> Algorithm:
        self.algorithms[algorithm.name] = algorithm
        self.version += 1  # selectors' remembered picks are stale now
        return algorithm

    def ops(self) -> frozenset[str]:
        """Every op some registered algorithm runs."""
        return frozenset().union(*(a.ops for a in self.algorithms.values()))

    def names(self, op: str | None = None) -> list[str]:
        return [n for n, a in self.algorithms.items() if op is None or op in a.ops]

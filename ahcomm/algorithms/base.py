"""The algorithm-development framework: a call, the topology, resources and a context.

An algorithm is written in HCCL's three steps:

1. ``select(call, topo)`` - can it run this call here? (and, later, at what cost);
2. ``resources(call, topo)`` - how many sub-streams it needs and how many elements of the
   call fit one run (the executor slices larger calls, as HCCL loops over CCL buffers);
3. ``orchestrate(ctx)`` - submit tasks (copy, reduce, put, post, wait) to the main stream
   and sub-streams in ``ctx``, then ``await ctx.synchronize()``.

Protocol rules every algorithm keeps (the executor relies on them):

* every link notify posted during a run is waited for during the same run, so all flags
  are back at 0 when ``orchestrate`` returns;
* a run writes only into this collective's half of the CCL buffers (``ctx.ccl_in``,
  ``ctx.ccl_out``, peer offsets from ``ctx.put``/``ctx.remote``); the executor makes sure
  no rank still uses that half from two collectives ago.
"""

from __future__ import annotations

import math
import zlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Callable, ClassVar, Hashable, Sequence

import numpy as np

from .._dtypes import ReduceOp
from .._notify import Notify
from .._stream import Stream, TaskFn
from ..transports.base import Link, Signal
from ..transports.mailbox import Mailbox

if TYPE_CHECKING:
    from ._cost import CostModel

ALIGN = 64  # byte alignment of every region an algorithm carves from a CCL buffer

# Ops the executor runs whole, never sliced: their algorithms move data of any size through
# ``Channels`` (or read peers' memory). All but reduce carry per-rank ``Call.counts``.
WHOLE = frozenset({"reduce", "gather", "scatter", "all_to_all", "all_gather_v", "reduce_scatter_v",
                     "gather_v", "scatter_v", "all_to_all_v"})


_FINGERPRINTS: dict[tuple[object, ...], int] = {}  # fingerprints of recent kinds of call (the f-string is slow)


@dataclass(slots=True)
class Call:
    """One collective as every rank issued it.

    ``count`` is the per-rank block in elements: the whole vector for all_reduce, broadcast
    and reduce, the input of one rank for all_gather, the output of one rank for
    reduce_scatter, one rank's block for gather, scatter and all_to_all.

    ``counts`` (the ops in ``WHOLE`` but reduce) gives every rank's block in elements, the same on
    every rank: what each rank contributes (all_gather_v, gather, gather_v), receives
    (reduce_scatter_v, scatter, scatter_v), or - for all_to_all(_v) - what *this* rank
    sends to each peer; ``recv_counts`` is then what it receives from each. Blocks lie
    in rank order in the flat ``src``/``dst`` (``displs`` gives their offsets). Treat a
    Call as read-only.
    """

    op: str
    seq: int
    dtype: np.dtype
    count: int
    redop: ReduceOp | None = None
    root: int = 0
    counts: tuple[int, ...] | None = None
    recv_counts: tuple[int, ...] | None = None
    group: str = ""  # the communicator's identity (sub-communicators come with the multi-host work)
    _fp: int = 0

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def fingerprint(self) -> int:
        """A nonzero 32-bit summary of what every rank must agree on (not ``seq``: it travels
        beside it), computed once per call."""
        fp = self._fp
        if fp == 0:
            # Sizes every rank agrees on: the per-rank counts where the op has them (a rank's own
            # count differs across ranks there), none for all_to_all_v (each rank has its own row).
            sizes = "" if self.op == "all_to_all_v" else self.counts if self.counts is not None else self.count
            memo = (self.op, self.dtype, sizes, self.redop, self.root, self.group)
            fp = _FINGERPRINTS.get(memo, 0)
            if not fp:
                key = f"{self.op}|{self.dtype.str}{self.dtype.name}|{sizes}|{self.redop and self.redop.value}|" \
                      f"{self.root}|{self.group}"
                fp = zlib.crc32(key.encode()) or 1
                if len(_FINGERPRINTS) >= 4096:
                    _FINGERPRINTS.clear()
                _FINGERPRINTS[memo] = fp
            self._fp = fp
        return fp

    @property
    def empty(self) -> bool:
        """Nothing to move on any rank (all_to_all: nothing from or to this rank)."""
        if self.counts is None:
            return self.count == 0
        return not any(self.counts) and not any(self.recv_counts or ())

    @staticmethod
    def displs(counts: Sequence[int]) -> list[int]:
        """Offsets of blocks laid out back to back: [0, c0, c0+c1, ...] (one more than counts)."""
        out = [0]
        for c in counts:
            out.append(out[-1] + c)
        return out


@dataclass(frozen=True)
class Topology:
    """Where the ranks are and what joins them, as seen from ``rank``."""

    rank: int
    size: int
    hosts: tuple[str, ...]  # host identity of every rank
    link_kinds: tuple[str, ...]  # kind of the link to every rank ("self" for this rank)
    all_mapped: bool = False  # every link maps its peer's CCL buffers (Link.mapped)
    single_copy: bool = False  # every rank can read every peer's memory (agreed at init)
    mailbox: int = 0  # payload bytes of a mailbox slot (``Context.mailbox``); 0: no mailboxes

    @cached_property
    def servers(self) -> int:
        return len(set(self.hosts))


@dataclass(frozen=True)
class Resources:
    """What one run of an algorithm needs."""

    substreams: int = 0
    max_count: int | None = None  # elements of ``Call.count`` one run can take; None: any


class Context:
    """Everything ``orchestrate`` touches for one run (one slice of one collective)."""

    def __init__(self, *, call: Call, topo: Topology, links: dict[int, Link], src: np.ndarray,
                 dst: np.ndarray, ccl_in: np.ndarray, ccl_out: np.ndarray, half_offset: int, main: Stream,
                 subs: Sequence[Stream], ufunc: np.ufunc | None, final: bool = True,
                 scratch: Callable[[int], np.ndarray] | None = None, mailbox: Mailbox | None = None) -> None:
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
        self._locals: dict[Hashable, Notify] = {}
        self._error: BaseException | None = None
        for stream in (main, *self.subs):
            stream.on_error = self.fail  # a stream that fails must not leave the others waiting
    # -- notifies ---------------------------------------------------------------------------
    def local(self, key: Hashable) -> Notify:
        """A rank-local notify between this run's streams (created on first use)."""
        flag = self._locals.get(key)
        if flag is None:
            flag = self._locals[key] = Notify(f"local {key}")
            if self._error is not None:
                flag.fail(self._error)
        return flag

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
        task: TaskFn = lambda: link.post(signal, index, seq, value, fp)
        if stream.tracer is not None:
            task = stream.tracer.task(stream, "post", task, peer=peer, detail=signal, index=index, seq=seq)
        stream.submit(task)

    def wait(self, stream: Stream, peer: int, signal: Signal, index: int = 0) -> None:
        """Enqueue: wait for the flag ``peer`` posts on us."""
        task: TaskFn = self.links[peer].notify(signal, index, self.call.seq).wait
        if stream.tracer is not None:
            task = stream.tracer.task(stream, "wait", task, peer=peer, detail=signal, index=index, seq=self.call.seq)
        stream.submit(task)

    def put(self, stream: Stream, peer: int, src: np.ndarray, buf: str, offset: int) -> None:
        """Enqueue: write ``src`` into ``peer``'s buffer at ``offset`` within this collective's half."""
        link, seq, at = self.links[peer], self.call.seq, self.half_offset + offset
        task: TaskFn = lambda: link.put(src, buf, at, seq, stream.memory)
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
        if first is not None:
            raise first


class Algorithm(ABC):
    """Base class of every registered algorithm."""

    name: ClassVar[str]
    ops: ClassVar[frozenset[str]]
    exchanges: ClassVar[bool] = False  # every rank hears from every peer in every run (see the executor)

    def select(self, call: Call, topo: Topology) -> bool:
        """Whether this algorithm can run ``call`` on ``topo``."""
        return call.op in self.ops

    def cost(self, call: Call, topo: Topology, model: "CostModel") -> float | None:
        """Estimated seconds for ``call`` (alpha-beta, see ``_cost``); None: no estimate.

        The selector runs the cheapest algorithm that can run a call; one without an
        estimate is chosen only when no candidate has one.
        """
        return None

    def resources(self, call: Call, topo: Topology, half_bytes: int) -> Resources:
        """Streams and slice size for ``call``; ``half_bytes`` is the usable CCL half."""
        return Resources()

    @abstractmethod
    async def orchestrate(self, ctx: Context) -> None:
        """Submit this run's tasks and wait for them."""


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

    def register(self, algorithm: Algorithm) -> Algorithm:
        self.algorithms[algorithm.name] = algorithm
        return algorithm

    def names(self, op: str | None = None) -> list[str]:
        return [n for n, a in self.algorithms.items() if op is None or op in a.ops]

"""Timeline tracing: ``AHCOMM_TRACE=DIR`` records every collective and every stream task.

Each communicator with tracing on owns a ``Tracer`` (``Executor.tracer``; None when off, and
then no hook allocates or reads a clock). It records

* one span per collective on the ``collectives`` track (op, seq, algorithm, dtype, count,
  bytes), from ``Executor.run`` (the executor swaps in a timing wrapper at construction);
* one span per stream task on that stream's track (``main``, ``sub0``, ...): ``copy``,
  ``reduce``, ``put``, ``read``, ``post``, ``wait``, ``call``, with bytes and peer where the
  submitter knows them (``Stream`` and ``Context`` wrap the task in a ``_Task``). A task's
  span runs from when the stream starts it until it completes (a wait: until the flag came).

Timestamps are ``time.perf_counter_ns()``. When the communicator closes (or fails) the
tracer writes Chrome / Perfetto trace JSON to ``DIR/rank{r}of{size}[.GROUP].{host}.{pid}.json``, with
``ts``/``dur`` in microseconds from the tracer's start and, in ``otherData``, that origin
and this process's clock offset to rank 0 (estimated at init by ``estimate_offsets``), so
``ahcomm-trace merge`` can put every rank on rank 0's clock.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from time import perf_counter_ns
from typing import Any, Protocol

import numpy as np

from ._dtypes import ReduceOp

TaskFn = Callable[[], "Awaitable[Any] | None"]  # a stream task (``_stream``)


class Track(Protocol):
    """What a span records of its stream (``_stream.Stream``)."""

    @property
    def name(self) -> str: ...


class Named(Protocol):
    """What a collective's span records of its algorithm (``algorithms.base.Algorithm``)."""

    @property
    def name(self) -> str: ...


class CallFacts(Protocol):
    """What a collective's span records of its call (``algorithms.base.Call``)."""

    @property
    def op(self) -> str: ...
    @property
    def seq(self) -> int: ...
    @property
    def dtype(self) -> np.dtype: ...
    @property
    def count(self) -> int: ...
    @property
    def itemsize(self) -> int: ...
    @property
    def redop(self) -> ReduceOp | None: ...
    @property
    def root(self) -> int: ...
    @property
    def counts(self) -> tuple[int, ...] | None: ...
    @property
    def group(self) -> str: ...

ENV = "AHCOMM_TRACE"
MAX_SPANS = 300_000  # spans kept per communicator (~235 B each): the latest; older ones count as dropped
COLLECTIVES = "collectives"  # the track of collective spans
log = logging.getLogger("ahcomm.trace")

_process_offset: int | None = None  # this process's perf_counter_ns minus rank 0's (set at init)
_names: set[str] = set()  # file names this process has taken


def trace_dir(env: Mapping[str, str] | None = None) -> str | None:
    """The directory ``AHCOMM_TRACE`` names, or None (tracing off)."""
    value = (os.environ if env is None else env).get(ENV, "").strip()
    return value or None


class _Later:
    """A traced task's pending awaitable: awaiting it records the span when it completes;
    ``close()`` (the stream dropped the task) closes the task's own coroutine."""

    __slots__ = ("pending", "task")

    def __init__(self, task: "_Task", pending: Awaitable[Any]) -> None:
        self.task, self.pending = task, pending

    def __await__(self) -> Any:
        return self.task._later(self.pending).__await__()

    def close(self) -> None:
        close = getattr(self.pending, "close", None)
        if close is not None:
            close()


class _Task:
    """A stream task with its span: runs ``fn`` and records when it started and completed."""

    __slots__ = (
        "detail",
        "end",
        "error",
        "fn",
        "index",
        "kind",
        "nbytes",
        "peer",
        "seq",
        "start",
        "tracer",
        "track",
    )

    def __init__(self, tracer: Tracer, track: str, kind: str, fn: TaskFn, nbytes: int, peer: int,
                 detail: object, index: int, seq: int) -> None:
        self.tracer, self.track, self.kind, self.fn = tracer, track, kind, fn
        self.nbytes, self.peer, self.detail, self.index, self.seq = nbytes, peer, detail, index, seq
        self.start = self.end = 0
        self.error: str | None = None

    def __call__(self) -> Awaitable[Any] | None:
        self.start = perf_counter_ns()
        try:
            result = self.fn()
        except BaseException as exc:
            self._done(exc)
            raise
        if result is None:
            self._done(None)
            return None
        return _Later(self, result)

    async def _later(self, pending: Awaitable[Any]) -> Any:
        try:
            out = await pending
        except BaseException as exc:
            self._done(exc)
            raise
        self._done(None)
        return out

    def _done(self, exc: BaseException | None) -> None:
        self.end = perf_counter_ns()
        if exc is not None:
            self.error = type(exc).__name__
        self.fn = _noop  # release the closure (and the arrays it holds)
        tracer = self.tracer
        tracer.spans.append(self)
        tracer.recorded += 1

    def event(self, origin: int, pid: int, tid: int) -> str:
        """This span as one trace event (JSON text)."""
        kind = self.kind
        parts, args = [kind], [f'"kind":"{kind}"']
        detail = self.detail
        if isinstance(detail, str):  # a local notify's name, or the task's function
            local = kind in ("post", "wait")
            what = detail if local else _short(detail)
            parts.append("(local)" if local else what)
            args.append(f'"what":{_q(what)}')
        elif detail is not None:  # a link Signal
            signal = getattr(detail, "name", str(detail))
            parts.append(signal)
            args.append(f'"signal":"{signal}","index":{self.index},"seq":{self.seq}')
        if self.nbytes >= 0:
            parts.append(_size(self.nbytes))
            args.append(f'"bytes":{self.nbytes}')
        if self.peer >= 0:
            parts.append(f"{'<-' if kind in ('wait', 'read') else '->'} r{self.peer}")
            args.append(f'"peer":{self.peer}')
        if self.error is not None:
            args.append(f'"error":{_q(self.error)}')
        return _span(" ".join(parts), _CATEGORY.get(kind, "task"), self.start, self.end, origin, pid, tid,
                     "{" + ",".join(args) + "}")


_CATEGORY = {"copy": "memory", "reduce": "memory", "put": "link", "read": "link", "post": "notify",
             "wait": "notify"}


def _noop() -> None:
    return None


class _Collective:
    """One collective's span on the collectives track (its args are built when written)."""

    __slots__ = ("algorithm", "call", "end", "error", "start")
    track = COLLECTIVES

    def __init__(self, call: CallFacts, algorithm: str, start: int, end: int, error: str | None) -> None:
        self.call, self.algorithm, self.start, self.end, self.error = call, algorithm, start, end, error

    def event(self, origin: int, pid: int, tid: int) -> str:
        call = self.call
        args: dict[str, Any] = {"op": call.op, "seq": call.seq, "algorithm": self.algorithm,
                                "dtype": call.dtype.name, "count": call.count, "bytes": call.count * call.itemsize}
        if call.redop is not None:
            args["redop"] = call.redop.value
        if call.op in ("broadcast", "reduce", "gather", "gather_v", "scatter", "scatter_v"):
            args["root"] = call.root
        if call.counts is not None:
            args["counts"] = list(call.counts)
        if self.error is not None:
            args["error"] = self.error
        return _span(f"{call.op} #{call.seq}", "collective", self.start, self.end, origin, pid, tid,
                     json.dumps(args, separators=(",", ":")))


def _span(name: str, cat: str, start: int, end: int, origin: int, pid: int, tid: int, args: str) -> str:
    return (f'{{"name":{_q(name)},"cat":"{cat}","ph":"X","ts":{(start - origin) / 1e3:.3f},'
            f'"dur":{max(0, end - start) / 1e3:.3f},"pid":{pid},"tid":{tid},"args":{args}}}')


def _q(text: str) -> str:
    """``text`` as a JSON string."""
    return f'"{text}"' if text.isascii() and text.isprintable() and '"' not in text and "\\" not in text \
        else json.dumps(text)


class Tracer:
    """The spans of one communicator on this rank, written as trace JSON at close."""

    def __init__(self, directory: str, rank: int, size: int) -> None:
        self.directory = Path(directory)
        self.rank, self.size = rank, size
        self.group = ""
        self.origin = perf_counter_ns()
        self.offset: int | None = None  # this clock minus rank 0's; None: the process's, if known
        self.estimate: int | None = None  # the offset the ping-pongs measured (used across hosts)
        self.rtt: int | None = None  # round trip of the ping-pong the estimate came from
        self.spans: deque[_Task | _Collective] = deque(maxlen=MAX_SPANS)
        self.recorded = 0
        self.path = self.directory / _file_name(rank, size)

    @classmethod
    def from_env(cls, rank: int, size: int) -> Tracer | None:
        """A tracer when ``AHCOMM_TRACE`` is set, else None."""
        directory = trace_dir()
        return None if directory is None else cls(directory, rank, size)

    # -- recording ----------------------------------------------------------------------------------
    def task(self, stream: Track, kind: str, fn: TaskFn, *, nbytes: int = -1, peer: int = -1,
             detail: object = None, index: int = 0, seq: int = -1) -> TaskFn:
        """``fn`` wrapped so that its span on ``stream``'s track is recorded when it completes."""
        return _Task(self, stream.name, kind, fn, nbytes, peer, detail, index, seq)

    def submitter(self, stream: Track, submit: Callable[[TaskFn], None]) -> Callable[[TaskFn], None]:
        """``stream.submit`` that also records tasks submitted without a kind (as ``task``)."""
        def traced_submit(fn: TaskFn) -> None:
            if type(fn) is not _Task:
                fn = _Task(self, stream.name, "task", fn, -1, -1, getattr(fn, "__qualname__", None), 0, -1)
            submit(fn)
        return traced_submit

    def runner(self, run: Callable[..., Awaitable[None]]) -> Callable[..., Awaitable[None]]:
        """``Executor.run(call, algorithm, ...)`` wrapped to record each collective's span."""
        async def traced_run(call: CallFacts, algorithm: Named, *args: Any, **kwargs: Any) -> None:
            start = perf_counter_ns()
            error: BaseException | None = None
            try:
                await run(call, algorithm, *args, **kwargs)
            except BaseException as exc:
                error = exc
                raise
            finally:
                self.collective(call, algorithm.name, start, perf_counter_ns(), error)
        return traced_run

    def set_group(self, group: str) -> None:
        """Name this communicator (a sub-communicator: every member gives the same name) in the
        trace's labels and file name."""
        self.group = group
        _names.discard(self.path.name)
        self.path = self.directory / _file_name(self.rank, self.size, group)

    def collective(self, call: CallFacts, algorithm: str, start: int, end: int, error: BaseException | None) -> None:
        if call.group:
            self.group = call.group
        reason = None if error is None else f"{type(error).__name__}: {error}"
        self._keep(_Collective(call, algorithm, start, end, reason))

    def _keep(self, span: _Task | _Collective) -> None:
        self.spans.append(span)
        self.recorded += 1

    # -- output -------------------------------------------------------------------------------------
    def label(self) -> str:
        return f"rank {self.rank}/{self.size}" + (f" {self.group}" if self.group else "")

    def text(self) -> str:
        """The trace as JSON: metadata events naming the process and its tracks, then the spans."""
        tracks = _track_ids(s.track for s in self.spans)
        meta = [json.dumps(e, separators=(",", ":")) for e in metadata(self.rank, self.label(), tracks)]
        origin, pid = self.origin, self.rank
        spans = [s.event(origin, pid, tracks[s.track]) for s in sorted(self.spans, key=lambda s: s.start)]
        offset = self.offset if self.offset is not None else _process_offset
        info = {"rank": self.rank, "size": self.size, "group": self.group, "pid": os.getpid(),
                "host": socket.gethostname(), "clock": "perf_counter_ns", "origin_ns": self.origin,
                "offset_ns": offset, "estimated_offset_ns": self.estimate, "rtt_ns": self.rtt,
                "dropped": self.recorded - len(self.spans)}
        return ('{"traceEvents":[' + ",\n".join(meta + spans) + '],"displayTimeUnit":"ns","otherData":'
                + json.dumps({"ahcomm": info}) + "}")

    def write(self) -> Path | None:
        """Write the trace file (again, with everything so far); None if it could not be written."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(self.text(), encoding="utf-8")
            tmp.replace(self.path)
        except Exception as exc:  # noqa: BLE001 - a trace must never break close() or abort()
            log.warning("ahcomm: could not write the trace %s: %r", self.path, exc)
            return None
        return self.path


def metadata(pid: int, label: str, tracks: Mapping[str, int]) -> list[dict[str, Any]]:
    """``M`` events: the process's name and order, and each track's name and order."""
    out: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": label}},
        {"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0, "args": {"sort_index": pid}}]
    for name, tid in tracks.items():
        out.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}})
        out.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid, "args": {"sort_index": tid}})
    return out


def _track_ids(names: Any) -> dict[str, int]:
    """Track ids: collectives 0, main 1, then sub0, sub1, ... in number order, then the rest."""
    def order(name: str) -> tuple[int, int, str]:
        if name == COLLECTIVES:
            return (0, 0, name)
        if name == "main":
            return (1, 0, name)
        if name.startswith("sub") and name[3:].isdigit():
            return (2, int(name[3:]), name)
        return (3, 0, name)
    ordered = sorted({COLLECTIVES, "main", *names}, key=order)
    return {name: i for i, name in enumerate(ordered)}


def _file_name(rank: int, size: int, group: str = "") -> str:
    host = "".join(c if c.isalnum() or c in "-_" else "_" for c in socket.gethostname())[:64]
    base = f"rank{rank}of{size}{'.' + group if group else ''}.{host}.{os.getpid()}"
    name, k = f"{base}.json", 1
    while name in _names:
        name, k = f"{base}.{k}.json", k + 1
    _names.add(name)
    return name


def _size(nbytes: int) -> str:
    if nbytes < 1024:
        return f"{nbytes} B"
    if nbytes < 1 << 20:
        return f"{nbytes / 1024:.4g} KiB"
    return f"{nbytes / (1 << 20):.4g} MiB"


def _short(qualname: str) -> str:
    """'Mesh._sc_all_reduce.<locals>.<lambda>' -> 'Mesh._sc_all_reduce'."""
    parts = [p for p in qualname.split(".") if p not in ("<locals>", "<lambda>")]
    return ".".join(parts[-2:]) or qualname


def set_process_offset(offset: int) -> None:
    """This process's clock minus rank 0's (``_clock`` measures it at init): the default of every tracer."""
    global _process_offset
    _process_offset = offset

"""The catalogue's collectives: reduce, gather, scatter, all_to_all and the uneven variants.

A mixin of ``Comm`` (typed against ``_core.CommCore``). Blocks are rows along axis 0; ``Call.counts`` carries them in
elements. Where a rank cannot know every count (all_gather_v, gather_v, scatter_v without
counts, all_to_all_v without receive counts) a small count exchange runs first as its own
collective, and the main one is filled in when its turn comes: both take their sequence
numbers when the call is made, so matching across ranks is unchanged.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ._core import FrontEnd, Job
from ._core import Gathered as Gathered  # its home for users: ahcomm.Gathered
from ._device_calls import device_aware
from ._dtypes import ReduceOp, check_reduce, finish_avg
from ._errors import InvalidArgument, InvalidDtype, UsageError
from .algorithms.base import Call


def flat_view(result: np.ndarray) -> np.ndarray:
    """A flat contiguous view of ``result``, or a temporary when it is strided."""
    return result.reshape(-1) if result.flags.c_contiguous else np.empty(result.size, result.dtype)


def retrieved(future: "asyncio.Future[Any]") -> None:
    """A done callback for an internal future whose error reaches the caller another way."""
    if not future.cancelled():
        future.exception()


_ARGS = (InvalidArgument, InvalidDtype)  # argument errors that ``_reject`` turns into a retired call


def _row_size(arr: np.ndarray) -> int:
    return int(np.prod(arr.shape[1:], dtype=np.int64)) if arr.ndim > 1 else 1


class BlockedCollectives(FrontEnd):
    """reduce, gather(_v), scatter(_v), all_to_all(_v), all_gather_v, reduce_scatter_v."""

    # -- public ------------------------------------------------------------------------------
    @device_aware
    def reduce(self, x: Any, op: ReduceOp | str = "sum", root: int = 0, *, out: np.ndarray | None = None,
               algorithm: str | None = None, timeout: float | None = None) -> "asyncio.Future[np.ndarray | None]":
        """Elementwise reduction of ``x`` over all ranks, delivered to ``root`` (None elsewhere)."""
        arr, dtype = self._input(x, "reduce")
        redop = ReduceOp.parse(op)
        check_reduce(redop, dtype)
        self._check_root(root, "reduce")
        src = np.ascontiguousarray(arr).reshape(-1)
        call = Call(op="reduce", seq=self._seq, dtype=dtype, count=arr.size, redop=redop, root=int(root))
        if self.rank != root:
            return self._submit(call, src, src[:0], None, None, algorithm, timeout=timeout)
        try:  # only the root checks out=
            result = self._output("reduce", out, arr.shape, dtype)
        except _ARGS as exc:
            raise self._reject("reduce", exc, root) from None
        dst = flat_view(result)
        if result is arr and arr.flags.c_contiguous:
            src = dst
        elif out is not None and np.may_share_memory(result, arr):
            src = src.copy()
        return self._submit(call, src, dst, result, self._finish(dst, result, redop), algorithm, timeout=timeout)

    @device_aware
    def gather(self, x: Any, root: int = 0, *, out: np.ndarray | None = None,
               algorithm: str | None = None, timeout: float | None = None) -> "asyncio.Future[np.ndarray | None]":
        """Every rank's ``x`` concatenated along axis 0 at ``root`` (None elsewhere)."""
        arr, _ = self._input(x, "gather")
        self._check_root(root, "gather")
        arr = arr.reshape(1, *arr.shape) if arr.ndim == 0 else arr
        rows = (arr.shape[0],) * self.size
        return self._gather(arr, root, rows, out, algorithm, "gather", uneven=False, timeout=timeout)

    @device_aware
    def gather_v(self, x: Any, root: int = 0, *, counts: Sequence[int] | None = None,
                 out: np.ndarray | None = None, algorithm: str | None = None,
                 timeout: float | None = None) -> "asyncio.Future[Gathered | None]":
        """Like ``gather`` with a row count per rank; ``root`` gets ``Gathered(data, counts)``.

        ``counts`` (rows per rank, the same on every rank) saves an exchange when known.
        """
        arr, _ = self._input(x, "gather_v")
        self._check_root(root, "gather_v")
        self._check_rows(arr, "gather_v")
        if counts is not None:
            try:  # counts[rank] against this rank's rows: only this rank can check
                rows = self._check_counts(counts, "gather_v", own=arr.shape[0])
            except _ARGS as exc:
                raise self._reject("gather_v", exc, root) from None
            return self._gather(arr, root, rows, out, algorithm, "gather_v", uneven=True, timeout=timeout)
        row = _row_size(arr)
        shapes = self.all_gather(np.array([arr.shape[0], row], np.int64), timeout=timeout)
        shapes.add_done_callback(retrieved)
        return self._gather(arr, root, None, out, algorithm, "gather_v", uneven=True,
                            later=lambda: self._exchanged_rows(shapes, "gather_v", row), timeout=timeout)

    @device_aware
    def all_gather_v(self, x: Any, *, counts: Sequence[int] | None = None, out: np.ndarray | None = None,
                     algorithm: str | None = None, timeout: float | None = None) -> "asyncio.Future[Gathered]":
        """Every rank's ``x`` (row counts may differ) concatenated along axis 0, on every rank."""
        arr, dtype = self._input(x, "all_gather_v")
        self._check_rows(arr, "all_gather_v")
        src = np.ascontiguousarray(arr).reshape(-1)
        call = Call(op="all_gather_v", seq=self._seq, dtype=dtype, count=src.size)
        row = _row_size(arr)

        def prepare(job: Job, rows: tuple[int, ...]) -> None:
            result = self._output("all_gather_v", out, (sum(rows), *arr.shape[1:]), dtype)
            job.dst = flat_view(result)
            job.call.counts = tuple(r * row for r in rows)
            job.result = Gathered(result, rows)
            job.finish = self._finish(job.dst, result, None)

        if counts is not None:
            try:  # counts[rank] against this rank's rows, out=: only this rank can check
                rows = self._check_counts(counts, "all_gather_v", own=arr.shape[0])
                return self._submit(call, src, src, None, None, algorithm, prepare=lambda job: prepare(job, rows),
                                    timeout=timeout)
            except _ARGS as exc:
                raise self._reject("all_gather_v", exc) from None
        shapes = self.all_gather(np.array([arr.shape[0], row], np.int64), timeout=timeout)
        shapes.add_done_callback(retrieved)
        call.seq = self._seq
        return self._submit(call, src, src, None, None, algorithm, later=True, timeout=timeout,
                            prepare=lambda job: prepare(job, self._exchanged_rows(shapes, "all_gather_v", row)))

    @device_aware
    def reduce_scatter_v(self, x: Any, counts: Sequence[int], op: ReduceOp | str = "sum", *,
                         out: np.ndarray | None = None, algorithm: str | None = None,
                         timeout: float | None = None) -> "asyncio.Future[np.ndarray]":
        """Reduce ``x`` over ranks; rank r gets the r-th block of ``counts`` rows (sum = x.shape[0])."""
        arr, dtype = self._input(x, "reduce_scatter_v")
        redop = ReduceOp.parse(op)
        check_reduce(redop, dtype)
        self._check_rows(arr, "reduce_scatter_v")
        rows = self._check_counts(counts, "reduce_scatter_v", total=arr.shape[0])
        row = _row_size(arr)
        result = self._output("reduce_scatter_v", out, (rows[self.rank], *arr.shape[1:]), dtype)
        dst = flat_view(result)
        src = np.ascontiguousarray(arr).reshape(-1)
        if out is not None and np.may_share_memory(result, arr):
            src = src.copy()
        call = Call(op="reduce_scatter_v", seq=self._seq, dtype=dtype, count=dst.size, redop=redop,
                    counts=tuple(r * row for r in rows))
        return self._submit(call, src, dst, result, self._finish(dst, result, redop), algorithm, timeout=timeout)

    @device_aware
    def scatter(self, x: Any, root: int = 0, *, out: np.ndarray | None = None,
                algorithm: str | None = None, timeout: float | None = None) -> "asyncio.Future[np.ndarray]":
        """Block r of the root's ``x`` (axis 0, divisible by the world size) to rank r.

        Other ranks' ``x`` (or ``out``) gives only the shape and dtype; ``x`` may be None
        where ``out`` is given.
        """
        self._check_root(root, "scatter")
        try:  # x is checked at the root only, out= elsewhere
            arr = self._template(x, out, "scatter", root)
            return self._scatter(arr, root, self._even_rows(arr, "scatter"), out, algorithm, "scatter",
                                 timeout=timeout)
        except _ARGS as exc:
            raise self._reject("scatter", exc, root) from None

    @device_aware
    def scatter_v(self, x: Any, counts: Sequence[int], root: int = 0, *, out: np.ndarray | None = None,
                  algorithm: str | None = None, timeout: float | None = None) -> "asyncio.Future[np.ndarray]":
        """Block r (``counts[r]`` rows of the root's ``x``) to rank r.

        Every rank passes the same ``counts``; other ranks' ``x`` (or ``out``) gives only
        the dtype and the shape of a row.
        """
        self._check_root(root, "scatter_v")
        try:  # x and the counts' total are checked at the root only, out= elsewhere
            arr = self._template(x, out, "scatter_v", root)
            self._check_rows(arr, "scatter_v")
            rows = self._check_counts(counts, "scatter_v", total=arr.shape[0] if self.rank == root else None)
            return self._scatter(arr, root, rows, out, algorithm, "scatter_v", timeout=timeout)
        except _ARGS as exc:
            raise self._reject("scatter_v", exc, root) from None

    @device_aware
    def all_to_all(self, x: Any, *, out: np.ndarray | None = None,
                   algorithm: str | None = None, timeout: float | None = None) -> "asyncio.Future[np.ndarray]":
        """Block j (axis 0, divisible by the world size) of ``x`` goes to rank j; the result
        holds the block every rank sent here, in rank order (same shape as ``x``)."""
        arr, _ = self._input(x, "all_to_all")
        rows = self._even_rows(arr, "all_to_all")
        return self._all_to_all(arr, rows, rows, out, algorithm, "all_to_all", timeout=timeout)

    @device_aware
    def all_to_all_v(self, x: Any, send_counts: Sequence[int], *, recv_counts: Sequence[int] | None = None,
                     out: np.ndarray | None = None, algorithm: str | None = None,
                     timeout: float | None = None) -> "asyncio.Future[Gathered]":
        """``send_counts[j]`` rows of ``x`` (in order) go to rank j; returns ``Gathered(data,
        recv_counts)``. Receive counts are exchanged for you unless given."""
        arr, _ = self._input(x, "all_to_all_v")
        self._check_rows(arr, "all_to_all_v")
        send = self._check_counts(send_counts, "all_to_all_v", total=arr.shape[0], name="send_counts")
        if recv_counts is not None:
            recv = self._check_counts(recv_counts, "all_to_all_v", name="recv_counts")
            return self._all_to_all(arr, send, recv, out, algorithm, "all_to_all_v", timeout=timeout)
        exchanged = self.all_to_all(np.array(send, np.int64), timeout=timeout)
        exchanged.add_done_callback(retrieved)
        return self._all_to_all(arr, send, None, out, algorithm, "all_to_all_v", exchanged=exchanged,
                                timeout=timeout)

    def _reject(self, op: str, exc: UsageError, root: int = 0) -> UsageError:
        """``exc`` is a check that only some ranks can make (a root-only argument, this rank's
        own rows): the call still takes its sequence number here and is retired in its turn
        (``_retire``), so every rank agrees about it. Returns ``exc`` for the caller to raise."""
        if self.size > 1 and self._live():
            empty = np.empty(0, np.uint8)

            def rejected(job: Job) -> None:
                raise exc

            call = Call(op=op, seq=self._seq, dtype=empty.dtype, count=0, root=int(root))
            done = self._submit(call, empty, empty, None, None, None, prepare=rejected, later=True)
            done.add_done_callback(retrieved)  # the caller gets exc at once
        return exc

    # -- plumbing ----------------------------------------------------------------------------
    def _finish(self, dst: np.ndarray, result: np.ndarray, redop: ReduceOp | None) -> Callable[[], None] | None:
        avg = redop is ReduceOp.AVG
        strided = not result.flags.c_contiguous  # dst is then a temporary
        if not avg and not strided:
            return None
        size = self.size

        def finish() -> None:
            if avg:
                finish_avg(dst, size)
            if strided:
                np.copyto(result, dst.reshape(result.shape))
        return finish

    def _even_rows(self, arr: np.ndarray, what: str) -> tuple[int, ...]:
        """Rows per rank when axis 0 splits evenly over the ranks; else an error naming the _v op."""
        if arr.ndim == 0 or arr.shape[0] % self.size:
            rows = arr.shape[0] if arr.ndim else "a 0-d array"
            raise InvalidArgument(f"{what}: x.shape[0] ({rows}) must be divisible by the world size ({self.size}); "
                                  f"pad x to a multiple of {self.size} rows, or for uneven blocks use {what}_v")
        return (arr.shape[0] // self.size,) * self.size

    def _check_rows(self, arr: np.ndarray, what: str) -> None:
        if arr.ndim == 0:
            raise InvalidArgument(f"{what}: x must have at least one dimension (blocks are rows of axis 0)")

    def _check_counts(self, counts: Sequence[int], what: str, *, own: int | None = None, total: int | None = None,
                      name: str = "counts") -> tuple[int, ...]:
        try:
            rows = tuple(int(c) for c in counts)
        except (TypeError, ValueError):
            raise InvalidArgument(
                f"{what}: {name} must be a sequence of {self.size} integers, got {counts!r}") from None
        if len(rows) != self.size or any(c < 0 for c in rows):
            raise InvalidArgument(f"{what}: {name} must be {self.size} non-negative integers "
                                  f"(one per rank), got {list(rows)}")
        if own is not None and rows[self.rank] != own:
            raise InvalidArgument(f"{what}: {name}[{self.rank}] is {rows[self.rank]} but this rank's x has "
                                  f"{own} rows")
        if total is not None and sum(rows) != total:
            raise InvalidArgument(f"{what}: {name} add up to {sum(rows)} rows but x has {total} rows")
        return rows

    def _exchanged_rows(self, shapes: "asyncio.Future[np.ndarray]", what: str, row: int) -> tuple[int, ...]:
        table = shapes.result().reshape(self.size, 2)
        bad = [p for p in range(self.size) if int(table[p, 1]) != row and int(table[p, 0])]
        if bad:
            raise InvalidArgument(f"{what}: rows differ in size across ranks: rank {self.rank} has {row} "
                                  f"elements per row, rank {bad[0]} has {int(table[bad[0], 1])}")
        return tuple(int(c) for c in table[:, 0])

    def _template(self, x: Any, out: np.ndarray | None, what: str, root: int) -> np.ndarray:
        """The root's data, or (elsewhere) an array giving the dtype and row shape."""
        if x is None and (self.rank == root or out is None):
            self._check_open(what)
            where = "at the root" if self.rank == root else "unless out= is given"
            raise InvalidArgument(f"{what}: x is required {where}")
        if x is None:
            assert out is not None
            self._input(out, what)  # checks the communicator is open first
            if what == "scatter" and out.ndim:  # even blocks: the whole is size x out's rows (a view of nothing)
                return np.broadcast_to(np.empty((), out.dtype), (out.shape[0] * self.size, *out.shape[1:]))
            return np.empty((0, *out.shape[1:]), out.dtype) if out.ndim else out  # only dtype and row shape count
        arr, _ = self._input(x, what)
        return arr

    def _gather(self, arr: np.ndarray, root: int, rows: tuple[int, ...] | None, out: np.ndarray | None,
                algorithm: str | None, op: str, *, uneven: bool,
                later: Callable[[], tuple[int, ...]] | None = None,
                timeout: float | None = None) -> "asyncio.Future[Any]":
        """``rows`` per rank, or None: ``later()`` gives them when the call's turn comes."""
        dtype, row = arr.dtype, _row_size(arr)
        src = np.ascontiguousarray(arr).reshape(-1)
        call = Call(op=op, seq=self._seq, dtype=dtype, count=src.size, root=int(root))

        def prepare(job: Job) -> None:
            got = rows if rows is not None else later()  # type: ignore[misc]
            job.call.counts = tuple(r * row for r in got)
            if self.rank == root:
                result = self._output(op, out, (sum(got), *arr.shape[1:]), dtype)
                job.dst = flat_view(result)
                job.finish = self._finish(job.dst, result, None)
                job.result = Gathered(result, got) if uneven else result

        if rows is None:
            return self._submit(call, src, src[:0], None, None, algorithm, prepare=prepare, later=True,
                                timeout=timeout)
        try:  # the root's out=: only the root checks it
            return self._submit(call, src, src[:0], None, None, algorithm, prepare=prepare, timeout=timeout)
        except _ARGS as exc:
            raise self._reject(op, exc, root) from None

    def _scatter(self, arr: np.ndarray, root: int, rows: tuple[int, ...], out: np.ndarray | None,
                 algorithm: str | None, op: str, *, timeout: float | None = None) -> "asyncio.Future[Any]":
        dtype, row = arr.dtype, _row_size(arr)
        src = np.ascontiguousarray(arr).reshape(-1) if self.rank == root else np.empty(0, dtype)
        mine = rows[self.rank]
        result = self._output(op, out, (mine, *arr.shape[1:]), dtype)
        dst = flat_view(result)
        if self.rank == root and np.may_share_memory(result, arr):
            src = src.copy()
        call = Call(op=op, seq=self._seq, dtype=dtype, count=mine * row, root=int(root),
                    counts=tuple(r * row for r in rows))
        return self._submit(call, src, dst, result, self._finish(dst, result, None), algorithm, timeout=timeout)

    def _all_to_all(self, arr: np.ndarray, send: tuple[int, ...], recv: tuple[int, ...] | None,
                    out: np.ndarray | None, algorithm: str | None, op: str, *,
                    exchanged: "asyncio.Future[np.ndarray] | None" = None,
                    timeout: float | None = None) -> "asyncio.Future[Any]":
        dtype, row = arr.dtype, _row_size(arr)
        src = np.ascontiguousarray(arr).reshape(-1)
        call = Call(op=op, seq=self._seq, dtype=dtype, count=send[self.rank] * row,
                    counts=tuple(s * row for s in send))

        def prepare(job: Job) -> None:
            got = recv if recv is not None else tuple(int(c) for c in exchanged.result())  # type: ignore[union-attr]
            result = self._output(op, out, (sum(got), *arr.shape[1:]), dtype)
            job.dst = flat_view(result)
            if np.may_share_memory(job.dst, job.src):  # blocks are sent while others land: read a copy
                job.src = job.src.copy()
            job.call.recv_counts = tuple(r * row for r in got)
            job.result = result if op == "all_to_all" else Gathered(result, got)
            job.finish = self._finish(job.dst, result, None)

        return self._submit(call, src, src[:0], None, None, algorithm, prepare=prepare, later=recv is None,
                            timeout=timeout)

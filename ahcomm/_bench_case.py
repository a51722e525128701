"""What one ahcomm-bench measurement is: the sizes of a sweep, each rank's known input and the
expected output, the buffers and call of one (op, size) (``Case``), and its timing (``measure``).
Shared by the benchmark's sweeps, ``calibrate`` and ``tune``."""

from __future__ import annotations

import argparse
import asyncio
import math
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from ._peer_memory import alloc

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "gather", "scatter", "all_to_all")
BLOCKED = ("all_gather", "reduce_scatter", "gather", "scatter", "all_to_all")  # size counts n blocks
REDUCING = ("all_reduce", "reduce_scatter", "reduce")
ROOTED = ("broadcast", "reduce", "gather", "scatter")
REDOPS = ("sum", "prod", "max", "min", "avg", "band", "bor", "bxor")  # every ReduceOp
BITWISE = {"band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor}


def dtype_arg(text: str) -> np.dtype:
    """``-d``: a dtype ahcomm moves (argparse says which ones otherwise, before any rank starts)."""
    from ._dtypes import SUPPORTED_DTYPES

    by_name = {str(d): d for d in SUPPORTED_DTYPES}
    found = by_name.get(text.strip().lower())
    if found is None:
        raise argparse.ArgumentTypeError(f"unsupported dtype {text!r}; choose from {', '.join(by_name)}")
    return found


def parse_size(text: str) -> int:
    """'8', '64K', '4M', '1G' (binary multiples)."""
    text = text.strip().upper().rstrip("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    try:
        return int(float(text[:-1]) * mult[text[-1]]) if text and text[-1] in mult else int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"size {text!r}: use a number of bytes, or one with K, M or G "
                                         "(8, 64K, 1.5M, 1G)") from None


def sizes(minbytes: int, maxbytes: int, factor: int) -> Iterator[int]:
    """minbytes * factor^k up to maxbytes, plus maxbytes itself if the steps skip it."""
    s, last = max(1, minbytes), 0
    while s <= maxbytes:
        yield s
        last = s
        if factor <= 1:
            break
        s *= factor
    if last < maxbytes and factor > 1:
        yield maxbytes


def bus_factor(op: str, n: int) -> float:
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    return (n - 1) / n if op in BLOCKED else 1.0


def pattern(rank: int, count: int, dtype: np.dtype, offset: int = 0) -> np.ndarray:
    """Known input ((i % 7) + 1) * (rank + 1): sums stay exact in every dtype we test."""
    idx = np.arange(offset, offset + count, dtype=np.int64)
    return (((idx % 7) + 1) * (rank + 1)).astype(dtype)


def blocks(ranks: Sequence[int], block: int, dtype: np.dtype, offsets: Sequence[int]) -> np.ndarray:
    return np.concatenate([pattern(r, block, dtype, o) for r, o in zip(ranks, offsets)])


def source(op: str, rank: int, n: int, block: int, dtype: np.dtype, root: int) -> np.ndarray:
    """The known input of ``rank``."""
    if op == "reduce_scatter":
        return pattern(rank, block * n, dtype)
    if op == "scatter":
        return blocks(range(n), block, dtype, [0] * n) if rank == root else np.zeros(block * n, dtype)
    if op == "all_to_all":
        return blocks([rank] * n, block, dtype, [j * block for j in range(n)])
    if op == "broadcast":
        return pattern(root, block, dtype) if rank == root else np.zeros(block, dtype)
    return pattern(rank, block, dtype)


def expected(op: str, rank: int, n: int, block: int, dtype: np.dtype, redop: str, root: int) -> np.ndarray | None:
    if op in ("gather", "reduce") and rank != root:
        return None
    if op in ("all_gather", "gather"):
        return blocks(range(n), block, dtype, [0] * n)
    if op == "scatter":
        return pattern(rank, block, dtype)
    if op == "all_to_all":
        return blocks(range(n), block, dtype, [rank * block] * n)
    if op == "broadcast":
        return pattern(root, block, dtype)
    offset = rank * block if op == "reduce_scatter" else 0
    if redop in BITWISE:
        return BITWISE[redop].reduce([pattern(r, block, dtype, offset) for r in range(n)])  # type: ignore[no-any-return]
    base = pattern(0, block, dtype, offset).astype(np.float64)
    factor = {"sum": n * (n + 1) / 2, "avg": (n + 1) / 2, "max": n, "min": 1,
              "prod": float(math.factorial(n))}[redop]
    ref = base ** n if redop == "prod" else base
    return (ref * factor).astype(dtype)


def _touched(count: int, dtype: np.dtype, registered: bool = False) -> np.ndarray:
    """Zeros of ``count`` with every page written (faulted in): private, or from ``ahcomm.alloc``
    (``registered``: memory this host's peers map)."""
    array = alloc(count, dtype) if registered else np.empty(count, dtype)
    array.fill(0)
    return array


class Case:
    """Buffers and the call for one (op, size), allocated and touched once."""

    def __init__(self, comm: Any, op: str, nbytes: int, dtype: np.dtype, redop: str, root: int,
                 algorithm: str | None, inplace: bool, registered: bool = False) -> None:
        n, item = comm.size, dtype.itemsize
        total = max(1, nbytes // item)
        self.block = max(1, total // n) if op in BLOCKED else total
        self.size = self.block * item * (n if op in BLOCKED else 1)
        self.comm, self.op, self.dtype, self.redop, self.root = comm, op, dtype, redop, root
        self.algorithm = algorithm
        rooted_out = comm.rank == root or op not in ("gather", "reduce")
        in_count = self.block * n if op in ("reduce_scatter", "all_to_all", "scatter") else self.block
        out_count = self.block * n if op in ("all_gather", "gather", "all_to_all") else self.block
        # Every page written once: an untouched np.zeros maps the kernel's shared zero page, which
        # an op that only reads its input (all_gather, a broadcast's root) reads from the cache
        # (np=2 32 MiB all_gather: 2.9-3.2 ms a call untouched against 4.3-4.8 with its pages).
        self.src = _touched(in_count, dtype, registered)
        if inplace and op in ("all_reduce", "broadcast", "reduce"):
            self.dst: np.ndarray | None = self.src if rooted_out else None
        else:
            self.dst = _touched(out_count, dtype, registered) if rooted_out else None

    def issue(self) -> "asyncio.Future[Any]":
        kw: dict[str, Any] = {"out": self.dst, "algorithm": self.algorithm}
        if self.op == "reduce":
            return self.comm.reduce(self.src, self.redop, self.root, **kw)  # type: ignore[no-any-return]
        if self.op in REDUCING:
            return getattr(self.comm, self.op)(self.src, self.redop, **kw)  # type: ignore[no-any-return]
        if self.op in ROOTED:
            return getattr(self.comm, self.op)(self.src, self.root, **kw)  # type: ignore[no-any-return]
        return getattr(self.comm, self.op)(self.src, **kw)  # type: ignore[no-any-return]

    async def check(self) -> int:
        """Run once on known data; return the number of wrong elements on this rank. A separate
        output is filled with a value no right answer holds first: an algorithm that leaves part
        of it unwritten is not credited with what ran before it into the same buffer."""
        rank, n = self.comm.rank, self.comm.size
        self.src[:] = source(self.op, rank, n, self.block, self.dtype, self.root)
        want = expected(self.op, rank, n, self.block, self.dtype, self.redop, self.root)
        if want is not None and self.dst is not None and self.dst is not self.src:
            _poison(self.dst, want)
        got = await self.issue()
        if want is None:
            wrong = 0 if got is None else got.size
        elif self.dtype.kind == "f":
            wrong = int(np.count_nonzero(~np.isclose(got, want, rtol=1e-2 if self.dtype.itemsize == 2 else 1e-5)))
        else:
            wrong = int(np.count_nonzero(got != want))
        self.src[:] = 0  # timed loops run on zeros: in-place sums cannot overflow
        return wrong


def _poison(array: np.ndarray, want: np.ndarray) -> None:
    """Fill ``array`` with a value unlike ``want`` at every element: NaN for floating dtypes, the
    right answer with its lowest bit flipped for integers and bools."""
    if array.dtype == np.bool_ or array.dtype.kind in "iu":
        np.bitwise_xor(want.reshape(array.shape), array.dtype.type(1), out=array)
    else:
        array[...] = np.nan


async def measure(case: Case, warmup: int, iters: int, max_seconds: float) -> tuple[float, float, int]:
    """(mean us per op on this rank, median us per op, iterations timed)."""
    comm = case.comm
    for _ in range(warmup):
        await case.issue()
    await comm.barrier()
    t0 = time.perf_counter()
    await case.issue()
    one = time.perf_counter() - t0
    # Every rank must time the same number of iterations: agree on the slowest estimate.
    est = await comm.all_reduce(np.array([one]), "max")
    budget = int(max_seconds / est[0]) if est[0] > 0 else iters
    count = max(min(3, iters), min(iters, budget))
    await comm.barrier()
    stamps = np.empty(count + 1)
    stamps[0] = time.perf_counter()
    for i in range(count):
        await case.issue()
        stamps[i + 1] = time.perf_counter()
    each = np.diff(stamps)
    return float(each.mean()) * 1e6, float(np.median(each)) * 1e6, count


def runnable(comm: Any, op: str, dtype: np.dtype) -> list[str]:
    """Algorithms that can run ``op`` on this communicator's topology."""
    return sorted(comm.explain(op, 1, dtype)[1])

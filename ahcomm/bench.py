"""ahcomm-bench: nccl-tests-style collective benchmark.

    ahcomm-bench -n 4 all_reduce -b 8 -e 64M -f 4 -c 1

Columns: size, count, type, redop, root, time (us), algbw, busbw (GB/s), #wrong. ``size``
follows nccl-tests: the buffer for all_reduce/broadcast, the whole output of all_gather,
the whole input of reduce_scatter. time = mean per op, averaged over ranks. busbw factors:
all_reduce 2(n-1)/n, all_gather and reduce_scatter (n-1)/n, broadcast 1. Starts N ranks
itself (through ahcomm-run) unless it is already a rank of a launched job.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from typing import Any, Iterator, Sequence

import numpy as np

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
BLOCKED = ("all_gather", "reduce_scatter")


def parse_size(text: str) -> int:
    """'8', '64K', '4M', '1G' (binary multiples)."""
    text = text.strip().upper().rstrip("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(text[:-1]) * mult[text[-1]]) if text and text[-1] in mult else int(text)


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


def expected(op: str, rank: int, n: int, block: int, dtype: np.dtype, redop: str, root: int) -> np.ndarray:
    if op == "all_gather":
        return np.concatenate([pattern(r, block, dtype) for r in range(n)])
    if op == "broadcast":
        return pattern(root, block, dtype)
    offset = rank * block if op == "reduce_scatter" else 0
    base = pattern(0, block, dtype, offset).astype(np.float64)
    factor = {"sum": n * (n + 1) / 2, "avg": (n + 1) / 2, "max": n, "min": 1,
              "prod": float(math.factorial(n))}[redop]
    ref = base ** n if redop == "prod" else base
    return (ref * factor).astype(dtype)


class Case:
    """Buffers and the call for one (op, size), allocated and touched once."""

    def __init__(self, comm: Any, op: str, nbytes: int, dtype: np.dtype, redop: str, root: int,
                 algorithm: str | None, inplace: bool) -> None:
        n, item = comm.size, dtype.itemsize
        total = max(1, nbytes // item)
        self.block = max(1, total // n) if op in BLOCKED else total
        self.size = self.block * item * (n if op in BLOCKED else 1)
        self.comm, self.op, self.dtype, self.redop, self.root = comm, op, dtype, redop, root
        self.algorithm = algorithm
        in_count = self.block * n if op == "reduce_scatter" else self.block
        out_count = self.block * n if op == "all_gather" else self.block
        self.src = np.zeros(in_count, dtype)
        self.dst = self.src if inplace and op in ("all_reduce", "broadcast") else np.zeros(out_count, dtype)

    def issue(self) -> "asyncio.Future[np.ndarray]":
        kw: dict[str, Any] = {"out": self.dst, "algorithm": self.algorithm}
        if self.op in ("all_reduce", "reduce_scatter"):
            return getattr(self.comm, self.op)(self.src, self.redop, **kw)  # type: ignore[no-any-return]
        if self.op == "broadcast":
            return self.comm.broadcast(self.src, self.root, **kw)  # type: ignore[no-any-return]
        return self.comm.all_gather(self.src, **kw)  # type: ignore[no-any-return]

    async def check(self) -> int:
        """Run once on known data; return the number of wrong elements on this rank."""
        rank, n = self.comm.rank, self.comm.size
        if self.op == "reduce_scatter":
            self.src[:] = pattern(rank, self.src.size, self.dtype)
        elif self.op == "broadcast" and rank != self.root:
            self.src[:] = 0
        else:
            self.src[:] = pattern(rank if self.op != "broadcast" else self.root, self.src.size, self.dtype)
        got = await self.issue()
        want = expected(self.op, rank, n, self.block, self.dtype, self.redop, self.root)
        if self.dtype.kind == "f":
            wrong = int(np.count_nonzero(~np.isclose(got, want, rtol=1e-2 if self.dtype.itemsize == 2 else 1e-5)))
        else:
            wrong = int(np.count_nonzero(got != want))
        self.src[:] = 0  # timed loops run on zeros: in-place sums cannot overflow
        return wrong


async def measure(case: Case, warmup: int, iters: int, max_seconds: float) -> tuple[float, int]:
    """(mean us per op on this rank, iterations timed)."""
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
    t0 = time.perf_counter()
    for _ in range(count):
        await case.issue()
    elapsed = time.perf_counter() - t0
    return elapsed / count * 1e6, count


async def run_rank(args: argparse.Namespace) -> list[dict[str, Any]]:
    import ahcomm

    comm = await ahcomm.init()
    rows: list[dict[str, Any]] = []
    dtype = np.dtype(args.dtype)
    async with comm:
        n = comm.size
        if comm.rank == 0:
            print(f"# ahcomm-bench {args.op}  np={n}  dtype={dtype}  algorithm={args.algorithm or 'auto'}"
                  f"  {'in-place' if args.inplace else 'out-of-place'}  links="
                  f"{','.join(sorted({l['kind'] for l in comm.stats()['links'].values()})) or 'none'}")
            print(f"#{'size':>12} {'count':>12} {'type':>8} {'redop':>6} {'root':>5} "
                  f"{'time(us)':>11} {'algbw':>8} {'busbw':>8} {'#wrong':>7}", flush=True)
        for nbytes in sizes(args.minbytes, args.maxbytes, args.stepfactor):
            case = Case(comm, args.op, nbytes, dtype, args.redop, args.root, args.algorithm, args.inplace)
            wrong = await case.check() if args.check else 0
            us, count = await measure(case, args.warmup_iters, args.iters, args.max_seconds)
            agg = await comm.all_reduce(np.array([us, float(wrong)]), "sum")
            mean_us, total_wrong = agg[0] / n, int(agg[1])
            algbw = case.size / (mean_us * 1e-6) / 1e9
            redop = args.redop if args.op in ("all_reduce", "reduce_scatter") else "none"
            root = args.root if args.op == "broadcast" else -1
            row = {"op": args.op, "size": case.size, "count": case.size // dtype.itemsize, "type": str(dtype),
                   "redop": redop, "root": root, "time_us": mean_us, "algbw": algbw,
                   "busbw": algbw * bus_factor(args.op, n), "wrong": total_wrong, "iters": count,
                   "note": args.algorithm or ""}
            rows.append(row)
            if comm.rank == 0:
                print(f" {row['size']:>12} {row['count']:>12} {row['type']:>8} {redop:>6} {root:>5} "
                      f"{mean_us:>11.1f} {algbw:>8.3f} {row['busbw']:>8.3f} {total_wrong:>7}", flush=True)
        if comm.rank == 0 and rows:
            print(f"# Avg bus bandwidth    : {sum(r['busbw'] for r in rows) / len(rows):.4f}")
            if args.json:
                with open(args.json, "w") as f:
                    json.dump({"tool": "ahcomm", "np": n, "inplace": args.inplace, "rows": rows}, f, indent=1)
    return rows


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ahcomm-bench", description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("op", choices=OPS)
    p.add_argument("-n", "--np", dest="nproc", type=int, default=2, help="ranks to start (when not launched)")
    p.add_argument("-b", "--minbytes", type=parse_size, default=parse_size("8"))
    p.add_argument("-e", "--maxbytes", type=parse_size, default=parse_size("64M"))
    p.add_argument("-f", "--stepfactor", type=int, default=4)
    p.add_argument("-d", "--dtype", default="float32")
    p.add_argument("-o", "--redop", default="sum", choices=("sum", "prod", "max", "min", "avg"))
    p.add_argument("-r", "--root", type=int, default=0)
    p.add_argument("-w", "--warmup-iters", type=int, default=3)
    p.add_argument("-i", "--iters", type=int, default=20)
    p.add_argument("-c", "--check", type=int, default=1, help="check results against numpy (1) or not (0)")
    p.add_argument("--max-seconds", type=float, default=1.0, help="cap on timed seconds per size")
    p.add_argument("--inplace", action="store_true", help="all_reduce/broadcast in place (out is the input)")
    p.add_argument("--algorithm", default=None, help="force an algorithm (see ahcomm.algorithms.names)")
    p.add_argument("--json", default=None, help="rank 0 writes the rows here")
    return p


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    if "AHCOMM_RANK" not in os.environ and "RANK" not in os.environ and "OMPI_COMM_WORLD_RANK" not in os.environ:
        from .run import launch

        sys.exit(asyncio.run(launch(args.nproc, [sys.executable, "-m", "ahcomm.bench", *argv])))
    asyncio.run(run_rank(args))


if __name__ == "__main__":
    main()

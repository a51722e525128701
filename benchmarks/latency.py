"""Small-message latency: p50 (and p90) per op, for issue 11.

Run under ahcomm-run:  ahcomm-run -n 2 python benchmarks/latency.py [--iters 2000] [--algorithm NAME]
Prints one line per case on rank 0: op, bytes, algorithm picked, p50 us, p90 us (the
slowest rank's median, so a fast rank never hides a slow one).

``--cases``, ``--inplace`` and ``--json`` are what benchmarks/compare.py --latency uses: the
cases as ``op:bytes`` (benchmarks/peers/_latency.py: all_gather's bytes are each rank's
share), all_reduce and broadcast in place and all_gather into a buffer made once (as torch's
and MPI's calls are), one checked call per case first, and the rows as JSON on rank 0.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

import ahcomm

sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))
import _common as C
import _latency as L

CASES = ("barrier:0,all_reduce:8,all_reduce:32K,broadcast:8,broadcast:32K,all_gather:8,all_gather:32K")


def calls(comm: ahcomm.Comm, op: str, k: int, inplace: bool,
          kw: dict[str, Any]) -> tuple[np.ndarray, np.ndarray, Any]:
    """(input, where the result lands, a call) for one case."""
    x = np.zeros(k, np.float32)
    if op == "barrier":
        return x, x, lambda: comm.barrier(**kw)
    if op == "all_gather":
        out = np.zeros(k * comm.size, np.float32)
        if inplace:
            return x, out, lambda: comm.all_gather(x, out=out, **kw)
        return x, out, lambda: comm.all_gather(x, **kw)
    fn = getattr(comm, op)
    if inplace:
        return x, x, lambda: fn(x, out=x, **kw)
    return x, x, lambda: fn(x, **kw)


async def checked(comm: ahcomm.Comm, op: str, k: int, x: np.ndarray, call: Any) -> int:
    """One call with known inputs: the wrong elements on this rank."""
    if op == "barrier":
        await call()
        return 0
    x[:] = C.check_input(op, comm.rank, comm.size, k)
    got = await call()
    wrong = int(np.count_nonzero(got != C.expected(op, comm.rank, comm.size, k)))
    x.fill(0.0)  # repeated in-place sums stay 0
    return wrong


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", "-i", type=int, default=2000)
    parser.add_argument("--warmup", "-w", type=int, default=200)
    parser.add_argument("--algorithm", default=None)
    parser.add_argument("--only", default="", help="only cases whose 'op bytes' contain this")
    parser.add_argument("--cases", default=CASES, help="op:bytes comma list (all_gather: bytes per rank)")
    parser.add_argument("--inplace", action="store_true", help="all_reduce/broadcast in place, all_gather into out=")
    parser.add_argument("--json", default=None, help="rank 0 writes the rows here")
    parser.add_argument("--exclude", default="", help="comma list of algorithms the selector may not pick "
                        "(A/B: the picks before one was added)")
    args = parser.parse_args()
    for name in filter(None, args.exclude.split(",")):
        ahcomm.algorithms.REGISTRY.algorithms.pop(name)
        ahcomm.algorithms.REGISTRY.version += 1
    comm = await ahcomm.init()
    rows = []
    for op, nbytes in L.cases(args.cases):
        if args.only and args.only not in f"{op}{nbytes}":
            continue
        k = L.elems(nbytes)
        kw = {"algorithm": args.algorithm} if args.algorithm else {}
        x, _, call = calls(comm, op, k, args.inplace, kw)
        name = "-" if op == "barrier" else args.algorithm or comm.explain(op, k, np.float32)[0]
        wrong = await checked(comm, op, k, x, call)
        for _ in range(args.warmup):
            await call()
        stamps = np.empty(args.iters + 1)
        await comm.barrier()
        stamps[0] = time.perf_counter()
        for i in range(args.iters):
            await call()
            stamps[i + 1] = time.perf_counter()
        agg = await comm.all_reduce(np.array(L.spread(stamps)), "max")
        bad = await comm.all_reduce(np.array([wrong], np.int64))
        if comm.rank == 0:
            rows.append(L.row(op, nbytes, float(agg[0]), float(agg[1]), args.iters, int(bad[0]), name))
            L.print_row(comm.size, rows[-1])
    if comm.rank == 0:
        L.write(args.json, "ahcomm", comm.size, rows, {"version": f"ahcomm {ahcomm.__version__}",
                                                       "inplace": args.inplace})
    await comm.close()


if os.environ.get("AHCOMM_BENCH_LOOP") == "uvloop":  # the same program on uvloop's event loop (if installed)
    import uvloop

    uvloop.run(main())
else:
    asyncio.run(main())

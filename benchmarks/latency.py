"""Small-message latency: p50 (and p90) per op, for issue 11.

Run under ahcomm-run:  ahcomm-run -n 2 python benchmarks/latency.py [--iters 2000] [--algorithm NAME]
Prints one line per case on rank 0: op, bytes, algorithm picked, p50 us, p90 us (the
slowest rank's median, so a fast rank never hides a slow one).
"""

from __future__ import annotations

import argparse
import asyncio
import time

import numpy as np

import ahcomm

CASES = [("barrier", 0), ("all_reduce", 8), ("all_reduce", 32 * 1024), ("broadcast", 8),
         ("broadcast", 32 * 1024), ("all_gather", 8), ("all_gather", 32 * 1024)]


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--algorithm", default=None)
    parser.add_argument("--only", default="")
    args = parser.parse_args()
    comm = await ahcomm.init()
    for op, nbytes in CASES:
        if args.only and args.only not in f"{op}{nbytes}":
            continue
        x = np.ones(max(1, nbytes // 4) if nbytes else 0, np.float32)
        if op == "barrier":
            call = lambda: comm.barrier()
            name = "-"
        else:
            kw = {"algorithm": args.algorithm} if args.algorithm else {}
            call = getattr(comm, op)
            fn = call
            call = lambda fn=fn, kw=kw: fn(x, **kw)
            name = args.algorithm or comm.explain(op, x.size, np.float32)[0]
        stamps = np.empty(args.iters + 1)
        for _ in range(args.warmup):
            await call()
        stamps[0] = time.perf_counter()
        for i in range(args.iters):
            await call()
            stamps[i + 1] = time.perf_counter()
        each = np.diff(stamps) * 1e6
        p50, p90 = float(np.median(each)), float(np.percentile(each, 90))
        agg = await comm.all_reduce(np.array([p50, p90]), "max")
        if comm.rank == 0:
            print(f"np={comm.size} {op:11s} {nbytes:6d} B  {name:9s} p50 {agg[0]:8.1f} us  p90 {agg[1]:8.1f} us",
                  flush=True)
    await comm.close()


asyncio.run(main())

"""One rank's view of back-to-back 8 B all_reduces: p50, mean, wake-ups sent, spin hits, CPU.

    ahcomm-run -n 4 python benchmarks/latency_probe.py [--iters 2000]
    AHCOMM_YIELD_US=0 ahcomm-run -n 4 python benchmarks/latency_probe.py   # the A/B's other side

Every rank prints one line: p50 and mean us per call, FIFO wake-ups it sent per call, the
safety net's rechecks, the spin's hits/spins (``transports.mailbox.Spin``) and its CPU time
per call (``time.process_time``), as used in benchmarks/results/2026-11-25-latency-np4.md.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import numpy as np

import ahcomm


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", "-i", type=int, default=2000)
    parser.add_argument("--warmup", "-w", type=int, default=200)
    args = parser.parse_args()
    comm = await ahcomm.init()
    x = np.zeros(2, np.float32)
    for _ in range(args.warmup):
        await comm.all_reduce(x, out=x)
    box = comm._executor.mailbox
    wakes, rechecks = getattr(box, "wakes", 0), getattr(box, "rechecks", 0)
    times = []
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(args.iters):
        t = time.perf_counter()
        await comm.all_reduce(x, out=x)
        times.append(time.perf_counter() - t)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    times.sort()
    n = args.iters
    spin = getattr(box, "spin", None)
    print(f"rank {comm.rank} {comm.explain('all_reduce', 2)[0]} p50 {times[n // 2] * 1e6:.0f} us "
          f"mean {elapsed / n * 1e6:.0f} us wakes/call {(getattr(box, 'wakes', 0) - wakes) / n:.2f} "
          f"rechecks {getattr(box, 'rechecks', 0) - rechecks} "
          f"spin {getattr(spin, 'hits', 0)}/{getattr(spin, 'spins', 0)} yields {getattr(spin, 'yields', False)} "
          f"cpu/call {cpu / n * 1e6:.0f} us", flush=True)
    await comm.close()


asyncio.run(main())

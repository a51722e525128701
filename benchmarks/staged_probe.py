"""Copies through a small slot against plain copies and single-copy reads, two processes at once
(the cost model's ``STAGED``, results/2026-11-26-staged-copies.md).

Each of two processes owns a source of ``MiB`` MiB and a destination twice that, and times (median
of 8, three rounds, both processes starting each try together): a single-copy read of the other's
source plus a local copy (direct's all_gather), the read alone, the local copy alone, two plain
copies, and a copy through a 1 MiB slot (in, then out: oneshot's path).
Usage: PYTHONPATH=$PWD python benchmarks/staged_probe.py [MiB]

Non-temporal stores (glibc's ``memmove`` switches to them from a size set at process start): run
it with ``GLIBC_TUNABLES=glibc.cpu.x86_non_temporal_threshold=0x100040`` to see the copies
above 1 MiB made so (results/2026-11-26-nt-stores.md).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time
from typing import Any

import numpy as np

SLOT = 1 << 20


def worker(rank: int, addrs: Any, pids: Any, bar: Any, q: Any, mib: int) -> None:
    from ahcomm.transports import _cma

    n = mib << 20
    src = np.full(n, rank + 1, np.uint8)
    other = np.ones(n, np.uint8)
    dst = np.zeros(2 * n, np.uint8)
    slot = np.zeros(SLOT, np.uint8)
    addrs[rank], pids[rank] = src.ctypes.data, os.getpid()
    bar.wait()
    peer = 1 - rank

    def read() -> None:
        _cma.read(pids[peer], dst[n:], addrs[peer])

    def through_slot() -> None:
        for lo in range(0, n, SLOT):
            np.copyto(slot, other[lo:lo + SLOT])
            np.copyto(dst[n + lo:n + lo + SLOT], slot)

    modes = {
        "read + local copy": lambda: (np.copyto(dst[:n], src), read()),
        "read": read,
        "local copy": lambda: np.copyto(dst[:n], src),
        "two copies": lambda: (np.copyto(dst[:n], src), np.copyto(dst[n:], other)),
        "through a slot": through_slot,
    }
    res: dict[str, list[float]] = {}
    for _ in range(3):
        for name, fn in modes.items():
            took = []
            for _ in range(8):
                bar.wait()
                t = time.perf_counter()
                fn()
                took.append(time.perf_counter() - t)
            res.setdefault(name, []).append(statistics.median(took) * 1e3)
    if rank == 0:
        q.put(res)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("mib", nargs="?", type=int, default=16, help="MiB each process copies (default 16)")
    mib = p.parse_args().mib
    addrs, pids, bar, q = mp.Array("q", 2), mp.Array("q", 2), mp.Barrier(2), mp.Queue()
    procs = [mp.Process(target=worker, args=(r, addrs, pids, bar, q, mib)) for r in range(2)]
    for p in procs:
        p.start()
    res = q.get()
    for p in procs:
        p.join()
    print(f"load {os.getloadavg()[0]:.1f}; ms per try, three rounds")
    for name, rounds in res.items():
        print(f"{mib} MiB {name:18s} " + " ".join(f"{x:.2f}" for x in rounds))


if __name__ == "__main__":
    main()

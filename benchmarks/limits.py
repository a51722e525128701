"""This host's physical copy limits, printed beside collective figures (issue 12).

memcpy: one thread copying 64 MiB within a process (numpy.copyto, best of 5).
cma: the kernel's single copy, process_vm_readv of another process's 64 MiB into ours
(1 thread, and 2 threads each reading one half), best of 5. The other process is started
afresh and fills its own buffer, as a peer rank does (a forked child's pages are shared
copy-on-write with ours, which measured 2-3x slower than ranks read each other).
GB/s = 1e9 bytes/s.
Usage: PYTHONPATH=$PWD python benchmarks/limits.py
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import numpy as np

from ahcomm.transports import _cma

N = 64 << 20
# the peer: fills its own 64 MiB, says where it is, waits until we close its stdin
PEER = ("import os, sys, numpy as np; b = np.ones(64 << 20, np.uint8); "
        "print(os.getpid(), b.ctypes.data, flush=True); sys.stdin.read()")


def best(fn: Callable[[], None], k: int = 5) -> float:
    times = []
    for _ in range(k):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return N / min(times) / 1e9


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args()  # --help, and no stray arguments
    src, dst = np.ones(N, np.uint8), np.zeros(N, np.uint8)
    print(f"memcpy 1 thread: {best(lambda: np.copyto(dst, src)):.2f} GB/s")
    child = subprocess.Popen([sys.executable, "-c", PEER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None and child.stdin is not None
    pid, addr = (int(x) for x in child.stdout.readline().split())
    half = N // 2

    def two() -> None:
        ts = [threading.Thread(target=_cma.read, args=(pid, dst[i * half:(i + 1) * half], addr + i * half))
              for i in range(2)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    try:
        print(f"cma 1 thread:    {best(lambda: _cma.read(pid, dst, addr)):.2f} GB/s")
        print(f"cma 2 threads:   {best(two):.2f} GB/s")
    finally:
        child.stdin.close()
        child.wait()


if __name__ == "__main__":
    main()

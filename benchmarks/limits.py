"""This host's physical copy limits, printed beside collective figures (issue 12).

memcpy: one thread copying 64 MiB within a process (numpy.copyto, best of 5).
cma: the kernel's single copy, process_vm_readv of another process's 64 MiB into ours
(1 thread, and 2 threads each reading one half), best of 5. The other process is started
afresh and fills its own buffer, as a peer rank does (a forked child's pages are shared
copy-on-write with ours, which measured 2-3x slower than ranks read each other).
cma both ways: the two processes read each other's 64 MiB at the same time, one thread each
(a 2-rank all_reduce's situation), each one's rate, best of 5 rounds started together.
mapped: a copy of the other process's 64 MiB out of its shared-memory segment mapped here
(what ``ahcomm.alloc`` buffers give a reader), 1 thread, best of 5.
GB/s = 1e9 bytes/s.
Usage: PYTHONPATH=$PWD python benchmarks/limits.py
"""

from __future__ import annotations

import argparse
import mmap
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import numpy as np

from ahcomm.transports import _cma

N = 64 << 20
# the peer: fills its own 64 MiB (and a shared segment's), says where the first is; then, for each
# line "PID ADDR" from us, reads that memory of ours into its own buffer and prints the seconds;
# ends when we close its stdin
PEER = """
import os, sys, time, mmap, numpy as np
from ahcomm.transports import _cma
b = np.ones(64 << 20, np.uint8)
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
os.ftruncate(fd, 64 << 20)
m = mmap.mmap(fd, 64 << 20)
np.frombuffer(m, np.uint8)[:] = 1
print(os.getpid(), b.ctypes.data, flush=True)
into = np.zeros(64 << 20, np.uint8)
for line in sys.stdin:
    pid, addr = (int(x) for x in line.split())
    t0 = time.perf_counter()
    _cma.read(pid, into, addr)
    print(time.perf_counter() - t0, flush=True)
"""


def best(fn: Callable[[], None], k: int = 5) -> float:
    times = []
    for _ in range(k):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return N / min(times) / 1e9


def _mapped_rate(m: mmap.mmap, dst: np.ndarray) -> float:
    mapped = np.frombuffer(m, np.uint8)  # gone on return: the mapping can close
    return best(lambda: np.copyto(dst, mapped))


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args()  # --help, and no stray arguments
    src, dst = np.ones(N, np.uint8), np.zeros(N, np.uint8)
    print(f"memcpy 1 thread: {best(lambda: np.copyto(dst, src)):.2f} GB/s")
    shm = f"/dev/shm/ahcomm-{os.getpid()}-limits"
    child = subprocess.Popen([sys.executable, "-c", PEER, shm], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
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
        mine, theirs = [], []
        for _ in range(5):  # both ways at once: the child reads our src while we read its buffer
            child.stdin.write(f"{os.getpid()} {src.ctypes.data}\n")
            child.stdin.flush()
            t0 = time.perf_counter()
            _cma.read(pid, dst, addr)
            mine.append(time.perf_counter() - t0)
            theirs.append(float(child.stdout.readline()))
        print(f"cma both ways:   {N / min(mine) / 1e9:.2f} and {N / min(theirs) / 1e9:.2f} GB/s (1 thread each)")
        with open(shm, "r+b") as f, mmap.mmap(f.fileno(), N) as m:
            print(f"mapped 1 thread: {_mapped_rate(m, dst):.2f} GB/s")
    finally:
        child.stdin.close()
        child.wait()
        if os.path.exists(shm):
            os.unlink(shm)


if __name__ == "__main__":
    main()

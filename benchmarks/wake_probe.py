"""What a post that wakes a sleeping peer costs right after a big copy (no ahcomm involved).

Two processes on two cores: the first writes one byte to a pipe the second waits on with
epoll (as a rank's event loop waits on its notify FIFO), the second answers. Before each write
the first copies N bytes between two private buffers, or spins as long without touching
memory. Printed: the write() that wakes the peer, and the round trip, median of 300, per N.
On the Intel VM of 2026-11-27 (results/2026-11-27-cold-notify.md, three runs): write() 12.9-13.6
us with nothing before it, 22-24 after a 1 MiB copy, 33.5-37.2 after 2 MiB; the round trip 56 us
with nothing before, 71-101 after a 2 MiB copy.

    python3 benchmarks/wake_probe.py
"""

from __future__ import annotations

import argparse
import os
import select
import statistics
import time

import numpy as np

SIZES = (0, 256 << 10, 1 << 20, 2 << 20, 4 << 20)
ROUNDS = 300


def _answer(rx: int, tx: int) -> None:
    poller = select.epoll()
    poller.register(rx, select.EPOLLIN)
    while True:
        poller.poll()
        if os.read(rx, 1) != b"a":
            os._exit(0)
        os.write(tx, b"x")


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args()  # --help, and no stray arguments
    cores = sorted(os.sched_getaffinity(0))
    to_peer, from_peer = os.pipe(), os.pipe()
    if os.fork() == 0:
        if len(cores) > 1:
            os.sched_setaffinity(0, {cores[1]})
        _answer(to_peer[0], from_peer[1])
    os.sched_setaffinity(0, {cores[0]})
    src = np.ones(max(SIZES), np.uint8)
    dsts = [np.ones(max(SIZES), np.uint8) for _ in range(4)]
    print("| before the post | its time (us) | write() waking the peer (us) | round trip (us) |")
    print("|---|---:|---:|---:|")
    copy_time = 0.0  # the last copy's median: the spin that follows it lasts as long
    for nbytes in SIZES:
        for spin in ((False, True) if nbytes else (False,)):
            work, writes, trips = [], [], []
            for i in range(ROUNDS):
                t0 = time.perf_counter()
                if spin:
                    _spin(copy_time)
                elif nbytes:
                    np.copyto(dsts[i % len(dsts)][:nbytes], src[:nbytes])
                t1 = time.perf_counter()
                os.write(to_peer[1], b"a")
                t2 = time.perf_counter()
                os.read(from_peer[0], 1)
                t3 = time.perf_counter()
                work.append(t1 - t0)
                writes.append(t2 - t1)
                trips.append(t3 - t1)
            if not spin:
                copy_time = statistics.median(work)
            what = f"a spin as long as the {nbytes >> 10} KiB copy" if spin else (
                f"a {nbytes >> 10} KiB copy" if nbytes else "nothing")
            print(f"| {what} | {statistics.median(work) * 1e6:.0f} | {statistics.median(writes) * 1e6:.1f} | "
                  f"{statistics.median(trips) * 1e6:.1f} |")
    os.write(to_peer[1], b"q")


if __name__ == "__main__":
    main()

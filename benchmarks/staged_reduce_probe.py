"""A reduction in place with an operand just written (a ring all_reduce's ``dst += slot``) against
the calibrated one (three arrays from memory), and copies likewise; one process, best of 5.

The slot (2 MiB) is rewritten before each piece, as a peer's put leaves it in the cache; the
destination (64 MiB) comes from memory. GB/s = 1e9 B/s of the destination. docs/sim.md
("Fidelity and limits") quotes it.
Usage: PYTHONPATH=$PWD python benchmarks/staged_reduce_probe.py
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np

N = 64 << 20
SLOT = 2 << 20


def best(fn: Callable[[], object], k: int = 5) -> float:
    """Seconds of the fastest of ``k`` runs (``fn``'s own figure where it returns a float)."""
    times = []
    for _ in range(k):
        t0 = time.perf_counter()
        took = fn()
        times.append(took if isinstance(took, float) else time.perf_counter() - t0)
    return min(times)


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args()
    n, p = N // 4, SLOT // 4
    a, b, c, dst = (np.ones(n, np.float32) for _ in range(4))
    slot, fresh = np.ones(p, np.float32), np.ones(p, np.float32)

    def through_slot(reduce: bool) -> float:
        spent = 0.0
        for lo in range(0, n, p):
            np.copyto(slot, fresh)  # the peer's put
            t0 = time.perf_counter()
            if reduce:
                np.add(dst[lo:lo + p], slot, out=dst[lo:lo + p])
            else:
                np.copyto(dst[lo:lo + p], slot)
            spent += time.perf_counter() - t0
        return spent

    def rate(seconds: float) -> str:
        return f"{N / seconds / 1e9:.2f} GB/s"

    print(f"reduce, three arrays from memory:   {rate(best(lambda: np.add(a, b, out=c)))}")
    print(f"reduce in place with a fresh slot:  {rate(best(lambda: through_slot(True)))}")
    print(f"copy, from memory:                  {rate(best(lambda: np.copyto(c, a)))}")
    print(f"copy out of a fresh slot:           {rate(best(lambda: through_slot(False)))}")


if __name__ == "__main__":
    main()

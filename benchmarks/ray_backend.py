"""ray.util.collective.allreduce on the same actors: backend "ahcomm" vs Ray's "gloo".

    pip install "ahcomm[ray]"; python benchmarks/ray_backend.py [--actors 2]

Two groups over the same actors (one per backend); each actor times one synchronous
allreduce (float32, sum) per call after warm-up; the driver prints the median over calls of
the slowest actor's time, for 64 B, 1 MiB and 64 MiB.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import ray
import ray.util.collective as col

import ahcomm.ray

SIZES = {"64 B": 64, "1 MiB": 1 << 20, "64 MiB": 64 << 20}


@ray.remote(num_cpus=0)
class Bench:
    def __init__(self, rank: int, size: int) -> None:
        ahcomm.ray.register()
        self.rank, self.size = rank, size

    def join(self, backend: str) -> None:
        col.init_collective_group(self.size, self.rank, backend=backend, group_name=backend)

    def run(self, backend: str, nbytes: int, iters: int) -> list[float]:
        a = np.ones(nbytes // 4, np.float32)
        for _ in range(max(2, iters // 10)):
            col.allreduce(a, backend)
        times = []
        for _ in range(iters):
            col.barrier(backend)
            start = time.perf_counter()
            col.allreduce(a, backend)
            times.append(time.perf_counter() - start)
        return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--actors", type=int, default=2)
    args = parser.parse_args()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    actors = [Bench.remote(r, args.actors) for r in range(args.actors)]
    for backend in ("ahcomm", "gloo"):
        ray.get([a.join.remote(backend) for a in actors])
    for label, nbytes in SIZES.items():
        iters = 200 if nbytes < 1 << 16 else 50 if nbytes < 16 << 20 else 10
        for backend in ("ahcomm", "gloo"):
            per_actor = ray.get([a.run.remote(backend, nbytes, iters) for a in actors])
            slowest = [max(ts) for ts in zip(*per_actor)]
            med = statistics.median(slowest)
            print(f"{backend:7s} {label:>7s}  median {med * 1e6:10.1f} us  best {min(slowest) * 1e6:10.1f} us  "
                  f"busbw {2 * (args.actors - 1) / args.actors * nbytes / med / 1e9:7.3f} GB/s", flush=True)
    ray.shutdown()


if __name__ == "__main__":
    main()

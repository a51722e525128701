"""dist.all_reduce through the "ahcomm" backend and through gloo, same calls, same sizes.

    torchrun --standalone --nproc-per-node 2 benchmarks/torch_backend.py ahcomm
    torchrun --standalone --nproc-per-node 2 benchmarks/torch_backend.py gloo

Rank 0 prints one line per size: the median and best time of one synchronous all_reduce
(float32, sum) over ``--iters`` calls after warm-up, and the bus bandwidth 2(n-1)/n * bytes / time.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import ahcomm.torch  # noqa: F401 - registers the backend

SIZES = {"64 B": 64, "1 MiB": 1 << 20, "64 MiB": 64 << 20}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("backend", choices=["ahcomm", "gloo"])
    parser.add_argument("--iters", type=int, default=0, help="calls per size (default: by size)")
    args = parser.parse_args()
    dist.init_process_group(args.backend)
    n, me = dist.get_world_size(), dist.get_rank()
    for label, nbytes in SIZES.items():
        t = torch.ones(nbytes // 4)
        iters = args.iters or (200 if nbytes < 1 << 16 else 50 if nbytes < 16 << 20 else 10)
        for _ in range(max(2, iters // 10)):
            dist.all_reduce(t)
        times = []
        for _ in range(iters):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(t)
            times.append(time.perf_counter() - start)
        if me == 0:
            med, best = statistics.median(times), min(times)
            busbw = 2 * (n - 1) / n * nbytes / med / 1e9
            print(f"{args.backend:7s} {label:>7s}  median {med * 1e6:10.1f} us  best {best * 1e6:10.1f} us  "
                  f"busbw {busbw:7.3f} GB/s  ({iters} calls)", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

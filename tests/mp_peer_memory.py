"""A rank program for tests/test_peer_memory.py: collectives on ahcomm.alloc buffers between real processes.

all_reduce (mesh, and the selector's pick), broadcast and all_gather (direct and mesh) on
counts above the single-copy thresholds, odd and larger than the 1 MiB CCL buffer, checked
against numpy; WHO=all: every rank's buffers from alloc, WHO=some: the even ranks' only.
Prints the bytes this rank read out of mapped memory and through the kernel.
"""

from __future__ import annotations

import asyncio
import os

import numpy as np

import ahcomm


def data(rank: int, count: int, dtype: object, salt: int) -> np.ndarray:
    return ((np.arange(count) * 7 + rank * 13 + salt) % 101).astype(dtype)


async def main() -> None:
    comm = await ahcomm.init()
    n, r = comm.size, comm.rank
    mine = os.environ.get("WHO", "all") == "all" or r % 2 == 0

    def buffer(count: int, dtype: object, fill: np.ndarray | None = None) -> np.ndarray:
        x = ahcomm.alloc(count, dtype) if mine else np.zeros(count, dtype)
        if fill is not None:
            x[:] = fill
        return x

    k = 0
    for count in (300_001, 1 << 20, 3 << 20):
        for dtype in (np.float32, np.int32, np.float64):
            k += 1
            want = sum(data(p, count, dtype, k) for p in range(n)).astype(dtype)
            for algorithm in ("mesh", None):
                x = buffer(count, dtype, data(r, count, dtype, k))
                await comm.all_reduce(x, out=x, algorithm=algorithm)
                assert np.array_equal(x, want), (count, dtype, algorithm)
            root = k % n
            for algorithm in ("mesh", "direct"):
                x = buffer(count, dtype, data(r, count, dtype, k))
                await comm.broadcast(x, root, out=x, algorithm=algorithm)
                assert np.array_equal(x, data(root, count, dtype, k)), (count, dtype, algorithm)
                out = buffer(count * n, dtype)
                await comm.all_gather(buffer(count, dtype, data(r, count, dtype, k)), out=out, algorithm=algorithm)
                assert np.array_equal(out, np.concatenate([data(p, count, dtype, k) for p in range(n)]))
    mapped = kernel = 0
    for stats in comm.stats()["links"].values():
        mapped += stats["read_bytes"]["mapped"]
        kernel += stats["read_bytes"]["kernel"]
    await comm.close()
    os.write(1, f"OK mapped {mapped} kernel {kernel}\n".encode())


asyncio.run(main())

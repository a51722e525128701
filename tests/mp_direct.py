"""A rank program for tests/test_algo_direct.py: ``direct`` between real processes (sdma links).

MODE=matrix: broadcast (every root) and all_gather forced to direct, counts 0, 1, odd and
larger than the CCL buffer, several dtypes, in place and not, checked against numpy; prints
the path counts of ``comm.stats()``. NO_CMA=1 makes the kernel probe fail first (as Yama's
ptrace_scope or a container would): the calls must take the staged fallback.
MODE=kill: rank VICTIM SIGKILLs itself while 64 MiB broadcasts and all_gathers run (OPS=broadcast:
broadcasts only, each root in turn); the others must raise (PeerFailure) within seconds, naming
the collective, not hang.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import ml_dtypes
import numpy as np

import ahcomm

VICTIM = 1


def data(rank: int, count: int, dtype: object, salt: int) -> np.ndarray:
    return ((np.arange(count) * 7 + rank * 13 + salt) % 101).astype(dtype)


async def matrix(comm: ahcomm.Comm) -> None:
    n, r = comm.size, comm.rank
    dtypes = [np.float32, np.int8, np.float64, ml_dtypes.bfloat16]
    counts = [0, 1, 37, 300_001, 1 << 20]  # the last two: larger than the 1 MiB CCL buffer, threaded reads
    k = 0
    for count in counts:
        for dtype in dtypes:
            k += 1
            inplace = k % 2 == 0
            root = k % n
            x = data(r, count, dtype, k)
            got = await comm.broadcast(x, root, out=x if inplace else None, algorithm="direct")
            assert np.array_equal(got, data(root, count, dtype, k)), (count, dtype, root)
            assert inplace or r == root or np.array_equal(x, data(r, count, dtype, k))
            got = await comm.all_gather(data(r, count, dtype, k), algorithm="direct")
            want = np.concatenate([data(p, count, dtype, k) for p in range(n)])
            assert np.array_equal(got.reshape(-1), want), (count, dtype)
    stats = comm.stats()
    os.write(1, f"OK rank {r} single_copy {stats['single_copy']} paths {sorted(stats['paths'].items())}\n".encode())


def die() -> None:
    with open(os.environ["KILL_FILE"], "w") as f:
        f.write(repr(time.time()))
    os.kill(os.getpid(), signal.SIGKILL)


async def kill(comm: ahcomm.Comm) -> None:
    r = comm.rank
    if r != VICTIM:  # survive the launcher's SIGTERM long enough to report
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    big = np.ones(16 << 20, np.float32)  # 64 MiB: killed while the bytes move
    await comm.barrier()
    if r == VICTIM:
        threading.Timer(0.5, die).start()
    try:
        for i in range(10_000):
            await comm.broadcast(big, root=i % comm.size, algorithm="direct")
            if os.environ.get("OPS") != "broadcast":
                await comm.all_gather(big[:1 << 20], algorithm="direct")
        os.write(1, f"NO FAILURE rank {r}\n".encode())
    except ahcomm.AhcommError as exc:
        after = time.time() - float(open(os.environ["KILL_FILE"]).read())
        cause = exc if isinstance(exc, ahcomm.PeerFailure) else exc.__cause__
        os.write(1, f"DETECTED rank {r} type={type(exc).__name__} cause={type(cause).__name__} "
                    f"after={after:.3f} msg={exc}\n".encode())
    await comm.close()


async def main() -> None:
    if os.environ.get("NO_CMA") == "1":
        from ahcomm.transports import _cma
        _cma.probe = lambda *args, **kwargs: False  # the kernel refuses cross-memory reads
    comm = await ahcomm.init()
    if os.environ.get("MODE", "matrix") == "kill":
        await kill(comm)
        return
    await matrix(comm)
    await comm.close()


asyncio.run(main())

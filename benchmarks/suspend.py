"""Suspend/resume on this host (issue 13): /dev/shm usage (os.statvfs, the whole host) before
``suspend()``, while suspended and after ``resume()``, and the time of each.

    ahcomm-run -n 4 python benchmarks/suspend.py        # default 64 MiB CCL buffers
"""

from __future__ import annotations

import asyncio
import os
import time

import numpy as np

import ahcomm

MiB = float(1 << 20)


def used() -> float:
    """MiB of /dev/shm in use on this host."""
    st = os.statvfs("/dev/shm")
    return (st.f_blocks - st.f_bfree) * st.f_frsize / MiB


async def main() -> None:
    comm = await ahcomm.init()
    await comm.all_reduce(np.ones(1 << 20))
    for rnd in range(3):
        await comm.barrier()
        before = used()
        t0 = time.perf_counter()
        await comm.suspend()
        took_suspend = time.perf_counter() - t0
        await asyncio.sleep(0.2)  # the other ranks release theirs meanwhile
        during = used()
        t0 = time.perf_counter()
        await comm.resume()
        took_resume = time.perf_counter() - t0
        await comm.barrier()
        after = used()
        st = comm.stats()
        if comm.rank == 0 or rnd == 2:
            print(f"round {rnd} rank {comm.rank}: /dev/shm used {before:.1f} -> {during:.1f} -> {after:.1f} MiB; "
                  f"released {st['released_bytes'] / MiB:.2f} MiB own, unmapped {st['unmapped_bytes'] / MiB:.2f} "
                  f"MiB; suspend {took_suspend * 1e3:.1f} ms, resume {took_resume * 1e3:.1f} ms", flush=True)
        got = await comm.all_reduce(np.full(1 << 20, comm.rank, np.float32))
        assert (got == sum(range(comm.size))).all()
    await comm.close()


if __name__ == "__main__":
    asyncio.run(main())

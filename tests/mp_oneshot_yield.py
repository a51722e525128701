"""A rank program for tests/test_oneshot_groups.py: oneshot where ranks share cores.

Started on fewer cores than ranks (at most two ranks per core), the waiters poll their
flags and yield their core between looks (``transports.mailbox.yield_budget``) before they
sleep: every op oneshot claims, checked, 300 times; prints the policy and its counters.
"""

from __future__ import annotations

import asyncio

import numpy as np

import ahcomm


async def main() -> None:
    comm = await ahcomm.init()
    n, r = comm.size, comm.rank
    for i in range(60):
        got = await comm.all_reduce(np.array([r + i, 1], np.int64), algorithm="oneshot")
        assert list(got) == [sum(range(n)) + n * i, n], got
        got = await comm.broadcast(np.full(7, r + i, np.float32), root=i % n, algorithm="oneshot")
        assert np.all(got == i % n + i), got
        got = await comm.all_gather(np.array([r * i], np.int32), algorithm="oneshot")
        assert list(got.reshape(-1)) == [p * i for p in range(n)], got
        got = await comm.reduce_scatter(np.arange(2 * n, dtype=np.float64) + i, algorithm="oneshot")
        assert list(got) == [n * (2 * r + i), n * (2 * r + 1 + i)], got
        await comm.barrier()
    spin = comm._executor.mailbox.spin  # type: ignore[union-attr]
    print(f"OK rank {r} yields {spin.yields} budget {spin.budget * 1e6:.0f} us hits {spin.hits}/{spin.spins}",
          flush=True)
    await comm.close()


asyncio.run(main())

"""A rank program for tests/test_algo_eager.py: eager over real rdma processes.

Small calls are eager's (no mailboxes over rdma): every op it claims, checked, with the
default pick, then sub-communicators (split) too. With ``KILL_AT`` set, rank 1 SIGKILLs
itself before call ``KILL_AT`` and the others print how their eager call failed.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import numpy as np

import ahcomm


def say(text: str) -> None:
    os.write(1, (text + "\n").encode())


async def rounds(comm: ahcomm.Comm, count: int) -> None:
    n, r = comm.size, comm.rank
    for i in range(count):
        got = await comm.all_reduce(np.array([r + i, 1], np.int64))
        assert list(got) == [sum(range(n)) + n * i, n], got
        got = await comm.broadcast(np.full(7, r + i, np.float32), root=i % n)
        assert np.all(got == i % n + i), got
        got = await comm.all_gather(np.array([r * i], np.int32))
        assert list(got.reshape(-1)) == [p * i for p in range(n)], got
        got = await comm.reduce_scatter(np.arange(2 * n, dtype=np.float64) + i)
        assert list(got) == [n * (2 * r + i), n * (2 * r + 1 + i)], got
        got = await comm.reduce(np.full(3, r, np.int32), "max", root=i % n)
        assert got is None if r != i % n else list(got) == [n - 1] * 3, got
        got = await comm.all_to_all(np.arange(n, dtype=np.int16) + 10 * r)
        assert list(got) == [10 * p + r for p in range(n)], got
        await comm.barrier()


async def main() -> None:
    comm = await ahcomm.init()
    r = comm.rank
    picks = {op: comm.explain(op, 2, np.float32)[0] for op in ("all_reduce", "broadcast", "all_gather")}
    assert set(picks.values()) == {"eager"}, picks
    kill_at = int(os.environ.get("KILL_AT", "0"))
    if kill_at:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # survive the launcher long enough to report
        x = np.ones(4, np.float32)
        for _ in range(kill_at):
            await comm.all_reduce(x)
        if r == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        start = time.monotonic()
        try:
            await comm.all_reduce(x)
            say(f"NO FAILURE rank {r}")
        except ahcomm.AhcommError as exc:
            say(f"FAILED rank {r} after {time.monotonic() - start:.3f} s: {type(exc).__name__}: "
                + str(exc).replace("\n", " "))
        await comm.close()
        return
    await rounds(comm, 30)
    group = await comm.split(r % 2)
    assert group is not None
    if group.size > 1:
        assert group.explain("all_reduce", 2, np.float32)[0] == "eager"
        await rounds(group, 10)
    await group.close()
    say(f"OK rank {r} picks {sorted(set(picks.values()))}")
    await comm.close()


asyncio.run(main())

"""Several collectives in flight; the event loop is never blocked by a collective."""

from __future__ import annotations

import asyncio
import time

import numpy as np

import ahcomm
from conftest import run_inproc


async def test_many_collectives_in_flight_pair_by_issue_order() -> None:
    size = 4

    async def body(comm: ahcomm.Comm) -> list[np.ndarray]:
        r = comm.rank
        futures = [
            comm.all_reduce(np.full(100, r + 1.0)),
            comm.all_gather(np.full(3, r, np.int32)),
            comm.broadcast(np.full(7, r * 10.0), root=2),
            comm.all_reduce(np.full(5000, r + 1.0), "max", algorithm="ring"),
            comm.reduce_scatter(np.arange(8.0) * (r + 1)),
            comm.barrier(),
            comm.all_reduce(np.full(10, 1, np.int64)),
        ]
        return list(await asyncio.gather(*futures))

    for res in await run_inproc(size, body, buffsize=4096):
        assert np.all(res[0] == 10)
        np.testing.assert_array_equal(res[1], np.repeat(np.arange(size, dtype=np.int32), 3))
        assert np.all(res[2] == 20)
        assert np.all(res[3] == size)
        assert res[5] is None and np.all(res[6] == size)


async def test_tasks_issue_concurrently_from_different_coroutines() -> None:
    # Each rank issues from two tasks; issue order (the sequence number) decides the pairing.
    async def body(comm: ahcomm.Comm) -> tuple[np.ndarray, np.ndarray]:
        a = asyncio.ensure_future(comm.all_reduce(np.full(4, 1.0)))
        b = asyncio.ensure_future(comm.all_reduce(np.full(4, 2.0)))
        return await a, await b

    for a, b in await run_inproc(3, body):
        assert np.all(a == 3) and np.all(b == 6)


async def test_cancelled_awaiter_does_not_break_later_collectives() -> None:
    async def body(comm: ahcomm.Comm) -> np.ndarray:
        fut = comm.all_reduce(np.ones(100_000))
        task = asyncio.ensure_future(asyncio.wait_for(asyncio.shield(fut), 0))
        try:
            await task
        except asyncio.TimeoutError:
            pass
        await fut  # still completes for everyone
        return await comm.all_reduce(np.full(10, comm.rank + 1.0))

    for res in await run_inproc(3, body):
        assert np.all(res == 6)


async def test_event_loop_stays_responsive_during_a_large_collective() -> None:
    ticks: list[float] = []
    done = asyncio.Event()

    async def ticker() -> None:
        while not done.is_set():
            ticks.append(time.perf_counter())
            await asyncio.sleep(0.002)

    t = asyncio.ensure_future(ticker())
    x = np.ones(16 << 20, np.float32)  # 64 MiB per rank: tens of milliseconds of copying at least

    async def body(comm: ahcomm.Comm) -> np.ndarray:
        return await comm.all_reduce(x, algorithm="ring")

    start = time.perf_counter()
    await run_inproc(2, body, buffsize=16 << 20)
    end = time.perf_counter()
    done.set()
    await t
    during = [tick for tick in ticks if start < tick < end]
    gaps = np.diff([start, *during, end])
    assert len(during) >= 2, f"the ticker ran {len(during)} times in {end - start:.3f} s of collective"
    assert gaps.max() < 0.5, f"loop blocked for {gaps.max():.3f} s"

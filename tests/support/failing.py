"""Failure checks every algorithm's tests share: a mismatched call, an abort while waiting."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import numpy as np
import pytest

import ahcomm


async def mismatch_fails_every_rank(comms: list[ahcomm.Comm], algorithm: str) -> None:
    """Rank 0 runs an all_reduce, rank 1 an all_gather, both as call #0 with ``algorithm``: both
    raise CollectiveMismatchError naming #0 (the communicators are closed afterwards)."""
    try:
        futs = [comms[0].all_reduce(np.ones(4, np.float32), algorithm=algorithm),
                comms[1].all_gather(np.ones(4, np.float32), algorithm=algorithm)]
        results = await asyncio.wait_for(asyncio.gather(*futs, return_exceptions=True), 20)
        assert all(isinstance(r, ahcomm.CollectiveMismatchError) for r in results), results
        assert all("#0 mismatch" in str(r) for r in results), results
    finally:
        await asyncio.gather(*(c.close() for c in comms))


async def abort_fails_the_waiters(issue: Callable[[ahcomm.Comm], "asyncio.Future[object]"], waiting: int) -> None:
    """Three ranks; ranks below ``waiting`` issue a call (``issue``) that waits for rank 2,
    which aborts instead: every waiter raises PeerFailure naming it, none hangs."""
    comms = await ahcomm.init_inprocess(3)
    try:
        futs = [issue(comms[r]) for r in range(waiting)]
        await asyncio.sleep(0.05)
        assert not any(f.done() for f in futs)  # they wait for rank 2
        comms[2].abort("stop")
        for fut in futs:
            with pytest.raises(ahcomm.PeerFailure, match=r"rank 2 aborted"):
                await asyncio.wait_for(fut, 5)
    finally:
        await asyncio.gather(*(c.close() for c in comms), return_exceptions=True)

"""Defects found where two of the session's features meet (a review of the merged tree).

Each test fails on the code before its fix: an abort between oneshot slices hung the caller,
ranks running different algorithms timed out instead of naming the difference, and an
algorithm registered again under its name was not used for calls already seen.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

import ahcomm
import ahcomm._comm as comm_module
from ahcomm import algorithms
from ahcomm.algorithms.ring import Ring
from ahcomm.testing import local_world

from support.inproc import run_inproc


class _StagedInput:
    """Stands in for a device input copied to the host slice by slice; the peer is lost
    (here: the communicator aborted) while the third slice is still on its way."""

    pending = True

    def __init__(self, comm: ahcomm.Comm) -> None:
        self.comm = comm

    def wait(self) -> None:
        pass

    async def ready(self, lo: int, hi: int) -> None:
        if lo == 32:
            self.comm.abort("peer lost while the next slice is staged")
            await asyncio.sleep(0.01)


async def test_abort_between_oneshot_slices_fails_the_call(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AHCOMM_MAILBOX_BYTES", "64")  # 16 float32 per slot: 64 elements run in 4 slices
    comms = await local_world(2, transport="sdma")
    try:
        futures = []
        for c in comms:
            staged = _StagedInput(c) if c.rank == 0 else None
            monkeypatch.setattr(comm_module, "take_staging", lambda s=staged: s)
            futures.append(c.all_reduce(np.ones(64, np.float32), algorithm="oneshot"))
        monkeypatch.setattr(comm_module, "take_staging", lambda: None)
        started = time.monotonic()
        results = await asyncio.wait_for(asyncio.gather(*futures, return_exceptions=True), 20)
        assert time.monotonic() - started < 10
        assert isinstance(results[0], ahcomm.CommClosedError), results[0]
        assert isinstance(results[1], ahcomm.PeerFailure), results[1]
    finally:
        await asyncio.gather(*(c.close() for c in comms), return_exceptions=True)


@pytest.mark.parametrize("transport", ["inproc", "sdma"])
async def test_ranks_running_different_algorithms_is_a_mismatch(transport: str) -> None:
    comms = await local_world(2, transport=transport)
    try:
        async def call(c: ahcomm.Comm) -> BaseException | None:
            try:
                await c.all_reduce(np.ones(8, np.float32), algorithm="oneshot" if c.rank == 0 else "ring",
                                   timeout=30)
            except ahcomm.AhcommError as exc:
                return exc
            return None

        started = time.monotonic()
        errors = await asyncio.wait_for(asyncio.gather(*(call(c) for c in comms)), 60)
        assert time.monotonic() - started < 10  # named at once, not after the timeout
        for exc in errors:
            assert isinstance(exc, ahcomm.CollectiveMismatchError), exc
            assert "rank 0 runs oneshot, rank 1 runs ring" in str(exc)
    finally:
        for c in comms:
            c.abort()
        await asyncio.gather(*(c.close() for c in comms), return_exceptions=True)


class _FreeRing(Ring):
    name = "ring"

    def cost(self, call: object, topo: object, model: object) -> float:  # type: ignore[override]
        return 0.0


async def test_an_algorithm_registered_again_is_used_for_calls_already_seen() -> None:
    old = algorithms.REGISTRY.algorithms["ring"]

    async def body(c: ahcomm.Comm) -> tuple[str, str]:
        before = c.explain("all_reduce", 8)[0]
        await c.all_reduce(np.ones(8, np.float32))
        await c.barrier()
        if c.rank == 0:
            algorithms.register(_FreeRing())
        await c.barrier()
        return before, c.explain("all_reduce", 8)[0]

    try:
        results = await run_inproc(2, body)
    finally:
        algorithms.register(old)
    for before, after in results:
        assert before != "ring" and after == "ring", results

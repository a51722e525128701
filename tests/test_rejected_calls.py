"""Issues 17.1 and 16: a call rejected after it took its sequence number, or rejected on some
ranks only, never wedges the job. Rejected on every rank: each raises, and the next
collective runs. Rejected on some ranks while others run it: every rank fails within
seconds naming the rank that rejected it and its error (never a timeout)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import pytest

import ahcomm

from support.inproc import run_inproc

# Calls here carry timeout=20: a wedged communicator shows up as CollectiveTimeout, not a hang.
T = 20


async def _then_all_reduce(comm: ahcomm.Comm) -> float:
    """Two collectives after the rejected one: the second uses the rejected call's buffer half."""
    await comm.all_reduce(np.ones(4), timeout=T)
    return float((await comm.all_reduce(np.ones(4), timeout=T))[0])


@pytest.mark.parametrize("case", ["rows_differ", "algorithm", "out_every_rank", "gather_v_rows_differ",
                                  "gather_v_algorithm", "all_to_all_v_out_every_rank", "all_gather_object_out"])
async def test_rejected_on_every_rank_after_taking_its_number_leaves_the_communicator_usable(case: str) -> None:
    """The issue's repro and its relatives: counts are exchanged first, then a check fails on
    every rank (it used to make the next collective hang on every rank)."""
    calls: dict[str, tuple[Callable[[ahcomm.Comm], Awaitable[Any]], str]] = {
        "rows_differ": (lambda c: c.all_gather_v(np.ones((1, 3 + c.rank)), timeout=T), "rows differ in size"),
        "algorithm": (lambda c: c.all_gather_v(np.ones((1 + c.rank, 3)), algorithm="tree", timeout=T),
                      "'tree' cannot run all_gather_v"),
        "out_every_rank": (lambda c: c.all_gather_v(np.ones((1 + c.rank, 3)), out=np.empty((9, 3)), timeout=T),
                           r"all_gather_v: out has shape \(9, 3\)"),
        "gather_v_rows_differ": (lambda c: c.gather_v(np.ones((1, 3 + c.rank)), timeout=T), "rows differ in size"),
        "gather_v_algorithm": (lambda c: c.gather_v(np.ones((1 + c.rank, 3)), algorithm="ring", timeout=T),
                               "'ring' cannot run gather_v"),
        # (all_to_all_v's count exchange, an all_to_all, reports progress itself: this one held before)
        "all_to_all_v_out_every_rank": (
            lambda c: c.all_to_all_v(np.ones((2, 2)), [1, 1], out=np.empty((5, 2)), timeout=T),
            r"all_to_all_v: out has shape \(5, 2\)"),
        "all_gather_object_out": (lambda c: c.all_gather_v(np.ones(2 + c.rank), out=np.empty(1), timeout=T),
                                  "out has shape"),
    }
    call, text = calls[case]

    async def body(comm: ahcomm.Comm) -> float:
        with pytest.raises(ahcomm.InvalidArgument, match=text):
            await call(comm)
        return await _then_all_reduce(comm)

    assert await run_inproc(2, body) == [2.0, 2.0]


async def test_rejected_by_the_algorithms_resources_leaves_the_communicator_usable() -> None:
    """ConfigError from the executor (buffers too small) came after the run started: the next
    collective on the same buffer half hung."""
    async def body(comm: ahcomm.Comm) -> float:
        await comm.all_reduce(np.ones(2), timeout=T)  # it proves only that every rank started it
        with pytest.raises(ahcomm.ConfigError, match="AHCOMM_BUFFSIZE is too small"):
            await comm.reduce_scatter(np.ones(24), algorithm="ring", timeout=T)
        return await _then_all_reduce(comm)

    assert await run_inproc(12, body, buffsize=1024) == [12.0] * 12


async def _one_rank_rejects(size: int, rejecter: int, call: Callable[[ahcomm.Comm], Awaitable[Any]],
                            own: str, *, op: str) -> None:
    """``call`` is rejected on ``rejecter`` only: it raises ``own`` there; the communicator fails
    at once on every rank with a mismatch naming the rejecting rank and its error."""
    async def body(comm: ahcomm.Comm) -> None:
        if comm.rank == rejecter:
            with pytest.raises(ahcomm.InvalidArgument, match=own):
                await call(comm)
        else:  # a rank whose part needs nothing from the rejecting one (a non-root's reduce) may complete it
            try:
                await call(comm)
            except ahcomm.CollectiveMismatchError as exc:
                assert f"{op} #" in str(exc) and f"rank {rejecter} rejected it (InvalidArgument: " in str(exc)
        with pytest.raises((ahcomm.CommClosedError, ahcomm.CollectiveMismatchError),
                           match=f"{op} #.*rank {rejecter} rejected it"):
            for _ in range(50):  # the rejecting rank may hear of the verdict a moment later
                await comm.all_reduce(np.ones(2), timeout=T)
                await asyncio.sleep(0.01)

    comms = await ahcomm.init_inprocess(size)
    try:
        await asyncio.wait_for(asyncio.gather(*(body(c) for c in comms)), 3 * T)
    finally:
        await asyncio.gather(*(c.close() for c in comms))


async def test_gather_v_wrong_out_at_the_root_fails_every_rank_naming_it() -> None:
    await _one_rank_rejects(
        3, 0, lambda c: c.gather_v(np.ones((1 + c.rank, 2)), out=np.empty((4, 2)) if c.rank == 0 else None,
                                   timeout=T),
        r"gather_v: out has shape \(4, 2\)", op="gather_v")


async def test_all_gather_v_wrong_out_on_one_rank_fails_every_rank_naming_it() -> None:
    await _one_rank_rejects(
        2, 1, lambda c: c.all_gather_v(np.ones((1 + c.rank, 2)), out=np.empty((7, 2)) if c.rank == 1 else None,
                                       timeout=T),
        r"out has shape \(7, 2\)", op="all_gather_v")


async def test_all_to_all_v_wrong_out_on_one_rank_fails_every_rank_naming_it() -> None:
    await _one_rank_rejects(
        2, 0, lambda c: c.all_to_all_v(np.ones((2, 2)), [1, 1], out=np.empty((3, 2)) if c.rank == 0 else None,
                                       timeout=T),
        r"out has shape \(3, 2\)", op="all_to_all_v")


async def test_scatter_without_x_at_the_root_fails_every_rank_naming_it() -> None:
    """A root-only check: scatter's x at the root (the others give out= only)."""
    await _one_rank_rejects(
        3, 0, lambda c: c.scatter(None, root=0, out=np.empty(2), timeout=T), "scatter: x is required at the root",
        op="scatter")


async def test_scatter_v_counts_that_do_not_add_up_at_the_root_fail_every_rank() -> None:
    await _one_rank_rejects(
        2, 1, lambda c: c.scatter_v(np.ones((5, 2)) if c.rank == 1 else None, [2, 2], root=1,
                                    out=np.empty((2, 2)), timeout=T),
        "scatter_v: counts add up to 4 rows but x has 5 rows", op="scatter_v")


async def test_reduce_and_gather_wrong_out_at_the_root_fail_every_rank() -> None:
    await _one_rank_rejects(
        2, 1, lambda c: c.reduce(np.ones(3), root=1, out=np.empty(2) if c.rank == 1 else None, timeout=T),
        r"reduce: out has shape \(2,\)", op="reduce")
    await _one_rank_rejects(
        2, 0, lambda c: c.gather(np.ones(3), out=np.empty(2) if c.rank == 0 else None, timeout=T),
        r"gather: out has shape \(2,\)", op="gather")


async def test_gather_v_counts_that_disagree_with_one_ranks_rows_fail_every_rank() -> None:
    await _one_rank_rejects(
        3, 2, lambda c: c.gather_v(np.ones((1 + (c.rank == 2), 2)), counts=[1, 1, 1], timeout=T),
        r"gather_v: counts\[2\] is 1 but this rank's x has 2 rows", op="gather_v")


async def test_a_peer_that_runs_a_call_rejected_here_is_named_on_the_rejecting_rank() -> None:
    """The rejecting rank learns of the disagreement too (from the peer's signal or its word)."""
    comms = await ahcomm.init_inprocess(2)
    try:
        async def body(comm: ahcomm.Comm) -> str:
            out = np.empty((7, 2)) if comm.rank == 1 else None
            try:
                await comm.all_gather_v(np.ones((1 + comm.rank, 2)), out=out, timeout=T)
            except ahcomm.AhcommError:
                pass
            with pytest.raises(ahcomm.CommClosedError) as info:
                for _ in range(50):  # the verdict may take a moment to arrive
                    await comm.barrier(timeout=T)
                    await asyncio.sleep(0.01)
            return str(info.value)

        texts = await asyncio.wait_for(asyncio.gather(*(body(c) for c in comms)), 3 * T)
        for text in texts:
            assert "all_gather_v #1 mismatch: rank 1 rejected it" in text and "rank 0 called it" in text
    finally:
        await asyncio.gather(*(c.close() for c in comms))


async def test_a_failure_after_the_run_fails_that_call_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """finish() (avg's division, the copy to a strided out) runs after the collective completed
    on every rank: failing there is the caller's error, not the communicator's."""
    import ahcomm._collectives as collectives

    real = collectives.finish_avg
    calls = {"n": 0}

    def flaky(dst: np.ndarray, size: int) -> None:
        calls["n"] += 1
        if calls["n"] == 1:
            raise MemoryError("no room for the division")
        real(dst, size)

    monkeypatch.setattr(collectives, "finish_avg", flaky)

    async def body(comm: ahcomm.Comm) -> float:
        got = comm.all_reduce(np.ones(4), "avg", timeout=T)
        try:
            await got
        except MemoryError:
            pass
        return await _then_all_reduce(comm)

    assert await run_inproc(2, body) == [2.0, 2.0]
    assert calls["n"] == 2


async def test_barrier_takes_algorithm() -> None:
    """Issue 17.7: barrier() took no algorithm= though every collective does."""
    async def body(comm: ahcomm.Comm) -> None:
        await comm.barrier(algorithm="dissemination", timeout=T)
        with pytest.raises(ahcomm.InvalidArgument, match="'ring' cannot run barrier.*can: dissemination"):
            comm.barrier(algorithm="ring")
        await comm.barrier(timeout=T)

    await run_inproc(3, body)


async def test_a_device_input_that_fails_to_stage_fails_every_rank_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Staging fails after the run started (slice by slice): the peers are mid-protocol, so the
    communicator fails on every rank, and the peers' error names the rank, the type and text."""
    import ahcomm._comm as comm_module

    class Failing:
        def wait(self) -> None:
            pass

        async def ready(self, lo: int, hi: int) -> None:
            raise RuntimeError("device copy failed")

    given = iter([Failing()])
    monkeypatch.setattr(comm_module, "take_staging", lambda: next(given, None))
    comms = await ahcomm.init_inprocess(2)
    try:
        results = await asyncio.wait_for(asyncio.gather(*(c.all_reduce(np.ones(4), timeout=T) for c in comms),
                                                        return_exceptions=True), 3 * T)
        assert isinstance(results[0], RuntimeError)
        assert isinstance(results[1], ahcomm.PeerFailure) and results[1].rank == 0
        assert "all_reduce #0 failed on rank 0: RuntimeError: device copy failed" in str(results[1])
    finally:
        await asyncio.gather(*(c.close() for c in comms))


async def test_counts_given_on_some_ranks_only_fail_every_rank_at_once() -> None:
    """gather_v with counts= on rank 0 only: the others exchange counts first (one collective
    more), so the calls no longer pair up: a mismatch within seconds, not a wait."""
    comms = await ahcomm.init_inprocess(2)
    try:
        start = asyncio.get_running_loop().time()
        results = await asyncio.wait_for(asyncio.gather(
            *(c.gather_v(np.ones((1, 2)), counts=[1, 1] if c.rank == 0 else None, timeout=T) for c in comms),
            return_exceptions=True), 3 * T)
        assert all(isinstance(r, ahcomm.CollectiveMismatchError) for r in results), results
        assert asyncio.get_running_loop().time() - start < T / 2
    finally:
        await asyncio.gather(*(c.close() for c in comms))

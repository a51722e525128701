"""oneshot on sub-communicators: split and new_group get mailboxes of their own.

The same matrix as tests/test_algo_oneshot.py (every op oneshot claims, dtypes, counts 0/1/odd,
in place and not) on the groups of a split, world sizes 2..9, while the parent runs its own
oneshot calls at the same time (a rank's wake-up descriptor serves both); nested groups;
mismatch and abort while a group member waits in its mailbox; a real job (shared-memory boxes,
FIFO wake-ups) that leaves no name behind.
"""

from __future__ import annotations

import asyncio
import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_algo_oneshot import cases, issue, want
from test_multiprocess import left_behind, shm_names

import ahcomm

from jobs import ROOT, run_job
from support.inproc import run_inproc
from support.numerics import assert_close

HERE = Path(__file__).parent


@pytest.mark.parametrize("size", [2, 3, 5, 9])
async def test_matrix_on_split_groups_beside_the_parent(size: int, rng: np.random.Generator) -> None:
    colors = 2 if size > 2 else 1
    sizes = [len(range(c, size, colors)) for c in range(colors)]
    todo = [cases(rng, n) for n in sizes]
    parent_x = [np.full(3, r + 1, np.int64) for r in range(size)]

    async def body(comm: ahcomm.Comm) -> list[Any]:
        group = await comm.split(comm.rank % colors)
        assert group is not None
        try:
            assert group.size == 1 or group.explain("all_reduce", 2)[0] == "oneshot"
            out = []
            for k, case in enumerate(todo[comm.rank % colors]):
                beside = comm.all_reduce(parent_x[comm.rank], algorithm="oneshot") if k % 3 == 0 else None
                out.append(await issue(group, case))
                if beside is not None:
                    np.testing.assert_array_equal(await beside, sum(parent_x))
            return out
        finally:
            await group.close()

    results = await run_inproc(size, body)
    for color in range(colors):
        members = list(range(color, size, colors))
        for k, case in enumerate(todo[color]):
            for g, rank in enumerate(members):
                expected = want(case, g, len(members))
                if expected is None:
                    assert results[rank][k] is None
                else:
                    assert_close(results[rank][k].reshape(-1), expected)


async def test_nested_groups_and_new_group() -> None:
    """A group of a group (a mailbox derived from a derived one), and new_group's order."""
    async def body(comm: ahcomm.Comm) -> tuple[Any, Any]:
        outer = await comm.new_group([5, 3, 1, 0, 2])
        inner = await outer.split(outer.rank % 2) if outer is not None else None
        try:
            a = None if outer is None else await outer.all_gather(np.array([comm.rank], np.int32),
                                                                  algorithm="oneshot")
            b = None if inner is None else await inner.all_reduce(np.array([comm.rank], np.int32),
                                                                  algorithm="oneshot")
            return a, b
        finally:
            if inner is not None:
                await inner.close()
            if outer is not None:
                await outer.close()

    results = await run_inproc(6, body)
    assert results[4] == (None, None)
    for rank in (5, 3, 1, 0, 2):
        np.testing.assert_array_equal(results[rank][0].reshape(-1), [5, 3, 1, 0, 2])
    for rank, want_sum in ((5, 5 + 1 + 2), (1, 8), (2, 8), (3, 3 + 0), (0, 3)):
        np.testing.assert_array_equal(results[rank][1], [want_sum])


async def test_mismatch_in_a_group_mailbox_fails_its_members() -> None:
    comms = await ahcomm.init_inprocess(4)
    groups = await asyncio.gather(*(c.split(c.rank // 2) for c in comms))
    try:
        futs = [groups[0].all_reduce(np.ones(4, np.float32), algorithm="oneshot"),
                groups[1].all_gather(np.ones(4, np.float32), algorithm="oneshot")]
        results = await asyncio.wait_for(asyncio.gather(*futs, return_exceptions=True), 20)
        assert all(isinstance(r, ahcomm.CollectiveMismatchError) for r in results), results
        # the other group and the parent go on
        other = await asyncio.gather(*(g.all_reduce(np.ones(2, np.float32), algorithm="oneshot") for g in groups[2:]))
        assert all(np.array_equal(o, [2, 2]) for o in other)
    finally:
        await asyncio.gather(*(g.close() for g in groups if g is not None), return_exceptions=True)
        await asyncio.gather(*(c.close() for c in comms), return_exceptions=True)


async def test_abort_while_a_group_member_waits_in_its_mailbox() -> None:
    comms = await ahcomm.init_inprocess(4)
    groups = await asyncio.gather(*(c.split(c.rank % 2) for c in comms))
    try:
        fut = groups[0].all_reduce(np.ones(4, np.float32), algorithm="oneshot")
        await asyncio.sleep(0.05)
        assert not fut.done()  # group rank 0 (world 0) waits for world rank 2's slot
        groups[2].abort("stop")
        with pytest.raises(ahcomm.PeerFailure, match="aborted"):
            await asyncio.wait_for(fut, 5)
    finally:
        await asyncio.gather(*(g.close() for g in groups if g is not None), return_exceptions=True)
        await asyncio.gather(*(c.close() for c in comms), return_exceptions=True)


@pytest.mark.multiprocess
def test_groups_of_a_real_job_run_oneshot_in_shared_memory() -> None:
    before = shm_names()
    proc = run_job(4, str(HERE / "mp_oneshot_groups.py"), env={"AHCOMM_TRANSPORT": "sdma",
                                                                          "PYTHONPATH": f"{HERE}{os.pathsep}{ROOT}"},
                   timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert not left_behind(before), "shared-memory names were left behind"
    for r in range(4):
        assert re.search(rf"\[{r}\] OK rank {r} group oneshot 300 calls", out), out


@pytest.mark.parametrize("size", [3, 6])
async def test_matrix_on_a_shrunk_communicator(size: int, rng: np.random.Generator) -> None:
    """shrink (rank 1 excluded) derives the survivors' mailbox from the old one's; the old
    communicator may close first."""
    todo = cases(rng, size - 1)

    async def body(comm: ahcomm.Comm) -> list[Any] | None:
        new = await comm.shrink(exclude=[1])
        await comm.close()  # the failed-old-first order of a recovery: the new one keeps its mailbox
        if new is None:
            return None
        try:
            assert new.explain("all_reduce", 2)[0] == "oneshot"
            return [await issue(new, case) for case in todo]
        finally:
            await new.close()

    comms = await ahcomm.init_inprocess(size)
    try:
        results = await asyncio.wait_for(asyncio.gather(*(body(c) for c in comms)), 60)
    finally:
        await asyncio.gather(*(c.close() for c in comms), return_exceptions=True)
    assert results[1] is None
    survivors = [r for r in range(size) if r != 1]
    for k, case in enumerate(todo):
        for g, rank in enumerate(survivors):
            expected = want(case, g, size - 1)
            got = results[rank]
            assert got is not None
            if expected is None:
                assert got[k] is None
            else:
                assert_close(got[k].reshape(-1), expected)


@pytest.mark.multiprocess
@pytest.mark.parametrize("n", [2, 3])
def test_ranks_that_share_a_core_yield_and_stay_correct(n: int) -> None:
    """Pinned to fewer cores than ranks (n on one core: n = 2 yields, n = 3 sleeps at once)."""
    import subprocess

    from jobs import job_argv, job_env
    core = min(os.sched_getaffinity(0))
    proc = subprocess.run(job_argv(n, str(HERE / "mp_oneshot_yield.py")),
                          env=job_env({"PYTHONPATH": f"{HERE}{os.pathsep}{ROOT}", "AHCOMM_TRANSPORT": "sdma"}),
                          capture_output=True, text=True, timeout=240, cwd=ROOT,
                          preexec_fn=lambda: os.sched_setaffinity(0, {core}))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    for r in range(n):
        assert re.search(rf"\[{r}\] OK rank {r} yields {n == 2} budget {200 if n == 2 else 0} us", out), out


async def test_a_member_without_room_for_its_box_leaves_the_group_without_mailboxes() -> None:
    """One rank's box cannot be made (/dev/shm full): every member decides alike, from the
    descriptions, to run the group without mailboxes; the group works."""
    comms = await ahcomm.init_inprocess(3)

    def full() -> None:
        raise OSError(28, "No space left on device")

    comms[1]._executor.mailbox.offer = full  # type: ignore[union-attr,method-assign]
    groups = await asyncio.gather(*(c.split(0) for c in comms))
    try:
        assert all(g is not None and g.explain("all_reduce", 2)[0] != "oneshot" for g in groups)
        got = await asyncio.gather(*(g.all_reduce(np.ones(2, np.float32)) for g in groups if g is not None))
        assert all(np.array_equal(x, [3, 3]) for x in got)
    finally:
        await asyncio.gather(*(g.close() for g in groups if g is not None), return_exceptions=True)
        await asyncio.gather(*(c.close() for c in comms), return_exceptions=True)

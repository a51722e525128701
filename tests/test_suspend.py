"""Comm.suspend()/resume() (issue 13): the buffers and shared memory go and come back.

On real processes (sdma and rdma, tests/mp_suspend.py): every op is right before and after,
the shared memory a rank maps drops to nothing while suspended (its /proc/self/maps), calls
while suspended raise CommSuspendedError naming the op, a peer killed while the others are
suspended makes their resume raise PeerFailure (and they shrink and go on). In one process:
the same checks against numpy on in-process links, the usage errors, sub-communicators.
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from mp_suspend import every_op
from test_multiprocess import left_behind, shm_names

import ahcomm
from ahcomm.testing import local_world
from ahcomm.transports._notify_ring import inbox_bytes

from jobs import ROOT, job_env

WORKER = str(Path(__file__).parent / "mp_suspend.py")
MiB = 1 << 20
BUFFSIZE_MB = 4  # the jobs' CCL buffers (the worker's large ops are sliced through them)


def run(case: str, n: int, transport: str, **extra: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "ahcomm.run", "-n", str(n), "--on-failure", "continue", "--tag-output", WORKER]
    env = job_env({"CASE": case, "AHCOMM_TRANSPORT": transport, "AHCOMM_EXEC_TIMEOUT": "20",
                   "AHCOMM_BUFFSIZE": str(BUFFSIZE_MB), **extra})
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=180, cwd=ROOT)


def oks(res: subprocess.CompletedProcess[str]) -> dict[int, dict[str, str]]:
    out = {}
    for line in res.stdout.splitlines():
        if " OK " in line:
            fields = dict(re.findall(r"(\w+)=(\S+)", line))
            out[int(fields["rank"])] = fields
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("transport", ["sdma", "rdma"])
def test_suspend_releases_the_memory_and_resume_restores_every_op(transport: str, n: int) -> None:
    res = run("cycle", n, transport)
    assert res.returncode == 0, res.stdout + res.stderr
    ok = oks(res)
    assert sorted(ok) == list(range(n)), res.stdout + res.stderr
    for rank, f in ok.items():
        before, during, after = int(f["mapped_before"]), int(f["mapped_suspended"]), int(f["mapped_resumed"])
        own = 2 * BUFFSIZE_MB * MiB
        if transport == "sdma":  # its own buffers and every peer's mapped (and the host mailboxes)
            assert before >= n * own and after == before, f
            assert int(f["unmapped"]) >= (n - 1) * own, f
        assert during == 0, f"rank {rank} still maps {during} bytes of shared memory while suspended: {f}"
        assert int(f["released"]) >= own, f
        print(f"{transport} np={n} rank {rank}: mapped {before} -> {during} -> {after} bytes; released "
              f"{f['released']} own, unmapped {f['unmapped']} of peers'; suspend {f['suspend_s']} s, "
              f"resume {f['resume_s']} s")


@pytest.mark.multiprocess
def test_groups_and_their_parent_suspend_and_resume_with_their_mailboxes() -> None:
    """A group's mailbox is made from its parent's: suspending the parent closed it, and the
    group resumed on a closed one (its first small call failed)."""
    before = shm_names()
    res = run("groups", 4, "sdma")
    assert res.returncode == 0, res.stdout + res.stderr
    assert not left_behind(before), "shared-memory names were left behind"
    ok = oks(res)
    assert sorted(ok) == list(range(4)), res.stdout + res.stderr
    for rank, f in ok.items():
        assert f["group"] == "oneshot" and f["parent"] == "oneshot", f  # both run on mailboxes again
        assert f["mapped_suspended"] == "0", f"rank {rank} still maps shared memory while suspended: {f}"


@pytest.mark.multiprocess
@pytest.mark.parametrize("transport", ["sdma", "rdma"])
def test_a_peer_killed_while_suspended_fails_the_others_resume(transport: str) -> None:
    res = run("die", 4, transport, VICTIM="2")
    assert res.returncode == 137, res.stdout + res.stderr  # rank 2's death is the job's status
    ok = oks(res)
    assert sorted(ok) == [0, 1, 3], res.stdout + res.stderr
    assert {(f["error"], f["peer"]) for f in ok.values()} == {("PeerFailure", "2")}, ok
    killed = float(re.search(r"KILL (\S+)", res.stdout).group(1))  # type: ignore[union-attr]
    print(f"{transport}: SIGKILL of a suspended rank -> the others' resume raised after "
          f"{max(float(f['raised']) for f in ok.values()) - killed:.3f} s")


# -- in one process --------------------------------------------------------------------------
async def _world(size: int, transport: str = "inproc") -> list[ahcomm.Comm]:
    return await local_world(size, transport=transport, buffsize=1 << 16)


async def _all(comms: list[ahcomm.Comm], fn: str) -> list[object]:
    return list(await asyncio.wait_for(asyncio.gather(*(getattr(c, fn)() for c in comms)), 30))


@pytest.mark.parametrize("transport", ["inproc", "sdma", "rdma"])
async def test_in_process_ops_raise_while_suspended_and_are_right_after(transport: str) -> None:
    comms = await _world(3, transport)
    try:
        await asyncio.gather(*(every_op(c, 20000) for c in comms))  # 160 KB a block: over the 64 KiB buffers
        await _all(comms, "suspend")
        for c in comms:
            inbox = inbox_bytes(3) if transport == "sdma" else 0  # its notify inbox: a ring per rank of the host
            assert c.suspended and c.stats()["suspended"] and c.stats()["released_bytes"] == 2 * (1 << 16) + inbox
            calls = (lambda c=c: c.all_reduce(np.ones(2)), c.barrier, lambda c=c: c.broadcast_object(1),
                     lambda c=c: c.recv(0 if c.rank else 1), lambda c=c: c.split(0))
            for call in calls:
                with pytest.raises(ahcomm.CommSuspendedError, match="is suspended") as info:
                    await call()  # type: ignore[operator]
                assert info.value.op in ("all_reduce", "barrier", "broadcast_object", "recv", "split")
            with pytest.raises(ahcomm.CommSuspendedError, match="suspend: .* is suspended"):
                await c.suspend()
        await _all(comms, "resume")
        assert not any(c.suspended for c in comms)
        await asyncio.gather(*(every_op(c, 20000) for c in comms))
        for c in comms:
            with pytest.raises(ahcomm.UsageError, match="resume: .* is not suspended"):
                await c.resume()
    finally:
        await asyncio.gather(*(c.close() for c in comms))


async def test_suspend_of_a_failed_or_closed_communicator_raises() -> None:
    comms = await _world(2)
    comms[0].abort("test")
    await asyncio.sleep(0.05)
    for c in comms:
        with pytest.raises(ahcomm.CommClosedError):
            await c.suspend()
    await asyncio.gather(*(c.close() for c in comms))
    with pytest.raises(ahcomm.CommClosedError):
        await comms[0].resume()


async def test_resume_on_one_rank_alone_times_out_naming_the_others() -> None:
    comms = await _world(3)
    try:
        await _all(comms, "suspend")
        with pytest.raises(ahcomm.CollectiveTimeout, match="no word from ranks 1, 2") as info:
            await comms[0].resume(timeout=0.3)
        assert info.value.missing == (1, 2)
        for c in comms[1:]:  # the communicator fails on every rank (they are out of step now)
            with pytest.raises(ahcomm.CollectiveTimeout, match="resume on rank 0"):
                await c.resume()
    finally:
        await asyncio.gather(*(c.close() for c in comms))


@pytest.mark.parametrize("transport", ["inproc", "sdma", "rdma"])
async def test_suspend_refuses_on_every_rank_while_a_group_is_open(transport: str) -> None:
    comms = await _world(3, transport)
    try:
        groups = await asyncio.gather(*(c.new_group([0, 1]) for c in comms))
        outcomes = await asyncio.gather(*(c.suspend() for c in comms), return_exceptions=True)
        for out in outcomes:  # rank 2 is in no group, yet refuses too (it would wait for the others)
            assert isinstance(out, ahcomm.UsageError) and "ranks 0, 1" in str(out), outcomes
        assert not any(c.suspended for c in comms)
        members = [g for g in groups if g is not None]
        await asyncio.gather(*(g.suspend() for g in members))  # a group suspends on its own
        await _all(comms, "suspend")  # then the parent may
        await _all(comms, "resume")
        await asyncio.gather(*(g.resume() for g in members))
        got = await asyncio.gather(*(g.all_reduce(np.full(4, g.rank + 1.0)) for g in members))
        assert all((x == 3.0).all() for x in got)
        got = await asyncio.gather(*(c.all_reduce(np.full(4, c.rank + 1.0)) for c in comms))
        assert all((x == 6.0).all() for x in got)
    finally:
        await asyncio.gather(*(c.close() for c in comms))


async def test_close_while_suspended() -> None:
    comms = await _world(2, "sdma")
    await _all(comms, "suspend")
    await asyncio.wait_for(asyncio.gather(*(c.close() for c in comms)), 30)
    assert all(c.closed for c in comms)


@pytest.mark.parametrize("transport", ["sdma", "rdma"])
async def test_a_shrunk_communicator_suspends_and_resumes(transport: str) -> None:
    comms = await _world(3, transport)
    try:
        shrunk = await asyncio.gather(*(c.shrink(exclude=[2]) for c in comms[:2]))
        assert all(s is not None for s in shrunk)
        live = [s for s in shrunk if s is not None]
        await _all(live, "suspend")
        assert all(s.stats()["released_bytes"] == 2 * (1 << 16) for s in live)
        await _all(live, "resume")
        got = await asyncio.gather(*(s.all_reduce(np.arange(50000.0) * (s.rank + 1)) for s in live))
        assert all(np.array_equal(x, np.arange(50000.0) * 3) for x in got)
        await asyncio.gather(*(s.close() for s in live))
    finally:
        await asyncio.gather(*(c.close() for c in comms))

"""Ranks of the elastic tests (started by ahcomm-run; CASE picks the scenario).

kill:     rank VICTIM SIGKILLs itself mid-loop; the survivors shrink and all_reduce.
exclude:  no failure: every rank but 1 shrinks with exclude=[1] (rank 1 gets None when it calls).
converge: ranks see different failures (exclude=[3] on rank 0, [4] on rank 1, none on rank 2,
          ranks 3 and 4 do not take part): all three end in one communicator of ranks 0, 1, 2.
stagger:  no failure, no exclude: every rank shrinks (to all of them), rank 3 0.3 s after the
          others (their first joins reach it before it listens).
twice:    ranks 2 and then 4 of 5 die at different times: two shrinks in a row.
late:     rank VICTIM dies while the others are in their shrink (it never joins).
grow:     (under --on-failure restart) rank VICTIM dies; the survivors shrink, all_reduce, then
          grow() while the launcher restarts it; its init() rejoins; the state comes from rank 0
          by broadcast_object and every rank all_reduces on the grown communicator.
group:    groups A = ranks 1, 2, 3 and B = ranks 0, 1; rank 2 dies: A shrinks to ranks 1, 3 (the
          whole communicator to 0, 1, 3), B goes on unaffected.
Each survivor prints "OK old=R new=R' size=N members=A,B,.. first=T" (T: time.time() of its first
collective's completion on the new communicator); a victim prints "KILL T" before it dies.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time

import numpy as np

import ahcomm


def die() -> None:
    print(f"KILL {time.time():.6f}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


async def check(comm: ahcomm.Comm, new: ahcomm.Comm | None, survivors: list[int], caught: float = 0.0, *,
                close: bool = True) -> None:
    assert new is not None, f"rank {comm.rank}: shrink gave None"
    assert new.size == len(survivors), (new.size, survivors)
    assert new.rank == survivors.index(comm.rank), (new.rank, survivors)
    out = await new.all_reduce(np.full(1000, comm.rank + 1, np.int64))
    first = time.time()
    assert (out == sum(r + 1 for r in survivors)).all(), out[:4]
    for i in range(5):  # it keeps working, with several algorithms
        got = await new.all_reduce(np.arange(4096, dtype=np.float32) * (comm.rank + i))
        assert np.allclose(got, np.arange(4096, dtype=np.float32) * sum(r + i for r in survivors))
    gathered = await new.all_gather_object(comm.rank)
    assert gathered == survivors, gathered
    print(f"OK old={comm.rank} new={new.rank} size={new.size} members={','.join(map(str, new.world_ranks))} "
          f"first={first:.6f} caught={caught:.6f}", flush=True)
    if close:
        await new.close()


async def grown_check(grown: ahcomm.Comm, state: dict[str, int] | None, victim: int) -> None:
    state = await grown.broadcast_object(state, root=1 if victim == 0 else 0)  # a survivor has it
    # What the root summed up before the growth: 20 calls of 4 ranks (19 where the victim's part of
    # its last call was still in its socket when it was SIGKILLed: that call fails on the survivors),
    # then 5 of 3. The test checks that every rank of the grown communicator prints the same.
    assert state is not None and state["total"] in (19 * 4 + 5 * 3, 20 * 4 + 5 * 3), state
    got = await grown.all_reduce(np.full(100, grown.rank + 1, np.int64))
    assert grown.size == 4 and (got == 10).all(), (grown.size, got[:3])
    small = grown.explain("all_reduce", 2)[0]  # sdma: the grown communicator's own mailboxes (oneshot)
    for i in range(20):
        got = await grown.all_reduce(np.array([grown.rank + i, 1], np.int64))
        assert list(got) == [6 + 4 * i, 4], got
    print(f"GROWN rank={grown.rank} size={grown.size} restarts={os.environ.get('AHCOMM_RESTART_COUNT', '0')} "
          f"state={state['total']} small={small}", flush=True)
    await grown.close()


async def grow_case(comm: ahcomm.Comm, victim: int) -> None:
    if os.environ.get("AHCOMM_RESTART_COUNT"):  # the replacement: init() joined the running job
        assert comm.rank == victim and comm.size == 4, (comm.rank, comm.size)
        await grown_check(comm, None, victim)
        return
    total = 0
    for i in range(100):
        if comm.rank == victim and i == 20:
            die()
        try:
            total += int((await comm.all_reduce(np.ones(1, np.int64)))[0])
        except ahcomm.CommunicationError:
            break
    new = await comm.shrink()
    assert new is not None and new.size == 3
    for _ in range(5):
        total += int((await new.all_reduce(np.ones(1, np.int64)))[0])
    grown = await new.grow()
    await grown_check(grown, {"total": total}, victim)
    await new.close()
    await comm.close()


async def main() -> None:
    case = os.environ["CASE"]
    victim = int(os.environ.get("VICTIM", "2"))
    comm = await ahcomm.init()
    if case == "grow":
        await grow_case(comm, victim)
        return
    size, rank = comm.size, comm.rank
    if case in ("kill", "late"):
        failed = False
        for i in range(1000):
            if case == "kill" and rank == victim and i == 20:
                die()
            try:
                await comm.all_reduce(np.ones(256, np.float32))
            except ahcomm.CommunicationError:
                failed, caught = True, time.time()
                break
            if case == "late" and i == 20:
                break
        if case == "late":
            others = [r for r in range(size) if r not in (victim,)]
            if rank == victim:
                await asyncio.sleep(1.0)  # the others are in their shrink, waiting for this rank
                die()
            new = await comm.shrink()
            await check(comm, new, others)
            return
        assert failed, "the victim's death was never noticed"
        try:
            comm.barrier()
        except ahcomm.CommClosedError:
            pass
        else:
            raise AssertionError("the old communicator is usable after the failure")
        new = await comm.shrink()
        await check(comm, new, [r for r in range(size) if r != victim], caught)
        await comm.close()  # the old one: the new one was closed first
        return
    if case == "exclude":
        await comm.all_reduce(np.ones(8, np.float32))
        if rank == 1:
            assert await comm.shrink(exclude=[1]) is None
            await asyncio.sleep(3)  # the others finish their shrink and work without this rank
            return  # exits without closing: the others' new communicator is not affected
        new = await comm.shrink(exclude=[1])
        await check(comm, new, [r for r in range(size) if r != 1])
        return
    if case == "stagger":
        await comm.all_reduce(np.ones(8, np.float32))
        if rank == 3:
            await asyncio.sleep(0.3)
        new = await comm.shrink()
        await check(comm, new, list(range(size)), close=False)
        await comm.close()  # the old one first: the new one still works, on the same connections
        assert new is not None
        assert (await new.all_reduce(np.ones(4, np.int64)) == size).all()
        await new.close()
        return
    if case == "twice":  # rank 2 dies, later rank 4: two shrinks in a row
        current, alive = comm, list(range(size))
        for i in range(200):
            if (rank == 2 and i == 10) or (rank == 4 and i == 60):
                die()
            try:
                await current.all_reduce(np.ones(16, np.float32))
            except (ahcomm.CommunicationError, ahcomm.CommClosedError):
                shrunk = await current.shrink()
                assert shrunk is not None
                alive = list(shrunk.world_ranks)
                current = shrunk
            if len(alive) == 3:
                break
        await check(comm, current, [0, 1, 3])
        return
    if case == "converge":
        await comm.all_reduce(np.ones(8, np.float32))
        if rank >= 3:
            await asyncio.sleep(3)
            return
        new = await comm.shrink(exclude={0: [3], 1: [4], 2: []}[rank])
        await check(comm, new, [0, 1, 2])
        return
    if case == "group":
        a = await comm.new_group([1, 2, 3])
        b = await comm.new_group([0, 1])
        if rank == 2:
            await asyncio.sleep(0.2)
            die()
        if a is not None:
            with_a = [1, 2, 3]
            try:
                for _ in range(100):
                    await a.all_reduce(np.ones(64, np.float32))
                    await asyncio.sleep(0.01)
                raise AssertionError("the death of rank 2 was never noticed in group A")
            except ahcomm.CommunicationError:
                pass
            a2 = await a.shrink()
            assert a2 is not None and a2.size == 2 and list(a2.world_ranks) == [1, 3], a2
            got = await a2.all_reduce(np.full(8, rank, np.int64))
            assert (got == 4).all(), got
            print(f"A shrunk on {rank}: {list(a2.world_ranks)}", flush=True)
            try:
                await a2.grow()
                raise AssertionError("a shrunk group grew")
            except ahcomm.UsageError as exc:
                assert "sub-communicator" in str(exc), exc
            await a2.close()
            await a.close()
            del with_a
        if b is not None:  # untouched by the death
            for _ in range(3):
                got = await b.all_reduce(np.full(8, rank + 1, np.int64))
                assert (got == 3).all(), got
            print(f"B fine on {rank}", flush=True)
            await b.close()
        with contextlib.suppress(ahcomm.CommunicationError, ahcomm.CommClosedError):  # it failed meanwhile
            await comm.all_reduce(np.ones(8, np.float32))
        new = await comm.shrink()
        await check(comm, new, [0, 1, 3])
        return
    raise SystemExit(f"unknown CASE {case}")


if __name__ == "__main__":
    asyncio.run(main())
    sys.stdout.flush()

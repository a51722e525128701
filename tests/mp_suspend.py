"""Ranks of the suspend/resume tests (started by ahcomm-run; CASE picks the scenario).

cycle: every op checked against numpy, suspend (double suspend, calls while suspended, resume
       checked), the shared memory this process maps counted before, while and after, resume,
       every op again (small ones and ones larger than the CCL buffers), a second cycle.
       Prints "OK rank=R mapped_before=B mapped_suspended=S mapped_resumed=M released=N
       unmapped=U suspend_s=T resume_s=T".
die:   every rank suspends; rank VICTIM then SIGKILLs itself; the others call resume, which must
       raise PeerFailure naming it; they shrink and all_reduce on the survivors, suspend and
       resume theirs, and run small and other calls on it. Prints
       "KILL T" (the victim) and "OK rank=R raised=T error=NAME peer=P" (the survivors).
groups: split into even and odd ranks; each group suspends, then the parent; the parent
       resumes, then the groups; small (oneshot) and large calls are checked on both, twice;
       then rank 1 is shrunk away and the survivors suspend and resume theirs.
       Prints "OK rank=R group=ALGORITHM parent=ALGORITHM mapped_suspended=S".
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Awaitable, Callable

import numpy as np

import ahcomm

SHM = "/dev/shm/ahcomm-"


def mapped_shm() -> int:
    """Bytes of ahcomm shared memory this process maps now (its own segments and its peers')."""
    total = 0
    with open("/proc/self/maps") as maps:
        for line in maps:
            if SHM in line:
                lo, hi = line.split()[0].split("-")
                total += int(hi, 16) - int(lo, 16)
    return total


def expect(cond: bool, what: str) -> None:
    if not cond:
        raise AssertionError(what)


async def every_op(comm: ahcomm.Comm, scale: int) -> None:
    """Each collective (and send/recv) against numpy; ``scale`` elements per rank block."""
    n, r = comm.size, comm.rank
    rows = [np.arange(scale, dtype=np.float64) * (p + 1) + p for p in range(n)]
    mine = rows[r]
    total = np.sum(rows, axis=0)
    expect(np.array_equal(await comm.all_reduce(mine), total), "all_reduce")
    expect(np.array_equal(await comm.all_reduce(mine, "max"), np.max(rows, axis=0)), "all_reduce max")
    expect(np.array_equal(await comm.all_gather(mine), np.concatenate(rows)), "all_gather")
    blocks = np.concatenate([mine + q for q in range(n)])
    expect(np.array_equal(await comm.reduce_scatter(blocks), total + n * r), "reduce_scatter")
    expect(np.array_equal(await comm.broadcast(mine, root=n - 1), rows[n - 1]), "broadcast")
    got = await comm.reduce(mine, root=0)
    expect(r != 0 or np.array_equal(got, total), "reduce")
    a2a = await comm.all_to_all(np.concatenate([mine[:8] + q for q in range(n)]))
    expect(np.array_equal(a2a, np.concatenate([rows[p][:8] + r for p in range(n)])), "all_to_all")
    await comm.barrier()
    peer = (r + 1) % n
    sent = comm.send(mine, peer, tag=7)
    back = await comm.recv((r - 1) % n, tag=7)
    await sent
    expect(np.array_equal(back, rows[(r - 1) % n]), "send/recv")
    expect(await comm.all_gather_object({"rank": r}) == [{"rank": p} for p in range(n)], "all_gather_object")


async def refused(call: Callable[[], Awaitable[object]], kind: type[BaseException], what: str) -> str:
    try:
        await call()
    except kind as exc:
        return str(exc)
    raise AssertionError(f"{what} did not raise {kind.__name__}")


async def cycle(comm: ahcomm.Comm) -> None:
    big = 1 << 20  # float64 elements: 8 MiB per rank, over the tests' 4 MiB CCL buffers (sliced)
    await every_op(comm, 1000)
    await every_op(comm, big)
    before = mapped_shm()
    t0 = time.perf_counter()
    await comm.suspend()
    took_suspend = time.perf_counter() - t0
    suspended = mapped_shm()
    stats = comm.stats()
    expect(stats["suspended"] and comm.suspended, "stats()['suspended']")
    text = await refused(comm.suspend, ahcomm.CommSuspendedError, "a second suspend")
    expect("suspend" in text and "suspended" in text, text)
    text = await refused(lambda: comm.all_reduce(np.ones(4)), ahcomm.CommSuspendedError, "all_reduce while suspended")
    expect(text.startswith("all_reduce:"), text)
    try:
        comm.send(np.ones(4), (comm.rank + 1) % comm.size)
    except ahcomm.CommSuspendedError as exc:
        expect(exc.op == "send", repr(exc.op))
    else:
        raise AssertionError("send while suspended did not raise")
    t0 = time.perf_counter()
    await comm.resume()
    took_resume = time.perf_counter() - t0
    await every_op(comm, 1000)
    await every_op(comm, big)
    resumed = mapped_shm()
    await refused(comm.resume, ahcomm.UsageError, "resume without suspend")
    await comm.suspend()  # a second cycle
    await comm.resume()
    await every_op(comm, 1000)
    print(f"OK rank={comm.rank} mapped_before={before} mapped_suspended={suspended} mapped_resumed={resumed} "
          f"released={stats['released_bytes']} unmapped={stats['unmapped_bytes']} "
          f"suspend_s={took_suspend:.4f} resume_s={took_resume:.4f}", flush=True)


async def die(comm: ahcomm.Comm, victim: int) -> None:
    await comm.all_reduce(np.ones(16))
    await comm.suspend()
    if comm.rank == victim:
        await asyncio.sleep(0.3)
        print(f"KILL {time.time():.6f}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        await comm.resume()
    except ahcomm.PeerFailure as exc:
        raised, error, peer = time.time(), type(exc).__name__, exc.rank
    else:
        raise AssertionError(f"rank {comm.rank}: resume did not raise although rank {victim} died")
    new = await comm.shrink()
    assert new is not None
    got = await new.all_reduce(np.full(8, comm.rank + 1.0))
    survivors = [r for r in range(comm.size) if r != victim]
    expect(np.array_equal(got, np.full(8, float(sum(r + 1 for r in survivors)))), f"all_reduce after shrink: {got}")
    pick = new.explain("all_reduce", 2)[0]
    await new.suspend()  # the survivors' communicator (ranks renumbered: 3 is 2 now) suspends and resumes
    await new.resume()
    expect(new.explain("all_reduce", 2)[0] == pick, f"small calls ran {pick}, now {new.explain('all_reduce', 2)}")
    await small_calls(new, 10, None)
    await every_op(new, 1000)
    print(f"OK rank={comm.rank} raised={raised:.6f} error={error} peer={peer}", flush=True)
    await new.close()


async def small_calls(comm: ahcomm.Comm, rounds: int, algorithm: str | None = "oneshot") -> None:
    """``rounds`` small all_reduces and broadcasts on ``comm`` (oneshot: on its mailboxes), checked."""
    n = comm.size
    for i in range(rounds):
        got = await comm.all_reduce(np.array([comm.rank + i], np.float32), algorithm=algorithm)
        expect(got[0] == n * i + n * (n - 1) / 2, f"{algorithm} all_reduce {i}: {got}")
        got = await comm.broadcast(np.full(5, comm.rank + i, np.int32), root=i % n, algorithm=algorithm)
        expect((got == i % n + i).all(), f"oneshot broadcast {i}: {got}")


async def groups(comm: ahcomm.Comm) -> None:
    group = await comm.split(comm.rank % 2)
    assert group is not None
    for _ in range(2):
        await small_calls(group, 20)
        await group.suspend()
        await comm.suspend()
        suspended = mapped_shm()
        await comm.resume()
        await small_calls(comm, 20)  # the parent's small calls while the group is still suspended
        await group.resume()
        await small_calls(group, 20)
        await small_calls(comm, 20)
        await every_op(group, 1000)
        await every_op(comm, 1000)
    picks = group.explain("all_reduce", 2)[0], comm.explain("all_reduce", 2)[0]
    await group.close()
    shrunk = await comm.shrink(exclude=[1])  # ranks 0, 2, 3 of comm are 0, 1, 2 of shrunk
    if shrunk is not None:
        await small_calls(shrunk, 10)
        await shrunk.suspend()
        await shrunk.resume()
        await small_calls(shrunk, 10)  # on a host mailbox indexed by its own ranks
        await every_op(shrunk, 1000)
        await shrunk.close()
    print(f"OK rank={comm.rank} group={picks[0]} parent={picks[1]} mapped_suspended={suspended}", flush=True)


async def main() -> None:
    case = os.environ["CASE"]
    comm = await ahcomm.init()
    if case == "cycle":
        await cycle(comm)
    elif case == "die":
        await die(comm, int(os.environ.get("VICTIM", "1")))
    elif case == "groups":
        await groups(comm)
    await comm.close()


if __name__ == "__main__":
    asyncio.run(main())

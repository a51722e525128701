"""A rank program for tests/test_oneshot_groups.py: small calls on split groups of a real job.

Two groups (even and odd ranks) run 300 oneshot calls each (all_reduce, broadcast, barrier,
all_gather, checked) while the parent runs its own; the group's mailbox is a shared-memory
one woken through the host's FIFOs. Then the last rank is shrunk away and the survivors
run 50 oneshot all_reduces on theirs.
"""

from __future__ import annotations

import asyncio

import numpy as np

import ahcomm


async def main() -> None:
    comm = await ahcomm.init()
    group = await comm.split(comm.rank % 2)
    assert group is not None
    name = group.explain("all_reduce", 2)[0]
    assert name == "oneshot", name
    calls = 0
    for i in range(75):
        beside = comm.all_reduce(np.array([i, comm.rank], np.int64))
        got = await group.all_reduce(np.array([group.rank + i], np.float32), algorithm="oneshot")
        assert got[0] == sum(range(group.size)) + group.size * i, got
        got = await group.broadcast(np.full(5, group.rank + i, np.int32), root=i % group.size, algorithm="oneshot")
        assert np.all(got == i % group.size + i), got
        await group.barrier()
        got = await group.all_gather(np.array([group.rank * i], np.int64), algorithm="oneshot")
        assert list(got.reshape(-1)) == [g * i for g in range(group.size)], got
        calls += 4
        parent = await beside
        assert list(parent) == [comm.size * i, sum(range(comm.size))], parent
    await group.close()
    shrunk = await comm.shrink(exclude=[comm.size - 1])  # the survivors' mailbox: derived from the host's
    await comm.close()
    if shrunk is not None:
        assert shrunk.explain("all_reduce", 2)[0] == "oneshot"
        for i in range(50):
            got = await shrunk.all_reduce(np.array([i + shrunk.rank], np.int64))
            assert got[0] == shrunk.size * i + sum(range(shrunk.size)), got
        await shrunk.close()
    print(f"OK rank {comm.rank} group {name} {calls} calls", flush=True)


asyncio.run(main())

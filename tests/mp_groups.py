"""A rank program for the sub-communicator tests: split and new_group on real processes.

Every op x algorithm runs on a group (against numpy) while the parent runs its own
collectives at the same time; then new_group, nested splits, and the checks that groups made
no new connection (the process holds the same sockets) and that their bytes went over their links.
With ``GROUP_FAULT=1`` the last rank dies during a group collective instead, and every other
member must raise PeerFailure on the group.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import numpy as np
from mp_catalogue import run_catalogue, run_rank

import ahcomm


def open_sockets() -> int:
    """Sockets this process holds (its connections; shared-memory mappings hold fds too)."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:  # the listing's own descriptor, closed by now
            pass
    return count


async def parent_traffic(comm: ahcomm.Comm, rounds: int) -> None:
    for i in range(rounds):
        x = np.full(1000 + i, comm.rank + i, np.float64)
        got = await comm.all_reduce(x)
        want = sum(range(comm.size)) + comm.size * i
        assert np.all(got == want), (i, got[:3], want)
        await asyncio.sleep(0)


async def main() -> None:
    comm = await ahcomm.init()
    r, n = comm.rank, comm.size
    sockets = open_sockets()
    group = await comm.split(r % 2, key=-r)  # reversed order inside each group
    assert group is not None
    members = [p for p in range(n) if p % 2 == r % 2][::-1]
    assert group.world_ranks == tuple(members), (group.world_ranks, members)
    assert group.rank == members.index(r) and group.size == len(members)
    assert open_sockets() == sockets, f"split opened sockets: {sockets} -> {open_sockets()}"
    if os.environ.get("GROUP_FAULT") == "1":
        await fault(comm, group)
        return
    ran, _ = await asyncio.gather(run_catalogue(group), parent_traffic(comm, 30))
    kinds = {link["kind"] for link in group.stats()["links"].values()}
    assert kinds <= {os.environ["EXPECT_LINK"]}, kinds
    if group.size > 1:
        assert all(link["bytes_sent"] > 0 for link in group.stats()["links"].values()), group.stats()
    pair = await comm.new_group([n - 1, 0])
    assert (pair is None) == (r not in (0, n - 1))
    if pair is not None:
        x = np.arange(100_000, dtype=np.float32) * (r + 1)
        if pair.size > 1:
            got = await pair.all_reduce(x)
            np.testing.assert_array_equal(got, np.arange(100_000, dtype=np.float32) * (n + 1))
            peer = 1 - pair.rank
            back, _ = await pair.batch_send_recv([ahcomm.P2POp("recv", np.empty_like(x), peer),
                                                  ahcomm.P2POp("send", x, peer)])
            np.testing.assert_array_equal(back, np.arange(100_000, dtype=np.float32) * (pair.world_ranks[peer] + 1))
        await pair.close()
    nested = await group.split(group.rank // 2, buffsize=16384)  # groups of the group, small buffers
    assert nested is not None
    got = await nested.all_gather(np.array([r]))
    assert list(got) == list(nested.world_ranks), (got, nested.world_ranks)
    big = np.arange(50_000, dtype=np.float64) + r  # 400 KB through 16 KB buffers
    np.testing.assert_array_equal(await nested.all_reduce(big),
                                  np.arange(50_000, dtype=np.float64) * nested.size + sum(nested.world_ranks))
    assert open_sockets() == sockets, f"sub-communicators opened sockets: {sockets} -> {open_sockets()}"
    await comm.close()  # closes the groups still open
    assert group.closed and nested.closed
    print(f"OK rank {r}/{n} group {group.rank}/{group.size} ran {ran} cases", flush=True)


async def fault(comm: ahcomm.Comm, group: ahcomm.Comm) -> None:
    r, n = comm.rank, comm.size
    if r != n - 1:  # survive the launcher's SIGTERM long enough to report (it SIGKILLs after --grace)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    await group.barrier()
    if r == n - 1:
        await asyncio.sleep(0.3)
        os._exit(3)
    start = time.monotonic()
    try:
        if r % 2 == (n - 1) % 2:  # the dead rank's group waits on it
            await group.all_reduce(np.ones(10))
        else:
            await comm.all_reduce(np.ones(10))
    except ahcomm.PeerFailure as exc:
        print(f"RAISED rank {r} after {time.monotonic() - start:.2f} s: {exc}", flush=True)
        return
    raise AssertionError("no PeerFailure")


if __name__ == "__main__":
    run_rank(main)

"""A rank program for the multi-host tests (ranks in network namespaces): links to ranks on
this host must be sdma and to other hosts rdma; every op x algorithm against numpy; the
byte counters show where the traffic went. MH_LAYOUT gives ranks per host, e.g. "3,1"."""

from __future__ import annotations

import os

import numpy as np
from mp_catalogue import run_catalogue, run_rank

import ahcomm


async def main() -> None:
    layout = [int(c) for c in os.environ["MH_LAYOUT"].split(",")]
    host_of = [h for h, count in enumerate(layout) for _ in range(count)]
    comm = await ahcomm.init()
    r, n = comm.rank, comm.size
    links = comm.stats()["links"]
    for peer, link in links.items():
        want = "sdma" if host_of[peer] == host_of[r] else "rdma"
        assert link["kind"] == want, (r, peer, link["kind"], want)
    assert comm.topology.servers == len(layout), comm.topology
    cases = await run_catalogue(comm)
    await sub_communicators(comm, host_of)
    moved = {kind: sum(link["bytes_sent"] for link in comm.stats()["links"].values() if link["kind"] == kind)
             for kind in ("sdma", "rdma")}
    await comm.close()
    print(f"OK rank {r}/{n} host {host_of[r]} cases={cases} sdma_bytes={moved['sdma']} rdma_bytes={moved['rdma']}",
          flush=True)


async def sub_communicators(comm: ahcomm.Comm, host_of: list[int]) -> None:
    """One group per host (its links all sdma) and one per local rank (all rdma: one rank per
    host), made on the parent's connections; each all_reduce checked against numpy."""
    r = comm.rank
    local_rank = host_of[:r].count(host_of[r])
    on_host = await comm.split(host_of[r])
    across = await comm.split(local_rank)
    assert on_host is not None and across is not None
    for group, kind in ((on_host, "sdma"), (across, "rdma")):
        kinds = {link["kind"] for link in group.stats()["links"].values()}
        assert kinds <= {kind}, (r, group.world_ranks, kinds)
        x = np.arange(5000, dtype=np.float64) * (r + 1)
        got = await group.all_reduce(x)
        np.testing.assert_array_equal(got, np.arange(5000, dtype=np.float64) * sum(w + 1 for w in group.world_ranks))
    assert on_host.topology.servers == 1 and across.topology.servers == across.size
    await across.close()
    await on_host.close()


if __name__ == "__main__":
    run_rank(main)

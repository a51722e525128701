"""A rank program for the multi-host tests (ranks in network namespaces): links to ranks on
this host must be sdma and to other hosts rdma; every op x algorithm against numpy; the
byte counters show where the traffic went. MH_LAYOUT gives ranks per host, e.g. "3,1"."""

from __future__ import annotations

import os

import ahcomm
from mp_catalogue import run_catalogue, run_rank


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
    moved = {kind: sum(l["bytes_sent"] for l in comm.stats()["links"].values() if l["kind"] == kind)
             for kind in ("sdma", "rdma")}
    await comm.close()
    print(f"OK rank {r}/{n} host {host_of[r]} cases={cases} sdma_bytes={moved['sdma']} rdma_bytes={moved['rdma']}",
          flush=True)


if __name__ == "__main__":
    run_rank(main)

"""Joining a job by root info (HcclGetRootInfo / HcclCommInitRootInfo) and by an HCCL rank table."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import ahcomm

pytestmark = pytest.mark.multiprocess

PROGRAM = """
import asyncio, json, os, sys, numpy as np, ahcomm
async def main():
    kw = json.loads(sys.argv[1])
    comm = await ahcomm.init(**kw)
    got = await comm.all_reduce(np.full(4, comm.rank + 1.0))
    kinds = sorted({l["kind"] for l in comm.stats()["links"].values()})
    print(f"rank {comm.rank}/{comm.size} sum={got[0]:g} servers={comm.topology.servers} kinds={','.join(kinds)}",
          flush=True)
    await comm.close()
asyncio.run(main())
"""


def run_ranks(kwargs: list[dict[str, object]], env: dict[str, str]) -> list[str]:
    procs = [subprocess.Popen([sys.executable, "-c", PROGRAM, json.dumps(kw)], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for kw in kwargs]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(outs)
    return outs


def clean_env() -> dict[str, str]:
    drop = ("AHCOMM_RANK", "AHCOMM_WORLD_SIZE", "AHCOMM_MASTER_ADDR", "AHCOMM_MASTER_PORT", "AHCOMM_JOB_SECRET",
            "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    return {k: v for k, v in os.environ.items() if k not in drop}


def test_root_info_token_joins_ranks_without_a_launcher() -> None:
    token = ahcomm.get_root_info("127.0.0.1")
    assert token.startswith("ahcomm-root-1:") and len(token) < 200
    outs = run_ranks([{"root_info": token, "rank": r, "world_size": 3} for r in range(3)], clean_env())
    assert all("sum=6" in out for out in outs), outs


def test_damaged_root_info_is_a_clear_error() -> None:
    import asyncio

    with pytest.raises(ahcomm.ConfigError, match="not a token from ahcomm.get_root_info"):
        asyncio.run(ahcomm.init(root_info="hello", rank=0, world_size=2))
    with pytest.raises(ahcomm.ConfigError, match="damaged"):
        asyncio.run(ahcomm.init(root_info="ahcomm-root-1:!!!!", rank=0, world_size=2))


def test_hccl_rank_table(tmp_path: Path) -> None:
    """Two 'servers' (identities s0 and s1, both on this host's loopback): 2 + 1 ranks."""
    port = 29000 + os.getpid() % 2000
    table = {"version": "1.0", "server_count": "2", "status": "completed", "master_port": port,
             "server_list": [
                 {"server_id": "s0", "host_ip": "127.0.0.1",
                  "device": [{"device_id": "0", "device_ip": "192.168.1.8", "rank_id": "0"},
                             {"device_id": "1", "device_ip": "192.168.1.9", "rank_id": "1"}]},
                 {"server_id": "s1", "host_ip": "127.0.0.1",
                  "device": [{"device_id": "0", "device_ip": "192.168.2.8", "rank_id": "2"}]}]}
    path = tmp_path / "ranks.json"
    path.write_text(json.dumps(table))
    env = {**clean_env(), "AHCOMM_JOB_SECRET": "rank-table-test-secret-0123456789"}
    outs = run_ranks([{"rank_table": str(path), "rank": r} for r in range(3)], env)
    assert "rank 0/3 sum=6 servers=2 kinds=rdma,sdma" in outs[0], outs
    assert "rank 2/3 sum=6 servers=2 kinds=rdma" in outs[2], outs


def test_rank_table_errors_name_the_problem(tmp_path: Path) -> None:
    import asyncio

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"server_list": [{"server_id": "a", "device": [{"rank_id": "1"}]}]}))
    with pytest.raises(ahcomm.ConfigError, match=r"rank_ids must be 0..0 once each, got \[1\]"):
        asyncio.run(ahcomm.init(rank_table=str(bad), rank=0))
    with pytest.raises(ahcomm.ConfigError, match="needs rank="):
        asyncio.run(ahcomm.init(rank_table=str(bad)))


def test_socket_ifname_grammar_picks_the_interface() -> None:
    from ahcomm._rendezvous import match_interface

    have = [("lo", "127.0.0.1"), ("docker0", "172.17.0.1"), ("eth0", "10.1.0.5"), ("eth1", "10.2.0.5")]
    assert match_interface("eth", have) == "10.1.0.5"
    assert match_interface("=eth1", have) == "10.2.0.5"
    assert match_interface("^docker,lo", have) == "10.1.0.5"
    assert match_interface("=eth", have) is None
    assert match_interface("ib,eth1", have) == "10.2.0.5"


def test_socket_ifname_that_matches_nothing_names_what_there_is() -> None:
    import asyncio

    cfg = ahcomm.Config.from_env({"AHCOMM_SOCKET_IFNAME": "=nosuchif0", "AHCOMM_JOB_SECRET": "s" * 32})
    with pytest.raises(ahcomm.ConfigError, match=r"AHCOMM_SOCKET_IFNAME='=nosuchif0' matches no interface.*lo \(127"):
        asyncio.run(ahcomm.init(config=cfg, rank=0, world_size=2, master_port=1))

"""The rendezvous names the real cause of a failed start, on every rank that registered:
ranks that never came, a rank started twice, a rank with another secret."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ahcomm.run import free_port

from jobs import ROOT, job_env

pytestmark = pytest.mark.multiprocess

SECRET = "rendezvous-test-secret-0123456789"
PROGRAM = """
import asyncio, os, sys, ahcomm
async def main():
    try:
        comm = await ahcomm.init()
    except ahcomm.ConnectError as exc:
        print("ConnectError:", exc, flush=True)
        sys.exit(3)
    print("joined", comm.rank, flush=True)
    await comm.close()
asyncio.run(main())
"""


def start(ranks: list[int], size: int, *, timeout: float, secrets: dict[int, str] | None = None,
          wait: float = 60) -> list[str]:
    """Start ``ranks`` by hand, as ahcomm-run would; every one must fail; return their outputs."""
    port = free_port()
    procs = []
    for index, rank in enumerate(ranks):
        env = job_env({"AHCOMM_RANK": str(rank), "AHCOMM_WORLD_SIZE": str(size), "AHCOMM_MASTER_ADDR": "127.0.0.1",
                       "AHCOMM_MASTER_PORT": str(port), "AHCOMM_CONNECT_TIMEOUT": str(timeout),
                       "AHCOMM_JOB_SECRET": (secrets or {}).get(index, SECRET), "AHCOMM_BUFFSIZE": "0.0625"},
                      drop=["RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"])
        procs.append(subprocess.Popen([sys.executable, "-c", PROGRAM], env=env, cwd=ROOT, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    try:
        outs = [p.communicate(timeout=wait)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 3 for p in procs), outs
    return outs


def test_rank_0_alone_names_the_ranks_that_never_registered() -> None:
    [out] = start([0], 2, timeout=3)
    assert "ranks [1] never registered" in out, out
    assert "is rank 0 running" not in out, out


def test_a_rank_started_twice_fails_every_rank_at_once_naming_it() -> None:
    """World size 3, rank 1 twice, rank 2 never: nobody waits out the 60 s connect timeout."""
    outs = start([0, 1, 1], 3, timeout=60, wait=40)
    for out in outs:
        assert "rank 1 was started twice" in out, outs


def test_a_rank_with_another_secret_is_named_on_rank_0_and_the_others() -> None:
    outs = start([0, 1, 2], 3, timeout=4, secrets={2: "another-secret-0123456789abcdef"})
    assert "refused this rank" in outs[2] and "AHCOMM_JOB_SECRET" in outs[2], outs
    for out in outs[:2]:  # rank 1 hears rank 0's diagnosis, not 'is rank 0 running?'
        assert "ranks [2] never registered" in out and "refused 1 connection" in out, outs
        assert "another AHCOMM_JOB_SECRET" in out, outs


def test_a_rank_whose_rank_0_never_started_says_so() -> None:
    [out] = start([1], 2, timeout=2)
    assert "nothing accepted a connection there (is rank 0 running?" in out, out


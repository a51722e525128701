"""The torch.distributed backend (ahcomm.torch): real jobs under torchrun and ahcomm-run
(tests/torch_worker.py checks each dist.* call against numpy and gloo), DDP's weights against
one process on the whole batch, a dead peer, and the in-process pieces."""

from __future__ import annotations

import datetime
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

import ahcomm.torch as at  # noqa: E402
from ahcomm import CollectiveTimeout, PeerFailure  # noqa: E402
from ahcomm._torch_work import torch_error  # noqa: E402

from jobs import ROOT, job_env, run_job  # noqa: E402

WORKER = str(Path(__file__).parent / "torch_worker.py")
CHECKS = ["all_reduce", "async_op", "all_gather gather", "reduce_scatter scatter broadcast reduce", "all_to_all",
          "p2p barrier", "object collectives", "new_group", "errors", "destroy"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


def torchrun(*args: str, timeout: float = 240, nproc: int = 2) -> subprocess.CompletedProcess[str]:
    env = job_env({"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
                  drop=[k for k in os.environ if k.startswith("AHCOMM_")])  # no AHCOMM_* variable is needed
    return subprocess.run([*TORCHRUN[:-1], str(nproc), WORKER, *args], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def passed(out: str, check: str) -> int:
    """How many ranks printed ``OK check`` (the ranks share one stdout: lines may interleave)."""
    return out.count(f"OK {check}")


@pytest.mark.multiprocess
@pytest.mark.parametrize("nproc", [2, 3])
def test_every_op_under_torchrun(nproc: int) -> None:
    """3 ranks: uneven splits over more peers, and a new_group that leaves rank 1 out."""
    proc = torchrun("ops", nproc=nproc)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for check in CHECKS:
        assert passed(proc.stdout, check) == nproc, (check, proc.stdout[-2000:])


@pytest.mark.multiprocess
def test_every_op_under_ahcomm_run() -> None:
    proc = run_job(2, "python", WORKER, "ops", env={"PYTHONPATH": str(ROOT)}, timeout=240, drop=["RANK", "WORLD_SIZE",
                   "MASTER_ADDR", "MASTER_PORT"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for check in CHECKS:
        assert passed(proc.stdout, check) == 2, (check, proc.stdout[-2000:])


@pytest.mark.multiprocess
@pytest.mark.parametrize("wrap", ["ddp", "fsdp"])
def test_training_reaches_the_weights_of_one_process(wrap: str) -> None:
    """DDP (gradient all_reduce in buckets, through futures) and FSDP2 (all_gather_into_tensor,
    reduce_scatter_tensor) on 2 ranks, each with half the batch, match one process on all of it."""
    proc = torchrun(wrap)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = {line.split(" ", 1)[0]: np.array(line.split()[1:], float) for line in proc.stdout.splitlines()
             if line.startswith(("WEIGHTS", "REFERENCE"))}
    weights, reference = lines["WEIGHTS"], lines["REFERENCE"]
    assert weights.shape == reference.shape == (8 * 16 + 16 + 16 + 1,)
    np.testing.assert_allclose(weights, reference, rtol=1e-5, atol=1e-6)
    assert not np.allclose(weights, 0)


@pytest.mark.multiprocess
def test_dead_peer_raises_from_wait() -> None:
    proc = torchrun("dead", timeout=120)  # a hang fails here
    assert "RAISED DistBackendError (cause PeerFailure)" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "PeerFailure" in proc.stdout and "rank 1" in proc.stdout, proc.stdout


@pytest.mark.multiprocess
def test_group_timeout_raises_from_wait() -> None:
    """A rank that never joins: the other's wait() raises CollectiveTimeout (a TimeoutError) once
    the group's timeout (5 s) has passed - it was once taken for "not done yet" and waited on forever."""
    proc = torchrun("timeout", timeout=120)  # a hang fails here
    assert "RAISED CollectiveTimeout TimeoutError=True" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "rank 1 had not arrived" in proc.stdout, proc.stdout


def test_import_registers_the_backend() -> None:
    assert "ahcomm" in dist.Backend.backend_list
    assert dist.Backend("ahcomm") == "ahcomm"
    assert "cpu" in dist.Backend.backend_capability["ahcomm"]
    at.register()  # idempotent
    assert dist.Backend.backend_list.count("ahcomm") == 1


def test_ahcomm_run_environment_feeds_torch_env_rendezvous() -> None:
    env = {"AHCOMM_RANK": "1", "AHCOMM_WORLD_SIZE": "4", "AHCOMM_LOCAL_RANK": "1", "AHCOMM_LOCAL_WORLD_SIZE": "2",
           "AHCOMM_MASTER_ADDR": "10.0.0.1", "AHCOMM_MASTER_PORT": "29555"}
    at._torch_env_from_ahcomm_run(env)
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["MASTER_ADDR"], env["MASTER_PORT"]) == (
        "1", "4", "1", "10.0.0.1", "29555")
    torchrun_env = {"AHCOMM_RANK": "1", "RANK": "3", "MASTER_PORT": "1"}  # torch's own variables win
    at._torch_env_from_ahcomm_run(torchrun_env)
    assert torchrun_env == {"AHCOMM_RANK": "1", "RANK": "3", "MASTER_PORT": "1"}


def test_slurm_step_feeds_torch_env_rendezvous() -> None:
    from ahcomm._slurm import port_for

    env = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "SLURM_JOB_ID": "77", "SLURM_STEP_ID": "2",
           "SLURM_STEP_NODELIST": "localhost,node[2-3]", "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_NODEID": "1"}
    at._torch_env_from_ahcomm_run(env)
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"], env["MASTER_PORT"]) == (
        "3", "4", "1", "2", str(port_for(77, 2)))
    assert env["MASTER_ADDR"] == socket.gethostbyname("localhost")


def test_errors_map_to_torch() -> None:
    err = torch_error(PeerFailure("rank 1 was lost", 1))
    assert isinstance(err, dist.DistBackendError) and isinstance(err.__cause__, PeerFailure)
    assert "rank 1 was lost" in str(err)
    timeout = CollectiveTimeout("slow", op="all_reduce", seq=3)
    assert torch_error(timeout) is timeout and isinstance(timeout, TimeoutError)
    with pytest.raises(ValueError, match="not supported"):
        at._redop(dist.ReduceOp.PREMUL_SUM)


def test_single_rank_group_in_process() -> None:
    """World size 1 through a HashStore: the calls and Work behave, results are the inputs."""
    dist.init_process_group("ahcomm", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    try:
        t = torch.arange(5, dtype=torch.float32)
        work = dist.all_reduce(t, async_op=True)
        fut = work.get_future()
        assert work.wait() and fut.wait()[0] is t
        assert torch.equal(t, torch.arange(5, dtype=torch.float32))
        out = torch.zeros(5)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
        gather(out, t)
        assert torch.equal(out, t)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.multiprocess
def test_ddp_example_runs_under_torchrun() -> None:
    proc = subprocess.run([*TORCHRUN, str(ROOT / "examples" / "torch_ddp.py"), "--steps", "10"], cwd=ROOT,
                          env=job_env({"PYTHONPATH": str(ROOT)},
                                      drop=[k for k in os.environ if k.startswith("AHCOMM_")]),
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "rank 1/2: final loss" in proc.stdout and proc.stdout.rstrip().endswith("OK"), proc.stdout

"""Slurm: host list expansion and the step's rendezvous (ahcomm._slurm)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ahcomm import ConfigError
from ahcomm._slurm import PORT_BASE, PORT_SPAN, expand_hostlist, port_for, rendezvous


@pytest.mark.parametrize("spec, hosts", [
    ("node01", ["node01"]),
    ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
    ("node[8-11]", ["node8", "node9", "node10", "node11"]),
    ("gpu-a[1-2]-ib,login1", ["gpu-a1-ib", "gpu-a2-ib", "login1"]),
    ("rack[1-2]n[01-02]", ["rack1n01", "rack1n02", "rack2n01", "rack2n02"]),
    ("a[009-011],b", ["a009", "a010", "a011", "b"]),
])
def test_expand_hostlist(spec: str, hosts: list[str]) -> None:
    assert expand_hostlist(spec) == hosts


@pytest.mark.parametrize("spec", ["node[01-", "node]1[", "node[a-b]", "node[5-3]", ""])
def test_bad_hostlist_names_the_problem(spec: str) -> None:
    with pytest.raises(ConfigError, match="Slurm host list"):
        expand_hostlist(spec)


def test_port_depends_on_job_and_step() -> None:
    ports = {port_for(job, step) for job in range(1000, 1010) for step in range(3)}
    assert len(ports) == 30
    assert all(PORT_BASE <= p < PORT_BASE + PORT_SPAN for p in ports)


def test_rendezvous_of_a_step() -> None:
    env = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "1", "SLURM_STEP_NODELIST": "localhost,node[2-3]"}
    assert rendezvous(env) == (socket.gethostbyname("localhost"), port_for(4242, 1))
    assert rendezvous({"SLURM_PROCID": "0"}) is None  # not a step: no job id or node list


def test_unresolvable_first_node_says_so() -> None:
    env = {"SLURM_JOB_ID": "1", "SLURM_STEP_NODELIST": "no-such-host-ahcomm[1-2].invalid"}
    with pytest.raises(ConfigError, match="does not resolve"):
        rendezvous(env)


def test_config_takes_the_rendezvous_and_local_size_from_srun() -> None:
    """Plain init() under srun: Config.from_env fills what no variable names from the step."""
    from ahcomm._config import Config

    step = {"SLURM_JOB_ID": "4321", "SLURM_STEP_ID": "2", "SLURM_JOB_NODELIST": "localhost",
            "SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_TASKS_PER_NODE": "2", "SLURM_NODEID": "0"}
    cfg = Config.from_env(step)
    assert (cfg.master_addr, cfg.master_port) == rendezvous(step)
    assert (cfg.rank, cfg.world_size, cfg.local_world_size) == (1, 2, 2)
    given = Config.from_env({**step, "AHCOMM_MASTER_ADDR": "127.0.0.1", "AHCOMM_MASTER_PORT": "29500"})
    assert (given.master_addr, given.master_port) == ("127.0.0.1", 29500)  # the user's choice wins


def test_local_world_size_from_tasks_per_node() -> None:
    from ahcomm._slurm import expand_tasks_per_node, local_world_size

    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert local_world_size({"SLURM_STEP_TASKS_PER_NODE": "4(x2),3", "SLURM_NODEID": "2"}) == 3
    assert local_world_size({"SLURM_STEP_TASKS_PER_NODE": "4"}) is None
    with pytest.raises(ConfigError, match="tasks per node"):
        expand_tasks_per_node("4(y2)")


# -- a real single-node Slurm ---------------------------------------------------------------
HERE = Path(__file__).parent
ROOT = HERE.parent


def _why_no_slurm() -> str | None:
    if os.geteuid() != 0:
        return "starting slurmctld/slurmd/munged needs root"
    missing = [b for b in ("srun", "slurmctld", "slurmd", "munged") if shutil.which(b) is None]
    if missing:
        return f"Slurm is not installed ({', '.join(missing)} missing: apt-get install slurm-wlm munge)"
    return None


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    why = _why_no_slurm()
    if why:
        pytest.skip(why)
    conf_dir = tmp_path_factory.mktemp("slurm")
    subprocess.run(["bash", str(HERE / "slurm_start.sh"), str(conf_dir)], check=True, timeout=60,
                   capture_output=True)
    env = {**os.environ, "SLURM_CONF": str(conf_dir / "slurm.conf"), "PYTHONPATH": str(ROOT)}
    try:
        deadline = time.monotonic() + 30
        while "idle" not in subprocess.run(["sinfo", "-h", "-o", "%t"], env=env, capture_output=True,
                                           text=True, timeout=20).stdout:
            if time.monotonic() > deadline:
                log = (conf_dir / "slurmctld.log").read_text()[-2000:]
                pytest.fail("the test's Slurm node did not become idle: " + log)
            time.sleep(0.5)
        yield env
    finally:
        subprocess.run(["bash", str(HERE / "slurm_stop.sh"), str(conf_dir)], timeout=30)


@pytest.mark.multiprocess
def test_srun_with_only_the_job_secret(slurm: dict[str, str]) -> None:
    """srun -n 2 on a real Slurm: the rendezvous comes from the step's node list, job and step ids."""
    env = {k: v for k, v in slurm.items() if not k.startswith(("AHCOMM_", "MASTER_", "RANK", "WORLD_SIZE"))}
    env["AHCOMM_JOB_SECRET"] = "s" * 32
    proc = subprocess.run(["srun", "-n", "2", sys.executable, str(HERE / "slurm_prog.py")], env=env,
                          capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = sorted(line for line in proc.stdout.splitlines() if line.startswith("rank "))
    assert len(lines) == 2, proc.stdout
    assert lines[0].startswith("rank 0/2 local_size=2") and lines[1].startswith("rank 1/2 local_size=2")
    assert all(line.endswith("sum=[3.0, 3.0, 3.0, 3.0]") for line in lines), lines


@pytest.mark.multiprocess
def test_torch_backend_under_srun_needs_nothing_exported(slurm: dict[str, str]) -> None:
    """srun -n 2 python train.py with dist.init_process_group("ahcomm"): torch's env:// gets the
    step's layout from ahcomm.torch, the job secret is made by rank 0 and shared via torch's store."""
    pytest.importorskip("torch")
    env = {k: v for k, v in slurm.items() if not k.startswith(("AHCOMM_", "MASTER_", "RANK", "WORLD_SIZE",
                                                                 "LOCAL_RANK"))}
    proc = subprocess.run(["srun", "-n", "2", sys.executable, str(HERE / "torch_worker.py"), "ops"], env=env,
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("OK destroy") == 2 and proc.stdout.count("OK all_to_all") == 2, proc.stdout

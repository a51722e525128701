"""Elastic communicators on real processes (sdma and rdma): the survivors of a SIGKILLed rank
shrink and go on; shrink(exclude=) without a failure; survivors that saw different failures
converge; a rank that dies during the shrink is left out; groups shrink alike and groups
without the dead rank are unaffected. The ranks run tests/mp_elastic.py."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import ahcomm

from jobs import ROOT, job_env

pytestmark = pytest.mark.multiprocess
WORKER = str(Path(__file__).parent / "mp_elastic.py")
TRANSPORTS = ["sdma", "rdma"]


def run(case: str, n: int, transport: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "ahcomm.run", "-n", str(n), "--on-failure", "continue", "--tag-output", WORKER]
    env = job_env({"CASE": case, "AHCOMM_TRANSPORT": transport, "AHCOMM_EXEC_TIMEOUT": "20"})
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)


def survivors(res: subprocess.CompletedProcess[str]) -> dict[int, dict[str, str]]:
    """old rank -> the fields of its OK line."""
    out = {}
    for line in res.stdout.splitlines():
        if " OK " in line:
            fields = dict(re.findall(r"(\w+)=(\S+)", line))
            out[int(fields["old"])] = fields
    return out


def kill_to_first_collective(res: subprocess.CompletedProcess[str]) -> float:
    killed = float(re.search(r"KILL (\S+)", res.stdout).group(1))  # type: ignore[union-attr]
    return max(float(f["first"]) for f in survivors(res).values()) - killed


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_survivors_of_a_sigkill_shrink_and_all_reduce(transport: str) -> None:
    res = run("kill", 4, transport)
    assert res.returncode == 137, res.stdout + res.stderr  # rank 2's death is the job's status
    ok = survivors(res)
    assert sorted(ok) == [0, 1, 3], res.stdout + res.stderr
    assert {old: (f["new"], f["members"]) for old, f in ok.items()} == {
        0: ("0", "0,1,3"), 1: ("1", "0,1,3"), 3: ("2", "0,1,3")}
    print(f"{transport}: SIGKILL -> first all_reduce on the shrunk communicator: "
          f"{kill_to_first_collective(res):.3f} s")


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_shrink_with_exclude_and_no_failure(transport: str) -> None:
    res = run("exclude", 4, transport)
    assert res.returncode == 0, res.stdout + res.stderr
    assert sorted(survivors(res)) == [0, 2, 3], res.stdout + res.stderr


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_rank_that_begins_its_shrink_late_is_waited_for(transport: str) -> None:
    res = run("stagger", 4, transport)
    assert res.returncode == 0, res.stdout + res.stderr
    assert sorted(survivors(res)) == [0, 1, 2, 3], res.stdout + res.stderr


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_shrunk_communicator_shrinks_again(transport: str) -> None:
    res = run("twice", 5, transport)
    assert res.returncode == 137, res.stdout + res.stderr
    ok = survivors(res)
    assert sorted(ok) == [0, 1, 3] and {f["members"] for f in ok.values()} == {"0,1,3"}, res.stdout + res.stderr


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_survivors_that_saw_different_failures_converge(transport: str) -> None:
    res = run("converge", 5, transport)
    assert res.returncode == 0, res.stdout + res.stderr
    ok = survivors(res)
    assert sorted(ok) == [0, 1, 2] and {f["members"] for f in ok.values()} == {"0,1,2"}, res.stdout + res.stderr


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_rank_that_dies_during_the_shrink_is_left_out(transport: str) -> None:
    res = run("late", 4, transport)
    assert res.returncode == 137, res.stdout + res.stderr
    assert sorted(survivors(res)) == [0, 1, 3], res.stdout + res.stderr


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_group_with_the_dead_rank_shrinks_and_others_are_unaffected(transport: str) -> None:
    res = run("group", 4, transport)
    assert res.returncode == 137, res.stdout + res.stderr
    assert "[1] A shrunk on 1: [1, 3]" in res.stdout and "[3] A shrunk on 3: [1, 3]" in res.stdout
    assert "[0] B fine on 0" in res.stdout and "[1] B fine on 1" in res.stdout
    assert sorted(survivors(res)) == [0, 1, 3], res.stdout + res.stderr


async def test_shrink_arguments_are_checked() -> None:
    comm = await ahcomm.init(rank=0, world_size=1)
    try:
        with pytest.raises(ahcomm.InvalidArgument, match="exclude names rank 5"):
            await comm.shrink(exclude=[5])
        with pytest.raises(ahcomm.InvalidArgument, match="exclude must be a sequence"):
            await comm.shrink(exclude=3)  # type: ignore[arg-type]
        assert await comm.shrink(exclude=[0]) is None
        alone = await comm.shrink()
        assert alone is not None and alone.size == 1
        got = await alone.all_reduce(__import__("numpy").ones(3))
        assert got.tolist() == [1.0, 1.0, 1.0]
        await alone.close()
    finally:
        await comm.close()


@pytest.mark.parametrize("victim", [2, 0])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_restarted_rank_rejoins_through_grow(transport: str, victim: int) -> None:
    """ahcomm-run --on-failure restart starts the dead rank again; its init() joins the survivors'
    grow() (world rank 0 serves the grow rendezvous: a survivor, or with victim 0 the replacement)."""
    argv = [sys.executable, "-m", "ahcomm.run", "-n", "4", "--on-failure", "restart", "--max-restarts", "1",
            "--tag-output", WORKER]
    env = job_env({"CASE": "grow", "VICTIM": str(victim), "AHCOMM_TRANSPORT": transport, "AHCOMM_EXEC_TIMEOUT": "20",
                   "AHCOMM_CONNECT_TIMEOUT": "20"}, drop=["AHCOMM_RESTART_COUNT"])
    res = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 137, res.stdout + res.stderr
    grown = sorted(line for line in res.stdout.splitlines() if "GROWN" in line)
    assert len(grown) == 4, res.stdout + res.stderr
    assert any(line.startswith(f"[{victim}] GROWN rank={victim} size=4 restarts=1 state=") for line in grown), grown
    # the replacement got the survivors' state (95, or 91 where the victim's last call failed on them)
    assert len({tuple(re.findall(r"state=(\d+)", line)) for line in grown}) == 1, grown
    # one host over sdma: the grown communicator has mailboxes of its own (fresh FIFOs and boxes)
    assert all(line.endswith("small=oneshot") == (transport == "sdma") for line in grown), grown


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_the_elastic_service_example_survives_a_crash_and_takes_the_replica_back(transport: str) -> None:
    """examples/elastic_service.py under --on-failure restart: replica 2 is killed at tick 15 of
    60, the others go on with 3 for 10 ticks, grow back to 4, and every replica ends with the
    total the cluster really served: 4*15 + 3*10 + 4*35 = 230."""
    argv = [sys.executable, "-m", "ahcomm.run", "-n", "4", "--on-failure", "restart", "--max-restarts", "1",
            "--tag-output", str(ROOT / "examples" / "elastic_service.py"), "--ticks", "60", "--crash", "2@15"]
    env = job_env({"AHCOMM_TRANSPORT": transport, "AHCOMM_EXEC_TIMEOUT": "20", "AHCOMM_CONNECT_TIMEOUT": "20"},
                  drop=["AHCOMM_RESTART_COUNT"])
    res = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 137, res.stdout + res.stderr  # the crash still shows in the status
    assert "[2] replica 2: restarted, joined the job; catching up" in res.stdout, res.stdout + res.stderr
    ends = sorted(line for line in res.stdout.splitlines() if "tick 60 total" in line)
    assert ends == [f"[{r}] replica {r}: tick 60 total 230" for r in range(4)], res.stdout + res.stderr

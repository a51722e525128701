"""ahcomm-run --on-failure stop|continue|restart and --max-restarts: what a rank's death does to the job."""

from __future__ import annotations

import subprocess
import sys

import pytest

from jobs import ROOT, job_env

pytestmark = pytest.mark.multiprocess

# Rank 1 fails (exit 3) while its restart count is below FAIL_UNTIL; the others finish after a while.
PROGRAM = """
import os, sys, time
rank = int(os.environ["AHCOMM_RANK"])
count = int(os.environ.get("AHCOMM_RESTART_COUNT", "0"))
if rank == 1:
    print(f"rank 1 start {count} world {os.environ['AHCOMM_WORLD_SIZE']}", flush=True)
    if count < int(sys.argv[1]):
        sys.exit(3)
    print("rank 1 done", flush=True)
    sys.exit(0)
time.sleep(1.5)
print(f"rank {rank} done", flush=True)
"""


def run(*options: str, fail_until: int = 99) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "ahcomm.run", "-n", "3", "--tag-output", *options,
            sys.executable, "-c", PROGRAM, str(fail_until)]
    return subprocess.run(argv, env=job_env(drop=["AHCOMM_RESTART_COUNT"]), capture_output=True, text=True,
                          timeout=60, cwd=ROOT)


def test_stop_is_the_default_and_stops_the_others() -> None:
    res = run()
    assert res.returncode == 3, res.stderr
    assert "rank 1 exited with code 3; stopping the other ranks" in res.stderr
    assert "done" not in res.stdout


def test_continue_keeps_the_others_running_and_reports_the_death() -> None:
    res = run("--on-failure", "continue")
    assert res.returncode == 3, res.stderr  # something died: the exit status says so
    assert "rank 1 exited with code 3; the other ranks go on" in res.stderr
    assert "[0] rank 0 done" in res.stdout and "[2] rank 2 done" in res.stdout
    assert res.stdout.count("rank 1 start") == 1


def test_restart_starts_the_rank_again_with_its_rank_and_a_restart_count() -> None:
    res = run("--on-failure", "restart", "--max-restarts", "3", fail_until=2)
    assert res.returncode == 3, res.stderr
    starts = [line for line in res.stdout.splitlines() if "rank 1 start" in line]
    assert starts == ["[1] rank 1 start 0 world 3", "[1] rank 1 start 1 world 3", "[1] rank 1 start 2 world 3"]
    assert "[1] rank 1 done" in res.stdout and "[0] rank 0 done" in res.stdout and "[2] rank 2 done" in res.stdout
    assert "rank 1 exited with code 3; restarting it (AHCOMM_RESTART_COUNT=1, 2 restarts left)" in res.stderr


def test_restart_gives_up_after_max_restarts_and_the_others_go_on() -> None:
    res = run("--on-failure", "restart", "--max-restarts", "1")
    assert res.returncode == 3, res.stderr
    assert res.stdout.count("rank 1 start") == 2
    assert "rank 1 exited with code 3 after 1 restarts; the other ranks go on" in res.stderr
    assert "[0] rank 0 done" in res.stdout


def test_max_restarts_without_restart_is_a_command_line_mistake() -> None:
    res = run("--max-restarts", "2")
    assert res.returncode == 2 and "--max-restarts needs --on-failure restart" in res.stderr

"""ahcomm-run binds each rank to a core (mpirun's --bind-to core, round robin where ranks
outnumber cores) and tells it how many cores the host's ranks share (AHCOMM_CORES), so that the
spin, copy-engine and cost-model rules still see the host's cores, not the rank's one."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ahcomm._binding import bind_mode, plan
from ahcomm._config import usable_cores
from ahcomm._errors import ConfigError

from jobs import ROOT, job_env

SHOW = ("import os; print(os.environ['AHCOMM_LOCAL_RANK'], sorted(os.sched_getaffinity(0)), "
        "os.environ.get('AHCOMM_CORES'), sep='|', flush=True)")
CORES = sorted(os.sched_getaffinity(0))


def test_plan_is_round_robin_over_the_allowed_cores() -> None:
    assert plan(5, "core", [2, 3]) == [{2}, {3}, {2}, {3}, {2}]
    assert plan(2, "auto", [0, 1, 2, 3]) == [{0, 1}, {2, 3}]  # a rank's copy threads keep a spare core
    assert plan(3, "core", [0, 1, 2, 3, 4]) == [{0}, {1, 2}, {3, 4}]
    assert plan(2, "core", [0, 1]) == [{0}, {1}]
    assert plan(4, "none", [0, 1]) is None
    assert plan(1, "core", [0, 1]) is None  # one rank keeps the launcher's cores
    assert plan(4, "core", [7]) is None  # one core: nothing to choose


def test_bind_mode_names_a_bad_value(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AHCOMM_BIND", "socket")
    with pytest.raises(ConfigError, match="AHCOMM_BIND.*'socket'"):
        bind_mode()
    assert bind_mode("none") == "none"
    monkeypatch.delenv("AHCOMM_BIND")
    assert bind_mode() == "auto"


def test_usable_cores_is_what_the_launcher_says(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AHCOMM_CORES", "6")
    assert usable_cores() == 6
    monkeypatch.setenv("AHCOMM_CORES", "zero")
    with pytest.raises(ConfigError, match="AHCOMM_CORES.*'zero'"):
        usable_cores()
    monkeypatch.delenv("AHCOMM_CORES")
    assert usable_cores() == len(CORES)


def launch(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ahcomm.run", *args], env=job_env(env, drop=("AHCOMM_CORES",)),
                          cwd=ROOT, capture_output=True, text=True, timeout=60)


def ranks_seen(proc: subprocess.CompletedProcess[str]) -> dict[int, tuple[str, str]]:
    assert proc.returncode == 0, proc.stderr
    seen = {}
    for line in proc.stdout.splitlines():  # "[rank] local|cores|AHCOMM_CORES"
        local, cores, told = line.split("] ", 1)[1].split("|")
        seen[int(local)] = (cores, told)
    return seen


@pytest.mark.multiprocess
@pytest.mark.skipif(len(CORES) < 2, reason="binding needs 2 or more cores to choose from")
def test_launcher_binds_rank_i_to_core_i_mod_n() -> None:
    n = len(CORES) + 1  # one rank more than cores: the round robin wraps
    seen = ranks_seen(launch("-n", str(n), "python", "-c", SHOW, env={"AHCOMM_BIND": ""}))
    assert seen == {i: (str([CORES[i % len(CORES)]]), str(len(CORES))) for i in range(n)}


@pytest.mark.multiprocess
@pytest.mark.skipif(len(CORES) < 2, reason="binding needs 2 or more cores to choose from")
def test_bind_to_none_leaves_ranks_free() -> None:
    seen = ranks_seen(launch("-n", "2", "--bind-to", "none", "python", "-c", SHOW))
    assert seen == {0: (str(CORES), "None"), 1: (str(CORES), "None")}
    seen = ranks_seen(launch("-n", "2", "python", "-c", SHOW, env={"AHCOMM_BIND": "none"}))
    assert seen == {0: (str(CORES), "None"), 1: (str(CORES), "None")}


@pytest.mark.multiprocess
def test_a_bad_binding_is_one_line() -> None:
    bad = launch("-n", "2", "python", "-c", "pass", env={"AHCOMM_BIND": "numa"})
    assert bad.returncode == 2 and "AHCOMM_BIND / --bind-to must be one of auto, core, none, got 'numa'" in bad.stderr
    assert "Traceback" not in bad.stderr, bad.stderr

"""ahcomm-run binds each rank to cores of its own (mpirun's --bind-to core; one core each, round
robin, where ranks outnumber cores) and tells it how many cores the host's ranks share (AHCOMM_CORES), so that the
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
    assert plan(2, "core", [0, 1, 2, 3]) == [{0, 1}, {2, 3}]  # a rank's copy threads keep a spare core
    assert plan(2, "auto", [0, 1, 2, 3]) is None  # auto: only where ranks outnumber cores
    assert plan(3, "auto", [0, 1]) == [{0}, {1}, {0}]
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
@pytest.mark.skipif(len(CORES) < 2, reason="binding needs 2 or more cores to choose from")
def test_auto_binds_only_where_ranks_outnumber_cores() -> None:
    n = len(CORES)
    seen = ranks_seen(launch("-n", str(n), "python", "-c", SHOW, env={"AHCOMM_BIND": "auto"}))
    assert seen == {i: (str(CORES), "None") for i in range(n)}
    seen = ranks_seen(launch("-n", str(n), "--bind-to", "core", "python", "-c", SHOW))
    assert seen == {i: (str(sorted(c)), str(n)) for i, c in enumerate(plan(n, "core", CORES) or [])}


@pytest.mark.multiprocess
def test_a_bad_binding_is_one_line() -> None:
    bad = launch("-n", "2", "python", "-c", "pass", env={"AHCOMM_BIND": "numa"})
    assert bad.returncode == 2 and "AHCOMM_BIND / --bind-to must be one of auto, core, none, got 'numa'" in bad.stderr
    assert "Traceback" not in bad.stderr, bad.stderr


@pytest.mark.multiprocess
def test_launcher_checks_ahcomm_cores_in_one_line() -> None:
    bad = launch("-n", "2", "python", "-c", "pass", env={"AHCOMM_CORES": "abc"})
    assert bad.returncode == 2 and "AHCOMM_CORES must be a whole number of cores" in bad.stderr, bad.stderr
    assert "Traceback" not in bad.stderr, bad.stderr
    bench = subprocess.run([sys.executable, "-m", "ahcomm.bench", "all_reduce", "-e", "8"], cwd=ROOT,
                           env=job_env({"AHCOMM_BIND": "numa"}), capture_output=True, text=True, timeout=60)
    assert bench.returncode == 1 and "Traceback" not in bench.stderr, bench.stderr
    assert "AHCOMM_BIND / --bind-to must be one of" in bench.stderr, bench.stderr


@pytest.mark.multiprocess
@pytest.mark.skipif(len(CORES) < 2, reason="binding needs 2 or more cores to choose from")
def test_free_ranks_drop_an_inherited_core_count() -> None:
    """A launcher started by a bound rank (one core, so it binds nothing) must not pass the outer
    job's AHCOMM_CORES on: its ranks share one core, not the outer host's count."""
    seen = ranks_seen(launch("--bind-to", "none", "-n", "2", "python", "-c", SHOW, env={"AHCOMM_CORES": "64"}))
    assert seen == {0: (str(CORES), "None"), 1: (str(CORES), "None")}
    seen = ranks_seen(launch("-n", "2", "--bind-to", "core", "python", "-c", SHOW, env={"AHCOMM_CORES": "64"}))
    assert {told for _, told in seen.values()} == {str(len(CORES))}  # a binding launcher says its own


def test_a_core_the_launcher_cannot_use_leaves_the_rank_free() -> None:
    """A plan naming a core outside the launcher's cpuset (changed since) starts the rank unbound
    instead of failing the launch in preexec_fn."""
    from ahcomm._runproc import child_setup

    proc = subprocess.run([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
                          preexec_fn=child_setup({4095}), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == str(CORES), proc


def test_a_rank_bound_to_one_core_runs_its_copies_inline(monkeypatch: pytest.MonkeyPatch) -> None:
    """Engines copy on spare cores: a rank bound to one core of its own has none, whatever the
    host's count (3 ranks on 4 cores get {0}, {1}, {2, 3})."""
    import ahcomm._stream as stream

    monkeypatch.delenv("AHCOMM_COPY_ENGINE", raising=False)
    monkeypatch.setattr(stream, "usable_cores", lambda: 4)
    monkeypatch.setattr(stream, "own_cores", lambda: 1)
    assert stream.engine_bytes_for(3) == stream.NO_ENGINE
    monkeypatch.setattr(stream, "own_cores", lambda: 2)
    assert stream.engine_bytes_for(3) == stream.ENGINE_THRESHOLD

"""Real processes through ahcomm-run: sdma (ipc + shared memory) and rdma (tcp) links."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from jobs import run_job

HERE = Path(__file__).parent
ROOT = HERE.parent
pytestmark = pytest.mark.multiprocess


def launch(n: int, *program: str, env: dict[str, str] | None = None, timeout: float = 180,
           tag: bool = True) -> subprocess.CompletedProcess[str]:
    """``program`` on ``n`` ranks with small CCL buffers and generous timeouts."""
    return run_job(n, *program, env={"AHCOMM_BUFFSIZE": "0.0625", "AHCOMM_EXEC_TIMEOUT": "60",
                                     "AHCOMM_CONNECT_TIMEOUT": "60", **(env or {})}, timeout=timeout, tag=tag)


def shm_names() -> set[str]:
    """ahcomm's names in /dev/shm now (``ahcomm-<creator pid>-...``)."""
    return {p.name for p in Path("/dev/shm").glob("ahcomm-*")}


def left_behind(before: set[str]) -> set[str]:
    """Names that were not there ``before`` and whose creator is gone: what a finished job left.
    Names of processes still running (another job on a shared machine) are not counted."""
    left = set()
    for name in shm_names() - before:
        pid = name.split("-")[1]
        if not (pid.isdigit() and Path(f"/proc/{pid}").exists()):
            left.add(name)
    return left


def cma_works() -> bool:
    """Whether this machine lets one process read another's memory (process_vm_readv)."""
    from ahcomm.transports import _cma

    child = subprocess.Popen([sys.executable, "-c", "import numpy as np, sys; a = np.ones(64, np.uint8); "
                              "print(a.ctypes.data, flush=True); sys.stdin.read()"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        return _cma.probe(child.pid, int(child.stdout.readline()))
    finally:
        child.kill()
        child.wait()


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("transport", ["sdma", "rdma"])
def test_collectives_on_real_transports(n: int, transport: str) -> None:
    single = transport == "sdma" and cma_works()
    env = {"AHCOMM_TRANSPORT": transport, "EXPECT_LINK": transport, "EXPECT_SINGLE_COPY": "1" if single else "0"}
    before = shm_names()
    proc = launch(n, str(HERE / "mp_worker.py"), env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not left_behind(before), "shared-memory names were left behind"
    for rank in range(n):
        assert f"[{rank}] OK rank {rank}/{n} {transport} single_copy={single}" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("transport", ["sdma", "rdma"])
def test_catalogue_on_real_transports(n: int, transport: str) -> None:
    """Every op x every algorithm that can run it on these links, p2p and object collectives."""
    env = {"AHCOMM_TRANSPORT": transport, "EXPECT_LINK": transport}
    before = shm_names()
    proc = launch(n, str(HERE / "mp_catalogue.py"), env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not left_behind(before), "shared-memory names were left behind"
    assert proc.stdout.count("op x algorithm cases") == n, proc.stdout + proc.stderr


def test_sdma_without_single_copy() -> None:
    env = {"AHCOMM_TRANSPORT": "sdma", "EXPECT_LINK": "sdma", "AHCOMM_SINGLE_COPY": "0", "EXPECT_SINGLE_COPY": "0"}
    proc = launch(3, str(HERE / "mp_worker.py"), env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("single_copy=False") == 3


def test_launcher_stops_the_job_when_a_rank_fails(tmp_path: Path) -> None:
    script = tmp_path / "fail.py"
    script.write_text(
        "import os, sys, time\n"
        "rank = int(os.environ['AHCOMM_RANK'])\n"
        "print('started', rank, flush=True)\n"
        "if rank == 1:\n"
        "    time.sleep(0.5); sys.exit(3)\n"
        "time.sleep(120)\n"
    )
    proc = launch(4, str(script), timeout=60)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "ahcomm-run: rank 1 exited with code 3; stopping the other ranks" in proc.stderr
    for rank in range(4):
        assert f"[{rank}] started {rank}" in proc.stdout


def test_launcher_env_and_untagged_output(tmp_path: Path) -> None:
    script = tmp_path / "env.py"
    script.write_text(
        "import os\n"
        "keys = ['AHCOMM_RANK', 'AHCOMM_WORLD_SIZE', 'AHCOMM_LOCAL_RANK', 'AHCOMM_LOCAL_WORLD_SIZE',"
        " 'AHCOMM_MASTER_ADDR']\n"
        "os.write(1, (' '.join(os.environ[k] for k in keys) + '\\n').encode())  # one write: lines stay whole\n"
    )
    proc = launch(3, "python", str(script), tag=False)
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.split("\n")[:3]) == [f"{r} 3 {r} 3 127.0.0.1" for r in range(3)]


def test_example_runs() -> None:
    proc = launch(4, "python", str(ROOT / "examples" / "01_allreduce.py"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("all_reduce sum=10 (expected 10)") == 4


def test_bench_cli_names_an_op_the_algorithm_does_not_run() -> None:
    """A forced algorithm that cannot run the op at all says so, not "cannot run this size"
    (twoshot runs all_reduce only); one that cannot run a size says the size."""
    argv = [sys.executable, "-m", "ahcomm.bench", "-n", "2", "all_gather", "-b", "1K", "-e", "1K",
            "-w", "1", "-i", "1", "--algorithm", "twoshot"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "twoshot cannot run this all_gather" in proc.stdout, proc.stdout
    typo = subprocess.run([*argv[:-1], "ringg"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert typo.returncode == 2 and "--algorithm 'ringg' is not an algorithm; one of: all," in typo.stderr, typo
    assert "Traceback" not in typo.stderr and "ring" in typo.stderr


def test_bench_cli_small_sweep(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    argv = [sys.executable, "-m", "ahcomm.bench", "-n", "2", "all_reduce", "-b", "8", "-e", "256K", "-f", "64",
            "-w", "1", "-i", "3", "--json", str(out)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Avg bus bandwidth" in proc.stdout and "#wrong" in proc.stdout
    import json

    doc = json.loads(out.read_text())
    assert doc["tool"] == "ahcomm" and [row["size"] for row in doc["rows"]] == [8, 512, 32768, 262144]
    assert all(row["wrong"] == 0 and row["busbw"] > 0 for row in doc["rows"])


def test_bench_cli_algorithm_all_skips_sizes_an_algorithm_cannot_run(tmp_path: Path) -> None:
    """``--algorithm all`` forced eager (messages of at most 64 KiB) on a 256 KiB call and the
    bench died (InvalidArgument): each algorithm runs the sizes it can, the selector every size."""
    out = tmp_path / "bench.json"
    argv = [sys.executable, "-m", "ahcomm.bench", "-n", "2", "all_reduce", "-b", "8", "-e", "256K", "-f", "32768",
            "-w", "1", "-i", "3", "--algorithm", "all", "--json", str(out)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    import json

    rows = json.loads(out.read_text())["rows"]
    eager = [row["size"] for row in rows if row["forced"] and row["algorithm"] == "eager"]
    assert eager == [8], rows  # 256 KiB is over an eager message
    assert [row["size"] for row in rows if not row["forced"]] == [8, 262144]
    assert "selector vs measured" in proc.stdout


def test_launcher_stops_the_job_when_a_rank_is_killed_mid_collective(tmp_path: Path) -> None:
    script = tmp_path / "killed.py"
    script.write_text(
        "import asyncio, os, signal, numpy as np, ahcomm\n"
        "async def main():\n"
        "    comm = await ahcomm.init()\n"
        "    for i in range(1000):\n"
        "        if comm.rank == 1 and i == 20:\n"
        "            os.kill(os.getpid(), signal.SIGKILL)\n"
        "        await comm.all_reduce(np.ones(1000))\n"
        "asyncio.run(main())\n"
    )
    proc = launch(3, str(script), timeout=60)
    assert proc.returncode == 128 + 9, proc.stdout + proc.stderr
    assert "ahcomm-run: rank 1 was killed by signal 9; stopping the other ranks" in proc.stderr


def test_launcher_multi_host_arguments_are_checked(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "AHCOMM_JOB_SECRET"}
    base = [sys.executable, "-m", "ahcomm.run"]
    no_secret = subprocess.run([*base, "--nnodes", "2", "--nproc-per-node", "1", "--master-addr", "10.0.0.1",
                                "--master-port", "29500", "python", "-c", "pass"],
                               env=env, capture_output=True, text=True)
    assert no_secret.returncode != 0 and "AHCOMM_JOB_SECRET exported on every host" in no_secret.stderr
    no_master = subprocess.run([*base, "--nnodes", "2", "--nproc-per-node", "1", "python", "-c", "pass"],
                               env={**env, "AHCOMM_JOB_SECRET": "x" * 32}, capture_output=True, text=True)
    assert no_master.returncode != 0 and "--master-addr and --master-port" in no_master.stderr
    bad_hosts = subprocess.run([*base, "-H", "a:0", "python", "-c", "pass"], capture_output=True, text=True)
    assert bad_hosts.returncode != 0 and "bad host entry 'a:0'" in bad_hosts.stderr
    from ahcomm.run import parse_hosts, read_hostfile

    hostfile = tmp_path / "hosts"
    hostfile.write_text("# comment\nnode1 slots=4\nnode2:2\nnode3\n")
    assert read_hostfile(str(hostfile)) == [("node1", 4), ("node2", 2), ("node3", 1)]
    assert parse_hosts("a:2, b") == [("a", 2), ("b", 1)]


class _FakeLibc:
    def __init__(self, result: int) -> None:
        self.calls: list[tuple[int, ...]] = []
        self.result = result

    def prctl(self, *args: Any) -> int:
        self.calls.append(tuple(a.value for a in args))
        return self.result


@pytest.mark.parametrize("scope,result,expect", [
    (None, 0, "open"), ("0", 0, "open"), ("1", 0, "allowed"), ("1", -1, "refused: prctl"),
    ("2", 0, "refused: Yama ptrace_scope is 2"), ("3", 0, "refused: Yama ptrace_scope is 3")])
def test_peers_may_read_us_under_yamas_relational_scope(scope: str | None, result: int, expect: str,
                                                       tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ubuntu's ptrace_scope 1 lets a process read only its descendants, so sibling ranks could not
    read each other; a rank lifts it for itself (as OpenMPI and MPICH do), and only there."""
    from ahcomm.transports import _cma

    path = tmp_path / "ptrace_scope"
    if scope is not None:
        path.write_text(scope + "\n")
    libc = _FakeLibc(result)
    monkeypatch.setattr(_cma, "_libc", libc)
    monkeypatch.setattr(_cma, "_allowed", 0)
    assert _cma.allow_peers(str(path)).said.startswith(expect)
    assert libc.calls == ([(_cma.PR_SET_PTRACER, _cma.PR_SET_PTRACER_ANY, 0, 0, 0)] if scope == "1" else [])


def test_the_last_communicator_to_close_puts_yamas_scope_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two communicators lifted the scope: the first to close leaves it lifted for the other (even
    released twice), the second restores the default (PR_SET_PTRACER 0: only descendants may read
    us); releasing a grant that lifted nothing does nothing."""
    from ahcomm.transports import _cma

    path = tmp_path / "ptrace_scope"
    path.write_text("1\n")
    libc = _FakeLibc(0)
    monkeypatch.setattr(_cma, "_libc", libc)
    monkeypatch.setattr(_cma, "_allowed", 0)
    _cma.Grant("open").release()
    assert libc.calls == []
    first, second = _cma.allow_peers(str(path)), _cma.allow_peers(str(path))
    assert first.said == second.said == "allowed"
    first.release()
    first.release()  # once only: the other communicator's grant still holds
    assert libc.calls[-1][1] == _cma.PR_SET_PTRACER_ANY
    second.release()
    assert libc.calls[-1] == (_cma.PR_SET_PTRACER, 0, 0, 0, 0)


@pytest.mark.parametrize("single", ["1", "0"])
def test_init_opens_the_rank_to_its_peers_reads_unless_single_copy_is_off(single: str) -> None:
    program = ("import asyncio, logging, ahcomm\n"
               "logging.basicConfig(level=logging.DEBUG, format='%(name)s %(message)s')\n"
               "async def main():\n"
               "    comm = await ahcomm.init()\n"
               "    await comm.close()\n"
               "asyncio.run(main())\n")
    proc = launch(2, sys.executable, "-c", program, env={"AHCOMM_TRANSPORT": "sdma", "AHCOMM_SINGLE_COPY": single})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    said = re.findall(r"ahcomm.security rank (\d): single-copy reads by peers: (open|allowed|refused.*)", out)
    assert sorted(int(r) for r, _ in said) == ([0, 1] if single == "1" else []), out

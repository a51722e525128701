"""ahcomm-run as a process supervisor: its ranks die with it, signals reach them, output is tagged,
mistakes on its command line are one line, and torch.distributed scripts run under it unchanged."""

from __future__ import annotations

import io
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ahcomm._runproc import Tagger

from jobs import ROOT, job_env

pytestmark = pytest.mark.multiprocess

SLEEPER = """
import asyncio, os
async def main():
    print("pid", os.getpid(), flush=True)
    await asyncio.sleep(120)
asyncio.run(main())
"""


def launcher(*args: str, ignore_sigint: bool = False) -> "subprocess.Popen[str]":
    """``python -m ahcomm.run ARGS`` in the background; ``ignore_sigint`` as a shell's background job starts it."""
    def setup() -> None:
        if ignore_sigint:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
    return subprocess.Popen([sys.executable, "-m", "ahcomm.run", *args], env=job_env(), cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=setup)


def rank_pids(proc: "subprocess.Popen[str]", n: int) -> list[int]:
    assert proc.stdout is not None
    pids = []
    while len(pids) < n:
        line = proc.stdout.readline()
        assert line, f"the launcher ended early: {proc.stderr.read() if proc.stderr else ''}"
        match = re.search(r"pid (\d+)", line)
        if match:
            pids.append(int(match.group(1)))
    return pids


def alive(pid: int) -> bool:
    """Running (a zombie waiting for a reaper counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_gone(pids: list[int], seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


def kill_all(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_killing_the_launcher_ends_its_ranks() -> None:
    proc = launcher("-n", "2", "python", "-c", SLEEPER)
    pids = rank_pids(proc, 2)
    try:
        proc.kill()  # SIGKILL: the launcher cannot pass anything on
        proc.wait(timeout=10)
        assert wait_gone(pids, 5.0) == [], "ranks outlived their launcher"
    finally:
        kill_all(pids)


def test_killing_the_launcher_ends_ranks_started_through_a_wrapper() -> None:
    """``sh -c 'python ...; true'`` forks python: the parent-death signal reaches sh alone, the
    launcher's watchdog stops the whole process group."""
    proc = launcher("-n", "2", "sh", "-c", f"{sys.executable} -c '{SLEEPER.strip()}'; true")
    pids = rank_pids(proc, 2)
    try:
        proc.kill()
        proc.wait(timeout=10)
        assert wait_gone(pids, 5.0) == [], "ranks outlived their launcher"
    finally:
        kill_all(pids)


FORKING_RSH = """
import subprocess, sys
sys.exit(subprocess.call(["sh", "-c", sys.argv[2]]))  # like ssh: the remote command is not our child's exec
"""


def test_killing_the_launcher_ends_the_ranks_it_started_over_rsh(tmp_path: Path) -> None:
    """``-H``: the remote launcher watches its standard input (the ssh connection); when the
    local launcher dies, that input ends and the remote ranks are stopped."""
    rsh = tmp_path / "rsh.py"
    rsh.write_text(FORKING_RSH)
    env = job_env({"AHCOMM_RSH": f"{sys.executable} {rsh}", "PYTHONPATH": str(ROOT)})
    proc = subprocess.Popen([sys.executable, "-m", "ahcomm.run", "-H", "localhost:2", "python", "-c", SLEEPER],
                            env=env, cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    pids = rank_pids(proc, 2)
    try:
        proc.kill()
        proc.wait(timeout=10)
        assert wait_gone(pids, 5.0) == [], "remote ranks outlived the launcher that started them"
    finally:
        kill_all(pids)


def test_sigint_reaches_ranks_started_from_a_background_job() -> None:
    """SIGINT inherited as ignored (``prog &`` in a script): ``kill -INT`` on the launcher still
    stops every rank, and each says KeyboardInterrupt in one line, not a traceback."""
    proc = launcher("-n", "2", "python", "-c", SLEEPER, ignore_sigint=True)
    pids = rank_pids(proc, 2)
    try:
        proc.send_signal(signal.SIGINT)
        _out, err = proc.communicate(timeout=20)
        assert wait_gone(pids, 5.0) == []
    finally:
        kill_all(pids)
        proc.kill()
    assert sorted(re.findall(r"^\[(\d)\] KeyboardInterrupt$", err, re.M)) == ["0", "1"], err
    assert "Traceback" not in err, err


def test_output_is_tagged_when_ranks_share_it() -> None:
    program = ["python", "-c", "import os; print('hi from', os.environ['AHCOMM_RANK'])"]
    tagged = subprocess.run([sys.executable, "-m", "ahcomm.run", "-n", "2", *program], env=job_env(), cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert sorted(tagged.stdout.splitlines()) == ["[0] hi from 0", "[1] hi from 1"], tagged
    plain = subprocess.run([sys.executable, "-m", "ahcomm.run", "-n", "2", "--no-tag-output", *program],
                           env=job_env(), cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert plain.stdout.count("hi from") == 2 and "[" not in plain.stdout, plain  # lines may interleave
    alone = subprocess.run([sys.executable, "-m", "ahcomm.run", "-n", "1", *program], env=job_env(), cwd=ROOT,
                           capture_output=True, text=True, timeout=60)
    assert alone.stdout == "hi from 0\n", alone


def test_tagging_passes_a_line_longer_than_the_reader_limit_whole() -> None:
    program = ["python", "-c", "import sys; sys.stdout.write('x' * 200000 + '\\n'); print('end')"]
    proc = subprocess.run([sys.executable, "-m", "ahcomm.run", "-n", "2", *program], env=job_env(), cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    for rank in (0, 1):
        mine = [line[4:] for line in proc.stdout.splitlines() if line.startswith(f"[{rank}] ")]
        assert "".join(mine) == "x" * 200000 + "end", (rank, [len(m) for m in mine])


def test_command_line_mistakes_are_one_line() -> None:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "ahcomm.run", *args], env=job_env(), cwd=ROOT,
                              capture_output=True, text=True, timeout=60)

    no_n = run("python", "-c", "pass")
    assert no_n.returncode == 2 and "-n is required" in no_n.stderr, no_n
    missing = run("-n", "2", "nosuchcmd-ahcomm")
    assert missing.returncode == 127, missing
    assert missing.stderr.strip() == "ahcomm-run: cannot start 'nosuchcmd-ahcomm': No such file or directory"


def test_tagger_keeps_other_tracebacks_whole() -> None:
    out = io.BytesIO()
    tagger = Tagger(b"[3] ", out)
    lines = [b"Traceback (most recent call last):\n", b'  File "x.py", line 1, in <module>\n', b"ValueError: bad\n",
             b"after\n", b"Traceback (most recent call last):\n", b"  File \"y\"\n", b"CancelledError\n", b"\n",
             b"During handling of the above exception, another exception occurred:\n", b"\n",
             b"Traceback (most recent call last):\n", b"  File \"z\"\n", b"KeyboardInterrupt\n"]
    for line in lines:
        tagger.line(line)
    tagger.flush()
    assert out.getvalue().decode().splitlines() == [
        "[3] Traceback (most recent call last):", '[3]   File "x.py", line 1, in <module>', "[3] ValueError: bad",
        "[3] after", "[3] KeyboardInterrupt"]


GLOO = """
import datetime, os, torch, torch.distributed as dist
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
t = torch.tensor([dist.get_rank() + 1.0])
dist.all_reduce(t)
print("torch", dist.get_rank(), dist.get_world_size(), os.environ["LOCAL_RANK"], int(t.item()), flush=True)
dist.destroy_process_group()
"""


def test_a_torch_distributed_script_runs_unchanged_under_ahcomm_run() -> None:
    pytest.importorskip("torch.distributed")
    proc = subprocess.run([sys.executable, "-m", "ahcomm.run", "-n", "2", "python", "-c", GLOO],
                          env=job_env(drop=["RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"]), cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(proc.stdout.splitlines()) == ["[0] torch 0 2 0 3", "[1] torch 1 2 1 3"], proc.stdout



TORCHRUN_PROGRAM = """
import asyncio, os, numpy as np, ahcomm
async def main():
    for _ in range(2):  # each init() meets on a port of its own
        async with await ahcomm.init() as comm:
            got = await comm.all_reduce(np.full(4, comm.rank + 1.0))
            # one write per line: torchrun's ranks share the pipe (print's line and newline may split)
            os.write(1, f"under torchrun {comm.rank} {comm.size} {int(got[0])}\\n".encode())
asyncio.run(main())
"""


def test_plain_init_under_torchrun_needs_only_the_secret(tmp_path: Path) -> None:
    """torchrun's agent holds MASTER_PORT with its store: ahcomm meets through that store instead."""
    pytest.importorskip("torch.distributed")
    script = tmp_path / "prog.py"
    script.write_text(TORCHRUN_PROGRAM)
    env = job_env({"AHCOMM_JOB_SECRET": "torchrun-test-secret-0123456789", "AHCOMM_BUFFSIZE": "0.0625",
                   "AHCOMM_CONNECT_TIMEOUT": "30", "PYTHONPATH": str(ROOT)},
                  drop=[k for k in os.environ if k.startswith("AHCOMM_") or k in ("RANK", "WORLD_SIZE", "MASTER_PORT")])
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(script)],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = re.findall(r"under torchrun (\d) (\d) (\d+)", proc.stdout)
    assert sorted(lines) == [("0", "2", "3")] * 2 + [("1", "2", "3")] * 2, proc.stdout + proc.stderr


def test_free_port_is_below_the_ephemeral_range(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The rendezvous port comes from below the kernel's range for outgoing connections (a port
    in it can be taken as a connection's source port before rank 0 binds it), is bindable, and
    falls back to the kernel's pick where the range leaves no room."""
    import socket

    from ahcomm import _rootinfo as run  # ahcomm.run.free_port is this one

    low = run._ephemeral_low()
    for _ in range(20):
        port = run.free_port()
        assert max(1024, low - 8192) <= port < low
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", port))
    fake = tmp_path / "range"
    fake.write_text("1025\t60999\n")
    assert run._ephemeral_low(str(fake)) == 1025
    assert run._ephemeral_low(str(tmp_path / "missing")) == 32768
    monkeypatch.setattr(run, "_ephemeral_low", lambda: 1025)  # no room below: the kernel's pick
    assert run.free_port() >= 1025

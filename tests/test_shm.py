"""Shared memory: a small /dev/shm (Docker's 64 MiB), a full one, SIGTERM during init, a segment
that vanishes, and flight records on a full disk. Real ranks run in a private mount namespace
whose /dev/shm is a small tmpfs (needs root or user namespaces: skipped where not permitted)."""

from __future__ import annotations

import errno
import os
import shlex
import signal
import subprocess
import sys
import textwrap
import time
from functools import cache
from pathlib import Path
from typing import Any

import pytest

import ahcomm
from ahcomm import _buffers, _flight
from ahcomm._buffers import SharedRegion
from ahcomm.run import free_port

from jobs import ROOT, job_argv, job_env

MiB = 1 << 20

# Every rank reports what init raised (as one line) instead of dying: shows it reached every rank.
PROGRAM = textwrap.dedent("""
    import asyncio, os, numpy as np, ahcomm

    async def main():
        rank = os.environ["AHCOMM_RANK"]
        try:
            comm = await ahcomm.init()
        except ahcomm.AhcommError as exc:
            print(f"rank {rank} raised {type(exc).__name__}: {exc}", flush=True)
            return
        async with comm:
            y = await comm.all_reduce(np.ones(3 << 20, np.float32))  # 12 MiB: more than a shrunk buffer
            print(f"rank {rank} sum={y[0]:.0f}", flush=True)

    asyncio.run(main())
""")


@cache
def _namespaces() -> str:
    """'' if a private mount namespace with its own /dev/shm can be made here, else why not."""
    try:
        done = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /dev/shm"],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unshare: {exc}"
    return "" if done.returncode == 0 else f"cannot mount a private /dev/shm: {done.stderr.strip()[:200]}"


def small_shm_job(tmp_path: Path, n: int, env: dict[str, str], *, size: str = "64m", prefill_mib: int = 0,
                  program: str = PROGRAM) -> subprocess.CompletedProcess[str]:
    """``ahcomm-run -n n`` of ``program`` where /dev/shm is a ``size`` tmpfs (``prefill_mib`` used)."""
    why = _namespaces()
    if why:
        pytest.skip(why)
    script = tmp_path / "prog.py"
    script.write_text(program)
    fill = f" && head -c {prefill_mib << 20} /dev/zero > /dev/shm/other-data" if prefill_mib else ""
    shell = f"mount -t tmpfs -o size={size} tmpfs /dev/shm{fill} && exec \"$@\""
    argv = ["unshare", "-m", "sh", "-c", shell, "sh", *job_argv(n, sys.executable, str(script), grace=2)]
    return subprocess.run(argv, env=job_env(env), capture_output=True, text=True, timeout=120, cwd=ROOT)


def _lines(out: str, n: int, word: str) -> list[str]:
    return sorted(line.split("] ", 1)[-1] for line in out.splitlines() if f" {word}" in line)[:n]


def test_default_buffers_shrink_to_fit_a_64mib_dev_shm(tmp_path: Path) -> None:
    """The default 64 MiB buffers (256 MiB for two ranks) died of SIGBUS; now they shrink, with a warning."""
    done = small_shm_job(tmp_path, 2, {}, program=PROGRAM)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "signal 7" not in done.stderr
    assert _lines(done.stdout, 2, "sum=") == ["rank 0 sum=2", "rank 1 sum=2"], done.stdout + done.stderr
    assert "using 8 MiB buffers" in done.stderr
    assert "/dev/shm is 64 MiB, too small for 2 rank(s)" in done.stderr and "--shm-size" in done.stderr


def test_a_chosen_buffsize_that_does_not_fit_is_a_config_error_on_every_rank(tmp_path: Path) -> None:
    done = small_shm_job(tmp_path, 2, {"AHCOMM_BUFFSIZE": "64"})
    assert "signal 7" not in done.stderr, done.stderr
    raised = _lines(done.stdout, 2, "raised")
    assert [line[:26] for line in raised] == ["rank 0 raised ConfigError:", "rank 1 raised ConfigError:"], \
        done.stdout + done.stderr
    for line in raised:
        assert "/dev/shm is 64 MiB" in line and "2 rank(s) on this host x 2 buffers x 64 MiB = 256 MiB" in line
        assert "--shm-size" in line and "AHCOMM_BUFFSIZE=8" in line, line


def test_a_dev_shm_already_full_is_an_error_not_sigbus(tmp_path: Path) -> None:
    """The buffers would fit an empty /dev/shm, but 60 of its 64 MiB are taken: posix_fallocate says
    ENOSPC before anything is mapped (before: SIGBUS at the first touch of a page)."""
    done = small_shm_job(tmp_path, 2, {"AHCOMM_BUFFSIZE": "4"}, prefill_mib=60)
    assert "signal 7" not in done.stderr, done.stderr
    raised = _lines(done.stdout, 2, "raised")  # 4 MiB free, and each rank needs 8: both fail
    assert [line[:6] for line in raised] == ["rank 0", "rank 1"], done.stdout + done.stderr
    for line in raised:
        assert "ConfigError: not enough shared memory for the CCL buffers: /dev/shm is 64 MiB" in line, line
        assert "this rank could not reserve its part of 2 rank(s) on this host x 2 buffers x 4 MiB" in line, line


def by_hand_job(tmp_path: Path, size: int, first: list[int], last: list[int]) -> list[str]:
    """Ranks started by hand (as torchrun or a script would, no ahcomm-run to stop the others) in
    a private 64 MiB /dev/shm: ``first`` make their buffers and wait in the rendezvous, then the
    rest of /dev/shm is filled (another job, say), then ``last`` start and cannot make theirs.
    Returns the lines the ranks printed, in rank order; every rank must have ended within 40 s
    (the connect timeout is 60 s: a rank that waited it out fails the test)."""
    why = _namespaces()
    if why:
        pytest.skip(why)
    script = tmp_path / "prog.py"
    script.write_text(PROGRAM)
    port = free_port()

    def rank(r: int) -> str:
        out = shlex.quote(str(tmp_path / f"rank{r}.out"))
        return f"AHCOMM_RANK={r} {shlex.quote(sys.executable)} {shlex.quote(str(script))} > {out} 2>&1 &"

    shell = "\n".join([
        "mount -t tmpfs -o size=64m tmpfs /dev/shm || exit 9",
        *(rank(r) for r in first),
        f"until [ $(ls /dev/shm | grep -c -e '-in-' -e '-out-') -ge {2 * len(first)} ]; do sleep 0.05; done",
        "sleep 0.5; head -c 64m /dev/zero > /dev/shm/other-data 2>/dev/null",  # full: no room for the last
        *(rank(r) for r in last),
        "wait",
    ])
    env = job_env({"AHCOMM_WORLD_SIZE": str(size), "AHCOMM_MASTER_ADDR": "127.0.0.1", "AHCOMM_MASTER_PORT": str(port),
                   "AHCOMM_CONNECT_TIMEOUT": "60", "AHCOMM_JOB_SECRET": "shm-test-secret-0123456789abcdef",
                   "AHCOMM_BUFFSIZE": "4", "AHCOMM_MAILBOX_BYTES": "0"},
                  drop=["RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "AHCOMM_TRANSPORT",
                        "LOCAL_WORLD_SIZE", "AHCOMM_LOCAL_WORLD_SIZE"])
    proc = subprocess.Popen(["unshare", "-m", "sh", "-c", shell], env=env, cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out = proc.communicate(timeout=40)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out = proc.communicate()[0]
    outs = [(tmp_path / f"rank{r}.out").read_text() for r in range(size)]
    if proc.returncode != 0:
        pytest.fail(f"the ranks still waited after 40 s (or the shell failed):\n{out}{''.join(outs)}")
    return [line for text in outs for line in text.splitlines() if line.startswith("rank ") and " raised " in line]


@pytest.mark.parametrize("short", [2, 0])
def test_a_rank_that_finds_dev_shm_full_fails_every_rank_started_by_hand(tmp_path: Path, short: int) -> None:
    """Only rank ``short`` finds no room; the others already wait in the rendezvous. Before, that
    rank raised and the others waited out AHCOMM_CONNECT_TIMEOUT (no ahcomm-run to stop them);
    now its error reaches them through rank 0's rendezvous (rank 0 serves it when rank 0 failed)."""
    others = [r for r in range(3) if r != short]
    lines = by_hand_job(tmp_path, 3, others, [short])
    assert [line[:7] for line in lines] == ["rank 0 ", "rank 1 ", "rank 2 "], lines
    for line in lines:
        if line.startswith(f"rank {short} "):
            assert "raised ConfigError: not enough shared memory for the CCL buffers: /dev/shm is 64 MiB" in line, line
            assert "this rank could not reserve" in line, line
        else:
            assert "raised ConnectError: " in line, line
            assert (f"rank {short} failed during init: ConfigError: not enough shared memory for the CCL buffers: "
                    "/dev/shm is 64 MiB" in line and "--shm-size" in line), line


def test_reserving_a_segment_that_does_not_fit_unlinks_it(monkeypatch: pytest.MonkeyPatch) -> None:
    def enospc(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", enospc)
    before = set(os.listdir(_buffers.SHM_DIR))
    with pytest.raises(ahcomm.ConfigError, match=r"not enough shared memory for the CCL buffers: /dev/shm"):
        SharedRegion.create(MiB, "test")
    assert set(os.listdir(_buffers.SHM_DIR)) <= before


@pytest.mark.parametrize(("size_mib", "ranks", "shrink", "expect"), [
    (64, 2, True, 8 * MiB),  # Docker's default: 2 ranks x 2 x 8 MiB = half of it
    (64, 4, True, 4 * MiB),
    (1024, 4, True, 64 * MiB),  # fits as asked
    (512, 4, True, 32 * MiB),  # the bytes alone would just fit, but each CCL_Out's words take a page more
    (512, 4, False, None),
    (64, 2, False, None),  # a chosen size is never shrunk
    (2, 2, True, None),  # not even 1 MiB buffers fit
])
def test_fit_decides_from_the_size_of_dev_shm(monkeypatch: pytest.MonkeyPatch, size_mib: int, ranks: int,
                                              shrink: bool, expect: int | None) -> None:
    monkeypatch.setattr(_buffers, "room", lambda directory=_buffers.SHM_DIR: (size_mib * MiB, size_mib * MiB))
    if expect is None:
        with pytest.raises(ahcomm.ConfigError, match="AHCOMM_BUFFSIZE=.*AHCOMM_TRANSPORT=rdma"):
            _buffers.fit(64 * MiB, ranks, shrink=shrink)
    else:
        assert _buffers.fit(64 * MiB, ranks, shrink=shrink) == expect


def test_a_segment_removed_during_init_is_an_ahcomm_error_naming_it() -> None:
    region = SharedRegion.create(4096, "gone")
    region.unlink()
    region.close()
    with pytest.raises(ahcomm.ConnectError, match=rf"CCL buffer /dev/shm/{region.name} \(created by pid "
                                                  rf"{os.getpid()}\) is gone"):
        SharedRegion.attach(region.name, 4096)


def test_sigterm_during_init_leaves_no_segments() -> None:
    """Rank 0 of two, alone: it has created its buffers and waits in the rendezvous when SIGTERM
    comes. It still dies of SIGTERM, but its /dev/shm names go first (before: left for a later job)."""
    code = f"import asyncio, ahcomm; asyncio.run(ahcomm.init(rank=0, world_size=2, master_port={free_port()}))"
    env = job_env({"AHCOMM_JOB_SECRET": "x" * 32, "AHCOMM_CONNECT_TIMEOUT": "60"},
                  drop=("AHCOMM_BUFFSIZE", "AHCOMM_TRANSPORT"))
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    mine = f"ahcomm-{proc.pid}-"
    try:
        deadline = time.monotonic() + 60
        while len([n for n in os.listdir(_buffers.SHM_DIR) if n.startswith(mine)]) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.stderr else ""
            time.sleep(0.05)
        time.sleep(0.3)  # into the rendezvous
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == -signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert [n for n in os.listdir(_buffers.SHM_DIR) if n.startswith(mine)] == []


def test_a_full_disk_leaves_no_partial_flight_record(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    real = os.fdopen

    class Full:
        def __init__(self, fh: Any) -> None:
            self.fh = fh

        def __enter__(self) -> "Full":
            return self

        def __exit__(self, *exc: object) -> None:
            self.fh.close()

        def write(self, data: Any) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fdopen", lambda fd, *a, **k: Full(real(fd, *a, **k)))
    monkeypatch.setenv("AHCOMM_FLIGHT_DIR", str(tmp_path))
    assert _flight.FlightRecorder(0, 1).dump("disk full", {}) is None
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setattr(os, "fdopen", real)
    path = _flight.FlightRecorder(0, 1).dump("room again", {})
    assert path is not None and [p.name for p in tmp_path.iterdir()] == [Path(path).name]
    assert (os.stat(path).st_mode & 0o777) == 0o600


def test_a_flight_record_on_a_full_tmpfs_is_whole_or_absent(tmp_path: Path) -> None:
    why = _namespaces()
    if why:
        pytest.skip(why)
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    code = textwrap.dedent(f"""
        import os, numpy as np
        from ahcomm import _flight
        from ahcomm.algorithms.base import Call
        os.environ["AHCOMM_FLIGHT_DIR"] = {str(mnt)!r}
        rec = _flight.FlightRecorder(0, 2)
        print(rec.dump("full", {{"pad": "x" * 20000}}), sorted(os.listdir({str(mnt)!r})))
    """)
    shell = f"mount -t tmpfs -o size=8k tmpfs {mnt} && exec \"$@\""
    done = subprocess.run(["unshare", "-m", "sh", "-c", shell, "sh", sys.executable, "-c", code],
                          capture_output=True, text=True, timeout=60, cwd=ROOT, env=job_env())
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["None", "[]"], done.stdout


@pytest.mark.parametrize("nbytes", [4096, 4093, 1])
def test_ccl_out_words_follow_the_bytes_and_a_peer_maps_them(nbytes: int) -> None:
    """``SharedRegion(words=True)``: 8 int64s after the bytes (8-aligned), word 0 their own address
    in the owner's process; a peer's attach maps the same words; an owner that made none leaves
    the attacher none, its bytes intact."""
    owner = SharedRegion.create(nbytes, "words-test", words=True)
    plain = SharedRegion.create(nbytes, "words-none")
    try:
        assert owner.nbytes == nbytes and owner.words.size == _buffers.WORDS
        assert int(owner.words[0]) == owner.words.ctypes.data and owner.words.ctypes.data % 8 == 0
        assert owner.words.ctypes.data >= owner.array.ctypes.data + nbytes  # after the bytes, not in them
        peer = SharedRegion.attach(owner.name, nbytes, words=True)
        owner.words[3] = 77
        assert int(peer.words[3]) == 77 and int(peer.words[0]) == int(owner.words[0])
        other = SharedRegion.attach(plain.name, nbytes, words=True)
        assert other.words.size == 0 and other.nbytes == nbytes
        for region in (peer, other):
            region.close()
    finally:
        for region in (owner, plain):
            region.unlink()
            region.close()

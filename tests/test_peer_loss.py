"""Peer loss at the transport: a dead or silent peer fails its links within ~2 s, a clean close
does not count as a loss.

The in-process tests drive two channels directly (a goodbye, a goodbye that races the
disconnection, an abrupt disconnection). The multi-process tests start real ranks through
``python -m ahcomm.run``: one rank SIGKILLs itself mid-collective, between collectives and
during a big transfer, or stops (SIGSTOP: only heartbeats can tell), and the survivors'
pending or next collective must fail with a PeerFailure naming it within 5 s.
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import time
from pathlib import Path

import pytest

from ahcomm import PeerFailure
from ahcomm._buffers import CclBuffers
from ahcomm.transports import _zmq
from ahcomm.transports._auth import Credentials
from ahcomm.transports._zmq import Channel
from ahcomm.transports.base import Signal
from ahcomm.transports.rdma import RdmaLink

from jobs import run_job
from support.events import Events

SECRET = "peer-loss-test-secret-0123456789"
DETECT_LIMIT = 5.0  # seconds from a peer's death to the survivors' PeerFailure


# -- in process: two channels joined by rdma links ---------------------------------------------


async def _pair(heartbeat: float = 0.0) -> tuple[list[Channel], list[RdmaLink]]:
    creds = Credentials.derive(SECRET)
    chans = [Channel(r, CclBuffers.local(1 << 16), ipc=True, tcp_host="127.0.0.1", creds=creds,
                     heartbeat=heartbeat) for r in range(2)]
    links = [RdmaLink(0, 1, chans[0], chans[1].endpoints["tcp"], None),
             RdmaLink(1, 0, chans[1], chans[0].endpoints["ipc"], None)]
    for ch in chans:
        ch.start()
    for link in links:  # a hello each way: both directions are up
        link.post(Signal.ACK, 0, 0)
    await asyncio.wait_for(asyncio.gather(*(link.wait(Signal.ACK, 0, 0) for link in links)), 10)
    deadline = time.monotonic() + 10
    while not all(link.up for link in links):
        assert time.monotonic() < deadline, "the handshake events never came"
        await asyncio.sleep(0.01)
    return chans, links


def _die(ch: Channel) -> None:
    """What a SIGKILL does to a rank's sockets: they close, without a goodbye."""
    ch.closing = True
    for link in ch.links.values():
        if link._monitor is not None:
            link._monitor.stop()
        link.sock.close(0)
    ch._monitor.stop()
    ch.router.close(0)


def _record(link: RdmaLink) -> list[tuple[int, str, float]]:
    seen: list[tuple[int, str, float]] = []
    link.attach(Events(link.events, on_lost=lambda peer, reason: seen.append((peer, reason, time.monotonic()))))
    return seen


async def test_a_clean_close_is_not_a_loss() -> None:
    chans, links = await _pair()
    seen = _record(links[0])
    waiter = asyncio.ensure_future(links[0].wait(Signal.DATA, 3, 0))
    chans[1].close()  # says goodbye on every link, then closes its sockets
    with pytest.raises(PeerFailure, match="rank 1 closed its communicator") as info:
        await asyncio.wait_for(waiter, 5)
    assert info.value.rank == 1
    await asyncio.sleep(_zmq.LOSS_GRACE + 0.5)  # long past the moment a loss would be judged
    assert seen == [] and links[0].lost_reason is None and links[0].peer_closed
    assert links[0].stats()["state"] == "closed by peer"
    chans[0].close()


async def test_a_goodbye_that_races_the_disconnection_is_still_clean() -> None:
    chans, links = await _pair()
    seen = _record(links[0])
    chans[1].router.close(0)  # rank 0 sees the disconnection first ...
    await asyncio.sleep(0.1)
    chans[1].close()  # ... and the goodbye a little later, within LOSS_GRACE
    await asyncio.sleep(_zmq.LOSS_GRACE + 0.5)
    assert seen == [] and links[0].peer_closed and links[0].lost_reason is None
    chans[0].close()


async def test_an_abrupt_disconnection_is_a_loss_within_two_seconds() -> None:
    chans, links = await _pair()
    seen = _record(links[0])
    waiter = asyncio.ensure_future(links[0].wait(Signal.DATA, 3, 0))
    flush_waiter = asyncio.ensure_future(links[0].message((5, 0)))  # a receive waiting too
    start = time.monotonic()
    _die(chans[1])
    with pytest.raises(PeerFailure, match="rank 1 is lost") as info:
        await asyncio.wait_for(waiter, 5)
    took = time.monotonic() - start
    assert info.value.rank == 1
    with pytest.raises(PeerFailure):
        await flush_waiter
    assert [(peer, "connection closed" in reason) for peer, reason, _ in seen] == [(1, True)]
    assert took < 2.0, f"the loss took {took:.2f} s to notice"
    assert links[0].stats()["state"] == "lost" and links[0].lost_at is not None
    with pytest.raises(PeerFailure):  # later use fails at once too
        links[0].post(Signal.ACK, 0, 1)
    print(f"in-process loss noticed after {took * 1000:.0f} ms")
    chans[0].close()


# -- real processes -----------------------------------------------------------------------------

WORKER = r'''
import asyncio, os, signal, sys, threading, time
import numpy as np
import ahcomm

VICTIM = 1
SCENARIO = os.environ["SCENARIO"]
KILL_FILE = os.environ["KILL_FILE"]


def die(how=signal.SIGKILL):
    with open(KILL_FILE, "w") as f:
        f.write(repr(time.time()))
    os.kill(os.getpid(), how)


async def main():
    comm = await ahcomm.init()
    r = comm.rank
    if r != VICTIM:  # survive the launcher's SIGTERM long enough to report (it SIGKILLs after --grace)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    pids = await comm.all_gather_object(os.getpid())
    x = np.ones(1000)
    await comm.all_reduce(x)
    try:
        if SCENARIO == "mid":
            if r == VICTIM:
                asyncio.get_running_loop().call_later(0.3, die)
            for _ in range(1_000_000):
                await comm.all_reduce(x)
        elif SCENARIO == "between":
            await comm.barrier()
            if r == VICTIM:
                die()
            link = comm._executor.links[VICTIM]
            deadline = time.time() + 10
            while link.lost_at is None and time.time() < deadline:  # idle: only the transport can notice
                await asyncio.sleep(0.02)
            await comm.all_reduce(x)
        elif SCENARIO == "big":
            big = np.ones(8 << 20)  # 64 MiB: killed while the bytes move
            if r == VICTIM:
                threading.Timer(0.4, die).start()
            for _ in range(1000):
                await comm.all_reduce(big)
        elif SCENARIO == "silent":
            await comm.barrier()
            if r == VICTIM:
                die(signal.SIGSTOP)  # alive, sockets open, silent: only heartbeats tell
            for _ in range(1_000_000):
                await comm.all_reduce(x)
                await asyncio.sleep(0.01)
        print(f"NO FAILURE rank {r}", flush=True)
    except ahcomm.AhcommError as exc:
        now = time.time()
        killed = float(open(KILL_FILE).read())
        link = comm._executor.links.get(VICTIM)
        lost = None if link is None or getattr(link, "lost_at", None) is None else link.lost_at - killed
        cause = exc if isinstance(exc, ahcomm.PeerFailure) else exc.__cause__
        print(f"DETECTED rank {r} type={type(exc).__name__} cause={type(cause).__name__} "
              f"names={getattr(cause, 'rank', None)} fail_after={now - killed:.3f} "
              f"lost_after={'-' if lost is None else f'{lost:.3f}'} msg={exc}", flush=True)
        if SCENARIO == "silent" and r == 0:
            os.kill(pids[VICTIM], signal.SIGKILL)
    await comm.close()


asyncio.run(main())
'''


def _launch(tmp_path: Path, n: int, scenario: str, transport: str, **env: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "loss_worker.py"
    script.write_text(WORKER)
    return run_job(n, str(script), grace=20, env={
        "AHCOMM_BUFFSIZE": "1", "AHCOMM_EXEC_TIMEOUT": "60", "AHCOMM_CONNECT_TIMEOUT": "60",
        "AHCOMM_TRANSPORT": transport, "SCENARIO": scenario, "KILL_FILE": str(tmp_path / "killed"), **env})


def _check(proc: subprocess.CompletedProcess[str], n: int, scenario: str, transport: str) -> list[float]:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 128 + 9, out  # the victim's SIGKILL is the job's status
    lines = re.findall(r"\[(\d+)\] DETECTED rank \d+ type=(\w+) cause=(\w+) names=(\S+) fail_after=([\d.]+) "
                       r"lost_after=(\S+) msg=(.*)", proc.stdout)
    assert sorted(int(rank) for rank, *_ in lines) == [r for r in range(n) if r != 1], out
    times = []
    for rank, kind, cause, names, fail_after, lost_after, msg in lines:
        assert "PeerFailure" in (kind, cause), out
        assert names == "1" or "rank 1" in msg, out  # the dead rank is named
        assert float(fail_after) < DETECT_LIMIT, out
        times.append(float(fail_after))
        print(f"{transport:5} {scenario:8} rank {rank}: collective failed {float(fail_after) * 1000:6.0f} ms after the "
              f"kill; transport judged rank 1 lost after "
              f"{'-' if lost_after == '-' else f'{float(lost_after) * 1000:.0f} ms'} ({kind}: {msg[:90]})")
    return times


@pytest.mark.multiprocess
@pytest.mark.parametrize("transport", ["sdma", "rdma"])
@pytest.mark.parametrize("scenario", ["mid", "between", "big"])
def test_a_killed_rank_fails_the_survivors_collectives(tmp_path: Path, scenario: str, transport: str) -> None:
    n = 2 if scenario == "big" else 3
    proc = _launch(tmp_path, n, scenario, transport)
    _check(proc, n, scenario, transport)


@pytest.mark.multiprocess
@pytest.mark.parametrize("transport", ["sdma", "rdma"])
def test_a_silent_rank_is_found_by_heartbeats(tmp_path: Path, transport: str) -> None:
    proc = _launch(tmp_path, 2, "silent", transport, AHCOMM_HEARTBEAT="0.5")
    _check(proc, 2, "silent", transport)


CLEAN = r'''
import asyncio, logging, os, time
import numpy as np
import ahcomm

async def main():
    comm = await ahcomm.init()
    for i in range(20):
        await comm.all_reduce(np.ones(100))
    if comm.rank == 2:
        await asyncio.sleep(0.5)  # the others wait in close's barrier
    await comm.close()
    links = [(p, l.stats()) for p, l in comm._executor.links.items()]
    print("CLOSED", comm.rank, sorted((p, s["state"]) for p, s in links), flush=True)
    time.sleep(0.3 * comm.rank)  # and leave at different times

asyncio.run(main())
'''


@pytest.mark.multiprocess
@pytest.mark.parametrize("transport", ["sdma", "rdma"])
def test_closing_normally_reports_no_loss(tmp_path: Path, transport: str) -> None:
    script = tmp_path / "clean.py"
    script.write_text(CLEAN)
    proc = run_job(3, str(script), env={"AHCOMM_BUFFSIZE": "0.0625", "AHCOMM_TRANSPORT": transport})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert proc.stdout.count("CLOSED") == 3, out
    assert "lost" not in out, out

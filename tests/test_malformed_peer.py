"""A member that sends a malformed message fails the communicator on every rank (issue 17.2).

A rank that rejects a message from a peer (a short header, an unknown kind, a put outside
its buffer: what a peer running another ahcomm version would send) fails its communicator
with ``TransportError`` and tells every peer, which fail with ``TransportError`` too. Before,
only the receiving link failed: over rdma a ring whose rejecting rank waited on another
link hung until AHCOMM_EXEC_TIMEOUT, with a message that did not mention the bad message.

The jobs are real processes (``ahcomm-run``, 3 ranks); the offender writes the frames on its
real link socket to the victim, as a peer out of step with the protocol would.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from jobs import run_job

OFFENDER, VICTIM = 2, 1  # over rdma rank 1 receives from rank 0 in a ring: only a hook can wake it

PROGRAM = r'''
import asyncio, os, time
from collections import deque
import numpy as np
import ahcomm
from ahcomm.transports._wire import HEADER

FRAMES = {
    "short header": [b"\x01" * 10],
    "unknown kind": [HEADER.pack(200, 0, 0, 0, 0, 0, 0)],
    "put outside the buffer": [HEADER.pack(2, 0, 0, 16, 0, 1 << 40, 0), b"x" * 16],
    "oversized eager message": [HEADER.pack(10, 0, 0, 1 << 20, 5, 0, 0), b"x" * 16],
    "eager message twice": [HEADER.pack(10, 0, 0, 1, 1000, 0, 0), b"x"],
}
TIMES = {"eager message twice": 2}  # the same message sent again: a second one for call 1000

async def main():
    comm = await ahcomm.init()
    r, x = comm.rank, np.ones(1000)
    start = time.monotonic()
    calls = deque()
    try:
        calls.extend([comm.all_reduce(x), comm.barrier(), comm.all_reduce(x)])
        await calls.popleft()  # every rank has issued it; each keeps two calls queued from now on
        if os.environ["WHEN"] == "idle":  # the message arrives while no collective runs anywhere
            await asyncio.gather(*calls)
            calls.clear()
        if r == OFFENDER:
            for _ in range(TIMES.get(os.environ["CASE"], 1)):
                comm._executor.links[VICTIM].sock.send_multipart(FRAMES[os.environ["CASE"]])
        if not calls:
            await asyncio.sleep(0.5)
        while time.monotonic() - start < 60:
            try:
                calls.append(comm.all_reduce(x))
            except ahcomm.CommClosedError:  # the communicator failed: a queued call says why
                if not calls:
                    raise
            # A call may still complete: one already done when the failure came (its waiter not yet
            # woken) and one running (its peers had not heard yet). Once none is left, the next
            # call raises CommClosedError from the failure.
            await calls.popleft()
        print(f"RANK {r} no error", flush=True)
    except ahcomm.AhcommError as exc:
        text = str(exc).replace("\n", " ")
        cause = type(exc.__cause__).__name__
        print(f"RANK {r} {type(exc).__name__} {cause} {time.monotonic() - start:.3f} {text}", flush=True)
        await asyncio.gather(*calls, return_exceptions=True)
    await comm.close()

asyncio.run(main())
'''

CASES = [("rdma", "short header", "a header of 10 bytes (expected 26)"),
         ("rdma", "unknown kind", "unknown message kind 200"),
         ("rdma", "put outside the buffer", "a put of 16 bytes at 1099511627776, outside the CCL buffer"),
         ("rdma", "oversized eager message", "an eager message of 1048576 bytes (at most 65536)"),
         ("rdma", "eager message twice", "a second eager message of call 1000"),
         ("sdma", "short header", "a header of 10 bytes (expected 26)"),
         ("sdma", "unknown kind", "unknown message kind 200")]


def _run(tmp_path: Path, transport: str, case: str, when: str) -> dict[int, tuple[str, str, float, str]]:
    """Each rank's (error type, its __cause__'s type, seconds, message) from the job."""
    script = tmp_path / "malformed.py"
    script.write_text(PROGRAM.replace("OFFENDER", str(OFFENDER)).replace("VICTIM", str(VICTIM)))
    proc = run_job(3, str(script), env={"AHCOMM_TRANSPORT": transport, "AHCOMM_EXEC_TIMEOUT": "30", "CASE": case,
                                        "WHEN": when, "AHCOMM_FLIGHT_DIR": str(tmp_path)}, timeout=120)
    out = proc.stdout + proc.stderr
    found = {int(rank): (kind, cause, float(seconds), text) for rank, kind, cause, seconds, text in
             re.findall(r"^\[\d\] RANK (\d) (\w+) (\w+) ([\d.]+) (.*)$", proc.stdout, re.M)}
    assert sorted(found) == [0, 1, 2], out
    for rank, (_, _, seconds, text) in found.items():
        assert seconds < 10, (rank, out)  # a hang guard, not a timing requirement (it takes milliseconds)
        offender = rf"(this rank \()?rank {OFFENDER}"
        assert re.search(rf"rank {VICTIM} rejected a message from {offender}", text), (rank, text)
    return found


@pytest.mark.multiprocess
@pytest.mark.parametrize("transport,case,reason", CASES, ids=[f"{t}-{c.replace(' ', '-')}" for t, c, _ in CASES])
def test_a_malformed_message_fails_every_rank_with_transport_error(tmp_path: Path, transport: str, case: str,
                                                                   reason: str) -> None:
    for rank, (kind, cause, _, text) in _run(tmp_path, transport, case, "busy").items():
        assert "TransportError" in (kind, cause), (rank, kind, cause, text)  # a pending call's, or the next one's
        assert reason in text, (rank, text)


@pytest.mark.multiprocess
@pytest.mark.parametrize("transport", ["rdma", "sdma"])
def test_a_malformed_message_while_idle_fails_the_communicator_at_once(tmp_path: Path, transport: str) -> None:
    """No collective runs when it arrives: the next call on every rank raises, naming it (before,
    over rdma the rejecting rank's ring waited on a healthy link until AHCOMM_EXEC_TIMEOUT)."""
    for rank, (kind, cause, _, text) in _run(tmp_path, transport, "unknown kind", "idle").items():
        assert "TransportError" in (kind, cause), (rank, kind, cause, text)  # CommClosedError from it, or itself
        assert "unknown message kind 200" in text, (rank, text)

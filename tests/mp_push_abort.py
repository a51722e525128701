"""A rank program for tests/test_push.py: no peer writes into a rank's output once its call has failed.

An in-place all_reduce of 32 MiB (mesh's single copy, which pushes each reduced piece into the
peers' outputs) during which rank 0 fails, while writes into its output go on. SLOW says which:

- ``peers``: the other ranks' writes take 2 ms more each (their push into rank 0's output,
  about 130 ms); rank 0 aborts 50 ms into the call;
- ``all``: rank 0's own writes too (1 ms, the others 4 ms); rank 0 aborts 30 ms in;
- ``close``: the others' writes take 40 ms more; rank 0 leaves ``async with comm:`` on an
  error 30 ms into the call (abort, then close, which stops the worker).

Rank 0 prints how many elements of its output no peer had written when its call ended
("UNWRITTEN <elements>": the writes were cut short, not over before the failure), then
"STABLE <seconds until its call ended>" if its output did not change in the 0.4 s after, else
"CHANGED <elements>" (or "NO FAILURE"); the others their error.
"""

from __future__ import annotations

import asyncio
import os
import time

import numpy as np

import ahcomm
from ahcomm.transports.sdma import _KernelPipe

DELAYS = {"peers": (0.0, 0.002), "all": (0.001, 0.004), "close": (0.0, 0.04)}


def slow_writes(delay: float) -> None:  # the push loop's writes (its links' pipes)
    write = _KernelPipe.write

    def slow(self: _KernelPipe, local: int, remote: int, nbytes: int) -> None:
        time.sleep(delay)
        write(self, local, remote, nbytes)
    _KernelPipe.write = slow  # type: ignore[method-assign]


def report(x: np.ndarray, took: float) -> None:
    before = x.copy()
    os.write(1, f"UNWRITTEN {int(np.count_nonzero(x == 1))}\n".encode())  # rank 0's input: no peer's share there yet
    time.sleep(0.4)
    changed = int(np.count_nonzero(x != before))
    os.write(1, (f"CHANGED {changed}\n" if changed else f"STABLE {took:.3f}\n").encode())


async def main() -> None:
    comm = await ahcomm.init()
    r, mode = comm.rank, os.environ.get("SLOW", "peers")
    x = np.full(8 << 20, r + 1, np.float32)
    await comm.all_reduce(x, out=x, algorithm="mesh")  # warm: the links and their probes
    assert np.all(x == comm.size * (comm.size + 1) / 2)
    x[:] = r + 1
    delay = DELAYS[mode][0 if r == 0 else 1]
    if delay:
        slow_writes(delay)
    start = time.monotonic()
    if r == 0 and mode == "close":
        task = asyncio.ensure_future(comm.all_reduce(x, out=x, algorithm="mesh"))
        try:
            async with comm:
                await asyncio.sleep(0.03)
                raise RuntimeError("an error elsewhere in the program")
        except RuntimeError:
            pass
        try:
            await task
            os.write(1, b"NO FAILURE\n")
        except BaseException as exc:  # noqa: BLE001 - CommClosedError (was: cancelled with the worker)
            os.write(1, f"CALL {type(exc).__name__}\n".encode())
            report(x, time.monotonic() - start)
        os._exit(0)
    if r == 0:
        asyncio.get_running_loop().call_later(0.03 if mode == "all" else 0.05, comm.abort, "test abort")
    try:
        await comm.all_reduce(x, out=x, algorithm="mesh")
        os.write(1, b"NO FAILURE\n")
    except ahcomm.AhcommError as exc:
        if r == 0:
            report(x, time.monotonic() - start)
        else:
            os.write(1, f"FAILED {type(exc).__name__}: {exc}\n".encode())
    os._exit(0)  # the communicator is broken: no close()


asyncio.run(main())

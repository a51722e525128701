"""A rank program for tests/test_algo_direct.py: no forwarder writes into a reader's output once
the reader's call has failed.

4 ranks told they share 2 cores (``AHCOMM_CORES=2``): a broadcast of 32 MiB from rank 0 runs
direct's forwarding (ranks 1 and 2 read a half each of rank 0's vector and write each piece
into the other readers' outputs). The other ranks' writes take 100 ms more each; rank VICTIM aborts
40 ms into the call: rank 3 (a reader the others write into), or rank 1 (a forwarder: its own
share goes at full speed while its event loop is busy, then rank 2 still writes the other half).

The victim prints how many elements of its output no forwarder had written when its call ended
("UNWRITTEN <elements>": the writes were cut short), then "STABLE <seconds until its call ended>"
if the output did not change in the 0.4 s after, else "CHANGED <elements>" (or "NO FAILURE");
the others their error.
"""

from __future__ import annotations

import asyncio
import os
import time

import numpy as np

import ahcomm
from ahcomm.transports.sdma import _KernelPipe

COUNT = 8 << 20  # float32: 32 MiB


def slow_writes(delay: float) -> None:  # the forwarders' writes (their links' pipes)
    write = _KernelPipe.write

    def slow(self: _KernelPipe, local: int, remote: int, nbytes: int) -> None:
        time.sleep(delay)
        write(self, local, remote, nbytes)
    _KernelPipe.write = slow  # type: ignore[method-assign]


def report(x: np.ndarray, mine: float, took: float) -> None:
    before = x.copy()
    os.write(1, f"UNWRITTEN {int(np.count_nonzero(x == mine))}\n".encode())
    time.sleep(0.4)
    changed = int(np.count_nonzero(x != before))
    os.write(1, (f"CHANGED {changed}\n" if changed else f"STABLE {took:.3f}\n").encode())


async def main() -> None:
    comm = await ahcomm.init()
    r, victim = comm.rank, int(os.environ["VICTIM"])
    x = np.full(COUNT, r + 1, np.float32)
    await comm.broadcast(x, root=0, out=x, algorithm="direct")  # warm: the links and their probes
    assert np.all(x == 1) and comm.stats()["paths"].get("direct.forward") == 1, comm.stats()["paths"]
    x[:] = r + 1
    if r != victim:
        slow_writes(0.1)
    start = time.monotonic()
    if r == victim:
        asyncio.get_running_loop().call_later(0.04, comm.abort, "test abort")
    try:
        await comm.broadcast(x, root=0, out=x, algorithm="direct")
        os.write(1, b"NO FAILURE\n")
    except ahcomm.AhcommError as exc:
        if r == victim:
            report(x, r + 1, time.monotonic() - start)
        else:
            os.write(1, f"FAILED {type(exc).__name__}: {exc}\n".encode())
            time.sleep(1.0)  # noqa: ASYNC251 - alive through the victim's report: a forwarder stops at the gate, not a dead root
    os._exit(0)  # the communicator is broken: no close()


asyncio.run(main())

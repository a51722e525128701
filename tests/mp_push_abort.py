"""A rank program for tests/test_push.py: no peer writes into a rank's output once its call has failed.

Two ranks, sdma, an in-place all_reduce of 32 MiB (mesh's single copy, which pushes each reduced
piece into the peer's output). Rank 1's writes are slowed (2 ms each), so its push into rank 0's
output takes about 130 ms; rank 0 aborts 50 ms into the call. Rank 0's call must fail, and its
output must not change after that (rank 1 stops at its next look at rank 0's closed gate).
Prints "STABLE <seconds to fail>" or "CHANGED <elements>" on rank 0, rank 1's error on rank 1.
"""

from __future__ import annotations

import asyncio
import os
import time

import numpy as np

import ahcomm
from ahcomm.transports.sdma import SdmaLink


async def main() -> None:
    comm = await ahcomm.init()
    r = comm.rank
    x = np.full(8 << 20, r + 1, np.float32)
    await comm.all_reduce(x, out=x, algorithm="mesh")  # warm: the links and their probes
    assert np.all(x == 3)
    if r == 1:
        write = SdmaLink.write

        def slow(self: SdmaLink, src: np.ndarray, addr: int) -> None:
            time.sleep(0.002)
            write(self, src, addr)
        SdmaLink.write = slow  # type: ignore[method-assign]
    else:
        asyncio.get_running_loop().call_later(0.05, comm.abort, "test abort")
    start = time.monotonic()
    try:
        await comm.all_reduce(x, out=x, algorithm="mesh")
        os.write(1, b"NO FAILURE\n")
    except ahcomm.AhcommError as exc:
        failed = time.monotonic() - start
        if r == 0:
            before = x.copy()
            time.sleep(0.4)  # noqa: ASYNC251 - nothing of this process runs: only rank 1 could write x
            changed = int(np.count_nonzero(x != before))
            os.write(1, (f"CHANGED {changed}\n" if changed else f"STABLE {failed:.3f}\n").encode())
        else:
            os.write(1, f"FAILED {type(exc).__name__}: {exc}\n".encode())
    os._exit(0)  # the communicator is broken: no close()


asyncio.run(main())

"""Rank 0 and rank 1 call different collectives and end their process the moment the error
reaches them; ranks 2 and 3 call their collective later, when 0 and 1 are gone, so they can
only know of the mismatch from the notice. Every rank prints ``RAISED <type> on rank <r>``."""

from __future__ import annotations

import asyncio
import os

import numpy as np

import ahcomm


async def main() -> None:
    comm = await ahcomm.init()
    x = np.ones(4, dtype=np.float32)
    if comm.rank >= 2:
        await asyncio.sleep(2.0)  # 0 and 1 have found the mismatch and exited by now
    try:
        if comm.rank == 1:
            await comm.broadcast(x, root=0)
        else:
            await comm.all_reduce(x)
    except ahcomm.AhcommError as exc:
        print(f"RAISED {type(exc).__name__} on rank {comm.rank}: {exc}", flush=True)
        if comm.rank < 2:
            os._exit(0)  # at once: nothing queued in this process is sent after this
    await comm.close()


if __name__ == "__main__":
    asyncio.run(main())

"""A call's time with ``out=`` (one preallocated result), without it (a result per call, dropped
at once: ``ahcomm._outputs.Results`` hands its memory out again) and in place, all_reduce, float32
sum, medians of 10 calls after 2 warm-up ones, three rounds. Run it with and without
``AHCOMM_RESULT_CACHE_MB=0`` (no reuse: fresh memory per result) to see what the reuse saves:

    ahcomm-run -n 2 python benchmarks/result_reuse.py 67108864
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import numpy as np

import ahcomm


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("nbytes", type=int, nargs="?", default=64 << 20, help="bytes of the all_reduce (default 64 MiB)")
    nbytes = p.parse_args().nbytes
    async with await ahcomm.init() as comm:
        x = np.ones(nbytes // 4, np.float32)
        y = np.ones_like(x)
        rounds: dict[str, list[float]] = {}
        for _ in range(3):
            for mode in ("out=", "no out=", "in place"):
                await comm.barrier()
                times = []
                for _ in range(12):
                    start = time.perf_counter()
                    if mode == "out=":
                        await comm.all_reduce(x, out=y)
                    elif mode == "in place":
                        await comm.all_reduce(x, out=x)
                    else:
                        z = await comm.all_reduce(x)
                        del z
                    times.append(time.perf_counter() - start)
                rounds.setdefault(mode, []).append(statistics.median(times[2:]) * 1e6)
                if mode == "in place":
                    x[:] = 1
        if comm.rank == 0:
            cells = ", ".join(f"{mode} {'/'.join(f'{t:.0f}' for t in ts)}" for mode, ts in rounds.items())
            print(f"{nbytes >> 20} MiB, us per call: {cells}; results reused {comm.stats()['results_reused']}")


if __name__ == "__main__":
    asyncio.run(main())

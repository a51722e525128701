"""Where an 8-byte all_reduce's time goes, stage by stage (issue 11), tracing off.

Two in-process ranks (one event loop), float32[2], sum. Each stage is what ``Comm`` does
for one call, run on its own ``--iters`` times:

validate     the input checks (device_aware, _input, ReduceOp.parse, check_reduce, _output, flat_view)
fingerprint  Call(...) and its fingerprint
flight       the flight-recorder entry
select       the selector's choice
queue        the future, the job, the queue and the worker's hand-off (enqueue + one loop turn)
publish      one mailbox publication (8 bytes: copy, header, flag, fence, no peer asleep)
run          the executor's run of oneshot on rank 0 (publish, arrivals, reduce), rank 1's
             publication made just before (included: subtract ``publish``), so nothing waits
finish       the entry's closing, the future's result and its delivery to the awaiting caller
total        a whole all_reduce (both ranks at once, per rank)

``python benchmarks/stages.py``            wall-clock table (us per call, best of 5 rounds)
``python benchmarks/stages.py --callgrind`` instruction counts per call (valgrind, slow)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ahcomm._bootstrap import create_inprocess
from ahcomm._collectives import flat_view
from ahcomm._core import Job
from ahcomm._dtypes import ReduceOp, check_reduce, ufunc_for
from ahcomm.algorithms.base import Call

STAGES = ("validate", "fingerprint", "flight", "select", "queue", "publish", "run", "finish", "total")


async def stage_fn(name: str) -> tuple[Callable[[], Any], bool]:
    """(one iteration of stage ``name``, whether it is a coroutine function)."""
    comms = await create_inprocess(2)
    c0, c1 = comms
    x0, x1 = np.ones(2, np.float32), np.ones(2, np.float32)
    call = Call(op="all_reduce", seq=0, dtype=x0.dtype, count=2, redop=ReduceOp.SUM)
    loop = asyncio.get_running_loop()
    algo = c0._selector.choose(call, c0.topology)
    ufunc = ufunc_for(ReduceOp.SUM, x0.dtype)
    if name == "validate":
        def validate() -> None:
            arr, dtype = c0._input(x0, "all_reduce")
            check_reduce(ReduceOp.parse("sum"), dtype)
            flat_view(c0._output("all_reduce", None, arr.shape, dtype))
        return validate, False
    if name == "fingerprint":
        return (lambda: Call(op="all_reduce", seq=0, dtype=x0.dtype, count=2, redop=ReduceOp.SUM).fingerprint), False
    if name == "flight":
        return (lambda: c0._flight.issue(call, None)), False
    if name == "select":
        return (lambda: c0._selector.choose(call, c0.topology)), False
    if name == "queue":
        async def queue() -> None:
            job = Job(call, algo, x0, x0, x0, None, loop.create_future())
            c0._queue.append(job)
            fut = loop.create_future()
            loop.call_soon(fut.set_result, None)  # the worker's wake-up: one loop turn
            await fut
            c0._queue.popleft()
        return queue, True
    if name in ("run", "publish"):
        seq = [0]
        ex0, box1 = c0._executor, c1._executor.mailbox
        d0 = np.empty_like(x0)
        assert box1 is not None
        fp = call.fingerprint

        async def run() -> None:  # rank 1's part is published first: rank 0 never waits
            s = seq[0]
            seq[0] += 1
            call_s = Call(op="all_reduce", seq=s, dtype=x0.dtype, count=2, redop=ReduceOp.SUM)
            call_s._fp = fp
            box1.publish(s, fp, x1)
            await ex0.run(call_s, algo, x0, d0, ufunc)
        if name == "run":
            return run, True
        return (lambda: box1.publish(0, fp, x1)), False
    if name == "finish":
        entry = c0._flight.issue(call, None)
        async def finish() -> None:
            fut = loop.create_future()
            c0._health.fps.pop(0, None)
            entry.state, entry.ended = "done", time.monotonic()
            fut.set_result(x0)
            await fut
        return finish, True
    async def total() -> None:
        await asyncio.gather(c0.all_reduce(x0), c1.all_reduce(x1))
    return total, True


async def measure(name: str, iters: int, rounds: int = 5) -> float:
    fn, is_async = await stage_fn(name)
    per = 2 if name == "total" else 1  # ranks served by one iteration
    for _ in range(50):  # warm: one-time costs (lazy imports, caches) are no stage's
        if is_async:
            await fn()
        else:
            fn()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        if is_async:
            for _ in range(iters):
                await fn()
        else:
            for _ in range(iters):
                fn()
        best = min(best, (time.perf_counter() - t0) / max(iters, 1) / per)
    return best * 1e6


def callgrind(name: str, iters: int) -> float:
    """Instructions per call of stage ``name``: (Ir with iters) - (Ir with none), per iteration."""
    counts = []
    for n in (0, iters):
        out = f"/tmp/ahcomm-stages-{os.getpid()}-{name}-{n}.cg"
        subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable, __file__,
                        "--stage", name, "--iters", str(n), "--rounds", "1"], check=True, capture_output=True,
                       env={**os.environ, "PYTHONHASHSEED": "0"})
        text = open(out).read()
        os.unlink(out)
        counts.append(int(re.search(r"^summary: (\d+)", text, re.M).group(1)))  # type: ignore[union-attr]
    return (counts[1] - counts[0]) / iters / (2 if name == "total" else 1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stage", choices=STAGES)
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--callgrind", action="store_true")
    args = parser.parse_args()
    if args.stage:
        print(asyncio.run(measure(args.stage, args.iters, args.rounds)))
        return
    for name in STAGES:
        if args.callgrind:
            print(f"{name:12s} {callgrind(name, args.iters):10.0f} instructions", flush=True)
        else:
            print(f"{name:12s} {asyncio.run(measure(name, args.iters)):8.2f} us", flush=True)


if __name__ == "__main__":
    main()

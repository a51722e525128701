"""Soak: many mixed collectives on real ranks; RSS, open descriptors, threads and tasks over time.

    python benchmarks/soak.py -n 2 --ops 20000 --every 1000 [--json FILE] [--check]

Starts N ranks through ahcomm-run (unless it already is a rank of a job). Each rank runs
``--ops`` operations cycling through all_reduce (small, and 1 MiB so the copy engines
run), all_gather, reduce_scatter, broadcast, all_to_all_v, gather, send/recv around a
ring, an object collective and a barrier, checking every result, and samples from
/proc/self every ``--every`` operations: resident memory, open file descriptors, threads
and asyncio tasks. Rank 0 prints the table and (``--json``) writes every rank's samples.
``--check`` fails (exit 1) unless, from the first sample (after warm-up) to the last, RSS
grew by less than ``--max-rss-growth`` MB and descriptors and threads did not grow.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all_v", "gather", "send_recv",
         "object", "all_reduce_1m", "barrier")


def sample(ops: int) -> dict[str, Any]:
    """RSS (MB), open descriptors, OS threads (zmq's and the copy engines' included), asyncio tasks."""
    with open("/proc/self/statm") as fh:
        rss_pages = int(fh.read().split()[1])
    with open("/proc/self/status") as fh:
        threads = next(int(line.split()[1]) for line in fh if line.startswith("Threads:"))
    return {"ops": ops, "t": time.monotonic(), "rss_mb": round(rss_pages * os.sysconf("SC_PAGE_SIZE") / 2**20, 2),
            "fds": len(os.listdir("/proc/self/fd")), "threads": threads, "py_threads": threading.active_count(),
            "tasks": len(asyncio.all_tasks())}


async def one(comm: Any, i: int, big: np.ndarray) -> int:
    """Run operation ``i``; return 1 if its result is wrong."""
    import ahcomm

    r, n = comm.rank, comm.size
    kind = KINDS[i % len(KINDS)]
    if kind == "all_reduce":
        got = await comm.all_reduce(np.full(256, r + i % 7, np.float32))
        return int(got[0] != sum(p + i % 7 for p in range(n)))
    if kind == "all_gather":
        got = await comm.all_gather(np.full(64, r, np.int32))
        return int(not np.array_equal(got[::64], np.arange(n)))
    if kind == "reduce_scatter":
        got = await comm.reduce_scatter(np.ones(128 * n, np.float32))
        return int(got.shape != (128,) or got[0] != n)
    if kind == "broadcast":
        root = i % n
        got = await comm.broadcast(np.full(512, float(r)), root=root)
        return int(got[-1] != root)
    if kind == "all_to_all_v":
        send = [(i + r + j) % 3 for j in range(n)]
        got = await comm.all_to_all_v(np.full((sum(send), 2), r, np.int64), send)
        want = [(i + p + r) % 3 for p in range(n)]
        return int(got.counts != tuple(want) or not np.array_equal(got.data[:, 0], np.repeat(np.arange(n), want)))
    if kind == "gather":
        root = (i // len(KINDS)) % n
        got = await comm.gather(np.full(32, r, np.int16), root=root)
        return int(r == root and not np.array_equal(got[::32], np.arange(n)))
    if kind == "send_recv":
        ops = [ahcomm.P2POp("send", np.full(100, r, np.float32), (r + 1) % n, tag=i % 100),
               ahcomm.P2POp("recv", np.empty(100, np.float32), (r - 1) % n, tag=i % 100)]
        got = await comm.batch_send_recv(ops)
        return int(got[1][0] != (r - 1) % n)
    if kind == "object":
        if (i // len(KINDS)) % 2:
            got = await comm.broadcast_object({"i": i, "from": r} if r == 0 else None, root=0)
            return int(got != {"i": i, "from": 0})
        got = await comm.all_gather_object({"rank": r, "i": i})
        return int(got != [{"rank": p, "i": i} for p in range(n)])
    if kind == "all_reduce_1m":
        got = await comm.all_reduce(big, out=np.empty_like(big))
        return int(got[0] != n)
    await comm.barrier()
    return 0


async def rank_main(args: argparse.Namespace) -> None:
    import ahcomm

    comm = await ahcomm.init()
    big = np.ones(256 * 1024, np.float32)  # 1 MiB: past the copy engines' threshold, several slices
    samples = [sample(0)]
    errors = 0
    start = time.perf_counter()
    for i in range(args.ops):
        errors += await one(comm, i, big)
        if (i + 1) % args.every == 0 or i + 1 == args.ops:
            samples.append(sample(i + 1))
    elapsed = time.perf_counter() - start
    everyone = await comm.gather_object({"rank": comm.rank, "samples": samples, "errors": errors}, root=0)
    await comm.close()
    if everyone is None:
        return
    doc = {"tool": "ahcomm-soak", "np": comm.size, "ops": args.ops, "seconds": round(elapsed, 2),
           "errors": sum(e["errors"] for e in everyone), "ranks": everyone}
    print(f"soak: {args.ops} ops on {comm.size} ranks in {elapsed:.1f} s ({args.ops / elapsed:.0f} ops/s), "
          f"{doc['errors']} wrong results", flush=True)
    print(f"{'rank':>4} {'ops':>7} {'RSS MB':>8} {'fds':>5} {'threads':>7} {'tasks':>5}")
    for entry in everyone:
        for s in entry["samples"]:
            print(f"{entry['rank']:>4} {s['ops']:>7} {s['rss_mb']:>8.1f} {s['fds']:>5} {s['threads']:>7} {s['tasks']:>5}")
    problems = verdict(doc, args.max_rss_growth) if args.check else []
    doc["problems"] = problems
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1))
    for p in problems:
        print(f"soak: {p}", flush=True)
    if problems or doc["errors"]:
        sys.exit(1)


def verdict(doc: dict[str, Any], max_rss_growth: float) -> list[str]:
    """Growth from the first sample after warm-up (the second) to the last, per rank."""
    problems = []
    for entry in doc["ranks"]:
        s = entry["samples"]
        first, last = s[1 if len(s) > 2 else 0], s[-1]
        growth = last["rss_mb"] - first["rss_mb"]
        if growth >= max_rss_growth:
            problems.append(f"rank {entry['rank']}: RSS grew {growth:.1f} MB (from {first['ops']} to {last['ops']} ops)")
        for key in ("fds", "threads"):
            if last[key] > first[key]:
                problems.append(f"rank {entry['rank']}: {key} grew from {first[key]} to {last[key]}")
    return problems


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-n", "--nproc", type=int, default=2)
    parser.add_argument("--ops", type=int, default=20000)
    parser.add_argument("--every", type=int, default=1000, help="sample every this many operations")
    parser.add_argument("--json", help="write every rank's samples here (rank 0)")
    parser.add_argument("--check", action="store_true", help="exit 1 unless RSS, fds and threads stay flat")
    parser.add_argument("--max-rss-growth", type=float, default=6.0, help="MB allowed by --check")
    args = parser.parse_args(argv)
    if "AHCOMM_RANK" in os.environ:
        asyncio.run(rank_main(args))
        return
    env = {"AHCOMM_BUFFSIZE": "1", "AHCOMM_EXEC_TIMEOUT": "120", **os.environ}
    argv_ = [sys.executable, "-m", "ahcomm.run", "-n", str(args.nproc), sys.executable, str(Path(__file__).resolve()),
             *(argv if argv is not None else sys.argv[1:])]
    sys.exit(subprocess.run(argv_, env=env).returncode)


if __name__ == "__main__":
    main()

"""``ahcomm-bench tune``: measure which algorithm is fastest on this host, per op, rank count and
size, and keep the picks in the calibration file, where the selector consults them before the
cost model (``algorithms/_tuned.py``; OpenMPI's tuned rules file, NCCL's tuner plugin).

For each rank count a job of that many ranks times, per op and size, every algorithm the cost
model prices within ``--within`` times its cheapest estimate (the rest are not worth the wait:
ring's 2(n-1) steps at 8 bytes), in ``--rounds`` interleaved rounds (each round in another
order, so a slow spell of the shared host lands on different algorithms), one median per round
(the slowest rank's); an algorithm's time is the median of its rounds. An algorithm that returns a
wrong result is never picked. all_reduce and broadcast run in place, as torch.distributed calls
them. The job's ranks price calls with the calibration less its old picks, so the report's
"model" column is the cost model's own pick.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

PRIVATE = "_tune"  # what `tune` starts on each of its ranks; not in --help
OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")  # the default ops to tune
WITHIN = 4.0  # time algorithms estimated within this factor of the cheapest estimate
# The fastest replaces the cost model's pick only where it beat it by more than this: closer
# than that, the order flips from one tuning run to the next on a shared 2-core host (np=2
# all_gather at 16, 32 and 64 MiB measured mesh, direct and oneshot fastest, 1-9% apart).
MARGIN = 0.05
ROUNDS = 3


def rank_list(text: str) -> list[int]:
    """``--ranks``: '2,4' -> [2, 4] (each at least 2)."""
    try:
        ranks = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"--ranks {text!r}: expected rank counts such as 2,4") from None
    if not ranks or ranks[0] < 2:
        raise argparse.ArgumentTypeError(f"--ranks {text!r}: each rank count must be 2 or more")
    return ranks


def op_list(text: str) -> list[str]:
    """``--ops``: 'all_reduce,broadcast' (any op ahcomm-bench times), or 'all'."""
    from ._bench_case import OPS as BENCH_OPS

    if text.strip() == "all":
        return list(BENCH_OPS)
    ops = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [op for op in ops if op not in BENCH_OPS]
    if not ops or unknown:
        raise argparse.ArgumentTypeError(f"--ops {text!r}: choose from all, {', '.join(BENCH_OPS)}")
    return ops


def private_parser() -> argparse.ArgumentParser:
    from ._bench_case import parse_size

    p = argparse.ArgumentParser(prog=f"ahcomm-bench {PRIVATE}")
    p.add_argument("--json", required=True)
    p.add_argument("--ops", type=op_list, required=True)
    p.add_argument("-b", "--minbytes", type=parse_size, required=True)
    p.add_argument("-e", "--maxbytes", type=parse_size, required=True)
    p.add_argument("-f", "--stepfactor", type=int, required=True)
    p.add_argument("-w", "--warmup-iters", type=int, required=True)
    p.add_argument("-i", "--iters", type=int, required=True)
    p.add_argument("--max-seconds", type=float, required=True)
    p.add_argument("--rounds", type=int, required=True)
    p.add_argument("--within", type=float, required=True)
    return p


async def tune_rank(args: argparse.Namespace) -> None:
    """One rank of a tuning job: time the candidates of every (op, size); rank 0 writes them."""
    import ahcomm

    from ._bench_case import Case, measure, sizes

    dtype = np.dtype(np.float32)
    async with await ahcomm.init() as comm:
        stats = comm.stats()
        kinds = sorted({link["kind"] for link in stats["links"].values()})
        points: list[dict[str, Any]] = []
        for op in args.ops:
            for nbytes in sizes(args.minbytes, args.maxbytes, args.stepfactor):
                case = Case(comm, op, nbytes, dtype, "sum", 0, None, True)
                model_pick, costs = comm.explain(op, case.block, dtype)
                known = [c for c in costs.values() if c is not None]
                cheapest = min(known, default=0.0)
                names = sorted(a for a, c in costs.items() if c is None or c <= args.within * cheapest)
                wrong: dict[str, int] = {}
                for name in names:
                    case.algorithm = name
                    wrong[name] = int((await comm.all_reduce(np.array([await case.check()]), "sum"))[0])
                timed = [a for a in names if not wrong[a]]
                times: dict[str, list[float]] = {a: [] for a in timed}
                for r in range(args.rounds if timed else 0):
                    start = r % len(timed)
                    for name in timed[start:] + timed[:start]:
                        case.algorithm = name
                        _, median_us, _ = await measure(case, args.warmup_iters, args.iters, args.max_seconds)
                        times[name].append(float((await comm.all_reduce(np.array([median_us]), "max"))[0]))
                points.append({"op": op, "bytes": case.size, "model": model_pick,
                               "times": {a: statistics.median(t) for a, t in times.items()},
                               "wrong": {a: w for a, w in wrong.items() if w}})
        if comm.rank == 0:
            with open(args.json, "w") as f:
                json.dump({"ranks": comm.size, "links": kinds, "single_copy": bool(stats["single_copy"]),
                           "points": points}, f)


def _quickest(times: dict[str, float]) -> str:
    return min(times, key=times.__getitem__)


def fastest(point: dict[str, Any]) -> str:
    """The algorithm one (op, size) point picks: the fastest measured, unless the cost model's own
    pick was within ``MARGIN`` of it."""
    times = point["times"]
    best = _quickest(times)
    model = times.get(point["model"])
    return str(point["model"]) if model is not None and model <= times[best] * (1 + MARGIN) else best


def picks_of(result: dict[str, Any]) -> list[Any]:
    """The measured picks in one tuning job's result (none where its links were of several kinds)."""
    from .algorithms._tuned import MeasuredPick

    if len(result["links"]) != 1:
        return []
    picks = []
    for point in result["points"]:
        times = point["times"]
        if times:
            best = fastest(point)
            picks.append(MeasuredPick(op=point["op"], ranks=int(result["ranks"]), link=result["links"][0],
                                      single_copy=bool(result["single_copy"]), nbytes=int(point["bytes"]),
                                      algorithm=best, time_us=float(times[best])))
    return picks


def report(result: dict[str, Any]) -> None:
    """Per op and size: the cost model's pick, the fastest measured, their times, the gain, and
    what is saved (the model's pick where the fastest beat it by ``MARGIN`` or less)."""
    n = result["ranks"]
    print(f"# np={n}  links={','.join(result['links']) or 'none'}  single_copy={result['single_copy']}")
    print(f"#{'op':>15} {'size':>10} {'model':>9} {'fastest':>9} {'model(us)':>11} {'best(us)':>10} {'gain':>6}"
          f" {'timed':>5}  saved")
    for point in result["points"]:
        times = point["times"]
        if not times:
            continue
        best = _quickest(times)
        model_us = times.get(point["model"], float("nan"))
        print(f" {point['op']:>15} {point['bytes']:>10} {point['model']:>9} {best:>9} {model_us:>11.1f} "
              f"{times[best]:>10.1f} {model_us / times[best]:>6.2f} {len(times):>5}  {fastest(point)}")
        for name, count in point["wrong"].items():
            print(f"#   {name} returned {count} wrong elements: left out")


def tune(args: argparse.Namespace) -> None:
    """Run a tuning job per rank count in ``args.ranks``; merge the picks into the calibration
    (``args.save``: into a copy of it there instead, the calibration left as it is)."""
    from .algorithms import cost as _cost
    from .run import launch

    model = _cost.load()
    base = replace(model, picks=())
    found: list[Any] = []
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        model_file = os.path.join(tmp, "model.json")
        with open(model_file, "w") as f:
            json.dump(base.to_dict(), f)
        # AHCOMM_ALGO would decide the job's picks itself (and be saved as measured)
        env = {k: v for k, v in os.environ.items() if k != "AHCOMM_ALGO"} | {"AHCOMM_TUNING_FILE": model_file}
        failed = ""
        for n in args.ranks:
            out = os.path.join(tmp, f"np{n}.json")
            command = [sys.executable, "-m", "ahcomm.bench", PRIVATE, "--json", out, "--ops", ",".join(args.tune_ops),
                       "-b", str(args.minbytes), "-e", str(args.maxbytes), "-f", str(args.stepfactor),
                       "-w", str(args.warmup_iters), "-i", str(args.iters), "--max-seconds", str(args.max_seconds),
                       "--rounds", str(args.rounds), "--within", str(args.within)]
            status = asyncio.run(launch(n, command, env=env))
            if status != 0:  # what earlier rank counts measured is still saved
                failed = f"ahcomm-bench tune: the {n}-rank job failed with status {status}"
                break
            try:
                with open(out) as f:
                    result = json.load(f)
            except (OSError, ValueError) as exc:  # the job said it ended well but left no result
                failed = f"ahcomm-bench tune: the {n}-rank job wrote no result ({exc})"
                break
            report(result)
            results.append(result)
            found += picks_of(result)
    tuned = {(p.op, p.ranks, p.link, p.single_copy) for p in found}
    kept = tuple(p for p in model.picks if (p.op, p.ranks, p.link, p.single_copy) not in tuned)
    path = _cost.save(replace(model, picks=kept + tuple(found)), Path(args.save) if args.save else None)
    print(f"saved {len(found)} measured picks ({len(kept)} earlier ones kept) to {path}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tool": "ahcomm-bench tune", "results": results}, f, indent=1)
    if failed:
        sys.exit(failed)

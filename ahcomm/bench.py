"""ahcomm-bench: nccl-tests-style collective benchmark.

    ahcomm-bench -n 4 all_reduce -b 8 -e 64M -f 4 -c 1

    ahcomm-bench -n 4 all_gather --algorithm all     (every algorithm, and the selector's pick)
    ahcomm-bench -n 4 all_reduce --algorithm all --plot busbw.png   (busbw vs size per algorithm)
    ahcomm-bench calibrate                           (measure the cost model's numbers)
    ahcomm-bench tune --ranks 2,4 -b 64K -e 64M -f 2 (measure the fastest algorithm per op, ranks, size)

Columns: size, count, type, redop, root, time (us), algbw, busbw (GB/s), #wrong. ``size``
follows nccl-tests: the buffer for all_reduce/broadcast/reduce, the whole output of
all_gather/gather, the whole input of reduce_scatter/scatter, one rank's buffer for
all_to_all. time = mean per op of the slowest rank (the largest per-rank mean, as MPI
benchmarks report; a rooted op's root may return before its receivers). busbw factors: all_reduce 2(n-1)/n,
all_gather, reduce_scatter, gather, scatter, all_to_all (n-1)/n, broadcast and reduce 1.
Starts N ranks itself (through ahcomm-run) unless it is already a rank of a launched job.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from . import _tune
from ._bench_case import (
    OPS,
    REDOPS,
    REDUCING,
    ROOTED,
    Case,
    bus_factor,
    dtype_arg,
    measure,
    parse_size,
    runnable,
    sizes,
)
from ._calibrate import PRIVATE, calibrate, calibrate_rank


async def sweep(comm: Any, args: argparse.Namespace, algorithm: str | None) -> list[dict[str, Any]]:
    """One nccl-tests table for ``algorithm`` (None: the selector's choice per size)."""
    rows: list[dict[str, Any]] = []
    dtype, n = np.dtype(args.dtype), comm.size
    if comm.rank == 0:
        print(f"# ahcomm-bench {args.op}  np={n}  dtype={dtype}  algorithm={algorithm or 'auto'}"
              f"  {'in-place' if args.inplace else 'out-of-place'}{_registered(comm, args)}  links="
              f"{','.join(sorted({link['kind'] for link in comm.stats()['links'].values()})) or 'none'}")
        print(f"#{'size':>12} {'count':>12} {'type':>8} {'redop':>6} {'root':>5} "
              f"{'time(us)':>11} {'algbw':>8} {'busbw':>8} {'#wrong':>7}  algorithm", flush=True)
    # what a forced algorithm that is not a candidate cannot run: the op itself, or only this size
    # (eager above one message)
    cannot = args.op if algorithm is not None and args.op not in _ops_of(algorithm) else "size"
    for nbytes in sizes(args.minbytes, args.maxbytes, args.stepfactor):
        case = Case(comm, args.op, nbytes, dtype, args.redop, args.root, algorithm, args.inplace, args.registered)
        known = comm.explain(args.op, case.block, dtype, root=args.root)
        if algorithm is not None and algorithm not in known[1]:
            if comm.rank == 0:
                print(f" {case.size:>12} {'':>12} {'':>8} {'':>6} {'':>5} {'-':>11} {'-':>8} {'-':>8} {'-':>7}  "
                      f"{algorithm} cannot run this {cannot}", flush=True)
            continue
        picked = algorithm or known[0]
        wrong = await case.check() if args.check else 0
        us, median, count = await measure(case, args.warmup_iters, args.iters, args.max_seconds)
        slowest = await comm.all_reduce(np.array([us, median]), "max")  # the slowest rank's time
        agg = await comm.all_reduce(np.array([us, float(wrong), median]), "sum")
        mean_us, median_us, total_wrong = float(slowest[0]), float(slowest[1]), int(agg[1])
        algbw = case.size / (mean_us * 1e-6) / 1e9
        redop = args.redop if args.op in REDUCING else "none"
        root = args.root if args.op in ROOTED else -1
        row = {"op": args.op, "size": case.size, "count": case.size // dtype.itemsize, "type": str(dtype),
               "redop": redop, "root": root, "time_us": mean_us, "algbw": algbw,
               "busbw": algbw * bus_factor(args.op, n), "wrong": total_wrong, "iters": count, "median_us": median_us,
               "avg_rank_us": float(agg[0]) / n, "median_avg_us": float(agg[2]) / n,  # means over ranks
               "algorithm": picked, "forced": algorithm is not None, "registered": args.registered}
        rows.append(row)
        if comm.rank == 0:
            print(f" {row['size']:>12} {row['count']:>12} {row['type']:>8} {redop:>6} {root:>5} "
                  f"{mean_us:>11.1f} {algbw:>8.3f} {row['busbw']:>8.3f} {total_wrong:>7}  {picked}", flush=True)
    if comm.rank == 0 and rows:
        print(f"# Avg bus bandwidth    : {sum(r['busbw'] for r in rows) / len(rows):.4f}", flush=True)
    return rows


def _registered(comm: Any, args: argparse.Namespace) -> str:
    """The header's word for -R: where ranks cannot read each other's memory it changes nothing."""
    if not args.registered:
        return ""
    return "  registered" if comm.stats()["single_copy"] else "  registered (no effect: no single copy here)"


def _ops_of(algorithm: str) -> frozenset[str]:
    """The collectives ``algorithm`` (a registered name: ``main`` checks) implements."""
    from .algorithms import REGISTRY

    return REGISTRY.algorithms[algorithm].ops


def selection_table(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per size: the selector's pick, the fastest measured algorithm, and pick time / best time
    (median times per op: one slow iteration on a shared host does not decide)."""
    out = []
    for size in sorted({r["size"] for r in rows}):
        forced = {r["algorithm"]: r["median_us"] for r in rows if r["size"] == size and r["forced"]}
        auto = [r for r in rows if r["size"] == size and not r["forced"]]
        if not forced or not auto:
            continue
        pick = auto[0]["algorithm"]
        best = min(forced, key=lambda name: forced[name])
        pick_time = forced.get(pick, auto[0]["median_us"])
        out.append({"size": size, "pick": pick, "best": best, "pick_us": pick_time, "best_us": forced[best],
                    "ratio": pick_time / forced[best] if forced[best] else 1.0})
    return out


async def run_rank(args: argparse.Namespace) -> list[dict[str, Any]]:
    import ahcomm

    comm = await ahcomm.init()
    rows: list[dict[str, Any]] = []
    async with comm:
        dtype = np.dtype(args.dtype)
        if args.algorithm == "all":
            for name in runnable(comm, args.op, dtype):
                rows += await sweep(comm, args, name)
            rows += await sweep(comm, args, None)
        else:
            rows += await sweep(comm, args, args.algorithm)
        table = selection_table(rows) if args.algorithm == "all" else []
        if comm.rank == 0 and table:
            print(f"# selector vs measured ({args.op}, np={comm.size}): "
                  "pick within 10% of the best where ratio <= 1.10")
            print(f"#{'size':>12} {'pick':>10} {'best':>10} {'pick(us)':>11} {'best(us)':>11} {'ratio':>6}")
            for t in table:
                print(f" {t['size']:>12} {t['pick']:>10} {t['best']:>10} {t['pick_us']:>11.1f} {t['best_us']:>11.1f} "
                      f"{t['ratio']:>6.2f}", flush=True)
        if comm.rank == 0 and args.json:
            with open(args.json, "w") as f:
                json.dump({"tool": "ahcomm", "np": comm.size, "inplace": args.inplace, "rows": rows,
                           "selection": table}, f, indent=1)
        if comm.rank == 0 and args.plot:
            plot(rows, args, comm.size)
    return rows


def plot(rows: list[dict[str, Any]], args: argparse.Namespace, nranks: int) -> None:
    """busbw vs size per algorithm (and the peers' from ``--plot-peers``) into ``args.plot``."""
    from ._plot import busbw

    peers = None
    if args.plot_peers:
        with open(args.plot_peers) as f:
            peers = json.load(f)
    print(f"# plot: {busbw(rows, args.plot, nranks=nranks, peers=peers)}", flush=True)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ahcomm-bench", description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("op", choices=(*OPS, "calibrate", "tune"),
                   help="the collective to time, 'calibrate' (measure the cost model's numbers) or 'tune' (measure "
                        "the fastest algorithm per op, rank count and size; the selector then takes it)")
    p.add_argument("-n", "--np", dest="nproc", type=int, default=2, help="ranks to start (when not launched)")
    p.add_argument("-b", "--minbytes", type=parse_size, default=parse_size("8"),
                   help="smallest size in bytes (8, 64K, 1M; default 8)")
    p.add_argument("-e", "--maxbytes", type=parse_size, default=parse_size("64M"),
                   help="largest size in bytes (default 64M)")
    p.add_argument("-f", "--stepfactor", type=int, default=4, help="size multiplier between rows (default 4)")
    p.add_argument("-d", "--dtype", type=dtype_arg, default=np.dtype(np.float32),
                   help="element type: a numpy name (float32, int64, ...) or bfloat16, float8_e4m3fn, float8_e5m2")
    p.add_argument("-o", "--redop", default="sum", choices=REDOPS,
                   help="reduce op of all_reduce, reduce_scatter and reduce (band/bor/bxor: integer or bool -d)")
    p.add_argument("-r", "--root", type=int, default=0, help="root rank of rooted ops (default 0)")
    p.add_argument("-w", "--warmup-iters", type=int, default=3, help="untimed iterations per size (default 3)")
    p.add_argument("-i", "--iters", type=int, default=20, help="timed iterations per size (default 20)")
    p.add_argument("-c", "--check", type=int, default=1, help="check results against numpy (1) or not (0)")
    p.add_argument("--max-seconds", type=float, default=1.0, help="cap on timed seconds per size")
    p.add_argument("--inplace", action="store_true", help="all_reduce/broadcast in place (out is the input)")
    p.add_argument("-R", "--registered", action="store_true",
                   help="buffers from ahcomm.alloc, which same-host peers map (nccl-tests -R: registered buffers)")
    p.add_argument("--algorithm", default=None,
                   help="force an algorithm (see ahcomm.algorithms.names), or 'all': each one, then the selector")
    p.add_argument("--json", default=None, help="rank 0 writes the rows here")
    p.add_argument("--plot", default=None, metavar="PNG",
                   help="rank 0 draws busbw vs size per algorithm here (needs ahcomm[plot])")
    p.add_argument("--plot-peers", default=None, metavar="JSON",
                   help="with --plot: also draw gloo's and OpenMPI's curves from benchmarks/compare.py's results "
                        "(e.g. benchmarks/results/latest.json)")
    tune = p.add_argument_group("tune")
    tune.add_argument("--ranks", type=_tune.rank_list, default=None,
                      help="rank counts to tune for, e.g. 2,4 (default: -n)")
    tune.add_argument("--ops", dest="tune_ops", type=_tune.op_list, default=list(_tune.OPS),
                      help=f"ops to tune, or 'all' (default {','.join(_tune.OPS)})")
    tune.add_argument("--rounds", type=int, default=_tune.ROUNDS,
                      help=f"interleaved rounds per size; an algorithm's time is its median (default {_tune.ROUNDS})")
    tune.add_argument("--save", default=None, metavar="JSON",
                      help="write the calibration with the new picks here instead of AHCOMM_TUNING_FILE "
                           "(or ~/.cache/ahcomm/calibration.json), which stays as it is")
    tune.add_argument("--within", type=float, default=_tune.WITHIN,
                      help="time the algorithms the cost model estimates within this factor of its cheapest "
                           f"(default {_tune.WITHIN:g})")
    return p


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == [PRIVATE]:  # one rank of `calibrate`'s 2-rank job
        private = argparse.ArgumentParser(prog=f"ahcomm-bench {PRIVATE}")
        private.add_argument("--json", required=True)
        asyncio.run(calibrate_rank(private.parse_args(argv[1:]).json))
        return
    if argv[:1] == [_tune.PRIVATE]:  # one rank of a `tune` job
        asyncio.run(_tune.tune_rank(_tune.private_parser().parse_args(argv[1:])))
        return
    p = parser()
    args = p.parse_args(argv)
    if args.op == "calibrate":
        calibrate()
        return
    if args.op == "tune":
        if args.rounds < 1 or args.within < 1:
            p.error("tune: --rounds must be 1 or more and --within 1 or more")
        args.ranks = args.ranks or [args.nproc]
        _tune.tune(args)
        return
    if args.algorithm not in (None, "all"):
        from .algorithms import REGISTRY

        if args.algorithm not in REGISTRY.algorithms:  # a typo: before any rank starts
            p.error(f"--algorithm {args.algorithm!r} is not an algorithm; one of: all, "
                    f"{', '.join(sorted(REGISTRY.algorithms))}")
    if args.op in REDUCING:
        from ._dtypes import ReduceOp, check_reduce
        from ._errors import InvalidDtype

        try:
            check_reduce(ReduceOp.parse(args.redop), args.dtype)
        except InvalidDtype as exc:
            p.error(f"-o {args.redop} -d {args.dtype}: {exc}")
    if args.plot:
        from ._plot import require

        require()  # before any rank starts: a missing matplotlib says so at once
        if args.plot_peers and not os.path.isfile(args.plot_peers):
            sys.exit(f"ahcomm-bench: --plot-peers {args.plot_peers}: no such file")
    if "AHCOMM_RANK" not in os.environ and "RANK" not in os.environ and "OMPI_COMM_WORLD_RANK" not in os.environ:
        from ._binding import checked_mode
        from ._errors import ConfigError
        from .run import launch

        try:
            checked_mode()
        except ConfigError as exc:
            sys.exit(f"ahcomm-bench: {exc}")
        sys.exit(asyncio.run(launch(args.nproc, [sys.executable, "-m", "ahcomm.bench", *argv])))
    try:
        asyncio.run(run_rank(args))
    except KeyboardInterrupt:  # Ctrl-C: the launcher says so once per rank, no traceback
        sys.exit(130)


if __name__ == "__main__":
    main()

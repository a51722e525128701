"""ahcomm-sim against this host: predicted (with this host's ``ahcomm-bench calibrate`` model)
vs measured (``ahcomm-bench``) ring all_reduce, all_gather and broadcast at 2 and 4 ranks,
2 MiB and 64 MiB (issue 15's target: within 25%). Markdown on stdout, with the load average.

    PYTHONPATH=. python benchmarks/sim_fidelity.py [--model FILE] [--json FILE] [--repeat R] [--calibrate-each]

Without ``--model`` it calibrates first into a private file (``AHCOMM_TUNING_FILE``: the
user's cached calibration is not touched); with ``--calibrate-each``, again right before each
op's measurement at each rank count (this VM's copy and link rates drift by up to 2x within
minutes: a model calibrated minutes before a measurement describes another moment). The same
algorithm (ring, ``--algorithm``) runs in both, all ranks on one server (``sdma`` links).
``ahcomm-bench`` sizes count every block of all_gather; the simulator's count one rank's block.
Broadcast is measured in place (``--inplace``), as the simulator runs it.
``with --cpu``: the simulator's CPU pool (the model's cores per server shared by copies,
reductions, puts, engine hand-offs and each post's CPU work, half the sender's and half the
receiver's; copies at once share the memory bandwidth).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from ahcomm.algorithms import CostModel
from ahcomm.sim import load_model, simulate

OPS = ("all_reduce", "all_gather", "broadcast")
SIZES = (2 << 20, 64 << 20)


def _load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def measure(op: str, n: int, algorithm: str, iters: int, tmp: Path, env: dict[str, str]) -> dict[int, float]:
    out = tmp / f"{op}-{n}.json"
    lo, hi = min(SIZES), max(SIZES)  # the sweep from SIZES' smallest to largest, one step apart
    cmd = [sys.executable, "-m", "ahcomm.bench", "-n", str(n), op, "-b", str(lo), "-e", str(hi), "-f", str(hi // lo),
           "-c", "0",
           "-w", "2", "-i", str(iters), "--max-seconds", "2", "--algorithm", algorithm, "--json", str(out)]
    if op == "broadcast":  # as the simulator runs it (and MPI_Bcast, torch's broadcast): out of place, the
        cmd.append("--inplace")  # root also copies its input to its output, 2x the time at 2 ranks
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    rows = json.loads(out.read_text())["rows"]
    return {int(r["size"]): float(r["median_us"]) for r in rows}


def calibrate(env: dict[str, str]) -> None:
    print(f"Calibrating (load {_load()})...", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "ahcomm.bench", "calibrate"], check=True, env=env, stdout=sys.stderr)


def describe(model: CostModel) -> str:
    return (f"sdma alpha {model.links['sdma'].alpha * 1e6:.1f} us, {1 / model.links['sdma'].beta / 1e9:.2f} GB/s; "
            f"copy {1 / model.copy / 1e9:.2f} GB/s (x{model.crowd:.2f} longer with every core copying), "
            f"reduce {1 / model.gamma / 1e9:.2f} GB/s; notify {model.task * 1e6:.0f} us "
            f"({model.notify_cpu * 1e6:.0f} of CPU; {model.cold_notify * 1e6:.0f} us more after a 2 MiB copy), "
            f"a call's own CPU {model.launch * 1e6:.0f} us, engine hand-off "
            f"{model.engine * 1e6:.0f} us; {model.cores} cores" + _in_cache(model))


def _in_cache(model: CostModel) -> str:
    if not model.cache or not model.copy_hot or not model.gamma_hot:
        return ""
    return (f"; in cache ({model.cache >> 20} MiB last-level) copy {1 / model.copy_hot / 1e9:.2f} GB/s, "
            f"reduce {1 / model.gamma_hot / 1e9:.2f} GB/s")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None, help="a calibration JSON (default: calibrate now)")
    p.add_argument("--algorithm", default="ring")
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--repeat", type=int, default=1,
                   help="ahcomm-bench runs per op and ranks: the median of their medians counts (spread shown)")
    p.add_argument("--calibrate-each", action="store_true",
                   help="calibrate again right before each op's measurement at each rank count")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.calibrate_each and args.model:
        p.error("--calibrate-each calibrates: it takes no --model")
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        model_path = args.model or str(tmp / "calibration.json")
        env = {**os.environ, "AHCOMM_TUNING_FILE": model_path}
        if args.model is None:
            calibrate(env)
        model = load_model(model_path)
        print(f"Model: {model.source}; {describe(model)}" + (" (the first; each op's below)" if args.calibrate_each
                                                            else "") + "\n")
        print("| op | ranks | bytes | measured us (median; runs' range) | predicted us | predicted/measured "
              "| with --cpu us "
              "| predicted/measured | load |")
        print("|---|---|---|---|---|---|---|---|---|")
        rows, models = [], [model.to_dict()]
        for n in args.ranks:
            for op in OPS:
                if args.calibrate_each and (n, op) != (args.ranks[0], OPS[0]):  # the first op has one
                    calibrate(env)
                    model = load_model(model_path)
                    models.append(model.to_dict())
                runs = [measure(op, n, args.algorithm, args.iters, tmp, env) for _ in range(max(1, args.repeat))]
                measured = {size: float(statistics.median(run[size] for run in runs)) for size in runs[0]}
                for size in SIZES:
                    if size not in measured:
                        continue
                    spread = [run[size] for run in runs]
                    per_rank = size // n if op == "all_gather" else size
                    r = simulate(op, n, n, per_rank, args.algorithm, model=model)
                    c = simulate(op, n, n, per_rank, args.algorithm, model=model, cpu=True)  # shared cores
                    ratio, cratio = r.time_us / measured[size], c.time_us / measured[size]
                    load = _load()
                    rows.append({"op": op, "ranks": n, "bytes": size, "measured_us": measured[size],
                                 "predicted_us": r.time_us, "ratio": ratio, "predicted_cpu_us": c.time_us,
                                 "ratio_cpu": cratio, "load": load, "measured_runs_us": spread,
                                 "model": describe(model)})
                    print(f"| {op} | {n} | {size} | {measured[size]:.0f} ({min(spread):.0f}-{max(spread):.0f}) | "
                          f"{r.time_us:.0f} | {ratio:.2f} | {c.time_us:.0f} | {cratio:.2f} | {load} |", flush=True)
                if args.calibrate_each:
                    print(f"|  | model for {op} at {n} ranks: {describe(model)} |||||||", flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps({"model": models[0], "models": models, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

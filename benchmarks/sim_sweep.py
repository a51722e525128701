"""Sweep ``ahcomm-sim``: predicted all_reduce time vs ranks per algorithm (8 B, 1 MiB, 64 MiB),
the selector's pick against the simulated best, a straggler's effect, closed-form agreement
(contention and compute off) and wall time / memory per point. Markdown on stdout; with
``--json FILE`` every row as JSON, with ``--png FILE`` a plot (time vs ranks, one panel per size).

    PYTHONPATH=. python benchmarks/sim_sweep.py --ranks 8 16 32 64 128 256 512 1024 2048 4096 \\
        --json benchmarks/results/2026-11-25-sim-scale.json --png benchmarks/results/2026-11-25-sim-scale.png

A point is skipped (``-``) when its extrapolated wall time (the last two points of the same
algorithm and size, growing as they grew) is over ``--budget`` seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
from dataclasses import replace
from typing import Any

from ahcomm.sim import candidates, closed_form, reference_model, simulate

SIZES = {"8 B": 8, "1 MiB": 1 << 20, "64 MiB": 64 << 20}
ALGOS = ("ring", "rhd", "nhr", "hier")


def _load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def _guess(walls: list[tuple[int, float]], n: int) -> float:
    """Wall seconds expected at ``n`` from the last two points (0: unknown)."""
    if len(walls) < 2:
        return walls[-1][1] * (n / walls[-1][0]) ** 2 if walls else 0.0
    (n0, w0), (n1, w1) = walls[-2:]
    growth = max(1.0, w1 / max(w0, 1e-3)) if w1 > 0.05 else (n / n1) ** 2
    return w1 * growth ** (max(1.0, n / n1) / max(1.0, n1 / n0))


def sweep(ranks: list[int], k: int, budget: float, rows: list[dict[str, Any]]) -> None:
    print(f"## Predicted all_reduce time (us), reference cluster, {k} ranks/server, contention on\n")
    print("| size | ranks | " + " | ".join(ALGOS) + " | selector's pick | simulated best | pick/best |")
    print("|---|---|" + "---|" * len(ALGOS) + "---|---|---|")
    for label, size in SIZES.items():
        walls: dict[str, list[tuple[int, float]]] = {a: [] for a in ALGOS}
        for n in ranks:
            times: dict[str, float] = {}
            pick = ""
            for name in ALGOS:
                if name not in candidates("all_reduce", n, k, size) or _guess(walls[name], n) > budget:
                    continue
                r = simulate("all_reduce", n, k, size, name)
                walls[name].append((n, r.wall_s))
                times[name], pick = r.time_us, r.pick
                rows.append({**r.__dict__, "load": _load(), "table": "sweep"})
            if not times:
                continue
            best = min(times, key=times.__getitem__)
            cells = [f"{times[a]:.1f}" if a in times else "-" for a in ALGOS]
            ratio = f"{times[pick] / times[best]:.2f}" if pick in times else "?"
            print(f"| {label} | {n} | " + " | ".join(cells) + f" | {pick} | {best} | {ratio} |", flush=True)


def fidelity(ranks: list[int], k: int, budget: float, rows: list[dict[str, Any]]) -> None:
    model = replace(reference_model(), gamma=0.0, copy=0.0)
    print("\n## Simulated vs closed form (contention off, no compute)\n")
    print("| size | ranks | algorithm | simulated us | closed form us | diff | wall s |")
    print("|---|---|---|---|---|---|---|")
    for label, size in (("1 MiB", 1 << 20), ("64 MiB", 64 << 20)):
        walls: dict[str, list[tuple[int, float]]] = {a: [] for a in ALGOS}
        for n in ranks:
            for name in ("ring", "rhd", "hier"):
                cf = closed_form("all_reduce", name, n, k, size, model)
                if cf is None or _guess(walls[name], n) > budget:
                    continue
                r = simulate("all_reduce", n, k, size, name, model=model, contention=False)
                walls[name].append((n, r.wall_s))
                diff = r.time_us / (cf * 1e6) - 1
                rows.append({**r.__dict__, "closed_form_us": cf * 1e6, "load": _load(), "table": "closed_form"})
                print(f"| {label} | {n} | {name} | {r.time_us:.1f} | {cf * 1e6:.1f} | {diff * 100:+.1f}% | "
                      f"{r.wall_s:.1f} |", flush=True)


def stragglers(n: int, k: int, rows: list[dict[str, Any]]) -> None:
    late = 100e-6
    print(f"\n## One straggler (rank 3 starts {late * 1e6:g} us late), {n} ranks, all_reduce\n")
    print("| size | algorithm | on time us | with straggler us | added us |")
    print("|---|---|---|---|---|")
    for label, size in (("8 B", 8), ("1 MiB", 1 << 20)):
        for name in ALGOS:
            if name not in candidates("all_reduce", n, k, size):
                continue
            a = simulate("all_reduce", n, k, size, name)
            b = simulate("all_reduce", n, k, size, name, straggler=(3, late))
            rows.append({**b.__dict__, "on_time_us": a.time_us, "load": _load(), "table": "straggler"})
            print(f"| {label} | {name} | {a.time_us:.1f} | {b.time_us:.1f} | {b.time_us - a.time_us:+.1f} |",
                  flush=True)


def plot(rows: list[dict[str, Any]], path: str, per_server: int) -> None:
    from ahcomm._plot import require

    plt = require()
    fig, axes = plt.subplots(1, len(SIZES), figsize=(5 * len(SIZES), 4), constrained_layout=True)
    for ax, (label, size) in zip(axes, SIZES.items()):
        pts = [r for r in rows if r["table"] == "sweep" and r["bytes"] == size]
        for name in ALGOS:
            xs = [(r["ranks"], r["time_us"]) for r in pts if r["algorithm"] == name]
            if xs:
                ax.plot(*zip(*sorted(xs)), marker="o", label=name)
        picks = sorted({(r["ranks"], r["pick"]) for r in pts})
        chosen = [(n, next((r["time_us"] for r in pts if r["ranks"] == n and r["algorithm"] == p), None))
                  for n, p in picks]
        chosen = [(n, t) for n, t in chosen if t is not None]
        if chosen:
            ax.plot(*zip(*chosen), "k--", lw=1, label="selector's pick")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"all_reduce {label}")
        ax.set_xlabel(f"ranks ({per_server} per server)")
        ax.set_ylabel("predicted time (us)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ranks", type=int, nargs="+", default=[8, 16, 32, 64, 128])
    p.add_argument("--per-server", type=int, default=8)
    p.add_argument("--budget", type=float, default=30.0, help="skip a point expected to take longer (s)")
    p.add_argument("--closed-form-ranks", type=int, nargs="*", default=None)
    p.add_argument("--straggler-ranks", type=int, default=64)
    p.add_argument("--json", default=None)
    p.add_argument("--png", default=None)
    args = p.parse_args()
    started = time.perf_counter()
    print(f"Load average at start: {_load()} (2 shared cores)\n")
    rows: list[dict[str, Any]] = []
    sweep(args.ranks, args.per_server, args.budget, rows)
    fidelity(args.closed_form_ranks or args.ranks, args.per_server, args.budget, rows)
    stragglers(args.straggler_ranks, args.per_server, rows)
    print(f"\nTotal {time.perf_counter() - started:.0f} s wall, peak RSS "
          f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB, load average at end {_load()}")
    if args.json:
        with open(args.json, "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    if args.png:
        plot(rows, args.png, args.per_server)


if __name__ == "__main__":
    main()

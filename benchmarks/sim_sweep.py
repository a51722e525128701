"""Sweep ``ahcomm-sim``: predicted all_reduce time vs ranks per algorithm, the selector's pick
against the simulated best, closed-form agreement and a straggler's effect (markdown on stdout).

    PYTHONPATH=. python benchmarks/sim_sweep.py --ranks 8 16 32 64 128 > benchmarks/results/sim-sweep.md
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

from ahcomm.sim import candidates, closed_form, reference_model, simulate

SIZES = {"8 B": 8, "1 MiB": 1 << 20, "64 MiB": 64 << 20}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ranks", type=int, nargs="+", default=[8, 16, 32, 64, 128])
    p.add_argument("--per-server", type=int, default=8)
    p.add_argument("--budget", type=float, default=30.0, help="skip an algorithm at larger N once a run took this long")
    args = p.parse_args()
    k = args.per_server
    print(f"## Predicted all_reduce time (us), reference cluster, {k} ranks/server, contention on\n")
    print("| size | ranks | " + " | ".join(["ring", "rhd", "nhr", "hier"]) + " | selector's pick | simulated best | pick/best |")
    print("|---|---|---|---|---|---|---|---|---|")
    slow: set[str] = set()
    for label, size in SIZES.items():
        for n in args.ranks:
            times: dict[str, float] = {}
            pick = ""
            for name in ("ring", "rhd", "nhr", "hier"):
                if name not in candidates("all_reduce", n, k, size) or (name, size) in slow:
                    continue
                t0 = time.perf_counter()
                r = simulate("all_reduce", n, k, size, name)
                if time.perf_counter() - t0 > args.budget:
                    slow.add((name, size))  # type: ignore[arg-type]
                times[name], pick = r.time_us, r.pick
            best = min(times, key=times.__getitem__)
            cells = [f"{times[a]:.1f}" if a in times else "-" for a in ("ring", "rhd", "nhr", "hier")]
            ratio = f"{times[pick] / times[best]:.2f}" if pick in times else "?"
            print(f"| {label} | {n} | " + " | ".join(cells) + f" | {pick} | {best} | {ratio} |", flush=True)
    model = replace(reference_model(), gamma=0.0, copy=0.0)
    print("\n## Simulated vs closed form (contention off, no compute), 64 MiB all_reduce\n")
    print("| ranks | algorithm | simulated us | closed form us | diff |")
    print("|---|---|---|---|---|")
    for n in args.ranks:
        for name in ("ring", "rhd", "hier"):
            cf = closed_form("all_reduce", name, n, k, 64 << 20, model)
            if cf is None:
                continue
            r = simulate("all_reduce", n, k, 64 << 20, name, model=model, contention=False)
            print(f"| {n} | {name} | {r.time_us:.1f} | {cf * 1e6:.1f} | {(r.time_us / (cf * 1e6) - 1) * 100:+.1f}% |",
                  flush=True)
    n = min(64, max(args.ranks))
    print(f"\n## One straggler (rank 3 starts 100 us late), {n} ranks, 1 MiB all_reduce\n")
    print("| algorithm | on time us | with straggler us | added |")
    print("|---|---|---|---|")
    for name in candidates("all_reduce", n, k, 1 << 20):
        a = simulate("all_reduce", n, k, 1 << 20, name).time_us
        b = simulate("all_reduce", n, k, 1 << 20, name, straggler=(3, 100e-6)).time_us
        print(f"| {name} | {a:.1f} | {b:.1f} | {b - a:+.1f} |", flush=True)


if __name__ == "__main__":
    main()

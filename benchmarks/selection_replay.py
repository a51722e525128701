"""The selector's picks replayed against timings already measured: every point of a
``ahcomm-bench tune`` run (each candidate timed) priced by a cost model, no job started.

    python3 benchmarks/selection_replay.py --model ~/.cache/ahcomm/calibration.json
    python3 benchmarks/selection_replay.py --model cal.json --tune benchmarks/results/latest.json

A point counts as a hit where the model's pick took within ``--tolerance`` (10%) of the
fastest candidate's time; the picks ``tune`` saved in the model are left out (the model alone
decides). Prints one line per point and the totals (hits, geometric mean and worst of pick /
fastest). The tune data is ``compare.py --tune``'s ``latest.json`` (its ``tune`` entry) or
``ahcomm-bench tune --json``'s output.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from ahcomm._dtypes import ReduceOp
from ahcomm.algorithms import REGISTRY, Call, Topology
from ahcomm.algorithms._selection import Selector
from ahcomm.algorithms.cost import CostModel
from ahcomm.sim import load_model

BLOCKED = ("all_gather", "reduce_scatter")
REDUCING = ("all_reduce", "reduce_scatter", "reduce")


def replay(model: CostModel, tune: dict[str, Any], tolerance: float) -> tuple[list[str], int, int, float, float]:
    """(lines, hits, points, geometric mean and worst of pick / fastest)."""
    model = dataclasses.replace(model, picks=())
    lines, ratios = [], []
    for result in tune["results"]:
        n = int(result["ranks"])
        kind = (result.get("links") or ["sdma"])[0]
        topo = Topology(rank=0, size=n, hosts=("h",) * n, link_kinds=("self",) + (kind,) * (n - 1),
                        all_mapped=kind != "rdma", single_copy=bool(result.get("single_copy")), mailbox=1 << 20)
        selector = Selector(REGISTRY, "", model)
        for p in result["points"]:
            op, times = p["op"], p["times"]
            count = int(p["bytes"]) // 4 // (n if op in BLOCKED else 1)
            call = Call(op=op, seq=0, dtype=np.dtype(np.float32), count=count,
                        redop=ReduceOp.SUM if op in REDUCING else None, root=0)
            pick, fastest = selector.choose(call, topo).name, min(times, key=times.get)
            if pick not in times:  # the model picks what tune did not time: no verdict
                lines.append(f"np={n} {op} {p['bytes']} B: picks {pick}, not timed")
                continue
            ratios.append(times[pick] / times[fastest])
            lines.append(f"np={n} {op} {p['bytes']} B: picks {pick} ({ratios[-1]:.2f}x {fastest})")
    hits = sum(r <= 1 + tolerance for r in ratios)
    mean = math.exp(sum(math.log(r) for r in ratios) / len(ratios)) if ratios else float("nan")
    return lines, hits, len(ratios), mean, max(ratios, default=float("nan"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="a calibration (ahcomm-bench calibrate's JSON)")
    p.add_argument("--tune", default=str(Path(__file__).parent / "results" / "latest.json"),
                   help="tune timings: compare.py's latest.json or ahcomm-bench tune --json (default: latest.json)")
    p.add_argument("--tolerance", type=float, default=0.10)
    args = p.parse_args()
    try:
        model = load_model(args.model)
        data = json.loads(Path(args.tune).read_text())
    except (OSError, ValueError) as exc:  # a missing or wrong file: say which, no traceback
        p.error(str(exc))
    lines, hits, points, mean, worst = replay(model, data.get("tune", data), args.tolerance)
    print("\n".join(lines))
    print(f"{hits} of {points} within {args.tolerance:.0%} of the fastest; pick / fastest: geometric mean "
          f"{mean:.3f}, worst {worst:.2f}")


if __name__ == "__main__":
    main()

"""The selector against the measured best, for every op, size and rank count (issue 11's table).

    python3 benchmarks/selection_sweep.py                     # np 2 and 4, 8 B..8 MiB, sdma
    python3 benchmarks/selection_sweep.py --np 2 --ops all_reduce,broadcast --max-seconds 0.2
    AHCOMM_TRANSPORT=rdma python3 benchmarks/selection_sweep.py --tag rdma

Each (op, np) is one ``ahcomm-bench OP --algorithm all`` run: every algorithm that can run
the op is timed at every size, then the selector's own pick (``algorithm=auto``); the bench's
``selection`` rows give pick / best per size (median times). A case counts as a hit when the
pick is within ``--tolerance`` (10%) of the fastest. Writes
``benchmarks/results/<date>-selection[-TAG].md`` and ``.json``.

Timings on a shared host move by more than 10% between two timings of one algorithm, so a
miss is worth a look only when it repeats; the table says the host's load when it ran.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from compare import ROOT, run_json

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "gather", "scatter", "all_to_all")


def sweep(op: str, np_: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    """The bench's selection rows for one op at ``np_`` ranks."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "sel.json"
        cmd = [sys.executable, "-m", "ahcomm.bench", "-n", str(np_), op, "-b", args.minbytes, "-e", args.maxbytes,
               "-f", str(args.stepfactor), "--algorithm", "all", "--max-seconds", str(args.max_seconds),
               "--json", str(out)]
        data = run_json(cmd, args.timeout, Path(tmp) / "log.txt")
    if "error" in data:
        print(f"  {op} np{np_} failed: {data['error']['tail'][-400:]}", flush=True)
    return list(data.get("selection", []))


def cell(row: dict[str, Any], tolerance: float) -> str:
    if row["ratio"] <= 1 + tolerance:
        return row["pick"]
    return f"{row['pick']}({row['best']} {row['ratio']:.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--np", default="2,4", help="rank counts, comma separated (default 2,4)")
    parser.add_argument("--ops", default=",".join(OPS), help="ops, comma separated (default: all eight)")
    parser.add_argument("-b", "--minbytes", default="8")
    parser.add_argument("-e", "--maxbytes", default="8M")
    parser.add_argument("-f", "--stepfactor", type=int, default=8)
    parser.add_argument("--max-seconds", type=float, default=0.3, help="timed seconds per size and algorithm")
    parser.add_argument("--tolerance", type=float, default=0.10)
    parser.add_argument("--timeout", type=float, default=900, help="seconds per (op, np) run")
    parser.add_argument("--tag", default="", help="suffix of the result files (e.g. rdma)")
    args = parser.parse_args()

    ops = [o for o in args.ops.split(",") if o]
    nps = [int(n) for n in args.np.split(",") if n]
    load = os.getloadavg()
    results: dict[str, list[dict[str, Any]]] = {}
    for np_ in nps:
        for op in ops:
            results[f"{op} np{np_}"] = rows = sweep(op, np_, args)
            print(f"{op:<15} np{np_}: " + " ".join(cell(r, args.tolerance) for r in rows), flush=True)
    cases = [r for rows in results.values() for r in rows]
    hits = sum(1 for r in cases if r["ratio"] <= 1 + args.tolerance)
    transport = os.environ.get("AHCOMM_TRANSPORT", "sdma (one host)")
    day = datetime.date.today().isoformat()
    stem = f"{day}-selection" + (f"-{args.tag}" if args.tag else "")
    lines = [
        f"# Selector vs measured ({day}, {transport})", "",
        f"`python3 benchmarks/selection_sweep.py --np {args.np} -b {args.minbytes} -e {args.maxbytes} "
        f"-f {args.stepfactor} --max-seconds {args.max_seconds}`; load average at the start "
        f"{load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f} on {os.cpu_count()} cores.", "",
        f"Each row: the selector's pick per size, {args.minbytes} to {args.maxbytes} by x{args.stepfactor} (the "
        "blocked ops' sizes counted as ahcomm-bench counts them); where another "
        f"algorithm measured more than {args.tolerance:.0%} faster, it is named with pick/best.", "",
        f"Pick within {args.tolerance:.0%} of the best: **{hits} of {len(cases)}** cases.", "", "```",
    ]
    for key, rows in results.items():
        op, np_ = key.split()
        lines.append(f"{op:<15} {np_}: " + " ".join(cell(r, args.tolerance) for r in rows))
    lines.append("```")
    out_dir = ROOT / "benchmarks" / "results"
    (out_dir / f"{stem}.md").write_text("\n".join(lines) + "\n")
    (out_dir / f"{stem}.json").write_text(json.dumps({"load": load, "results": results}, indent=1))
    print(f"pick within {args.tolerance:.0%}: {hits} of {len(cases)}; wrote {out_dir / stem}.md")


if __name__ == "__main__":
    main()

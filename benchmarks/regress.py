"""Never slower than before: ahcomm-bench for every op and size on an older revision and on this tree.

    python3 benchmarks/regress.py --base 238cf12          # np 2, 8 B..8 MiB, 3 rounds (~5-8 min)
    python3 benchmarks/regress.py --base 238cf12 --quick  # 1 round, shorter timing per size

The base revision is exported with ``git archive`` into a temporary folder (no worktree, no
change to the repository); "new" is this working tree as it is (uncommitted edits included),
or ``--head REV`` exported the same way. Each run is ``python -m ahcomm.bench -n N OP ...
--json F`` with PYTHONPATH and the working folder set to that tree, so the launched ranks
import that tree's ahcomm. Per round and op the two trees run back to back, in alternating
order (old first in even rounds, new first in odd ones), so a change in the host's load hits
both alike. A cell is the median over rounds of the bench's per-size median time (us, mean
over ranks); ratio = new / old (< 1: faster now); rows above 1 + --tolerance are flagged.
Writes benchmarks/results/<date>-regress-<base>-np<N>.md and .json.
"""
from __future__ import annotations

import argparse
import datetime
import io
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

from compare import ROOT, fmt_size, run_json

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "gather", "scatter", "all_to_all")


def export(rev: str, dest: Path) -> str:
    """``git archive rev`` unpacked into dest; returns the full commit id."""
    sha = subprocess.run(["git", "rev-parse", "--verify", f"{rev}^{{commit}}"], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout.strip()
    tar = subprocess.run(["git", "archive", "--format=tar", sha], cwd=ROOT, capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(tar)) as tf:
        tf.extractall(dest, filter="data")
    return sha


def bench(tree: Path, op: str, a: argparse.Namespace, out: Path, log: Path) -> dict[str, Any]:
    """One ahcomm-bench run of op on tree."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [a.python, "-m", "ahcomm.bench", "-n", str(a.np), op, "-b", a.b, "-e", a.e, "-f", str(a.f),
           "-w", str(a.w), "-i", str(a.i), "--max-seconds", str(a.max_seconds), *a.bench_args.split(),
           "--json", str(out)]
    return run_json(cmd, a.timeout, log, env=env, cwd=tree)  # python -m puts the working folder first on sys.path


def table(runs: dict[str, dict[str, list[dict[str, Any]]]], ops: list[str],
          tol: float) -> tuple[list[str], list[dict[str, Any]]]:
    """Markdown lines and JSON rows: per op and size, old and new median us, ratio, algorithms."""
    lines, rows = [], []
    for op in ops:
        per: dict[str, dict[int, list[dict[str, Any]]]] = {"old": {}, "new": {}}
        for side in per:
            for doc in runs[side][op]:
                for r in doc.get("rows", []):
                    if r.get("op", op) == op:
                        per[side].setdefault(int(r["size"]), []).append(r)
        errors = [(side, doc["error"]) for side in per for doc in runs[side][op] if "error" in doc]
        lines += [f"## {op}", "", "| size | old us | new us | new / old | old alg | new alg | |",
                  "|---:|---:|---:|---:|---|---|---|"]
        for size in sorted(set(per["old"]) | set(per["new"])):
            med = {s: statistics.median(_median(r) for r in per[s][size])
                   if size in per[s] else None for s in per}
            alg = {s: "/".join(sorted({str(r.get("algorithm", "?")) for r in per[s].get(size, [])})) or "-"
                   for s in per}
            wrong = sum(int(r.get("wrong", 0)) for s in per for r in per[s].get(size, []))
            ratio = med["new"] / med["old"] if med["old"] and med["new"] else None
            flag = "WRONG" if wrong else ("slower" if ratio and ratio > 1 + tol else "")
            cell = {s: f"{med[s]:.1f}" if med[s] is not None else "-" for s in per}
            lines.append(f"| {fmt_size(size)} | {cell['old']} | {cell['new']} | "
                         f"{f'{ratio:.2f}' if ratio else '-'} | {alg['old']} | {alg['new']} | {flag} |")
            rows.append({"op": op, "size": size, "old_us": med["old"], "new_us": med["new"], "ratio": ratio,
                         "old_algorithm": alg["old"], "new_algorithm": alg["new"], "wrong": wrong,
                         "old_rounds": [_median(r) for r in per["old"].get(size, [])],
                         "new_rounds": [_median(r) for r in per["new"].get(size, [])]})
        lines.append("")
        for side, e in errors:
            lines += [f"- **{side}** failed rc={e['rc']}: `{e['cmd']}`", "", "```", e["tail"][-1200:], "```", ""]
    return lines, rows


def _median(row: dict[str, Any]) -> float:
    """The bench's median us per call averaged over ranks: ``median_avg_us`` (``median_us`` is the
    slowest rank's since 2026-11-25; an older revision's ``median_us`` is that average)."""
    return float(row.get("median_avg_us", row.get("median_us", row["time_us"])))


def main(argv: list[str] | None = None) -> int:
    """CLI."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", required=True, help="the older revision (commit, tag, branch)")
    p.add_argument("--head", default=None, help="the newer revision (default: this working tree as it is)")
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--ops", default=",".join(OPS))
    p.add_argument("-b", default="8")
    p.add_argument("-e", default="8M")
    p.add_argument("-f", type=int, default=4)
    p.add_argument("-w", type=int, default=5)
    p.add_argument("-i", type=int, default=50)
    p.add_argument("--max-seconds", type=float, default=0.3, help="cap on timed seconds per size (ahcomm-bench)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="1 round, -i 20 --max-seconds 0.15")
    p.add_argument("--tolerance", type=float, default=0.10, help="flag new/old above 1 + this")
    p.add_argument("--bench-args", default="", help="more ahcomm-bench flags for both, e.g. --inplace")
    p.add_argument("--python", default=str(ROOT / ".venv" / "bin" / "python"),
                   help="interpreter with ahcomm's dependencies (default .venv)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per bench run")
    p.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "results"))
    a = p.parse_args(argv)
    if a.quick:
        a.rounds, a.i, a.max_seconds = 1, 20, 0.15
    ops = [x for x in a.ops.split(",") if x]
    if bad := set(ops) - set(OPS):
        p.error(f"unknown ops {sorted(bad)}; choose from {', '.join(OPS)}")
    t0, date = time.monotonic(), datetime.date.today().isoformat()
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory(prefix="ahcomm-regress-") as td:
        tmp = Path(td)
        old = tmp / "old"
        base_sha = export(a.base, old)
        if a.head:
            new = tmp / "new"
            head_desc = export(a.head, new)
        else:
            new = ROOT
            head_desc = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True,
                                       text=True).stdout.strip() + " (working tree)"
        print(f"old = {a.base} ({base_sha[:12]}) in {old}; new = {head_desc} in {new}", flush=True)
        runs: dict[str, dict[str, list[dict[str, Any]]]] = {"old": {o: [] for o in ops}, "new": {o: [] for o in ops}}
        for k in range(a.rounds):
            for op in ops:
                for side in (("old", "new") if k % 2 == 0 else ("new", "old")):
                    tree = old if side == "old" else new
                    runs[side][op].append(bench(tree, op, a, tmp / f"{side}-{op}-{k}.json",
                                                tmp / f"{side}-{op}-{k}.log"))
    load.append(os.getloadavg()[0])
    lines, rows = table(runs, ops, a.tolerance)
    slower = [r for r in rows if r["ratio"] and r["ratio"] > 1 + a.tolerance]
    head = [f"# Never slower than before: {a.base} ({base_sha[:12]}) vs {head_desc}, np={a.np} ({date})", "",
            f"- ahcomm-bench -n {a.np} OP -b {a.b} -e {a.e} -f {a.f} -w {a.w} -i {a.i} --max-seconds {a.max_seconds}"
            f" {a.bench_args}".rstrip() + f"; {a.rounds} round(s), old and new back to back in alternating order",
            "- cells: median over rounds of the bench's median us per call (mean over ranks); new / old < 1: faster now;"
            f" 'slower': above {1 + a.tolerance:.2f}",
            f"- load average (1 min) {load[0]:.1f} at the start, {load[-1]:.1f} at the end; {os.cpu_count()} cores",
            f"- {len(slower)} of {len(rows)} cases slower than {1 + a.tolerance:.2f}x", "", ""]
    md = "\n".join(head + lines) + "\n"
    outdir = Path(a.out_dir)
    outdir.mkdir(parents=True, exist_ok=True)
    stem = outdir / f"{date}-regress-{a.base.replace('/', '_')}-np{a.np}"
    Path(f"{stem}.md").write_text(md)
    Path(f"{stem}.json").write_text(json.dumps(
        {"date": date, "argv": sys.argv[1:], "base": base_sha, "head": head_desc, "np": a.np, "rounds": a.rounds,
         "load": load, "rows": rows}, indent=1))
    print(md)
    print(f"wrote {stem}.md and .json ({time.monotonic() - t0:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Small-message latency, side by side in one run: ahcomm (spin on and off), gloo, OpenMPI.

For each world size (--np 2,4) it runs one after another (never concurrently), each a black
box whose failure is recorded in the report while the others still run:
  * ahcomm:        ahcomm-run -n N python benchmarks/latency.py --inplace --cases ... --json F
  * ahcomm spin 0: the same with AHCOMM_SPIN_US=0 AHCOMM_YIELD_US=0 (the waiter sleeps at once)
  * gloo:          benchmarks/peers/gloo_bench.py -n N --latency ...
  * mpi:           benchmarks/peers/mpi_bench.py -n N --latency ...
Each case: one checked call, -w warm-up calls, -i calls timed one by one; p50 and p90 of the
slowest rank (benchmarks/peers/_latency.py). With --rounds R the tools take turns R times
and each cell is the median of the R rounds. Writes benchmarks/results/<date>-latency.md and
<date>-latency.json.

    python3 benchmarks/compare.py --latency            # -i 2000 -w 200, np 2 and 4 (~2 min)
    python3 benchmarks/compare.py --latency --quick    # -i 300 -w 50
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from compare import PEERS, ROOT, fmt_size, run_json

sys.path.insert(0, str(PEERS))
from _latency import CASES, cases

TOOLS = ("ahcomm", "ahcomm-spin0", "gloo", "mpi")
# issue 11's targets: (op, bytes, np) -> (p50 below this many us, or None; at least this many times faster
# than gloo's p50, or None)
TARGETS: dict[tuple[str, int, int], tuple[float | None, float | None]] = {
    ("all_reduce", 8, 2): (60, None), ("all_reduce", 8, 4): (200, None), ("barrier", 0, 2): (50, None),
    ("all_reduce", 32768, 2): (120, None),
    ("all_gather", 32768, 2): (None, 3), ("all_gather", 32768, 4): (None, 3),
    ("broadcast", 32768, 2): (None, 3), ("broadcast", 32768, 4): (None, 3)}


def command(tool: str, n: int, a: argparse.Namespace, out: Path) -> tuple[list[str], dict[str, str] | None]:
    """The command line (and environment) of one tool's run at world size n."""
    its = ["-i", str(a.i), "-w", str(a.w), "--cases", a.cases, "--json", str(out)]
    if tool.startswith("ahcomm"):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}
        if tool == "ahcomm-spin0":
            env["AHCOMM_SPIN_US"] = env["AHCOMM_YIELD_US"] = "0"
        return [a.ahcomm_python, "-m", "ahcomm.run", "-n", str(n), "--no-tag-output", a.ahcomm_python,
                str(ROOT / "benchmarks" / "latency.py"), "--inplace", *its], env
    script = "gloo_bench.py" if tool == "gloo" else "mpi_bench.py"
    return [a.bench_python, str(PEERS / script), "-n", str(n), "--latency", *its], None


def merge(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """R rounds of one tool -> one doc whose p50/p90 are the medians over the rounds."""
    ok = [d for d in docs if "error" not in d]
    out: dict[str, Any] = {"rows": [], "errors": [d["error"] for d in docs if "error" in d], "rounds": len(ok)}
    if ok:
        out.update({k: v for k, v in ok[0].items() if k not in ("rows", "error")})
        keyed: dict[tuple[str, int], list[dict[str, Any]]] = {}
        for d in ok:
            for r in d["rows"]:
                keyed.setdefault((r["op"], int(r["bytes"])), []).append(r)
        for rs in keyed.values():
            out["rows"].append({**rs[0], "p50_us": statistics.median(r["p50_us"] for r in rs),
                                "p90_us": statistics.median(r["p90_us"] for r in rs),
                                "wrong": sum(int(r["wrong"]) for r in rs),
                                "p50_rounds": [r["p50_us"] for r in rs]})
    return out


def cell(r: dict[str, Any] | None) -> str:
    """'p50 / p90' in us."""
    if r is None:
        return "-"
    bad = " (WRONG)" if int(r.get("wrong", 0)) else ""
    return f"{r['p50_us']:.1f} / {r['p90_us']:.1f}{bad}"


def verdict(op: str, nbytes: int, n: int, ah: dict[str, Any] | None, gloo: dict[str, Any] | None) -> str:
    """Issue 11's target for this case and whether ahcomm's p50 meets it."""
    below, times = TARGETS.get((op, nbytes, n), (None, None))
    if ah is None or (below is None and times is None):
        return ""
    if below is not None:
        return f"< {below:g} us: {'yes' if ah['p50_us'] < below else 'no'}"
    if gloo is None:
        return f">= {times:g}x gloo: no gloo number"
    return f">= {times:g}x gloo: {'yes' if gloo['p50_us'] >= times * ah['p50_us'] else 'no'}"


def section(n: int, res: dict[str, Any]) -> str:
    """Markdown for one world size."""
    tools = [t for t in TOOLS if t in res]
    rows = {t: {(r["op"], int(r["bytes"])): r for r in res[t]["rows"]} for t in tools}
    keys = list(dict.fromkeys(k for t in tools for k in rows[t]))
    peers = [p for p in ("gloo", "mpi") if p in res]
    head = ["op", "bytes"] + [f"{t} p50 / p90" for t in tools] + [f"{p} / ahcomm" for p in peers] + ["issue 11"]
    out = [f"## np={n}", "", "| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 2) + "---|"]
    for op, nbytes in keys:
        got = {t: rows[t].get((op, nbytes)) for t in tools}
        ah = got.get("ahcomm")
        speed = [f"{got[p]['p50_us'] / ah['p50_us']:.2g}x" if got[p] and ah and ah["p50_us"] > 0 else "-"
                 for p in peers]
        out.append("| " + " | ".join([op, fmt_size(nbytes) if nbytes else "-", *[cell(got[t]) for t in tools],
                                      *speed, verdict(op, nbytes, n, ah, got.get("gloo"))]) + " |")
    algs = sorted({f"{op} {fmt_size(b) if b else ''}: {r['note']}".replace(" :", ":")
                   for (op, b), r in rows.get("ahcomm", {}).items() if r.get("note") not in (None, "", "-")})
    out += ["", "ahcomm's algorithm: " + ", ".join(algs) if algs else "", ""]
    for t in tools:
        for e in res[t].get("errors", []):
            out += [f"- **{t}** failed rc={e['rc']}: `{e['cmd']}`", "", "```", e["tail"][-1500:], "```", ""]
    return "\n".join(out) + "\n"


def header(a: argparse.Namespace, res: dict[int, Any], date: str, loads: list[float]) -> str:
    """Report preamble."""
    vers = sorted({f"{t.split('-')[0]}: {d['version']}" for r in res.values() for t, d in r.items()
                   if d.get("version")})
    try:
        rev = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True,
                             text=True, timeout=10).stdout.strip() or "?"
    except (OSError, subprocess.SubprocessError):
        rev = "?"
    return "\n".join([
        f"# Small-message latency: ahcomm vs gloo vs OpenMPI ({date})", "",
        f"- machine: {platform.node()}, {os.cpu_count()} cores, Python {platform.python_version()};"
        f" load average (1 min) {loads[0]:.1f} at the start, {loads[-1]:.1f} at the end",
        f"- {a.i} timed calls after {a.w} warm-up calls per case, {a.rounds} round(s) (tools take turns;"
        " a cell is the median over rounds); np " + ", ".join(map(str, a.np)),
        "- cells: p50 / p90 in us of single back-to-back calls, the slowest rank's; float32, sum, root 0;"
        " all_reduce and broadcast in place, all_gather into a buffer made once; all_gather's bytes are"
        " each rank's share (the output is np times that)",
        "- ahcomm: default settings (AHCOMM_SPIN_US 30 where ranks do not outnumber cores,"
        " AHCOMM_YIELD_US 200 where they do by at most 2x); ahcomm-spin0: AHCOMM_SPIN_US=0 AHCOMM_YIELD_US=0"
        " (sleep at once); gloo: torch.distributed over 127.0.0.1;"
        " mpi: Open MPI sm BTL (busy-polls)",
        "- peer / ahcomm = peer p50 / ahcomm p50 (>1: ahcomm faster); issue 11: its target for the case",
        *[f"- {v}" for v in vers], f"- ahcomm tree: {ROOT} at {rev}", "", ""])


def main(argv: list[str] | None = None) -> int:
    """CLI (also reached as benchmarks/compare.py --latency)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--np", default="2,4", help="comma list of world sizes")
    p.add_argument("--tools", default=",".join(TOOLS))
    p.add_argument("--cases", default=CASES, help="op:bytes comma list (all_gather: bytes per rank)")
    p.add_argument("-i", type=int, default=2000, help="timed calls per case")
    p.add_argument("-w", type=int, default=200, help="warm-up calls per case")
    p.add_argument("--rounds", type=int, default=1, help="tools take turns this many times")
    p.add_argument("--quick", action="store_true", help="-i 300 -w 50")
    p.add_argument("--ahcomm-python", default=str(ROOT / ".venv" / "bin" / "python"))
    p.add_argument("--bench-python", default=str(ROOT / ".venv-bench" / "bin" / "python"))
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per tool run")
    p.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "results"))
    a = p.parse_args(argv)
    if a.quick:
        a.i, a.w = 300, 50
    a.np = [int(x) for x in a.np.split(",") if x]
    tools = [t for t in a.tools.split(",") if t]
    if unknown := set(tools) - set(TOOLS):
        p.error(f"unknown tools {sorted(unknown)}; choose from {', '.join(TOOLS)}")
    cases(a.cases)  # bad specs fail here, not in every tool
    outdir = Path(a.out_dir)
    outdir.mkdir(parents=True, exist_ok=True)
    date, loads, t0 = datetime.date.today().isoformat(), [os.getloadavg()[0]], time.monotonic()
    res: dict[int, Any] = {}
    with tempfile.TemporaryDirectory(prefix="ahcomm-latency-") as td:
        for n in a.np:
            print(f"== np={n}", flush=True)
            docs: dict[str, list[dict[str, Any]]] = {t: [] for t in tools}
            for k in range(a.rounds):
                for t in tools:
                    f = Path(td) / f"{t}-np{n}-{k}.json"
                    cmd, env = command(t, n, a, f)
                    docs[t].append(run_json(cmd, a.timeout, Path(td) / f"{t}-np{n}-{k}.log", env=env))
            res[n] = {t: merge(d) for t, d in docs.items()}
    loads.append(os.getloadavg()[0])
    md = header(a, res, date, loads) + "".join(section(n, res[n]) for n in a.np)
    (outdir / f"{date}-latency.md").write_text(md)
    (outdir / f"{date}-latency.json").write_text(json.dumps(
        {"date": date, "argv": sys.argv[1:], "iters": a.i, "warmup": a.w, "rounds": a.rounds, "load": loads,
         "results": {str(n): r for n, r in res.items()}}, indent=1))
    print(md)
    print(f"wrote {outdir}/{date}-latency.md and {date}-latency.json ({time.monotonic() - t0:.0f} s)", flush=True)
    failed = sorted({t for r in res.values() for t, d in r.items() if d["errors"]})
    if failed:
        print(f"note: errors recorded for {failed} (see the report)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Run ahcomm, torch/gloo and OpenMPI collective benchmarks back to back and compare busbw.

For each world size (--np 2,4) it runs, one after another (never concurrently):
  * ahcomm: `<ahcomm-python> -m ahcomm.bench -n N OP -b B -e E -f F --json FILE`, once per op
    (a black box: any failure is recorded in the report, the other tools still run);
  * gloo:   `<bench-python> benchmarks/peers/gloo_bench.py -n N ...`;
  * mpi:    `<bench-python> benchmarks/peers/mpi_bench.py -n N ...` (relaunches under mpirun).
Writes benchmarks/results/<date>-np<N>.md, latest.md and latest.json.
Ratios are busbw(ahcomm) / busbw(peer): above 1 means ahcomm is faster.

    python3 benchmarks/compare.py            # -b 8 -e 64M -f 4, np 2 and 4
    python3 benchmarks/compare.py --quick    # -b 8 -e 4M -f 16
    python3 benchmarks/compare.py --latency  # small-message p50/p90 instead (compare_latency.py)
    python3 benchmarks/compare.py --ops broadcast,all_gather -b 2M -e 64M -f 4 --rounds 3 \
        --ahcomm-algorithms direct,mesh,oneshot   # A/B of algorithms beside the peers, median of 3
    python3 benchmarks/compare.py -b 2M -e 64M -f 2 --rounds 3 --tune
        # first `ahcomm-bench tune` over the sweep's ops, rank counts and sizes: ahcomm runs the
        # picks measured on this host (in a file of the run's own, not the user's calibration)
Every tool's time is its slowest rank's (max over ranks of the per-rank mean).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PEERS = ROOT / "benchmarks" / "peers"
OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
TOOLS = ("ahcomm", "gloo", "mpi")


def run_json(cmd: list[str], timeout: float, log: Path, env: dict[str, str] | None = None,
             cwd: Path = ROOT) -> dict[str, Any]:
    """Run cmd (which writes JSON to cmd[cmd.index('--json')+1]); return doc or {'error': ...}."""
    out = Path(cmd[cmd.index("--json") + 1])
    out.unlink(missing_ok=True)
    t0 = time.monotonic()
    try:  # own session, so a timeout kills the tool's whole process group (launched ranks too)
        p = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, start_new_session=True, env=env)
        try:
            so, se = p.communicate(timeout=timeout)
            rc, tail = p.returncode, (se or so)[-2000:]
            log.write_text(f"$ {' '.join(cmd)}\n--- stdout\n{so}\n--- stderr\n{se}")
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
            rc, tail = -1, f"timeout after {timeout:.0f} s"
    except OSError as exc:
        rc, tail = -1, f"{type(exc).__name__}: {exc}"
    secs = round(time.monotonic() - t0, 1)
    print(f"  [{secs:7.1f} s] rc={rc} {' '.join(cmd)}", flush=True)
    if rc == 0:
        try:
            doc = json.loads(out.read_text())
            doc.setdefault("rows", [])
            return doc
        except (OSError, ValueError) as exc:
            tail = f"rc=0 but no valid JSON at {out}: {exc}\n{tail}"
    return {"error": {"cmd": " ".join(cmd), "rc": rc, "tail": tail.strip()}}


def sweep_args(a: argparse.Namespace) -> list[str]:
    """nccl-tests style sweep flags passed to every tool."""
    args = ["-b", a.b, "-e", a.e, "-f", str(a.f)]
    if a.w is not None:
        args += ["-w", str(a.w)]
    if a.i is not None:
        args += ["-i", str(a.i)]
    return args


def tune(a: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """``ahcomm-bench tune`` over the sweep's ops, rank counts and sizes into a tuning file of this
    run's own (``a.ahcomm_env`` then points the ahcomm runs at it); its report, or the error."""
    model = tmp / "tuned.json"  # the user's calibration with the new picks (``tune --save``)
    t0 = time.monotonic()
    doc = run_json([a.ahcomm_python, "-m", "ahcomm.bench", "tune", "--ranks", ",".join(map(str, a.np)),
                    "--ops", ",".join(a.ops), *sweep_args(a), "--save", str(model), "--json", str(tmp / "tune.json")],
                   a.timeout, tmp / "tune.log")
    doc["seconds"] = round(time.monotonic() - t0, 1)
    if "error" not in doc:
        a.ahcomm_env = {**os.environ, "AHCOMM_TUNING_FILE": str(model)}
    return doc


def run_np(n: int, a: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """All tools at world size n -> {tool: {"rows": [...], "errors": [...], ...}}."""
    res: dict[str, Any] = {}
    sw = sweep_args(a)
    variants = [("ahcomm", [])] if "ahcomm" in a.tools else []
    variants += [(f"ahcomm:{name}", ["--algorithm", name]) for name in a.ahcomm_algorithms]
    if a.registered and "ahcomm" in a.tools:  # the same picks, buffers from ahcomm.alloc
        variants.append(("ahcomm:registered", ["--registered"]))
    for tool, forced in variants:
        merged: dict[str, Any] = {"tool": tool, "np": n, "rows": [], "errors": []}
        for op in a.ops:
            tag = tool.replace(":", "-")
            f = tmp / f"{tag}-np{n}-{op}.json"
            doc = run_json([a.ahcomm_python, "-m", "ahcomm.bench", "-n", str(n), op, *sw, *a.ahcomm_args.split(),
                            *forced, "--json", str(f)], a.timeout, tmp / f"{tag}-np{n}-{op}.log", env=a.ahcomm_env)
            if "error" in doc:
                merged["errors"].append({"op": op, **doc["error"]})
            else:
                merged["rows"] += [r for r in doc["rows"] if r.get("op", op) == op]
                merged.update({k: v for k, v in doc.items() if k not in ("rows", "np", "tool")})
        res[tool] = merged
    for tool, script, extra in (("gloo", "gloo_bench.py", a.gloo_args),
                                ("mpi", "mpi_bench.py", a.mpi_args)):
        if tool not in a.tools:
            continue
        f = tmp / f"{tool}-np{n}.json"
        doc = run_json([a.bench_python, str(PEERS / script), "-n", str(n), *sw,
                        "--ops", ",".join(a.ops), *extra.split(), "--json", str(f)],
                       a.timeout, tmp / f"{tool}-np{n}.log")
        doc.setdefault("rows", [])
        doc["errors"] = [doc.pop("error")] if "error" in doc else []
        res[tool] = doc
    return res


def merge_rounds(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One result per tool from several rounds: per (op, size) the row of the median time
    (the lower middle for an even count), with every round's busbw in ``rounds_busbw``."""
    out: dict[str, Any] = {}
    for tool in rounds[0]:
        docs = [r[tool] for r in rounds if tool in r]
        groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
        for doc in docs:
            for row in doc.get("rows", []):
                groups.setdefault((row["op"], int(row["size"])), []).append(row)
        rows = []
        for key in sorted(groups, key=lambda k: (k[0], k[1])):
            got = groups[key]
            pick = sorted(got, key=lambda r: r["time_us"])[(len(got) - 1) // 2]
            rows.append({**pick, "rounds_busbw": [r["busbw"] for r in got]})
        merged = {k: v for k, v in docs[-1].items() if k not in ("rows", "errors")}
        merged["rows"] = rows
        merged["errors"] = [e for doc in docs for e in doc.get("errors", [])]
        out[tool] = merged
    return out


def fmt_size(b: int) -> str:
    """8 -> '8 B', 65536 -> '64 KiB'."""
    for unit, sh in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if b >= 1 << sh and b % (1 << (sh - 4 if sh > 10 else 0)) == 0:
            v = b / (1 << sh)
            return f"{v:g} {unit}"
    return f"{b} B"


def fmt_bw(x: float | None) -> str:
    """busbw cell."""
    if x is None:
        return "-"
    return f"{x:.3g}" if x < 1 else f"{x:.2f}"


def ratio(a: float | None, b: float | None) -> str:
    """a/b or '-'."""
    if not a or not b:
        return "-"
    return f"{a / b:.2f}" if a / b < 100 else f"{a / b:.0f}"


def rows_by(doc: dict[str, Any], op: str) -> dict[int, dict[str, Any]]:
    """{size: row} of one tool for one op."""
    return {int(r["size"]): r for r in doc.get("rows", []) if r.get("op") == op}


def np_section(n: int, res: dict[str, Any], ops: list[str], level: str = "##") -> str:
    """Markdown for one world size."""
    tools = [t for t in res if t.split(":")[0] in TOOLS]  # ahcomm, its forced variants, gloo, mpi
    out = [f"{level} np={n}", ""]
    smallest = {t: min(rows_by(res[t], "all_reduce"), default=None) for t in tools}
    if any(s is not None for s in smallest.values()):  # the sweep's smallest all_reduce (8 B by default)
        label = fmt_size(min(s for s in smallest.values() if s is not None))
        out += [f"{level}# {label} all_reduce time (slowest rank's mean us/op)", "",
                "| tool | size | time (us) |", "|---|---:|---:|"]
        for t in tools:
            ar, s = rows_by(res[t], "all_reduce"), smallest[t]
            out.append(f"| {t} | {fmt_size(s)} | {ar[s]['time_us']:.1f} |" if s is not None else f"| {t} | - | - |")
        out.append("")
    peers = [t for t in ("gloo", "mpi") if t in res]
    for op in ops:
        per = {t: rows_by(res[t], op) for t in tools}
        sizes = sorted(set().union(*[set(p) for p in per.values()]))
        head = ["size"] + [f"{t} busbw" for t in tools]
        if "ahcomm" in res:
            head += [f"ahcomm/{p}" for p in peers]
        out += [f"{level}# {op} (busbw GB/s)", "", "| " + " | ".join(head) + " |",
                "|" + "---:|" * len(head)]
        for s in sizes:
            bw = {t: (per[t][s]["busbw"] if s in per[t] else None) for t in tools}
            cells = [fmt_size(s)]
            for t in tools:
                bad = s in per[t] and int(per[t][s].get("wrong", 0)) != 0
                cells.append(fmt_bw(bw[t]) + (" (WRONG)" if bad else ""))
            if "ahcomm" in res:
                cells += [ratio(bw["ahcomm"], bw[p]) for p in peers]
            out.append("| " + " | ".join(cells) + " |")
            spread = [f"{t} {'/'.join(fmt_bw(x) for x in per[t][s]['rounds_busbw'])}" for t in tools
                      if s in per[t] and len(per[t][s].get("rounds_busbw", [])) > 1]
            if spread:
                out.append("| | " + "; ".join(spread) + " |" + " |" * (len(head) - 2))
        notes = sorted({f"{t}: {r['note']}" for t in tools for r in per[t].values()
                        if r.get("note")})
        out += [""] + [f"- note {x}" for x in notes] + ([""] if notes else [])
    errs = [(t, e) for t in tools for e in res[t].get("errors", [])]
    if errs:
        out += [f"{level}# errors", ""]
        for t, e in errs:
            out += [f"- **{t}** {e.get('op', '')} rc={e['rc']}: `{e['cmd']}`", "",
                    "```", e["tail"][-1500:], "```", ""]
    return "\n".join(out) + "\n"


def header(a: argparse.Namespace, results: dict[int, Any], date: str) -> str:
    """Report preamble."""
    vers = sorted({f"{t}: {d.get('version', '?')}" for r in results.values()
                   for t, d in r.items() if d.get("version")})
    return "\n".join([
        f"# ahcomm vs gloo vs OpenMPI collectives ({date})", "",
        f"- machine: {platform.node()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        f"- sweep: -b {a.b} -e {a.e} -f {a.f}" + (f" -w {a.w}" if a.w is not None else "")
        + (f" -i {a.i}" if a.i is not None else "") + f"; np {', '.join(map(str, a.np))}",
        "- float32, sum, root 0; time = the slowest rank's mean us/op (max over ranks, every tool),"
        " busbw = size/time * (all_reduce 2(n-1)/n, all_gather/reduce_scatter (n-1)/n,"
        " broadcast 1), GB/s = 1e9 B/s; all_gather size = total output,"
        " reduce_scatter size = total input",
        "- ratio = ahcomm busbw / peer busbw (>1: ahcomm faster); np above the core count"
        " oversubscribes; ahcomm:NAME = ahcomm with --algorithm NAME; ahcomm:registered = the same picks"
        " on buffers from ahcomm.alloc (ahcomm-bench -R)",
        f"- rounds: {a.rounds} (tools interleaved within each round; the median round's row is shown,"
        " every round's busbw on the line below it)",
        f"- load average (1 min) before each round: {', '.join(f'{x:.2f}' for x in a.loads) or '-'}",
        f"- ahcomm's picks: {a.picks}",
        *[f"- {v}" for v in vers], "", ""])


def main(argv: list[str] | None = None) -> int:
    """CLI."""
    argv = sys.argv[1:] if argv is None else argv
    if "--latency" in argv:
        from compare_latency import main as latency
        return latency([x for x in argv if x != "--latency"])
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--np", default="2,4", help="comma list of world sizes")
    p.add_argument("--ops", default=",".join(OPS))
    p.add_argument("--tools", default=",".join(TOOLS))
    p.add_argument("-b", default="8")
    p.add_argument("-e", default="64M")
    p.add_argument("-f", type=int, default=4)
    p.add_argument("-w", type=int, default=None, help="warmup iters (passed to all tools)")
    p.add_argument("-i", type=int, default=None, help="iters (passed to all tools)")
    p.add_argument("--quick", action="store_true", help="smoke sweep -b 8 -e 4M -f 16")
    p.add_argument("--latency", action="store_true",
                   help="small-message p50/p90 instead of the sweep (compare_latency.py; see --latency --help)")
    p.add_argument("--ahcomm-python", default=str(ROOT / ".venv" / "bin" / "python"))
    p.add_argument("--bench-python", default=str(ROOT / ".venv-bench" / "bin" / "python"))
    p.add_argument("--registered", action="store_true",
                   help="also run ahcomm with buffers from ahcomm.alloc (ahcomm-bench -R), as column ahcomm:registered")
    p.add_argument("--ahcomm-args", default="--inplace",
                   help="extra flags for ahcomm.bench (default --inplace: all_reduce and broadcast in place, "
                        "as torch's and MPI's calls here are)")
    p.add_argument("--gloo-args", default="", help="extra flags for gloo_bench.py")
    p.add_argument("--mpi-args", default="", help="extra flags for mpi_bench.py, e.g. "
                   "'--malloc-tuned' or '--out-of-place'")
    p.add_argument("--ahcomm-algorithms", default="", help="comma list: also run ahcomm forced to each "
                   "algorithm (columns ahcomm:NAME), e.g. 'direct,mesh' for an A/B in the same run")
    p.add_argument("--rounds", type=int, default=1, help="run every tool this many times, interleaved "
                   "(round 1: every tool, round 2: every tool, ...); report the median round")
    p.add_argument("--tune", action="store_true", help="first measure ahcomm's fastest algorithm per op, np and "
                   "size (ahcomm-bench tune, into this run's own file), then run the sweep with those picks")
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds per tool run")
    p.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "results"))
    a = p.parse_args(argv)
    if a.quick:
        a.b, a.e, a.f = "8", "4M", 16
    a.np = [int(x) for x in a.np.split(",") if x]
    a.ops = [x for x in a.ops.split(",") if x]
    a.tools = [x for x in a.tools.split(",") if x]
    a.ahcomm_algorithms = [x for x in a.ahcomm_algorithms.split(",") if x]
    a.loads = []
    a.ahcomm_env = None
    tuning = os.environ.get("AHCOMM_TUNING_FILE")
    a.picks = "the selector's, " + (f"AHCOMM_TUNING_FILE={tuning}" if tuning else "with this host's calibration file")
    outdir = Path(a.out_dir)
    outdir.mkdir(parents=True, exist_ok=True)
    date = datetime.date.today().isoformat()
    results: dict[int, Any] = {}
    with tempfile.TemporaryDirectory(prefix="ahcomm-compare-") as td:
        rounds: dict[int, list[dict[str, Any]]] = {n: [] for n in a.np}
        tuned: dict[str, Any] = {}
        if a.tune and "ahcomm" in a.tools:
            print("== ahcomm-bench tune", flush=True)
            tuned = tune(a, Path(td))
            a.picks = (f"measured by `ahcomm-bench tune` over this sweep's ops, np and sizes before round 1 "
                       f"({tuned['seconds']:.0f} s; latest.json's \"tune\" has its times)" if "error" not in tuned
                       else f"the selector's: `ahcomm-bench tune` failed ({tuned['error']['tail'][-200:]})")
        for k in range(max(1, a.rounds)):
            a.loads.append(os.getloadavg()[0])
            (Path(td) / f"r{k}").mkdir()
            for n in a.np:
                print(f"== round {k + 1}, np={n} (load {a.loads[-1]:.2f})", flush=True)
                rounds[n].append(run_np(n, a, Path(td) / f"r{k}"))
        for n in a.np:
            results[n] = merge_rounds(rounds[n])
            md = header(a, {n: results[n]}, date) + np_section(n, results[n], a.ops)
            (outdir / f"{date}-np{n}.md").write_text(md)
    latest = header(a, results, date) + "".join(np_section(n, results[n], a.ops)
                                                for n in a.np)
    (outdir / "latest.md").write_text(latest)
    (outdir / "latest.json").write_text(json.dumps(
        {"date": date, "argv": sys.argv[1:], "sweep": {"b": a.b, "e": a.e, "f": a.f},
         "results": {str(n): r for n, r in results.items()}, "tune": tuned}, indent=1))
    print(f"wrote {outdir}/latest.md, latest.json and {date}-np<N>.md", flush=True)
    failed = [t for r in results.values() for t, d in r.items() if d.get("errors")]
    if failed:
        print(f"note: errors recorded for {sorted(set(failed))} (see latest.md)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

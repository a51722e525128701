"""Print the README's benchmark summary from benchmarks/results/latest.json (made by compare.py)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

SIZES = {512 << 10: "512 KiB", 2 << 20: "2 MiB", 8 << 20: "8 MiB", 32 << 20: "32 MiB", 64 << 20: "64 MiB"}
OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")


def busbw(rows: list[dict], op: str, size: int) -> float | None:
    for row in rows:
        if row["op"] == op and row["size"] == size and row.get("wrong", 0) == 0:
            return float(row["busbw"])
    return None


def main(path: str) -> None:
    doc = json.loads(Path(path).read_text())
    res = doc["results"]
    print(f"Same-run comparison, {doc['date']}, this 2-core host, float32, sum, in place where the peers are "
          f"(sweep {doc['sweep']}). busbw in GB/s (nccl-tests definitions); ratio = ahcomm / peer.\n")
    print("| np | op | size | ahcomm | gloo | OpenMPI | vs gloo | vs MPI |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for n, tools in res.items():
        rows = {t: tools[t]["rows"] for t in ("ahcomm", "gloo", "mpi") if t in tools}
        for op in OPS:
            for size, label in SIZES.items():
                a, g, m = (busbw(rows.get(t, []), op, size) for t in ("ahcomm", "gloo", "mpi"))
                if a is None:
                    continue
                cells = [f"{v:.2f}" if v is not None else "-" for v in (a, g, m)]
                ratios = [f"{a / v:.2f}x" if v else "-" for v in (g, m)]
                print(f"| {n} | {op} | {label} | " + " | ".join(cells + ratios) + " |")
    small = [(n, [next((r for r in tools.get(t, {}).get("rows", []) if r["op"] == "all_reduce" and r["size"] == 8),
                       None) for t in ("ahcomm", "gloo", "mpi")]) for n, tools in res.items()]
    if not any(row for _, rows in small for row in rows):
        return  # the sweep had no 8-byte all_reduce
    print("\n8-byte all_reduce, the slowest rank's mean us per op:\n")
    print("| np | ahcomm | gloo | OpenMPI |")
    print("|---:|---:|---:|---:|")
    for n, rows in small:
        print(f"| {n} | " + " | ".join(f"{row['time_us']:.1f}" if row else "-" for row in rows) + " |")

if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("json", nargs="?", default=str(Path(__file__).parent / "results" / "latest.json"),
                   help="compare.py's JSON (default results/latest.json)")
    main(p.parse_args().json)

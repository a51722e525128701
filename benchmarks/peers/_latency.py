"""Latency mode shared by benchmarks/latency.py (ahcomm) and the peer benchmarks (gloo, MPI).

A case is ``op:bytes``: ``barrier:0``, ``all_reduce:8``, ``all_gather:32K``... float32, sum,
root 0. ``bytes`` is the buffer each rank passes in: all_reduce and broadcast the whole buffer,
all_gather each rank's share (the output is ``np`` times that). Every case: one checked call
with known inputs, ``warmup`` calls, then ``iters`` back-to-back calls, each timed on its own
(``perf_counter`` after every call); per rank the median (p50) and 90th percentile (p90) of
those times; reported: the slowest rank's p50 and p90 (so a fast rank never hides a slow one).
"""
from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any

from _common import parse_size

if TYPE_CHECKING:
    import numpy as np

CASES = "barrier:0,all_reduce:8,all_reduce:32K,all_gather:32K,broadcast:32K"
OPS = ("barrier", "all_reduce", "all_gather", "broadcast")


def add_args(p: argparse.ArgumentParser) -> None:
    """--latency and --cases (iterations: the shared -i / -w flags)."""
    p.add_argument("--latency", action="store_true",
                   help="latency mode: p50/p90 of single calls for --cases (use e.g. -i 2000 -w 200)")
    p.add_argument("--cases", default=CASES, help=f"latency cases, op:bytes comma list (default {CASES})")


def cases(spec: str) -> list[tuple[str, int]]:
    """'barrier:0,all_reduce:8' -> [('barrier', 0), ('all_reduce', 8)]; bad specs raise SystemExit."""
    out = []
    for item in (x.strip() for x in spec.split(",") if x.strip()):
        op, _, size = item.partition(":")
        if op not in OPS:
            raise SystemExit(f"latency case {item!r}: op must be one of {', '.join(OPS)}")
        try:
            nbytes = parse_size(size or "0")
        except ValueError:
            raise SystemExit(f"latency case {item!r}: size must be like 8, 32K, 1M") from None
        if op != "barrier" and nbytes < 4:
            raise SystemExit(f"latency case {item!r}: at least one float32 (4 bytes)")
        out.append((op, 0 if op == "barrier" else nbytes))
    return out


def elems(nbytes: int) -> int:
    """float32 elements of a case's input buffer."""
    return nbytes // 4


def spread(stamps: "np.ndarray") -> tuple[float, float]:
    """(p50, p90) in us of the gaps between consecutive perf_counter stamps (seconds)."""
    import numpy as np
    each = np.diff(stamps) * 1e6
    return float(np.median(each)), float(np.percentile(each, 90))


def row(op: str, nbytes: int, p50: float, p90: float, iters: int, wrong: int, note: str = "") -> dict[str, Any]:
    """One latency row of the shared JSON schema."""
    return {"op": op, "bytes": nbytes, "p50_us": p50, "p90_us": p90, "iters": iters, "wrong": wrong,
            "note": note}


def print_row(n: int, r: dict[str, Any]) -> None:
    """One line per case, as it finishes."""
    print(f"np={n} {r['op']:11s} {r['bytes']:7d} B  p50 {r['p50_us']:9.1f} us  p90 {r['p90_us']:9.1f} us  "
          f"iters {r['iters']}  wrong {r['wrong']}  {r['note']}", flush=True)


def write(path: str | None, tool: str, n: int, rows: list[dict[str, Any]], extra: dict[str, Any]) -> None:
    """{"tool", "np", "mode": "latency", "rows", ...extra} to path (if given)."""
    if path:
        with open(path, "w") as fh:
            json.dump({"tool": tool, "np": n, "mode": "latency", "rows": rows, **extra}, fh, indent=1)

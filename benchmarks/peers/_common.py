"""Shared helpers for the peer benchmarks (gloo, MPI): CLI, sizes, nccl-tests maths, output.

Conventions (nccl-tests):
  * size: all_reduce / broadcast = buffer bytes; all_gather = TOTAL output bytes (each rank
    sends size/np); reduce_scatter = TOTAL input bytes (each rank receives size/np).
    Requested sizes are rounded down to a whole number of float32 elements per rank
    (at least one element per rank), so e.g. 8 B all_gather at np=4 runs as 16 B.
  * count = size / 4 (total float32 elements, as nccl-tests prints it).
  * sweep: -b * -f^k, plus -e itself when the steps skip it.
  * time_us = the slowest rank's mean time per op (max over ranks of per-rank means): a rooted
    op's root may return long before its receivers, so an average over ranks flatters it.
  * algbw = size / time (GB/s, 1 GB = 1e9 B); busbw = algbw * factor(op, np).
"""
from __future__ import annotations

import argparse
import json
import math
from typing import TYPE_CHECKING, Any, Iterator

if TYPE_CHECKING:
    import numpy as np

OPS: tuple[str, ...] = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
ELEM = 4  # float32 bytes


def parse_size(text: str) -> int:
    """Parse '8', '64K', '4M', '1G' (binary multiples, as nccl-tests)."""
    text = text.strip().upper().rstrip("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    if text and text[-1] in mult:
        return int(float(text[:-1]) * mult[text[-1]])
    return int(text)


def make_parser(description: str) -> argparse.ArgumentParser:
    """nccl-tests style flags shared by both peer benchmarks."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("-n", "--np", type=int, default=2, help="world size")
    p.add_argument("-b", "--minbytes", type=parse_size, default=parse_size("8"))
    p.add_argument("-e", "--maxbytes", type=parse_size, default=parse_size("64M"))
    p.add_argument("-f", "--stepfactor", type=int, default=4)
    p.add_argument("-w", "--warmup_iters", type=int, default=3)
    p.add_argument("-i", "--iters", type=int, default=10)
    p.add_argument("--max-seconds", type=float, default=1.0,
                   help="cap on timed seconds per size (iters scaled down, min 3)")
    p.add_argument("--ops", default=",".join(OPS), help="comma list of ops")
    p.add_argument("--json", default=None, help="write results JSON here")
    return p


def sizes(minbytes: int, maxbytes: int, factor: int) -> Iterator[int]:
    """Geometric sweep minbytes * factor^k, plus maxbytes itself if the steps skip it.

    (Unlike nccl-tests, -b 8 -e 64M -f 4 therefore ends with 32M, 64M.)
    """
    s = max(1, minbytes)
    last = 0
    while s <= maxbytes:
        yield s
        last = s
        if factor <= 1:
            break
        s *= factor
    if last < maxbytes and factor > 1:
        yield maxbytes


def elems_per_rank(op: str, size: int, n: int) -> int:
    """float32 elements per rank-chunk for op at requested byte size."""
    total = max(1, size // ELEM)
    if op in ("all_gather", "reduce_scatter"):
        return max(1, total // n)
    return total


def actual_size(op: str, chunk: int, n: int) -> int:
    """Bytes reported for a chunk of `chunk` elements."""
    return chunk * ELEM * (n if op in ("all_gather", "reduce_scatter") else 1)


def cases(ops: str, minbytes: int, maxbytes: int, factor: int, n: int) -> Iterator[tuple[str, int, int, int, int]]:
    """(op, chunk, size, input elements, output elements) for every op and distinct swept size."""
    for op in [o for o in ops.split(",") if o]:
        seen: set[int] = set()
        for req in sizes(minbytes, maxbytes, factor):
            chunk = elems_per_rank(op, req, n)
            size = actual_size(op, chunk, n)
            if size in seen:
                continue
            seen.add(size)
            nin = chunk * n if op == "reduce_scatter" else chunk
            nout = chunk * n if op == "all_gather" else chunk
            yield op, chunk, size, nin, nout


def bus_factor(op: str, n: int) -> float:
    """nccl-tests busbw factor."""
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter"):
        return (n - 1) / n
    return 1.0


def timed_iters(warm_op_seconds: float, iters: int, max_seconds: float) -> int:
    """Iterations so the timed loop takes about max_seconds at most, at least min(3, iters)."""
    if warm_op_seconds <= 0:
        return iters
    budget = int(math.floor(max_seconds / warm_op_seconds))
    return max(min(3, iters), min(iters, budget))


def make_row(op: str, size: int, n: int, time_us: float, wrong: int,
             iters: int, note: str = "") -> dict[str, Any]:
    """One result row in the shared JSON schema."""
    algbw = size / (time_us * 1e-6) / 1e9 if time_us > 0 else 0.0
    return {"op": op, "size": size, "count": size // ELEM, "type": "float32",
            "redop": "sum", "root": 0, "time_us": time_us, "algbw": algbw,
            "busbw": algbw * bus_factor(op, n), "wrong": wrong, "iters": iters,
            "note": note}


def pattern(rank: int, count: int, offset: int = 0) -> "np.ndarray":
    """Known float32 input: ((i % 7) + 1) * (rank + 1); sums stay exact in float32."""
    import numpy as np
    idx = np.arange(offset, offset + count, dtype=np.int64)
    return (((idx % 7) + 1) * (rank + 1)).astype(np.float32)


def check_input(op: str, rank: int, n: int, chunk: int) -> "np.ndarray":
    """Input (send) buffer contents for the correctness call (broadcast: non-roots get -1)."""
    import numpy as np
    if op == "reduce_scatter":
        return pattern(rank, chunk * n)
    if op == "broadcast" and rank != 0:
        return np.full(chunk, -1.0, dtype=np.float32)
    return pattern(rank if op != "broadcast" else 0, chunk)


def expected(op: str, rank: int, n: int, chunk: int) -> "np.ndarray":
    """Output this rank should hold after the correctness call."""
    import numpy as np
    tri = n * (n + 1) // 2
    if op == "all_reduce":
        return pattern(0, chunk) * tri
    if op == "all_gather":
        return np.concatenate([pattern(r, chunk) for r in range(n)])
    if op == "reduce_scatter":
        return pattern(0, chunk, offset=rank * chunk) * tri
    return pattern(0, chunk)


def print_header(tool: str, n: int) -> None:
    """nccl-tests style header."""
    print(f"# {tool}  np={n}  (time = slowest rank's mean us/op; #wrong summed over ranks)")
    print(f"#{'op':>15} {'size':>12} {'count':>12} {'type':>8} {'redop':>6} {'root':>5} "
          f"{'time(us)':>11} {'algbw':>9} {'busbw':>9} {'#wrong':>7} {'iters':>6}  note")


def print_row(r: dict[str, Any]) -> None:
    """nccl-tests style table row."""
    print(f" {r['op']:>15} {r['size']:>12} {r['count']:>12} {r['type']:>8} {r['redop']:>6} "
          f"{r['root']:>5} {r['time_us']:>11.2f} {r['algbw']:>9.3g} {r['busbw']:>9.3g} "
          f"{r['wrong']:>7} {r['iters']:>6}  {r['note']}", flush=True)


def write_json(path: str | None, tool: str, n: int, rows: list[dict[str, Any]],
               extra: dict[str, Any] | None = None) -> None:
    """Write {"tool", "np", "rows", ...extra} to path (if given)."""
    if not path:
        return
    doc: dict[str, Any] = {"tool": tool, "np": n, "rows": rows}
    doc.update(extra or {})
    with open(path, "w") as fh:
        json.dump(doc, fh, indent=1)

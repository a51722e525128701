"""benchmarks/compare.py: rounds are merged into the median round's row per (tool, op, size)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent


def _compare() -> ModuleType:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("compare", ROOT / "benchmarks" / "compare.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _row(op: str, size: int, time_us: float) -> dict[str, object]:
    return {"op": op, "size": size, "time_us": time_us, "busbw": size / time_us / 1e3}


def test_the_median_round_is_reported_with_every_rounds_busbw() -> None:
    compare = _compare()
    rounds = [{"mpi": {"rows": [_row("broadcast", 1 << 20, t)], "errors": []},
               "ahcomm:direct": {"rows": [_row("broadcast", 1 << 20, 2 * t)], "errors": []}}
              for t in (30.0, 10.0, 20.0)]
    merged = compare.merge_rounds(rounds)
    (mpi,) = merged["mpi"]["rows"]
    assert mpi["time_us"] == 20.0 and len(mpi["rounds_busbw"]) == 3
    assert merged["ahcomm:direct"]["rows"][0]["time_us"] == 40.0
    two = compare.merge_rounds(rounds[:2])  # even: the lower middle (the faster of two), the same rule for every tool
    assert two["mpi"]["rows"][0]["time_us"] == 10.0
    md = compare.np_section(2, merged, ["broadcast"])
    assert "ahcomm:direct busbw" in md and "mpi " in md

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


def test_tune_runs_the_sweep_with_the_picks_it_measured(tmp_path: Path) -> None:
    """``--tune``: ahcomm-bench tune first, over the sweep's ops, np and sizes, into the run's own
    file; the ahcomm runs then take its picks (each row's algorithm is what tune saved), the report
    says so, and the user's calibration file is left as it was (its picks, ring's, would run where
    the ahcomm runs did not take the run's own file)."""
    import json
    import os
    import subprocess

    from ahcomm._tune import fastest

    mine = tmp_path / "calibration.json"
    ring = [{"op": "all_gather", "ranks": 2, "link": "sdma", "single_copy": True, "nbytes": n, "algorithm": "ring"}
            for n in (64 << 10, 128 << 10)]
    mine.write_text(json.dumps({"version": 2, "source": "defaults", "picks": ring}))
    before = mine.read_text()
    env = {**os.environ, "AHCOMM_TUNING_FILE": str(mine)}
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "compare.py"), "--tools", "ahcomm", "--np", "2",
                           "--ops", "all_gather", "-b", "64K", "-e", "128K", "-f", "2", "-w", "1", "-i", "3", "--tune",
                           "--ahcomm-python", sys.executable, "--out-dir", str(tmp_path / "out")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    latest = json.loads((tmp_path / "out" / "latest.json").read_text())
    points = latest["tune"]["results"][0]["points"]
    saved = {p["bytes"]: fastest(p) for p in points}
    rows = latest["results"]["2"]["ahcomm"]["rows"]
    assert sorted(saved) == [64 << 10, 128 << 10] and {r["size"]: r["algorithm"] for r in rows} == saved
    assert set(saved.values()) != {"ring"}  # (ring's 2 steps lose to one-step algorithms at 64 KiB)
    assert "measured by `ahcomm-bench tune`" in (tmp_path / "out" / "latest.md").read_text()
    assert mine.read_text() == before

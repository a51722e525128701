"""The benchmark scripts a newcomer runs by hand answer ``--help`` with their usage (and run
nothing); staged_probe.py took it for a size and died on int('--help'), summary.py for a file."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.mark.parametrize("script", ["staged_probe.py", "staged_reduce_probe.py", "limits.py", "summary.py",
                                    "selection_replay.py", "wake_probe.py", "result_reuse.py"])
def test_help_prints_usage_and_runs_nothing(script: str) -> None:
    done = subprocess.run([sys.executable, str(BENCHMARKS / script), "--help"], capture_output=True, text=True,
                          timeout=60, cwd=BENCHMARKS.parent)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage:") and "load" not in done.stdout and "GB/s" not in done.stdout.split("\n")[0]


def test_a_size_that_is_not_a_number_is_named() -> None:
    done = subprocess.run([sys.executable, str(BENCHMARKS / "staged_probe.py"), "lots"], capture_output=True,
                          text=True, timeout=60, cwd=BENCHMARKS.parent)
    assert done.returncode == 2 and "invalid int value: 'lots'" in done.stderr


@pytest.mark.parametrize(("lo", "hi", "factor"), [(8, 64 << 20, 4), (2 << 20, 64 << 20, 2), (3, 100, 10), (5, 5, 1)])
def test_every_tool_sweeps_the_same_sizes(lo: int, hi: int, factor: int) -> None:
    """The peers' scripts keep their own copy of the sweep (they run in the benchmark venv, which
    has no ahcomm): it must step as ahcomm-bench does, or compare.py's rows would not line up."""
    import importlib.util

    from ahcomm._bench_case import sizes

    spec = importlib.util.spec_from_file_location("peers_common", BENCHMARKS / "peers" / "_common.py")
    assert spec is not None and spec.loader is not None
    common = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(common)
    assert list(common.sizes(lo, hi, factor)) == list(sizes(lo, hi, factor))


def test_the_selection_replay_scores_the_model_s_picks_against_the_timings() -> None:
    """selection_replay.py prices each timed point with the model and compares its pick with the
    fastest: one point where the pick was fastest, one where it took twice as long."""
    import importlib.util

    import numpy as np

    from ahcomm.algorithms import REGISTRY, Call, CostModel, Topology
    from ahcomm.algorithms._selection import Selector

    spec = importlib.util.spec_from_file_location("selection_replay", BENCHMARKS / "selection_replay.py")
    assert spec is not None and spec.loader is not None
    replay = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(replay)
    model = CostModel(cores=2)
    topo = Topology(rank=0, size=2, hosts=("h",) * 2, link_kinds=("self", "sdma"), all_mapped=True,
                    single_copy=True, mailbox=1 << 20)
    sizes = (1 << 20, 64 << 20)
    picks = [Selector(REGISTRY, "", model).choose(Call(op="broadcast", seq=0, dtype=np.dtype(np.float32),
                                                       count=b // 4, root=0), topo).name for b in sizes]
    other = [next(a for a in ("ring", "star", "mesh") if a != pick) for pick in picks]
    tune = {"results": [{"ranks": 2, "links": ["sdma"], "single_copy": True, "points": [
        {"op": "broadcast", "bytes": sizes[0], "times": {picks[0]: 100.0, other[0]: 150.0}},
        {"op": "broadcast", "bytes": sizes[1], "times": {picks[1]: 200.0, other[1]: 100.0}}]}]}
    lines, hits, points, mean, worst = replay.replay(model, tune, 0.10)
    assert (hits, points, worst) == (1, 2, 2.0) and abs(mean - 2 ** 0.5) < 1e-9, lines


def test_the_selection_replay_names_a_model_it_cannot_read() -> None:
    done = subprocess.run([sys.executable, str(BENCHMARKS / "selection_replay.py"), "--model", "nothere.json"],
                          capture_output=True, text=True, timeout=60, cwd=BENCHMARKS.parent)
    assert done.returncode == 2 and "nothere.json" in done.stderr and "Traceback" not in done.stderr, done.stderr

"""The benchmark scripts a newcomer runs by hand answer ``--help`` with their usage (and run
nothing); staged_probe.py took it for a size and died on int('--help'), summary.py for a file."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.mark.parametrize("script", ["staged_probe.py", "limits.py", "summary.py"])
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

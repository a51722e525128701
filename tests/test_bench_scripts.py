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

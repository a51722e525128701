"""What a newcomer meets before the first collective: the package metadata, ``make demo``'s set-up,
the LICENSE, and ahcomm-bench's command line (argument errors before any rank starts)."""

from __future__ import annotations

import functools
import subprocess
import sys
import tomllib

import numpy as np
import pytest

from ahcomm import ReduceOp, _bench_case, bench

from jobs import ROOT, job_env


@functools.cache
def project() -> dict[str, object]:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]  # type: ignore[no-any-return]


def extra(name: str) -> list[str]:
    return project()["optional-dependencies"][name]  # type: ignore[index,no-any-return]


def test_requires_python_is_the_real_minimum() -> None:
    assert project()["requires-python"] == ">=3.11"  # asyncio.timeout, Task.cancelling
    readme = (ROOT / "README.md").read_text()
    assert "Python 3.11" in readme.split("ahcomm-run")[0], "the README says which Python before the first command"


def test_the_torch_extra_is_a_range_the_tested_torch_satisfies() -> None:
    (torch,) = extra("torch")
    assert torch.startswith("torch>=") and "==" not in torch, torch
    low = tuple(int(x) for x in torch.removeprefix("torch>=").split("."))
    assert low <= (2, 13, 0)
    assert "torch==2.13.0" in extra("test")  # a fresh test venv takes the local CPU wheel, never a CUDA build


def test_license_file_matches_the_metadata() -> None:
    assert project()["license"] == "Apache-2.0"
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text and "END OF TERMS" in text


def test_make_demo_installs_ahcomm_without_test_extras() -> None:
    done = subprocess.run(["make", "-n", "-B", "demo"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    if done.returncode == 127 or "not found" in done.stderr:
        pytest.skip("make is not installed")
    assert done.returncode == 0, done.stderr
    installs = [line for line in done.stdout.splitlines() if "pip install" in line]
    assert installs and all("[test]" not in line and "torch" not in line and "matplotlib" not in line
                            for line in installs), installs
    assert any(line.rstrip().endswith("pip install -q -e .") for line in installs), installs


def test_private_commands_are_not_in_bench_help() -> None:
    text = bench.parser().format_help()
    assert "_calibrate" not in text and "calibrate" in text
    assert "_tune" not in text and "--ranks" in text and "tune" in text


@pytest.mark.parametrize("op", [o.value for o in ReduceOp])
def test_bench_offers_every_reduce_op(op: str) -> None:
    assert bench.parser().parse_args(["all_reduce", "-o", op]).redop == op


@pytest.mark.parametrize("name", ["complex64", "object", "float128", "nonsense"])
def test_an_unsupported_dtype_is_an_argument_error(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        bench.parser().parse_args(["all_reduce", "-d", name])
    assert exit_.value.code == 2
    assert f"unsupported dtype '{name}'" in capsys.readouterr().err


def test_a_bad_size_is_an_argument_error_that_says_the_format(capsys: pytest.CaptureFixture[str]) -> None:
    """Before: 'invalid parse_size value' (a function's name, not the format)."""
    with pytest.raises(SystemExit) as exit_:
        bench.parser().parse_args(["all_reduce", "-b", "1X"])
    assert exit_.value.code == 2
    assert "size '1X': use a number of bytes, or one with K, M or G" in capsys.readouterr().err


def test_a_reduce_op_the_dtype_cannot_take_is_an_argument_error(capsys: pytest.CaptureFixture[str]) -> None:
    """Checked before any rank starts (before: two rank tracebacks)."""
    with pytest.raises(SystemExit) as exit_:
        bench.main(["-n", "2", "all_reduce", "-d", "int32", "-o", "avg"])
    assert exit_.value.code == 2
    assert "reduce op 'avg' needs a floating dtype" in capsys.readouterr().err


@pytest.mark.parametrize("redop", ["band", "bor", "bxor"])
def test_bench_checks_bitwise_results(redop: str) -> None:
    n, block, dtype = 3, 20, np.dtype(np.int32)
    ufunc = {"band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor}[redop]
    want = _bench_case.pattern(0, block, dtype)
    for r in range(1, n):
        want = ufunc(want, _bench_case.pattern(r, block, dtype))
    got = _bench_case.expected("all_reduce", 1, n, block, dtype, redop, 0)
    assert got is not None and np.array_equal(got, want)


@pytest.mark.multiprocess
def test_bench_runs_a_bitwise_sweep_with_no_wrong_elements() -> None:
    argv = [sys.executable, "-m", "ahcomm.bench", "-n", "2", "all_reduce", "-d", "uint16", "-o", "bxor", "-b", "8",
            "-e", "4K", "-f", "512", "-w", "1", "-i", "2", "--max-seconds", "0.05"]
    done = subprocess.run(argv, cwd=ROOT, env=job_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [line.split() for line in done.stdout.splitlines() if line.strip() and not line.startswith("#")]
    assert rows and all(row[2] == "uint16" and row[3] == "bxor" and row[8] == "0" for row in rows), done.stdout

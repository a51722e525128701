"""The examples run as documented (in process, and as real ranks through ahcomm-run)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
EXAMPLES = ROOT / "examples"


def run(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=180,
                          env={**os.environ, "AHCOMM_BUFFSIZE": "1", **(env or {})})


def test_custom_algorithm_in_process() -> None:
    proc = run(str(EXAMPLES / "custom_algorithm.py"))
    assert proc.returncode == 0, proc.stderr
    assert "hello_mesh all_gather on 4 ranks: [0.0, 1.0, 2.0, 3.0, 4.0, 10.0" in proc.stdout
    assert "'hello_mesh'" in proc.stdout
    assert "check_algorithm: hello_mesh matches numpy in 24 cases" in proc.stdout


@pytest.mark.multiprocess
def test_custom_algorithm_on_real_ranks() -> None:
    proc = run("-m", "ahcomm.run", "-n", "3", "python", str(EXAMPLES / "custom_algorithm.py"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "hello_mesh all_gather on 3 ranks" in proc.stdout


@pytest.mark.multiprocess
def test_custom_algorithm_selected_through_ahcomm_algo() -> None:
    """AHCOMM_ALGO names the registered algorithm: every all_gather then runs it."""
    script = ("import asyncio, runpy, numpy as np, ahcomm\n"
              "mod = runpy.run_path('examples/custom_algorithm.py')\n"
              "ahcomm.algorithms.register(mod['HelloAllGatherMesh']())\n"
              "async def main():\n"
              "    async with await ahcomm.init() as comm:\n"
              "        chosen, _ = comm.explain('all_gather', 4)\n"
              "        got = await comm.all_gather(np.full(4, comm.rank, np.float32))\n"
              "        assert got.tolist() == [p for p in range(comm.size) for _ in range(4)]\n"
              "        print(f'chosen {chosen}', flush=True)\n"
              "asyncio.run(main())\n")
    proc = run("-m", "ahcomm.run", "-n", "2", "python", "-c", script,
               env={"AHCOMM_ALGO": "allgather=level0:hello_mesh"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("hello_mesh") == 2 and "ring" not in proc.stdout, proc.stdout

"""Real jobs from the tests: ahcomm-run's command line, its environment, one subprocess call."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).parent.parent


def job_argv(n: int, *program: str, tag: bool = True, grace: float | None = None) -> list[str]:
    """``python -m ahcomm.run -n N [--grace G] --tag-output|--no-tag-output PROGRAM...``."""
    return [sys.executable, "-m", "ahcomm.run", "-n", str(n), *(["--grace", str(grace)] if grace else []),
            "--tag-output" if tag else "--no-tag-output", *program]


def job_env(env: dict[str, str] | None = None, *, drop: Iterable[str] = ()) -> dict[str, str]:
    """This process's environment without ``drop``, with ``env`` on top."""
    gone = set(drop)
    return {**{k: v for k, v in os.environ.items() if k not in gone}, **(env or {})}


def run_job(n: int, *program: str, env: dict[str, str] | None = None, timeout: float = 120, tag: bool = True,
            grace: float | None = None, drop: Iterable[str] = ()) -> subprocess.CompletedProcess[str]:
    """Run ``program`` on ``n`` ranks and wait for it (output captured as text)."""
    return subprocess.run(job_argv(n, *program, tag=tag, grace=grace), env=job_env(env, drop=drop),
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)

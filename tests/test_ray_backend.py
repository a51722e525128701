"""ahcomm.ray: "ahcomm" as a ray.util.collective backend, on a local Ray cluster (tests/ray_job.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray", reason="Ray is not installed (pip install 'ahcomm[ray]')")

ROOT = Path(__file__).parent.parent


@pytest.mark.multiprocess
def test_ray_actors_run_every_call_on_ahcomm() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "RAY_AUTH_MODE": "disabled"}
    proc = subprocess.run([sys.executable, str(Path(__file__).parent / "ray_job.py")], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for how in ("init_collective_group", "create_collective_group"):
        for rank in (0, 1):
            assert f"{how} rank {rank} ok" in proc.stdout, proc.stdout
    assert "dead peer: raised PeerFailure: rank 1 was lost" in proc.stdout, proc.stdout


def test_register_is_idempotent() -> None:
    from ray.util.collective.backend_registry import _global_registry

    import ahcomm.ray

    ahcomm.ray.register()
    ahcomm.ray.register()
    assert _global_registry.get("ahcomm") is ahcomm.ray.AhcommGroup


@pytest.mark.multiprocess
def test_async_actor_example() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "RAY_AUTH_MODE": "disabled"}
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "ray_async_actors.py")], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "joined ranks [0, 1]" in proc.stdout and proc.stdout.rstrip().endswith("OK"), proc.stdout

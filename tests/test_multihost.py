"""Several hosts as network namespaces joined by a bridge: ranks on one host use sdma links,
ranks on different hosts rdma links over real (veth) network hops."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from netns import Fabric

HERE = Path(__file__).parent
pytestmark = [pytest.mark.multiprocess]
AVAILABLE, WHY = Fabric.available()
SECRET = "multihost-test-secret-" + "0123456789abcdef"  # ranks started without ahcomm-run share one


def run_layout(layout: list[int], program: Path, timeout: float = 240) -> list[str]:
    """Start ``layout[h]`` ranks in host h; return every rank's output (raises on failure)."""
    size = sum(layout)
    with Fabric(len(layout)) as fabric:
        with socket.socket() as s:  # any free port number: the master binds it inside host 0
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        procs = []
        rank = 0
        for host, count in enumerate(layout):
            for local in range(count):
                env = {**os.environ, "AHCOMM_RANK": str(rank), "AHCOMM_WORLD_SIZE": str(size),
                       "AHCOMM_LOCAL_RANK": str(local), "AHCOMM_LOCAL_WORLD_SIZE": str(count),
                       "AHCOMM_MASTER_ADDR": fabric.address(0), "AHCOMM_MASTER_PORT": str(port),
                       "AHCOMM_SERVER_ID": f"host{host}", "AHCOMM_IF_IP": fabric.address(host),
                       "AHCOMM_BUFFSIZE": "0.0625", "AHCOMM_EXEC_TIMEOUT": "60", "AHCOMM_CONNECT_TIMEOUT": "60",
                       "MH_LAYOUT": ",".join(map(str, layout)), "PYTHONPATH": str(HERE),
                       "AHCOMM_JOB_SECRET": SECRET}
                procs.append(fabric.popen(host, [sys.executable, str(program)], env,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
                rank += 1
        outputs = []
        try:
            for proc in procs:
                out, _ = proc.communicate(timeout=timeout)
                outputs.append(out)
        finally:
            for proc in procs:
                proc.kill()
        failed = [i for i, p in enumerate(procs) if p.returncode != 0]
        assert not failed, f"ranks {failed} failed:\n" + "\n".join(outputs)
        return outputs


@pytest.mark.skipif(not AVAILABLE, reason=f"no network namespaces here: {WHY}")
@pytest.mark.parametrize("layout", [[2, 2], [3, 1], [2, 2, 2, 2]], ids=["2x2", "3+1", "4x2"])
def test_every_collective_across_hosts(layout: list[int]) -> None:
    outputs = run_layout(layout, HERE / "mh_worker.py")
    for rank, out in enumerate(outputs):
        match = re.search(r"OK rank (\d+)/\d+ host (\d+) cases=(\d+) sdma_bytes=(\d+) rdma_bytes=(\d+)", out)
        assert match and int(match.group(1)) == rank, out
        host, sdma, rdma = int(match.group(2)), int(match.group(4)), int(match.group(5))
        assert rdma > 0, f"rank {rank} sent nothing across hosts"
        assert (sdma > 0) == (layout[host] > 1), f"rank {rank}: {sdma} sdma bytes with {layout[host]} ranks on its host"

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


def worker_env(layout: list[int]) -> dict[str, str]:
    return {**os.environ, "AHCOMM_BUFFSIZE": "0.0625", "AHCOMM_EXEC_TIMEOUT": "60", "AHCOMM_CONNECT_TIMEOUT": "60",
            "MH_LAYOUT": ",".join(map(str, layout)), "PYTHONPATH": str(HERE), "AHCOMM_JOB_SECRET": SECRET}


def ok_ranks(output: str) -> set[int]:
    return {int(m) for m in re.findall(r"OK rank (\d+)/", output)}


@pytest.mark.skipif(not AVAILABLE, reason=f"no network namespaces here: {WHY}")
def test_launcher_torchrun_style_once_per_host() -> None:
    """``ahcomm-run --nnodes 2 --node-rank R --nproc-per-node 2 --master-addr A --master-port P``
    run once inside each host."""
    layout = [2, 2]
    with Fabric(2) as fabric:
        port = 29000 + os.getpid() % 1000
        procs = []
        for node in range(2):
            env = {**worker_env(layout), "AHCOMM_SERVER_ID": f"host{node}"}
            argv = [sys.executable, "-m", "ahcomm.run", "--nnodes", "2", "--node-rank", str(node),
                    "--nproc-per-node", "2", "--master-addr", fabric.address(0), "--master-port", str(port),
                    str(HERE / "mh_worker.py")]
            procs.append(fabric.popen(node, argv, env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
        outputs = [p.communicate(timeout=240)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(outputs)
    assert ok_ranks(outputs[0]) == {0, 1} and ok_ranks(outputs[1]) == {2, 3}, outputs


@pytest.mark.skipif(not AVAILABLE, reason=f"no network namespaces here: {WHY}")
def test_launcher_mpirun_style_hosts_over_rsh(tmp_path: Path) -> None:
    """``ahcomm-run -H a:3,b:1`` (and --hostfile) starts both hosts' ranks through AHCOMM_RSH;
    the secret reaches them on standard input, never on a command line."""
    layout = [3, 1]
    with Fabric(2) as fabric:
        hosts = {fabric.address(h): fabric.names[h] for h in range(2)}
        env = {**worker_env(layout), "AHCOMM_RSH": f"{sys.executable} {HERE / 'fake_rsh.py'}",
               "FAKE_RSH_HOSTS": ",".join(f"{a}={n}" for a, n in hosts.items())}
        hostfile = tmp_path / "hosts"
        hostfile.write_text(f"# two hosts\n{fabric.address(0)} slots=3\n{fabric.address(1)} slots=1\n")
        for how in (["-H", f"{fabric.address(0)}:3,{fabric.address(1)}:1"], ["--hostfile", str(hostfile)]):
            argv = [sys.executable, "-m", "ahcomm.run", *how, "--tag-output", str(HERE / "mh_worker.py")]
            proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=240)
            assert proc.returncode == 0, proc.stdout + proc.stderr
            assert ok_ranks(proc.stdout) == {0, 1, 2, 3}, proc.stdout
            assert SECRET not in proc.stdout + proc.stderr


NAMESPACE_PROGRAM = """
import asyncio, os, numpy as np, ahcomm
async def main():
    async with await ahcomm.init() as comm:
        got = await comm.all_reduce(np.full(4, comm.rank + 1.0))
        kinds = {p: l["kind"] for p, l in comm.stats()["links"].items()}
        print(f"NS rank {comm.rank} servers {comm.topology.servers} sum {got[0]:g} kinds {sorted(kinds.items())}",
              flush=True)
asyncio.run(main())
"""


@pytest.mark.skipif(not AVAILABLE, reason=f"no network namespaces here: {WHY}")
def test_namespaces_of_one_kernel_are_different_hosts_without_server_id() -> None:
    """Two network namespaces share hostname and boot id, not a network (nor abstract ipc
    sockets): launched as the README says, with no AHCOMM_SERVER_ID, they are two hosts."""
    with Fabric(2) as fabric:
        port = 29000 + (os.getpid() + 500) % 1000
        env = {k: v for k, v in os.environ.items() if k != "AHCOMM_SERVER_ID"}
        env.update({"AHCOMM_JOB_SECRET": SECRET, "AHCOMM_CONNECT_TIMEOUT": "15", "AHCOMM_BUFFSIZE": "0.0625"})
        procs = [fabric.popen(node, [sys.executable, "-m", "ahcomm.run", "--nnodes", "2", "--node-rank", str(node),
                                     "--nproc-per-node", "2", "--master-addr", fabric.address(0), "--master-port",
                                     str(port), "python", "-c", NAMESPACE_PROGRAM],
                              env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for node in range(2)]
        outputs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(outputs)
    lines = sorted(re.findall(r"NS rank (\d) servers (\d) sum (\d+) kinds (.*)", "".join(outputs)))
    assert [(r, s, t) for r, s, t, _ in lines] == [(str(r), "2", "10") for r in range(4)], outputs
    kinds = {int(r): k for r, _, _, k in lines}
    assert kinds[0] == "[(1, 'sdma'), (2, 'rdma'), (3, 'rdma')]", kinds
    assert kinds[3] == "[(0, 'rdma'), (1, 'rdma'), (2, 'sdma')]", kinds

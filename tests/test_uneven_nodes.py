"""``ahcomm-run --nnodes`` with a different ``--nproc-per-node`` on each host (torchrun's style;
issue 13): ranks are assigned when the launchers meet. Three launchers on this host, 2, 1, 1 ranks."""

from __future__ import annotations

import re
import secrets
import socket
import subprocess
import sys

from tests.jobs import ROOT, job_env

PROGRAM = """
import asyncio, numpy as np, ahcomm
async def main():
    comm = await ahcomm.init()
    x = np.full(3, comm.rank + 1, dtype=np.int64)
    y = await comm.all_reduce(x)
    print(f"RANK {comm.rank} OF {comm.size} SUM {int(np.asarray(y)[0])}", flush=True)
    await comm.close()
asyncio.run(main())
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_hosts_with_different_nproc_per_node_make_one_job() -> None:
    port = _free_port()
    env = job_env({"AHCOMM_JOB_SECRET": secrets.token_hex(32)})
    procs = [subprocess.Popen([sys.executable, "-m", "ahcomm.run", "--nnodes", "3", "--node-rank", str(node),
                               "--nproc-per-node", str(n), "--master-addr", "127.0.0.1", "--master-port", str(port),
                               "--tag-output", "python", "-c", PROGRAM],
                              env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for node, n in ((0, 2), (1, 1), (2, 1))]
    outs = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=120)
            outs.append(out)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    text = "\n".join(outs)
    assert all(proc.returncode == 0 for proc in procs), text[-4000:]
    said = [sorted(re.findall(r"RANK (\d) OF (\d) SUM (\d+)", out)) for out in outs]
    assert said == [[("0", "4", "10"), ("1", "4", "10")], [("2", "4", "10")], [("3", "4", "10")]], text[-4000:]

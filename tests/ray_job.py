"""A Ray job for tests/test_ray_backend.py: a local Ray cluster, two actors in an "ahcomm"
collective group (init_collective_group, and create_collective_group), every call checked; then
a group whose rank 1 is killed: rank 0's next call must raise, not hang."""

from __future__ import annotations

import sys

import numpy as np
import ray
import ray.util.collective as col

import ahcomm.ray


@ray.remote(num_cpus=0)
class Worker:
    def __init__(self, rank: int, size: int) -> None:
        ahcomm.ray.register()  # Ray's rule: in every actor too
        self.rank, self.size = rank, size

    def join(self, group: str) -> bool:
        col.init_collective_group(self.size, self.rank, backend="ahcomm", group_name=group)
        return True

    def check(self, group: str) -> str:
        import torch

        r, n = self.rank, self.size
        a = np.full(4, r + 1.0, np.float32)
        col.allreduce(a, group)
        assert a.tolist() == [n * (n + 1) / 2] * 4, a
        t = torch.full((3,), float(r + 1))
        col.allreduce(t, group, col.types.ReduceOp.MAX)
        assert t.tolist() == [float(n)] * 3, t
        outs = [np.zeros(3) for _ in range(n)]
        col.allgather(outs, np.full(3, float(r)), group)
        assert [o.tolist() for o in outs] == [[float(p)] * 3 for p in range(n)], outs
        y = np.zeros(2)
        col.reducescatter(y, [np.full(2, r + 10.0 * j) for j in range(n)], group)  # block j: r + 10 j
        assert y.tolist() == [sum(p + 10.0 * r for p in range(n))] * 2, y
        b = np.full(2, float(r))
        col.broadcast(b, n - 1, group)
        assert b.tolist() == [n - 1.0] * 2, b
        c = np.full(2, r + 1.0)
        col.reduce(c, 0, group)
        if r == 0:
            assert c.tolist() == [n * (n + 1) / 2] * 2, c
        col.barrier(group)
        if r == 0:
            col.send(np.arange(3.0), 1, group)
        elif r == 1:
            z = np.zeros(3)
            col.recv(z, 0, group)
            assert z.tolist() == [0.0, 1.0, 2.0], z
        return f"rank {r} ok"

    def after_peer_died(self, group: str) -> str:
        try:
            col.allreduce(np.ones(2), group)
        except Exception as exc:  # noqa: BLE001 - reported to the test
            return f"raised {type(exc).__name__}: {exc}"[:300]
        return "no error"


def main() -> None:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    ahcomm.ray.register()
    workers = [Worker.remote(r, 2) for r in range(2)]
    assert ray.get([w.join.remote("joined") for w in workers]) == [True, True]
    for line in ray.get([w.check.remote("joined") for w in workers]):
        print("init_collective_group", line, flush=True)
    declared = [Worker.remote(r, 2) for r in range(2)]
    col.create_collective_group(declared, 2, [0, 1], backend="ahcomm", group_name="declared")
    for line in ray.get([w.check.remote("declared") for w in declared]):
        print("create_collective_group", line, flush=True)
    pair = [Worker.remote(r, 2) for r in range(2)]
    ray.get([w.join.remote("dies") for w in pair])
    ray.kill(pair[1])
    print("dead peer:", ray.get(pair[0].after_peer_died.remote("dies"), timeout=120), flush=True)
    ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())

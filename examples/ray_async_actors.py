"""ahcomm's async API inside async Ray actors: a data-parallel mean over actors.

    pip install "ahcomm[ray]"
    python examples/ray_async_actors.py [--actors 2]

The driver makes a root-info token (``ahcomm.get_root_info()``: rank 0's address, a free port
and a fresh job secret) and hands it to every actor; each async actor joins with
``await ahcomm.init(root_info=token, rank=r, world_size=n)`` on the actor's own event loop and
then awaits collectives like any asyncio code, so one actor can serve other calls while a
collective is in flight. (For Ray's synchronous ``ray.util.collective`` API, use
``ahcomm.ray.register()`` and ``backend="ahcomm"`` instead: see docs/engines.md.)
"""

from __future__ import annotations

import argparse
import asyncio

import numpy as np
import ray

import ahcomm


@ray.remote(num_cpus=0)
class Shard:
    """Holds 1/n of a data set; computes the global mean and max with its peers."""

    def __init__(self, rank: int, size: int, seed: int) -> None:
        self.rank, self.size = rank, size
        self.data = np.random.default_rng(seed + rank).normal(loc=rank, size=(1000, 8)).astype(np.float32)
        self.comm: ahcomm.Comm | None = None

    async def join(self, token: str) -> int:
        self.comm = await ahcomm.init(root_info=token, rank=self.rank, world_size=self.size)
        return self.comm.rank

    async def stats(self) -> tuple[list[float], list[float]]:
        assert self.comm is not None
        total, biggest = await asyncio.gather(  # two collectives in flight at once
            self.comm.all_reduce(self.data.sum(0), "sum"),
            self.comm.all_reduce(self.data.max(0), "max"))
        count = await self.comm.all_reduce(np.array([len(self.data)], np.int64))
        return (total / count[0]).tolist(), biggest.tolist()

    async def leave(self) -> None:
        if self.comm is not None:
            await self.comm.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--actors", type=int, default=2)
    args = parser.parse_args()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    token = ahcomm.get_root_info()  # a credential: give it to the group's actors only
    shards = [Shard.remote(r, args.actors, seed=7) for r in range(args.actors)]
    print("joined ranks", ray.get([s.join.remote(token) for s in shards]))
    results = ray.get([s.stats.remote() for s in shards])
    mean, biggest = results[0]
    assert all(r == results[0] for r in results), "every actor must get the same answer"
    everything = np.concatenate([np.random.default_rng(7 + r).normal(loc=r, size=(1000, 8)).astype(np.float32)
                                 for r in range(args.actors)])
    ok = np.allclose(mean, everything.mean(0), rtol=1e-4) and np.allclose(biggest, everything.max(0))
    print(f"mean of column 0 over {len(everything)} rows: {mean[0]:.4f}; max: {biggest[0]:.4f}")
    print("OK" if ok else "MISMATCH")
    ray.get([s.leave.remote() for s in shards])
    ray.shutdown()


if __name__ == "__main__":
    main()

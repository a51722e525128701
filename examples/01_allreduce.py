"""The first example: every rank contributes rank+1; all_reduce sums them."""

import asyncio

import numpy as np

import ahcomm


async def main() -> None:
    comm = await ahcomm.init()  # rank/size/master from ahcomm-run's environment
    async with comm:
        x = np.full(1024, comm.rank + 1, dtype=np.float32)
        y = await comm.all_reduce(x, op="sum")  # new array; x unchanged
        await comm.all_reduce(x, op="max", out=x)  # in place
        g = await comm.all_gather(x)  # shape (size*1024,)
        r = await comm.reduce_scatter(g, op="sum")  # shape (1024,)
        b = await comm.broadcast(np.arange(4.0) * (comm.rank + 1), root=0)
        await comm.barrier()
        expected = comm.size * (comm.size + 1) / 2
        assert np.all(y == expected) and np.all(x == comm.size), (y[:3], x[:3])
        assert g.shape == (comm.size * 1024,) and np.all(r == comm.size * comm.size)
        print(f"rank {comm.rank}/{comm.size}: all_reduce sum={y[0]:.0f} (expected {expected:.0f}), "
              f"max={x[0]:.0f}, all_gather {g.shape}, reduce_scatter {r[0]:.0f}, broadcast {b.tolist()} "
              f"links={sorted({l['kind'] for l in comm.stats()['links'].values()})}")


if __name__ == "__main__":
    asyncio.run(main())

"""A rank under srun: the rendezvous from the Slurm step (ahcomm._slurm), one all_reduce."""
import asyncio
import os

import numpy as np

import ahcomm
from ahcomm._slurm import local_world_size, rendezvous


async def main():
    addr, port = rendezvous(os.environ)
    comm = await ahcomm.init()  # srun's environment is enough: Config.from_env derives the same address and port
    got = await comm.all_reduce(np.full(4, comm.rank + 1.0))
    local = local_world_size(os.environ)
    print(f"rank {comm.rank}/{comm.size} local_size={local} rendezvous={addr}:{port} sum={got.tolist()}", flush=True)
    await comm.close()
asyncio.run(main())

"""A rank under srun: the rendezvous from the Slurm step (ahcomm._slurm), one all_reduce."""
import asyncio, os, numpy as np, ahcomm
from ahcomm._slurm import rendezvous, local_world_size
async def main():
    addr, port = rendezvous(os.environ)
    comm = await ahcomm.init(master_addr=addr, master_port=port)
    got = await comm.all_reduce(np.full(4, comm.rank + 1.0))
    print(f"rank {comm.rank}/{comm.size} local_size={local_world_size(os.environ)} rendezvous={addr}:{port} sum={got.tolist()}", flush=True)
    await comm.close()
asyncio.run(main())

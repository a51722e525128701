"""HCCL's algorithm-development "hello world" (AllGatherMesh) written with ahcomm's framework.

    python examples/custom_algorithm.py                 # 4 ranks in this process
    ahcomm-run -n 4 python examples/custom_algorithm.py  # 4 processes, SDMA links

Three steps, as in HCCL: select (can it run this call?), resources (how many sub-streams,
how much per run) and orchestrate (tasks on the main stream and the sub-streams; the
``runs`` table maps each op the algorithm supports to its orchestration). In process, the
example then checks the algorithm against numpy with ``ahcomm.testing``.
"""

import asyncio
import os

import numpy as np

import ahcomm
from ahcomm.algorithms import Algorithm, Call, Context, Resources, Signal, Topology, register
from ahcomm.testing import acheck_algorithm


class HelloAllGatherMesh(Algorithm):
    name = "hello_mesh"

    def select(self, call: Call, topo: Topology) -> bool:  # 1. select: one host, peers' buffers mapped
        return call.op in self.ops and topo.all_mapped

    def resources(self, call: Call, topo: Topology, half_bytes: int) -> Resources:  # 2. resources
        return Resources(substreams=topo.size - 1, max_count=half_bytes // call.itemsize)

    async def _all_gather(self, ctx: Context) -> None:  # 3. orchestrate
        r, n, count = ctx.rank, ctx.size, ctx.src.size
        staged = ctx.typed(ctx.ccl_out, 0, count)
        ctx.main.copy(staged, ctx.src)  # user input -> CCL_Out
        for i in range(1, n):
            ctx.main.post(ctx.local(("go", i)))  # MainRecordSub
        ctx.main.copy(ctx.dst[r], staged)  # our own block -> output
        for i in range(1, n):
            peer, sub = (r - i) % n, ctx.subs[i - 1]  # BackwardRank, one sub-stream per peer
            sub.wait(ctx.local(("go", i)))  # SubWaitMain
            ctx.post(sub, peer, Signal.ACK)  # TxAck: our CCL_Out is staged
            ctx.wait(sub, peer, Signal.ACK)  # RxAck: so is the peer's
            sub.copy(ctx.dst[peer], ctx.typed(ctx.remote(peer, "out"), 0, count))  # read the peer's CCL_Out
            ctx.post(sub, peer, Signal.DATA)  # TxDataSignal: done reading the peer
            ctx.wait(sub, peer, Signal.DATA)  # RxDataSignal: the peer is done reading us
            sub.post(ctx.local(("done", i)))  # SubRecordMain
        for i in range(1, n):
            ctx.main.wait(ctx.local(("done", i)))  # MainWaitSub
        await ctx.synchronize()

    runs = {"all_gather": _all_gather}  # op -> its orchestration; the keys are the ops it supports


async def rank_main(comm: ahcomm.Comm) -> None:
    x = np.arange(5, dtype=np.float32) + 10 * comm.rank
    got = await comm.all_gather(x, algorithm="hello_mesh")  # selected by name
    assert np.array_equal(got, np.concatenate([np.arange(5, dtype=np.float32) + 10 * p for p in range(comm.size)]))
    big = np.full(300_000, comm.rank, np.float64)  # more than one run: the executor slices it
    assert np.array_equal(await comm.all_gather(big, algorithm="hello_mesh"), np.repeat(np.arange(comm.size), 300_000))
    if comm.rank == 0:
        print(f"hello_mesh all_gather on {comm.size} ranks: {got.tolist()}")
        print("algorithms that can run all_gather:", ahcomm.algorithms.names("all_gather"))


async def main() -> None:
    register(HelloAllGatherMesh())
    if "AHCOMM_RANK" in os.environ:  # launched: one rank per process
        async with await ahcomm.init() as comm:
            await rank_main(comm)
        return
    comms = await ahcomm.init_inprocess(4, buffsize=1 << 20)
    await asyncio.gather(*(rank_main(c) for c in comms))
    await asyncio.gather(*(c.close() for c in comms))
    # Against numpy: 2..5 ranks, float32/int32, empty, tiny, odd and sliced (> one CCL half) inputs.
    cases = await acheck_algorithm(HelloAllGatherMesh(), world_sizes=(2, 3, 5), counts=(0, 1, 7, 100_000))
    print(f"check_algorithm: hello_mesh matches numpy in {cases} cases")


if __name__ == "__main__":
    asyncio.run(main())

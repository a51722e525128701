"""Suspend/resume on this host: /dev/shm usage (os.statvfs) before, while and after, and the time of each
(issue 13). Run: ahcomm-run -n 4 python benchmarks/suspend.py (default 64 MiB CCL buffers)."""
import asyncio, os, time, numpy as np, ahcomm
def used():
    st = os.statvfs("/dev/shm"); return (st.f_blocks - st.f_bfree) * st.f_frsize
async def main():
    comm = await ahcomm.init()
    await comm.all_reduce(np.ones(1 << 20))
    for rnd in range(3):
        await comm.barrier(); u0 = used()
        t0 = time.perf_counter(); await comm.suspend(); ts = time.perf_counter() - t0
        await asyncio.sleep(0.2)  # everyone has released
        u1 = used()
        t0 = time.perf_counter(); await comm.resume(); tr = time.perf_counter() - t0
        await comm.barrier(); u2 = used()
        st = comm.stats()
        if comm.rank == 0 or rnd == 2:
            print(f"round {rnd} rank {comm.rank}: /dev/shm used {u0/2**20:.1f} -> {u1/2**20:.1f} -> {u2/2**20:.1f} MiB; "
                  f"released {st['released_bytes']/2**20:.2f} MiB own, unmapped {st['unmapped_bytes']/2**20:.2f} MiB; "
                  f"suspend {ts*1e3:.1f} ms resume {tr*1e3:.1f} ms", flush=True)
        got = await comm.all_reduce(np.full(1 << 20, comm.rank, np.float32))
        assert (got == sum(range(comm.size))).all()
    await comm.close()
asyncio.run(main())

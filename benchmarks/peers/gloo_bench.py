"""torch.distributed (gloo, TCP over 127.0.0.1) collective benchmark, nccl-tests conventions.

Ops: all_reduce (in place), all_gather (all_gather_single / all_gather_into_tensor, else
list all_gather), reduce_scatter (reduce_scatter_single / reduce_scatter_tensor, else list
reduce_scatter, else all_reduce + copy of own chunk), broadcast (root 0); float32, SUM.
Any fallback is named in the row's "note". Reported time = the slowest rank's mean us/op
(max over ranks, as MPI benchmarks report); #wrong = wrong elements summed over all ranks after one checked call.
Ranks are started with torch.multiprocessing.spawn on a free 127.0.0.1 port, GLOO_SOCKET_IFNAME=lo.

    .venv-bench/bin/python benchmarks/peers/gloo_bench.py -n 2 -b 8 -e 4M -f 16 --json out.json

Latency mode (p50/p90 of single calls, see _latency.py; barrier is dist.barrier):
    .venv-bench/bin/python benchmarks/peers/gloo_bench.py -n 2 --latency -i 2000 -w 200 --json out.json
"""
from __future__ import annotations

import datetime
import os
import socket
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402
import _latency as L  # noqa: E402

Call = Callable[[], None]


def free_port() -> int:
    """A currently free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def candidates(op: str, send: Any, recv: Any, n: int) -> list[tuple[str, Call]]:
    """Implementations of op in preference order: (note, call)."""
    import torch
    import torch.distributed as dist

    if op == "all_reduce":
        return [("", lambda: dist.all_reduce(send))]
    if op == "broadcast":
        return [("", lambda: dist.broadcast(send, src=0))]
    if op == "all_gather":
        fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        outs = list(recv.chunk(n))
        return [("", lambda: fn(recv, send)),
                ("list all_gather", lambda: dist.all_gather(outs, send))]
    if op == "reduce_scatter":
        fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        ins = list(send.chunk(n))
        tmp = torch.empty_like(send).fill_(0.0)
        rank = dist.get_rank()

        def emulated() -> None:
            tmp.copy_(send)
            dist.all_reduce(tmp)
            recv.copy_(tmp.chunk(n)[rank])

        return [("", lambda: fn(recv, send)),
                ("list reduce_scatter", lambda: dist.reduce_scatter(recv, ins)),
                ("emulated: all_reduce + copy", emulated)]
    raise SystemExit(f"unknown op {op}")


def rank_main(rank: int, n: int, port: int, args: Any) -> None:
    """Body executed by every spawned rank."""
    import numpy as np
    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore", category=FutureWarning)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=n, timeout=datetime.timedelta(minutes=5))

    def reduce(x: float, op: Any = dist.ReduceOp.SUM) -> float:
        t = torch.tensor([x], dtype=torch.float64)
        dist.all_reduce(t, op=op)
        return float(t.item())

    rows: list[dict[str, Any]] = []
    if rank == 0:
        C.print_header(f"gloo (torch {torch.__version__})", n)
    for op, chunk, size, nin, nout in C.cases(args.ops, args.minbytes, args.maxbytes, args.stepfactor, n):
        send = torch.empty(nin, dtype=torch.float32).fill_(0.0)  # touch pages now
        recv = send if op in ("all_reduce", "broadcast") else \
            torch.empty(nout, dtype=torch.float32).fill_(0.0)
        want = C.expected(op, rank, n, chunk)
        note, call, dt = "", None, 0.0
        for note, cand in candidates(op, send, recv, n):
            send.copy_(torch.from_numpy(C.check_input(op, rank, n, chunk)))
            dist.barrier()
            try:
                t = time.perf_counter()
                cand()
                dt = time.perf_counter() - t
            except (RuntimeError, NotImplementedError, ValueError, AttributeError):
                continue
            call = cand
            break
        if call is None:
            raise SystemExit(f"gloo: no working implementation of {op}")
        wrong = int(np.count_nonzero(recv.numpy() != want))
        if op == "all_reduce":
            send.fill_(0.0)  # repeated in-place sums stay 0
        for _ in range(args.warmup_iters):
            t = time.perf_counter()
            call()
            dt = time.perf_counter() - t
        iters = C.timed_iters(reduce(dt, dist.ReduceOp.MAX), args.iters, args.max_seconds)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            call()
        per_op = (time.perf_counter() - t0) / iters
        mean_us = reduce(per_op, dist.ReduceOp.MAX) * 1e6  # the slowest rank's (broadcast's root returns early)
        wrong = int(reduce(float(wrong)))
        if rank == 0:
            row = C.make_row(op, size, n, mean_us, wrong, iters, note)
            rows.append(row)
            C.print_row(row)
        del send, recv
    if rank == 0:
        C.write_json(args.json, "gloo", n, rows, {"version": f"torch {torch.__version__}"})
    dist.barrier()
    dist.destroy_process_group()


def rank_latency(rank: int, n: int, port: int, args: Any) -> None:
    """Latency mode: p50/p90 of single calls per case (the slowest rank's)."""
    import numpy as np
    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore", category=FutureWarning)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=n, timeout=datetime.timedelta(minutes=5))
    rows: list[dict[str, Any]] = []
    for op, nbytes in L.cases(args.cases):
        k = L.elems(nbytes)
        send = torch.zeros(max(k, 1), dtype=torch.float32)
        recv = torch.zeros(k * n, dtype=torch.float32) if op == "all_gather" else send
        impls = [("", dist.barrier)] if op == "barrier" else candidates(op, send, recv, n)
        note, call, wrong = "", None, 0
        for note, cand in impls:
            if op != "barrier":
                send.copy_(torch.from_numpy(C.check_input(op, rank, n, k)))
            dist.barrier()
            try:
                cand()
            except (RuntimeError, NotImplementedError, ValueError, AttributeError):
                continue
            call = cand
            if op != "barrier":
                wrong = int(np.count_nonzero(recv.numpy() != C.expected(op, rank, n, k)))
            break
        if call is None:
            raise SystemExit(f"gloo: no working implementation of {op}")
        send.fill_(0.0)  # repeated in-place sums stay 0
        for _ in range(args.warmup_iters):
            call()
        stamps = np.empty(args.iters + 1)
        dist.barrier()
        stamps[0] = time.perf_counter()
        for i in range(args.iters):
            call()
            stamps[i + 1] = time.perf_counter()
        agg = torch.tensor(L.spread(stamps), dtype=torch.float64)
        dist.all_reduce(agg, op=dist.ReduceOp.MAX)
        bad = torch.tensor([float(wrong)], dtype=torch.float64)
        dist.all_reduce(bad)
        if rank == 0:
            rows.append(L.row(op, nbytes, float(agg[0]), float(agg[1]), args.iters, int(bad.item()), note))
            L.print_row(n, rows[-1])
    if rank == 0:
        L.write(args.json, "gloo", n, rows, {"version": f"torch {torch.__version__}"})
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    """Parse flags and spawn the ranks."""
    import torch.multiprocessing as mp

    parser = C.make_parser(__doc__.splitlines()[0])
    L.add_args(parser)
    args = parser.parse_args(argv)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    body = rank_latency if args.latency else rank_main
    mp.spawn(body, args=(args.np, free_port(), args), nprocs=args.np, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

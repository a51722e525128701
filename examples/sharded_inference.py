"""Sharded inference of a transformer-style MLP block: tensor, sequence and pipeline parallel.

    ahcomm-run -n 2 python examples/sharded_inference.py
    ahcomm-run -n 4 python examples/sharded_inference.py --tokens-per-rank 64 --d-model 256

The block is ``y = x + gelu(x @ W1 + b1) @ W2 + b2`` in float32 (numpy). Every rank builds
the same weights from one seed and keeps only its shard, then checks its results against
the unsharded model:

1. Tensor parallel (Megatron-style): W1 is split by columns and W2 by rows, so each rank
   computes ``gelu(x @ W1[:, shard] + b1[shard]) @ W2[shard, :]``, a partial sum of the
   output, with no communication; one ``all_reduce`` adds the partials.
2. Sequence parallel: the same partials, combined with ``reduce_scatter`` over the token
   axis (each rank gets the sums for its block of tokens, adds bias and residual there), and
   ``all_gather`` rebuilds the whole sequence: the same volume as one all_reduce, but the
   pointwise work between runs on 1/size of the tokens.
3. Pipeline: two blocks as two stages; ranks [0, size/2) run stage 0 and send each
   micro-batch's activations to their partner in [size/2, size), which runs stage 1. The
   sends are eager, so stage 0 computes micro-batch k+1 while k is in flight, and stage 1
   has micro-batch k+1's receive posted while it computes k. (With an odd size the last rank
   sits this part out.)
4. Decoding (latency-bound): ``--layers`` blocks, one token step at a time for
   ``--decode-tokens`` steps of ``--batch`` sequences; each block's tensor-parallel output is
   one ``all_reduce`` of ``batch x d_model`` float32 per token (the exchange of a Megatron
   MLP at inference; an attention block adds one more). It reports ms per token and tokens/s
   (p50 over the steps), and how much of it the all_reduces took. With ``--compare-gloo`` the same ranks then run the very
   same decode with torch.distributed's gloo doing the all_reduces (same shapes, same numpy
   compute), alternating with ahcomm for ``--rounds`` rounds, and print both side by side.
   torch is optional: without it the comparison is skipped with a note.

    ahcomm-run -n 2 python examples/sharded_inference.py --compare-gloo --d-model 1024 --batch 8

The last line (rank 0) reports the largest error of each part against the reference and OK.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import ahcomm

TOL = 1e-4  # float32, sums of a few hundred terms of order 1


def gelu(x: np.ndarray) -> np.ndarray:
    """The tanh approximation (GPT-2's), in the input's dtype."""
    c = np.float32(np.sqrt(2.0 / np.pi))
    y: np.ndarray = np.float32(0.5) * x * (np.float32(1.0) + np.tanh(c * (x + np.float32(0.044715) * x * x * x)))
    return y


class Block:
    """Weights of one MLP block (the same on every rank: one seed)."""

    def __init__(self, seed: int, d_model: int, d_ff: int) -> None:
        rng = np.random.default_rng(seed)
        self.w1 = (rng.standard_normal((d_model, d_ff)) / np.sqrt(d_model)).astype(np.float32)
        self.b1 = (0.1 * rng.standard_normal(d_ff)).astype(np.float32)
        self.w2 = (rng.standard_normal((d_ff, d_model)) / np.sqrt(d_ff)).astype(np.float32)
        self.b2 = (0.1 * rng.standard_normal(d_model)).astype(np.float32)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """The unsharded reference."""
        y: np.ndarray = x + gelu(x @ self.w1 + self.b1) @ self.w2 + self.b2
        return y

    def partial(self, x: np.ndarray, rank: int, size: int) -> np.ndarray:
        """This rank's share of ``gelu(x @ W1 + b1) @ W2`` (column shard of W1, row shard of W2)."""
        cols = slice(rank * self.w1.shape[1] // size, (rank + 1) * self.w1.shape[1] // size)
        part: np.ndarray = gelu(x @ self.w1[:, cols] + self.b1[cols]) @ self.w2[cols, :]
        return part


async def tensor_parallel(comm: ahcomm.Comm, block: Block, x: np.ndarray) -> np.ndarray:
    partial = block.partial(x, comm.rank, comm.size)
    await comm.all_reduce(partial, out=partial)  # in place: partial becomes the sum
    y: np.ndarray = x + partial + block.b2
    return y


async def sequence_parallel(comm: ahcomm.Comm, block: Block, x: np.ndarray) -> np.ndarray:
    partial = block.partial(x, comm.rank, comm.size)
    mine = await comm.reduce_scatter(partial)  # (tokens/size, d_model): my tokens, summed
    rows = slice(comm.rank * mine.shape[0], (comm.rank + 1) * mine.shape[0])
    mine += x[rows] + block.b2  # bias and residual on my tokens only
    return await comm.all_gather(mine)


async def pipeline(comm: ahcomm.Comm, stages: tuple[Block, Block], x: np.ndarray, micro: int) -> np.ndarray | None:
    """Stage 0 on ranks [0, half), stage 1 on [half, 2*half); returns stage 1's output there."""
    half = comm.size // 2
    mbs = np.array_split(x, micro)
    if comm.rank < half:
        sends = []
        for mb in mbs:
            sends.append(comm.send(stages[0](mb), comm.rank + half))  # eager: on to the next
        await asyncio.gather(*sends)
        return None
    if comm.rank < 2 * half:
        src = comm.rank - half
        outs = []
        nxt = comm.recv(src, shape=mbs[0].shape, dtype=np.float32)
        for k in range(micro):
            act = await nxt
            if k + 1 < micro:  # posted before computing k: k+1 lands meanwhile
                nxt = comm.recv(src, shape=mbs[k + 1].shape, dtype=np.float32)
            outs.append(stages[1](act))
        return np.concatenate(outs)
    return None


# -- 4. decoding: one all_reduce per block per token, ahcomm and (optionally) gloo ---------------
Shard = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]  # W1 columns, b1 slice, W2 rows, b2
Reduce = Callable[[np.ndarray], Any]  # sums its argument over the ranks, in place


def shard(block: Block, rank: int, size: int) -> Shard:
    """This rank's slices of one block, contiguous and taken once (not per token)."""
    d_ff = block.w1.shape[1]
    cols = slice(rank * d_ff // size, (rank + 1) * d_ff // size)
    return (np.ascontiguousarray(block.w1[:, cols]), block.b1[cols].copy(),
            np.ascontiguousarray(block.w2[cols, :]), block.b2)


def rms_norm(y: np.ndarray) -> np.ndarray:
    """Rows scaled to unit RMS: keeps a deep stack of residual blocks bounded."""
    out: np.ndarray = y / np.sqrt(np.mean(y * y, axis=-1, keepdims=True) + np.float32(1e-6))
    return out


def reference_decode(blocks: list[Block], xs: np.ndarray) -> np.ndarray:
    """The unsharded model, token by token."""
    out = np.empty_like(xs)
    for t, x in enumerate(xs):
        for block in blocks:
            x = rms_norm(block(x))
        out[t] = x
    return out


class Timed:
    """Seconds per token step, seconds of it in all_reduce, and each step's output."""

    def __init__(self, xs: np.ndarray) -> None:
        self.step = np.zeros(len(xs))
        self.comm = np.zeros(len(xs))
        self.out = np.empty_like(xs)


async def decode_ahcomm(comm: ahcomm.Comm, shards: list[Shard], xs: np.ndarray) -> Timed:
    """Every token through every block; each block's partial output summed by one all_reduce."""
    res = Timed(xs)
    await comm.barrier()
    for t, x in enumerate(xs):
        t0 = time.perf_counter()
        for w1, b1, w2, b2 in shards:
            part = gelu(x @ w1 + b1) @ w2
            c0 = time.perf_counter()
            await comm.all_reduce(part, out=part)
            res.comm[t] += time.perf_counter() - c0
            x = rms_norm(x + part + b2)
        res.step[t] = time.perf_counter() - t0
        res.out[t] = x
    return res


def decode_blocking(reduce: Reduce, shards: list[Shard], xs: np.ndarray) -> Timed:
    """The same loop for a blocking all_reduce (gloo's), run in a worker thread."""
    res = Timed(xs)
    for t, x in enumerate(xs):
        t0 = time.perf_counter()
        for w1, b1, w2, b2 in shards:
            part = gelu(x @ w1 + b1) @ w2
            c0 = time.perf_counter()
            reduce(part)
            res.comm[t] += time.perf_counter() - c0
            x = rms_norm(x + part + b2)
        res.step[t] = time.perf_counter() - t0
        res.out[t] = x
    return res


class Gloo:
    """torch.distributed with the gloo backend beside ahcomm, in the same ranks."""

    def __init__(self) -> None:
        import torch
        import torch.distributed as dist
        self.torch, self.dist = torch, dist

    @staticmethod
    async def start(comm: ahcomm.Comm) -> Gloo | None:
        """Join a gloo group (rank 0 picks the port); None on every rank if any rank lacks torch."""
        try:
            gloo: Gloo | None = Gloo()
        except ImportError:
            gloo = None
        everyone = await comm.all_reduce(np.array([gloo is not None], np.int32), op="min")
        if gloo is None or not everyone[0]:
            return None
        addr = os.environ.get("AHCOMM_MASTER_ADDR") or os.environ.get("MASTER_ADDR") or "127.0.0.1"
        if addr in ("127.0.0.1", "localhost", "::1"):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        port = await comm.broadcast_object(free_port(addr) if comm.rank == 0 else None)
        host = f"[{addr}]" if ":" in addr else addr
        await asyncio.to_thread(gloo.dist.init_process_group, "gloo", init_method=f"tcp://{host}:{port}",
                                rank=comm.rank, world_size=comm.size)
        return gloo

    def all_reduce(self, part: np.ndarray) -> None:
        self.dist.all_reduce(self.torch.from_numpy(part))  # in place, float32 sum

    async def decode(self, shards: list[Shard], xs: np.ndarray) -> Timed:
        def run() -> Timed:
            self.dist.barrier()
            return decode_blocking(self.all_reduce, shards, xs)
        return await asyncio.to_thread(run)

    def stop(self) -> None:
        self.dist.destroy_process_group()


def free_port(addr: str) -> int:
    """A TCP port free on this host now (rank 0's, where gloo's store listens)."""
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    with socket.socket(family) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


async def decode_bench(comm: ahcomm.Comm, args: argparse.Namespace) -> float:
    """Time the decode with ahcomm (and gloo); print the report on rank 0; the largest error."""
    n, d_ff, warm = comm.size, args.d_ff_per_rank * comm.size, max(2, args.decode_tokens // 8)
    blocks = [Block(10 + i, args.d_model, d_ff) for i in range(args.layers)]
    shards = [shard(b, comm.rank, n) for b in blocks]
    xs = np.random.default_rng(7).standard_normal((args.decode_tokens, args.batch, args.d_model)).astype(np.float32)
    ref = reference_decode(blocks, xs)
    gloo = await Gloo.start(comm) if args.compare_gloo else None
    runs: dict[str, list[Timed]] = {name: [] for name in ("ahcomm", "gloo") if name == "ahcomm" or gloo}
    for _ in range(args.rounds):  # alternate, so a change in the host's load hits both alike
        await decode_ahcomm(comm, shards, xs[:warm])
        runs["ahcomm"].append(await decode_ahcomm(comm, shards, xs))
        if gloo is not None:
            await gloo.decode(shards, xs[:warm])
            runs["gloo"].append(await gloo.decode(shards, xs))
    if gloo is not None:
        await asyncio.to_thread(gloo.stop)
    err = max(float(np.abs(r.out - ref).max()) for rs in runs.values() for r in rs)
    # per backend: p50 ms per token step, p50 ms of it in all_reduce (the slowest rank's)
    stats = np.array([[np.median(np.concatenate([r.step for r in rs])) * 1e3,
                       np.median(np.concatenate([r.comm for r in rs])) * 1e3] for rs in runs.values()])
    stats = await comm.all_reduce(stats, op="max")
    if comm.rank == 0:
        kib = args.batch * args.d_model * 4 / 1024
        cells = [f"{name} {ms:.3f} ms/token ({1e3 / ms:.0f} tokens/s; all_reduce {cm:.3f} ms)"
                 for name, (ms, cm) in zip(runs, stats)]
        if gloo is not None:
            cells.append(f"ahcomm/gloo speed {stats[1][0] / stats[0][0]:.2f}x")
        elif args.compare_gloo:
            cells.append("gloo comparison skipped (torch is not installed on every rank)")
        print(f"decode: np={n} {args.layers} layers x {args.decode_tokens} tokens x {args.rounds} round(s), "
              f"batch {args.batch}, one {kib:g} KiB all_reduce per layer per token (p50): "
              + "; ".join(cells), flush=True)
    return err


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens-per-rank", type=int, default=16)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--d-ff-per-rank", type=int, default=64)
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--layers", type=int, default=8, help="decode: blocks (one all_reduce each per token)")
    ap.add_argument("--decode-tokens", type=int, default=64, help="decode: timed token steps per round")
    ap.add_argument("--batch", type=int, default=4, help="decode: sequences decoded together")
    ap.add_argument("--rounds", type=int, default=2, help="decode: rounds (ahcomm and gloo alternate)")
    ap.add_argument("--compare-gloo", action="store_true",
                    help="decode with torch.distributed gloo too (skipped if torch is missing)")
    args = ap.parse_args()
    for name in ("tokens_per_rank", "d_model", "d_ff_per_rank", "micro_batches", "layers", "decode_tokens",
                 "batch", "rounds"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1, not {getattr(args, name)}")
    comm = await ahcomm.init()
    async with comm:
        n = comm.size
        tokens, d_ff = args.tokens_per_rank * n, args.d_ff_per_rank * n
        blocks = (Block(1, args.d_model, d_ff), Block(2, args.d_model, d_ff))
        x = np.random.default_rng(0).standard_normal((tokens, args.d_model)).astype(np.float32)
        ref = blocks[0](x)

        tp = await tensor_parallel(comm, blocks[0], x)
        sp = await sequence_parallel(comm, blocks[0], x)
        errors = np.array([np.abs(tp - ref).max(), np.abs(sp - ref).max(), 0.0, 0.0], np.float32)

        # pipeline: each pair (r, r + size/2) runs its own batch (the pairs are data parallel)
        xb = np.random.default_rng(100 + comm.rank % max(1, n // 2)).standard_normal(
            (tokens, args.d_model)).astype(np.float32)
        got = await pipeline(comm, blocks, xb, args.micro_batches) if n >= 2 else blocks[1](blocks[0](xb))
        if got is not None:
            errors[2] = np.abs(got - blocks[1](blocks[0](xb))).max()
        errors[3] = await decode_bench(comm, args)
        worst = await comm.all_reduce(errors, op="max")
        ok = bool(np.all(worst <= TOL))
        if comm.rank == 0:
            print(f"sharded_inference: np={n} tokens={tokens} d_model={args.d_model} d_ff={d_ff} "
                  f"max|err| tensor-parallel={worst[0]:.2e} sequence-parallel={worst[1]:.2e} "
                  f"pipeline({n // 2} pair(s), {args.micro_batches} micro-batches)={worst[2]:.2e} "
                  f"decode({args.layers} layers)={worst[3]:.2e} "
                  f"{'OK' if ok else 'FAILED'}", flush=True)
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    asyncio.run(main())

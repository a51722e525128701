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

The last line (rank 0) reports the largest error of each part against the reference and OK.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

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


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens-per-rank", type=int, default=16)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--d-ff-per-rank", type=int, default=64)
    ap.add_argument("--micro-batches", type=int, default=4)
    args = ap.parse_args()
    comm = await ahcomm.init()
    async with comm:
        n = comm.size
        tokens, d_ff = args.tokens_per_rank * n, args.d_ff_per_rank * n
        blocks = (Block(1, args.d_model, d_ff), Block(2, args.d_model, d_ff))
        x = np.random.default_rng(0).standard_normal((tokens, args.d_model)).astype(np.float32)
        ref = blocks[0](x)

        tp = await tensor_parallel(comm, blocks[0], x)
        sp = await sequence_parallel(comm, blocks[0], x)
        errors = np.array([np.abs(tp - ref).max(), np.abs(sp - ref).max(), 0.0], np.float32)

        # pipeline: each pair (r, r + size/2) runs its own batch (the pairs are data parallel)
        xb = np.random.default_rng(100 + comm.rank % max(1, n // 2)).standard_normal(
            (tokens, args.d_model)).astype(np.float32)
        got = await pipeline(comm, blocks, xb, args.micro_batches) if n >= 2 else blocks[1](blocks[0](xb))
        if got is not None:
            errors[2] = np.abs(got - blocks[1](blocks[0](xb))).max()
        worst = await comm.all_reduce(errors, op="max")
        ok = bool(np.all(worst <= TOL))
        if comm.rank == 0:
            print(f"sharded_inference: np={n} tokens={tokens} d_model={args.d_model} d_ff={d_ff} "
                  f"max|err| tensor-parallel={worst[0]:.2e} sequence-parallel={worst[1]:.2e} "
                  f"pipeline({n // 2} pair(s), {args.micro_batches} micro-batches)={worst[2]:.2e} "
                  f"{'OK' if ok else 'FAILED'}", flush=True)
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    asyncio.run(main())

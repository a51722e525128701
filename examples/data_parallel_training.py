"""Data-parallel training of a tiny MLP classifier, with bucketed gradient all_reduce that
overlaps the backward pass (what DDP does).

    ahcomm-run -n 2 python examples/data_parallel_training.py
    ahcomm-run -n 4 python examples/data_parallel_training.py --steps 300 --bucket-elems 256

The data set is synthetic and seeded (the XOR of the signs of two hidden directions, in
``--features`` noisy dimensions), the model a 2-layer MLP (tanh hidden layer, logistic
output, binary cross-entropy), trained by minibatch SGD. Every step each rank takes its
1/size share of the same global minibatch, so the averaged gradient is exactly the
single-process gradient of the whole minibatch.

The backward pass produces gradients from the last layer to the first. They are flattened
in that order into one preallocated vector cut into buckets of ``--bucket-elems`` elements;
as soon as a bucket's gradients are all computed, its ``all_reduce(op="avg")`` is issued
(in place, on a view: nothing is allocated per step) and the backward pass goes on to the
next layer while the collective runs; the step waits for all buckets just before the update.

Rank 0 also trains the same model on the whole data set in one process, and the last line
compares the two final losses (they agree to float32 rounding) and reports OK.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Awaitable, Callable

import numpy as np

import ahcomm


def make_data(samples: int, features: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """XOR of the signs of two hidden directions (not linearly separable), in ``features`` noisy dimensions."""
    rng = np.random.default_rng(seed)
    plane = rng.standard_normal((samples, 2))
    label = (plane[:, 0] * plane[:, 1] > 0).astype(np.float32)
    lift = np.linalg.qr(rng.standard_normal((features, 2)))[0].T  # two orthonormal directions
    x = plane @ lift + 0.1 * rng.standard_normal((samples, features))
    return x.astype(np.float32), label


class MLP:
    """Parameters live in one flat vector (views per tensor), laid out in backward order:
    W2, b2 (the last layer's gradients come first), then W1, b1."""

    def __init__(self, features: int, hidden: int, seed: int = 1) -> None:
        shapes = [("w2", (hidden,)), ("b2", ()), ("w1", (features, hidden)), ("b1", (hidden,))]
        sizes = [int(np.prod(s)) for _, s in shapes]
        self.flat = np.zeros(sum(sizes), np.float32)
        self.grad = np.zeros_like(self.flat)
        self.p: dict[str, np.ndarray] = {}
        self.g: dict[str, np.ndarray] = {}
        self.bounds: dict[str, tuple[int, int]] = {}
        offset = 0
        for (name, shape), size in zip(shapes, sizes):
            self.p[name] = self.flat[offset:offset + size].reshape(shape)
            self.g[name] = self.grad[offset:offset + size].reshape(shape)
            self.bounds[name] = (offset, offset + size)
            offset += size
        rng = np.random.default_rng(seed)
        self.p["w1"][...] = rng.standard_normal((features, hidden)) / np.sqrt(features)
        self.p["w2"][...] = rng.standard_normal(hidden) / np.sqrt(hidden)

    def forward(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        h = np.tanh(x @ self.p["w1"] + self.p["b1"])
        logits = h @ self.p["w2"] + self.p["b2"]
        return h, logits

    def loss(self, x: np.ndarray, y: np.ndarray) -> float:
        _, z = self.forward(x)
        return float(np.mean(np.logaddexp(0, z) - y * z))  # BCE with logits, stable

    def accuracy(self, x: np.ndarray, y: np.ndarray) -> float:
        return float(np.mean((self.forward(x)[1] > 0) == (y > 0.5)))

    def backward(self, x: np.ndarray, y: np.ndarray, scale: float, on_ready: Callable[[int], None]) -> None:
        """Gradients of the mean loss times ``scale`` into ``self.grad``, last layer first;
        ``on_ready(n)`` after each tensor: the first ``n`` elements of ``grad`` are final."""
        h, z = self.forward(x)
        dz = (1.0 / (1.0 + np.exp(-z)) - y).astype(np.float32) * np.float32(scale / len(y))
        np.dot(h.T, dz, out=self.g["w2"])
        on_ready(self.bounds["w2"][1])
        self.g["b2"][...] = dz.sum()
        on_ready(self.bounds["b2"][1])
        dpre = np.outer(dz, self.p["w2"]) * (1 - h * h)
        np.dot(x.T, dpre, out=self.g["w1"])
        on_ready(self.bounds["w1"][1])
        np.sum(dpre, axis=0, out=self.g["b1"])
        on_ready(self.bounds["b1"][1])


def batches(samples: int, batch: int, steps: int, seed: int = 2) -> list[np.ndarray]:
    """The global minibatches (indices), the same on every rank."""
    rng = np.random.default_rng(seed)
    out: list[np.ndarray] = []
    while len(out) < steps:
        perm = rng.permutation(samples)
        out.extend(perm[i:i + batch] for i in range(0, samples - batch + 1, batch))
    return out[:steps]


async def train_parallel(comm: ahcomm.Comm, x: np.ndarray, y: np.ndarray, args: argparse.Namespace) -> MLP:
    model = MLP(x.shape[1], args.hidden)
    n, rank = comm.size, comm.rank
    edges = list(range(0, model.grad.size, args.bucket_elems)) + [model.grad.size]
    buckets = [model.grad[a:b] for a, b in zip(edges, edges[1:])]  # views: all_reduce in place
    for idx in batches(len(y), args.batch, args.steps):
        mine = np.array_split(idx, n)[rank]  # this rank's share of the global minibatch
        pending: list[Awaitable[np.ndarray]] = []
        issued = 0

        def ready(upto: int) -> None:
            nonlocal issued
            while issued < len(buckets) and edges[issued + 1] <= upto:  # bucket complete: send it
                pending.append(comm.all_reduce(buckets[issued], op="avg", out=buckets[issued]))
                issued += 1

        # scale so that the average over ranks is the whole minibatch's mean gradient
        model.backward(x[mine], y[mine], scale=n * len(mine) / len(idx), on_ready=ready)
        await asyncio.gather(*pending)
        model.flat -= np.float32(args.lr) * model.grad
    return model


def train_single(x: np.ndarray, y: np.ndarray, args: argparse.Namespace) -> MLP:
    model = MLP(x.shape[1], args.hidden)
    for idx in batches(len(y), args.batch, args.steps):
        model.backward(x[idx], y[idx], scale=1.0, on_ready=lambda _: None)
        model.flat -= np.float32(args.lr) * model.grad
    return model


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=2048)
    ap.add_argument("--features", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=32)
    ap.add_argument("--batch", type=int, default=128, help="global minibatch (split over the ranks)")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--lr", type=float, default=1.0)
    ap.add_argument("--bucket-elems", type=int, default=128, help="gradient elements per all_reduce bucket")
    ap.add_argument("--tol", type=float, default=1e-3, help="allowed |dp - single| of the final loss")
    args = ap.parse_args()
    x, y = make_data(args.samples, args.features)
    comm = await ahcomm.init()
    async with comm:
        initial = MLP(x.shape[1], args.hidden).loss(x, y)
        model = await train_parallel(comm, x, y, args)
        # the replicas must hold identical parameters (every all_reduce gives every rank the same bits)
        spread = await comm.all_reduce(model.flat.copy(), op="max")
        spread -= await comm.all_reduce(model.flat.copy(), op="min")
        in_sync = bool(np.all(spread == 0))
        loss = model.loss(x, y)
        ok = in_sync
        if comm.rank == 0:
            single = train_single(x, y, args)
            ref = single.loss(x, y)
            ok = ok and abs(loss - ref) <= args.tol and loss < 0.5 * initial
            buckets = -(-model.grad.size // args.bucket_elems)
            print(f"data_parallel_training: np={comm.size} steps={args.steps} params={model.flat.size} "
                  f"buckets={buckets} loss {initial:.4f} -> dp={loss:.4f} single={ref:.4f} "
                  f"|diff|={abs(loss - ref):.1e} max|param diff|={np.abs(model.flat - single.flat).max():.1e} accuracy={model.accuracy(x, y):.3f} "
                  f"replicas {'in sync' if in_sync else 'DIVERGED'} {'OK' if ok else 'FAILED'}", flush=True)
        ok = bool((await comm.broadcast(np.array([ok]), root=0))[0])
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    asyncio.run(main())

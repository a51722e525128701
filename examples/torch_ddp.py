"""PyTorch DistributedDataParallel on the "ahcomm" backend: the training loop is plain torch.

    pip install '.[torch]'        # torch is an optional extra
    torchrun --standalone --nproc-per-node 2 examples/torch_ddp.py
    ahcomm-run -n 2 python examples/torch_ddp.py

The only ahcomm line is ``import ahcomm.torch`` (it registers the backend); everything else is
what a gloo user writes, with "ahcomm" as the backend's name. No AHCOMM_* variable is needed
under torchrun: the backend exchanges its rendezvous address and job secret through torch's
store. Every rank trains on its share of each minibatch of a synthetic regression task; rank 0
then trains the same model on the whole minibatches in one process and checks that both end
with the same weights (DDP averages the gradients, so they agree to float32 rounding).
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import ahcomm.torch  # noqa: F401 - registers the "ahcomm" backend


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))


def train(model: torch.nn.Module, steps: int, batch: int, rank: int, size: int) -> float:
    """SGD on minibatches of ``batch`` rows; this rank takes rows [rank::size] of each."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = torch.Generator().manual_seed(1)
    w_true = torch.randn(16, 1, generator=data)
    loss = torch.zeros(())
    for _ in range(steps):
        x = torch.randn(batch, 16, generator=data)
        y = torch.sin(x @ w_true)
        xs, ys = x[rank::size], y[rank::size]
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(xs), ys)
        loss.backward()
        opt.step()
    return float(loss.detach())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch", type=int, default=64, help="global minibatch (divisible by the world size)")
    args = parser.parse_args()

    dist.init_process_group("ahcomm")
    rank, size = dist.get_rank(), dist.get_world_size()
    model = make_model()
    ddp = DistributedDataParallel(model)
    loss = train(ddp, args.steps, args.batch, rank, size)
    print(f"rank {rank}/{size}: final loss on its shard {loss:.4f}", flush=True)
    if rank == 0:
        alone = make_model()
        train(alone, args.steps, args.batch, 0, 1)
        diff = max(float((a - b).detach().abs().max()) for a, b in zip(model.parameters(), alone.parameters()))
        print(f"largest weight difference from one process on the whole batch: {diff:.2e}", flush=True)
        print("OK" if diff < 1e-4 else "MISMATCH", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""torch tensors through every collective: results come back as tensors of the caller's dtype."""

from __future__ import annotations

import numpy as np
import pytest

import ahcomm

from support.inproc import run_inproc

torch = pytest.importorskip("torch", reason="torch is not installed (the `torch` extra)")

DTYPES = [torch.float32, torch.float64, torch.int32, torch.bfloat16]


@pytest.mark.parametrize("size", [1, 2, 3, 5])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
async def test_every_collective_takes_and_returns_tensors(size: int, dtype: "torch.dtype") -> None:
    def x_of(rank: int) -> "torch.Tensor":
        return (torch.arange(size * 4, dtype=torch.float32).reshape(size * 2, 2) % 5 + rank).to(dtype)

    async def body(comm: ahcomm.Comm) -> dict[str, object]:
        x = x_of(comm.rank)
        out = torch.empty_like(x)
        return {
            "all_reduce": await comm.all_reduce(x), "all_reduce_out": (await comm.all_reduce(x, out=out)) is out,
            "out": out, "all_gather": await comm.all_gather(x), "reduce_scatter": await comm.reduce_scatter(x),
            "broadcast": await comm.broadcast(x, size - 1), "reduce": await comm.reduce(x, "max", 0),
            "gather": await comm.gather(x, 0), "scatter": await comm.scatter(x, 0),
            "all_to_all": await comm.all_to_all(x),
            "all_gather_v": await comm.all_gather_v(x[: comm.rank + 1]),
            "strided": await comm.all_reduce(x[:, :1]),  # a non-contiguous view
        }

    results = await run_inproc(size, body)
    xs = [x_of(r).float().numpy() for r in range(size)]
    total = sum(xs)
    for rank, res in enumerate(results):
        for key, value in res.items():
            if isinstance(value, torch.Tensor):
                assert value.dtype == dtype, (key, value.dtype)
        np.testing.assert_allclose(res["all_reduce"].float().numpy(), total, rtol=1e-2)
        assert res["all_reduce_out"] is True
        np.testing.assert_allclose(res["out"].float().numpy(), total, rtol=1e-2)
        np.testing.assert_allclose(res["all_gather"].float().numpy(), np.concatenate(xs))
        np.testing.assert_allclose(res["reduce_scatter"].float().numpy(), total[2 * rank:2 * rank + 2], rtol=1e-2)
        np.testing.assert_allclose(res["broadcast"].float().numpy(), xs[-1])
        assert (res["reduce"] is None) == (rank != 0) and (res["gather"] is None) == (rank != 0)
        if rank == 0:
            np.testing.assert_allclose(res["reduce"].float().numpy(), np.max(xs, axis=0))
            np.testing.assert_allclose(res["gather"].float().numpy(), np.concatenate(xs))
        np.testing.assert_allclose(res["scatter"].float().numpy(), xs[0][2 * rank:2 * rank + 2])
        np.testing.assert_allclose(res["all_to_all"].float().numpy(),
                                   np.concatenate([x[2 * rank:2 * rank + 2] for x in xs]))
        gathered = res["all_gather_v"]
        assert isinstance(gathered.data, torch.Tensor) and gathered.counts == tuple(range(1, size + 1))
        np.testing.assert_allclose(res["strided"].float().numpy(), total[:, :1], rtol=1e-2)


async def test_something_that_is_not_an_array_is_named() -> None:
    async def body(comm: ahcomm.Comm) -> None:
        with pytest.raises(ahcomm.InvalidArgument, match="all_reduce"):
            comm.all_reduce({"not": "an array"})

    await run_inproc(2, body)

"""Every collective x algorithm against numpy, world sizes 1..9 (and 13, 16), in process.

The CCL buffer is 2 KiB here, so the larger counts run in many slices and ring pieces.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ahcomm

from support.inproc import run_inproc
from support.numerics import assert_close, reduce_ref

SIZES = [1, 2, 3, 4, 5, 6, 7, 8, 9]
ALGOS = ["ring", "mesh"]
COUNTS = [0, 1, 37, 1500]  # 1500 float32 = 6000 B > the 2 KiB CCL buffer
DTYPES = [np.float32, np.float64, np.int32, np.int8, np.uint16, np.float16, np.bool_, np.int64, np.uint64]
SMALL_BUFF = 2048


def inputs(rng: np.random.Generator, size: int, count: int, dtype: Any, op: str = "sum") -> list[np.ndarray]:
    dt = np.dtype(dtype)
    if dt == np.bool_:
        return [rng.integers(0, 2, count).astype(bool) for _ in range(size)]
    if op == "prod":
        vals = [rng.integers(1, 3, count) for _ in range(size)]  # products stay small
    elif dt.kind == "f":
        vals = [rng.integers(-8, 9, count) for _ in range(size)]  # exact in every float width
    else:
        lo = 0 if dt.kind == "u" else -3
        vals = [rng.integers(lo, 4, count) for _ in range(size)]
    return [v.astype(dt) for v in vals]


def ops_for(dtype: Any) -> list[str]:
    return ["sum", "prod", "max", "min"] + (["avg"] if np.dtype(dtype).kind == "f" else [])


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("size", SIZES)
async def test_matrix(size: int, algo: str, rng: np.random.Generator) -> None:
    cases: list[tuple[str, Any, int, str, int]] = []
    for i, dtype in enumerate(DTYPES):
        count = COUNTS[i % len(COUNTS)]
        for op in ops_for(dtype):
            cases.append(("all_reduce", dtype, count, op, 0))
        cases.append(("all_gather", dtype, count, "", 0))
        cases.append(("reduce_scatter", dtype, count, ops_for(dtype)[i % 4], 0))
        cases.append(("broadcast", dtype, count, "", (i * 7) % size))
    for count in COUNTS:  # every count with the common dtype
        cases += [("all_reduce", np.float32, count, "sum", 0), ("all_gather", np.float32, count, "", 0),
                  ("reduce_scatter", np.float32, count, "sum", 0), ("broadcast", np.float32, count, "", size - 1)]
    data = [(op, inputs(rng, size, count * (size if op == "reduce_scatter" else 1), dtype, red), red, root)
            for op, dtype, count, red, root in cases]

    async def body(comm: ahcomm.Comm) -> list[np.ndarray]:
        out = []
        for op, xs, red, root in data:
            x = xs[comm.rank].copy()  # a private copy: peers read x in place, the reference stays clean
            if op == "all_reduce":
                out.append(await comm.all_reduce(x, red, algorithm=algo))
            elif op == "all_gather":
                out.append(await comm.all_gather(x, algorithm=algo))
            elif op == "reduce_scatter":
                out.append(await comm.reduce_scatter(x, red, algorithm=algo))
            else:
                out.append(await comm.broadcast(x, root, algorithm=algo))
            assert np.array_equal(x, xs[comm.rank], equal_nan=x.dtype.kind == "f")  # inputs are never modified
        return out

    results = await run_inproc(size, body, buffsize=SMALL_BUFF)
    for k, (op, xs, red, root) in enumerate(data):
        for rank in range(size):
            got = results[rank][k]
            if op == "all_reduce":
                want = reduce_ref(xs, red)
            elif op == "all_gather":
                want = np.concatenate(xs)
            elif op == "reduce_scatter":
                want = np.split(reduce_ref(xs, red), size)[rank]
            else:
                want = xs[root]
            assert_close(got, want)


@pytest.mark.parametrize("size", [13, 16])
@pytest.mark.parametrize("algo", ALGOS)
async def test_wide_worlds(size: int, algo: str, rng: np.random.Generator) -> None:
    xs = inputs(rng, size, 333 * size, np.float64)

    async def body(comm: ahcomm.Comm) -> tuple[np.ndarray, ...]:
        x = xs[comm.rank]
        return (await comm.all_reduce(x, algorithm=algo), await comm.all_gather(x[:333], algorithm=algo),
                await comm.reduce_scatter(x, algorithm=algo), await comm.broadcast(x, 5, algorithm=algo))

    results = await run_inproc(size, body, buffsize=8192)
    for rank, (ar, ag, rs, bc) in enumerate(results):
        assert_close(ar, reduce_ref(xs, "sum"))
        assert_close(ag, np.concatenate([x[:333] for x in xs]))
        assert_close(rs, np.split(reduce_ref(xs, "sum"), size)[rank])
        assert_close(bc, xs[5])


@pytest.mark.parametrize("algo", ALGOS)
async def test_shapes_inplace_strided_and_out(algo: str, rng: np.random.Generator) -> None:
    size = 3
    base = [rng.standard_normal((6, 4, 5)) for _ in range(size)]

    async def body(comm: ahcomm.Comm) -> dict[str, Any]:
        x = base[comm.rank]
        res: dict[str, Any] = {}
        res["ar_strided_in"] = await comm.all_reduce(x[:, ::2, :], algorithm=algo)  # non-contiguous input
        out = np.empty((5, 4, 6))[..., :].transpose(2, 1, 0)  # a strided out of shape (6, 4, 5)
        res["ar_strided_out"] = await comm.all_reduce(x, out=out, algorithm=algo)
        res["strided_out_is_out"] = res["ar_strided_out"] is out
        y = x.copy()
        res["inplace"] = await comm.all_reduce(y, "max", out=y, algorithm=algo)
        res["inplace_is_y"] = res["inplace"] is y
        res["ag"] = await comm.all_gather(x, algorithm=algo)
        res["ag0d"] = await comm.all_gather(np.float32(comm.rank), algorithm=algo)
        res["rs"] = await comm.reduce_scatter(x, algorithm=algo)
        b = x.copy()
        await comm.broadcast(b, root=2, out=b, algorithm=algo)
        res["bc"] = b
        return res

    results = await run_inproc(size, body, buffsize=SMALL_BUFF)
    total = sum(base)
    for rank, res in enumerate(results):
        np.testing.assert_allclose(res["ar_strided_in"], sum(b[:, ::2, :] for b in base))
        np.testing.assert_allclose(res["ar_strided_out"], total)
        assert res["strided_out_is_out"] and res["inplace_is_y"]
        np.testing.assert_array_equal(res["inplace"], np.maximum.reduce(base))
        assert res["ag"].shape == (18, 4, 5)
        np.testing.assert_array_equal(res["ag"], np.concatenate(base))
        np.testing.assert_array_equal(res["ag0d"], np.arange(size, dtype=np.float32))
        np.testing.assert_allclose(res["rs"], total[2 * rank:2 * rank + 2])
        np.testing.assert_array_equal(res["bc"], base[2])


async def test_results_are_bitwise_identical_across_ranks(rng: np.random.Generator) -> None:
    size = 5
    xs = [rng.standard_normal(10_001).astype(np.float32) for _ in range(size)]
    for algo in ALGOS:
        results = await run_inproc(size, lambda c, algo=algo: c.all_reduce(xs[c.rank], algorithm=algo),
                                   buffsize=SMALL_BUFF)
        for r in results[1:]:
            assert r.tobytes() == results[0].tobytes()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    size=st.integers(1, 9),
    rows=st.integers(0, 40),
    tail=st.lists(st.integers(1, 4), max_size=2),
    dtype=st.sampled_from(DTYPES),
    op=st.sampled_from(["sum", "prod", "max", "min", "avg"]),
    algo=st.sampled_from([*ALGOS, None]),
    buff=st.sampled_from([1024, 4096, 1 << 16]),
    seed=st.integers(0, 2**16),
)
async def test_hypothesis_all_reduce_and_reduce_scatter(size: int, rows: int, tail: list[int], dtype: Any, op: str,
                                                        algo: str | None, buff: int, seed: int) -> None:
    if op == "avg" and np.dtype(dtype).kind != "f":
        op = "sum"
    rng = np.random.default_rng(seed)
    shape = (rows * size, *tail)
    count = int(np.prod(shape))
    xs = [x.reshape(shape) for x in inputs(rng, size, count, dtype, op)]

    async def body(comm: ahcomm.Comm) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        x = xs[comm.rank]
        return (await comm.all_reduce(x, op, algorithm=algo), await comm.reduce_scatter(x, op, algorithm=algo),
                await comm.all_gather(x, algorithm=algo))

    results = await run_inproc(size, body, buffsize=buff)
    want = reduce_ref(xs, op)
    for rank, (ar, rs, ag) in enumerate(results):
        assert_close(ar, want)
        assert_close(rs, np.split(want, size)[rank] if rows else want[:0])
        assert_close(ag, np.concatenate(xs))


@pytest.mark.parametrize("size", [2, 3, 5, 8])
@pytest.mark.parametrize("inplace", [False, True])
async def test_single_copy_paths_match_staged_paths(size: int, inplace: bool, rng: np.random.Generator) -> None:
    # 1.1M float32 per rank = 4.4 MB: above every single-copy threshold and bigger than the scratch piece.
    count = 1_100_001
    xs = [rng.integers(-8, 9, count).astype(np.float32) for _ in range(size)]

    async def body(comm: ahcomm.Comm) -> list[np.ndarray]:
        assert comm.topology.single_copy is single
        x = xs[comm.rank]
        y = x.copy()
        ar = await comm.all_reduce(y, out=y if inplace else None, algorithm="mesh")
        ag = await comm.all_gather(x, algorithm="mesh")
        b = x.copy()
        bc = await comm.broadcast(b, root=size - 1, out=b if inplace else None, algorithm="mesh")
        mx = await comm.all_reduce(x, "max", algorithm="mesh")
        return [ar, ag, bc, mx]

    results = {}
    for single in (True, False):
        comms = await ahcomm.init_inprocess(size, buffsize=1 << 20, single_copy=single)
        try:
            results[single] = await asyncio.gather(*(body(c) for c in comms))
        finally:
            await asyncio.gather(*(c.close() for c in comms))
    for rank in range(size):
        ar, ag, bc, mx = results[True][rank]
        assert_close(ar, reduce_ref(xs, "sum"))
        assert_close(ag, np.concatenate(xs))
        assert_close(bc, xs[size - 1])
        assert_close(mx, reduce_ref(xs, "max"))
        for got, staged in zip(results[True][rank], results[False][rank]):
            np.testing.assert_array_equal(got, staged)


@pytest.mark.parametrize("algo_env,expect_puts", [("", False), ("level0:ring", True), ("allreduce=level0:ring", True),
                                                  ("allgather=level0:ring", False), ("level0:NA;level1:ring", False)])
async def test_ahcomm_algo_routes_calls(algo_env: str, expect_puts: bool) -> None:
    # Small all_reduce: mesh stages into its own buffer (no puts), ring puts to its neighbour.
    async def body(comm: ahcomm.Comm) -> int:
        await comm.all_reduce(np.ones(16))
        return sum(link["bytes_sent"] for link in comm.stats()["links"].values())

    sent = await run_inproc(3, body, algo=algo_env)
    assert all((s > 0) == expect_puts for s in sent), sent


async def test_algo_override_that_cannot_serve_names_alternatives() -> None:
    comms = await ahcomm.init_inprocess(2, algo="allreduce=level0:dissemination")
    try:
        cannot = "AHCOMM_ALGO's 'dissemination' cannot run all_reduce.*ring, mesh"
        with pytest.raises(ahcomm.InvalidArgument, match=cannot):
            comms[0].all_reduce(np.ones(4))
    finally:
        await asyncio.gather(*(c.close() for c in comms))

"""RHD (recursive halving-doubling) and NHR against numpy, in process, world sizes 1..9, 13, 16.

Both run all_reduce, reduce_scatter, all_gather, reduce_scatter_v and all_gather_v. The
CCL buffer is 2 KiB (8 KiB for 13 and 16 ranks): a slot holds 64 to 128 bytes,
so the large counts cross many pieces and credits. The schedules themselves are also
checked symbolically for many world sizes (who holds which contributions after each step).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import ahcomm
from ahcomm.algorithms import names
from ahcomm.algorithms.nhr import Layout, all_gather_step, reduce_scatter_step, steps, tree_order
from ahcomm.algorithms.rhd import Fold

from support.inproc import run_inproc
from support.numerics import assert_close, reduce_ref

ALGOS = ["rhd", "nhr"]
SIZES = [1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 16]
DTYPES = [np.float32, np.float64, np.int32, np.int8, np.float16, np.bool_, np.uint64]
COUNTS = [0, 1, 37, 700]  # 700 float32 = 2800 B > the whole 2 KiB CCL buffer


def buff_for(size: int) -> int:
    return 8192 if size > 9 else 2048


def inputs(rng: np.random.Generator, size: int, count: int, dtype: Any, op: str = "sum") -> list[np.ndarray]:
    dt = np.dtype(dtype)
    if dt == np.bool_:
        return [rng.integers(0, 2, count).astype(bool) for _ in range(size)]
    if op == "prod":
        return [rng.integers(1, 3, count).astype(dt) for _ in range(size)]  # products stay exact
    lo = 0 if dt.kind == "u" else -3
    return [rng.integers(lo, 4, count).astype(dt) for _ in range(size)]


def ops_for(dtype: Any) -> list[str]:
    return ["sum", "prod", "max", "min"] + (["avg"] if np.dtype(dtype).kind == "f" else [])


def uneven(rng: np.random.Generator, size: int, top: int) -> list[int]:
    """Counts in 0..top, one rank with nothing and one (another, where there is one) with ``top``."""
    counts = [int(c) for c in rng.integers(0, top + 1, size)]
    counts[0 if size == 1 else 1] = top
    counts[-1 if size > 2 else 0] = 0
    return counts


Case = tuple[str, list[np.ndarray], str, list[int] | None]  # (op, per-rank inputs, reduce op, counts)


def cases(rng: np.random.Generator, size: int) -> list[Case]:
    out: list[Case] = []
    for i, dtype in enumerate(DTYPES):
        count = COUNTS[i % len(COUNTS)]
        for op in ops_for(dtype):
            out.append(("all_reduce", inputs(rng, size, count, dtype, op), op, None))
        red = ops_for(dtype)[i % 4]
        out.append(("reduce_scatter", inputs(rng, size, count * size, dtype, red), red, None))
        out.append(("all_gather", inputs(rng, size, count, dtype), "", None))
        counts = uneven(rng, size, COUNTS[(i + 1) % len(COUNTS)])
        out.append(("reduce_scatter_v", inputs(rng, size, sum(counts), dtype, red), red, counts))
        out.append(("all_gather_v", [x[:c] for x, c in zip(inputs(rng, size, max(counts), dtype), counts)], "", counts))
    for count in COUNTS[1:]:  # every count with the common dtype and op
        out += [("all_reduce", inputs(rng, size, count, np.float32), "sum", None),
                ("reduce_scatter", inputs(rng, size, count * size, np.float32), "sum", None),
                ("all_gather", inputs(rng, size, count, np.float32), "", None)]
    zeros = [0] * size  # nothing anywhere: never reaches the algorithm, still a valid call
    out += [("reduce_scatter_v", inputs(rng, size, 0, np.int32), "sum", zeros),
            ("all_gather_v", inputs(rng, size, 0, np.int32), "", zeros)]
    return out


def expected(case: Case, rank: int, size: int) -> np.ndarray:
    op, xs, red, counts = case
    if op == "all_reduce":
        return reduce_ref(xs, red)
    if op == "reduce_scatter":
        return np.split(reduce_ref(xs, red), size)[rank]
    if op == "all_gather" or op == "all_gather_v":
        return np.concatenate(xs)
    assert counts is not None
    d = np.cumsum([0, *counts])
    return reduce_ref(xs, red)[d[rank]:d[rank + 1]]


async def call(comm: ahcomm.Comm, case: Case, algo: str) -> np.ndarray:
    op, xs, red, counts = case
    x = xs[comm.rank]
    if op == "all_reduce":
        return await comm.all_reduce(x, red, algorithm=algo)
    if op == "reduce_scatter":
        return await comm.reduce_scatter(x, red, algorithm=algo)
    if op == "all_gather":
        return await comm.all_gather(x, algorithm=algo)
    assert counts is not None
    if op == "reduce_scatter_v":
        return await comm.reduce_scatter_v(x, counts, red, algorithm=algo)
    got = await comm.all_gather_v(x, counts=counts, algorithm=algo)
    assert got.counts == tuple(counts)
    return got.data


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("algo", ALGOS)
async def test_matrix(algo: str, size: int, rng: np.random.Generator) -> None:
    data = cases(rng, size)
    floats = [rng.standard_normal(1001).astype(np.float32) for _ in range(size)]

    async def body(comm: ahcomm.Comm) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
        out = []
        for case in data:
            out.append(await call(comm, case, algo))
        y = floats[comm.rank].copy()
        inplace = await comm.all_reduce(y, "sum", out=y, algorithm=algo)
        assert inplace is y
        return out, y, await comm.all_reduce(floats[comm.rank], "max", algorithm=algo)

    originals = [[x.copy() for x in case[1]] for case in data]
    results = await run_inproc(size, body, buffsize=buff_for(size))
    for k, case in enumerate(data):
        for x, orig in zip(case[1], originals[k]):
            np.testing.assert_array_equal(x, orig)  # inputs are never modified
        for rank in range(size):
            assert_close(results[rank][0][k], expected(case, rank, size))
    for rank in range(size):  # one rank reduces each element: every rank gets the same bits
        assert results[rank][1].tobytes() == results[0][1].tobytes()
        np.testing.assert_allclose(results[rank][1], sum(floats), rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(results[rank][2], np.maximum.reduce(floats))


@pytest.mark.parametrize("algo", ALGOS)
async def test_blocks_with_rows_and_large_uneven_blocks(algo: str, rng: np.random.Generator) -> None:
    size = 6
    counts = [0, 900, 3, 0, 1, 517]  # rows of 2: blocks far larger than the 2 KiB buffer next to empty ones
    xs = [rng.integers(-50, 50, (sum(counts), 2)).astype(np.float64) for _ in range(size)]

    async def body(comm: ahcomm.Comm) -> tuple[np.ndarray, Any, np.ndarray]:
        x = xs[comm.rank]
        rs = await comm.reduce_scatter_v(x, counts, algorithm=algo)
        mine = np.split(x, np.cumsum(counts)[:-1])[comm.rank]
        ag = await comm.all_gather_v(mine, algorithm=algo)  # counts exchanged first
        return rs, ag, await comm.all_reduce(x, "min", algorithm=algo)

    results = await run_inproc(size, body, buffsize=2048)
    want = np.split(sum(xs), np.cumsum(counts)[:-1])
    for rank, (rs, ag, ar) in enumerate(results):
        np.testing.assert_array_equal(rs, want[rank])
        assert ag.counts == tuple(counts)
        np.testing.assert_array_equal(ag.data, np.concatenate([np.split(x, np.cumsum(counts)[:-1])[p]
                                                               for p, x in enumerate(xs)]))
        np.testing.assert_array_equal(ar, np.minimum.reduce(xs))


def test_registered() -> None:
    for op in ("all_reduce", "reduce_scatter", "all_gather", "reduce_scatter_v", "all_gather_v"):
        assert {"rhd", "nhr"} <= set(names(op))


@pytest.mark.parametrize("n", range(1, 40))
def test_nhr_schedule_reduces_each_contribution_once(n: int) -> None:
    held = [[{r} for _ in range(n)] for r in range(n)]  # held[rank][slice]: contributions in it
    sent = [0] * n
    for s in range(steps(n)):
        moves = []
        for r in range(n):
            to, frm, tx, _rx = reduce_scatter_step(r, n, s)
            assert reduce_scatter_step(to, n, s)[1:4:2] == (r, tx)  # the peer expects exactly these
            assert frm == (r + (1 << s)) % n
            moves += [(to, b, set(held[r][b])) for b in tx]
            sent[r] += len(tx)
        for to, b, got in moves:
            assert not held[to][b] & got  # nothing reduced twice
            held[to][b] |= got
    assert all(held[r][r] == set(range(n)) for r in range(n))
    assert sent == [n - 1] * n  # (n-1)/n of the data in ceil(log2 n) steps
    have = [{r} for r in range(n)]
    for s in reversed(range(steps(n))):
        moves = []
        for r in range(n):
            to, _, tx, _ = all_gather_step(r, n, s)
            assert all_gather_step(to, n, s)[1:4:2] == (r, tx) and set(tx) <= have[r]
            moves += [(to, set(tx))]
        for to, got in moves:
            assert not have[to] & got
            have[to] |= got
    assert all(h == set(range(n)) for h in have)
    assert steps(n) == (0 if n == 1 else int(np.ceil(np.log2(n))))


def test_nhr_tree_order_merges_slices() -> None:
    for n in range(1, 40):
        assert sorted(tree_order(n)) == list(range(n))
    # HCCL's slice map for 8 ranks; each reduce-scatter step then sends one contiguous run
    assert Layout([1] * 8, tree_order(8)).pos == [0, 4, 2, 6, 1, 5, 3, 7]
    for n in (4, 6, 8, 12, 16):
        layout = Layout([3] * n, tree_order(n))
        for r in range(n):
            for s in range(steps(n)):
                assert len(list(layout.runs(reduce_scatter_step(r, n, s)[2]))) == 1


@pytest.mark.parametrize("n", range(2, 34))
def test_rhd_fold_gives_every_block_one_owner(n: int) -> None:
    fold = Fold(n)
    owners = [fold.virtual(r) for r in range(n)]
    assert sorted(v for v in owners if v is not None) == list(range(fold.p))
    assert [fold.real(v) for v in range(fold.p)] == [r for r in range(n) if owners[r] is not None]
    for v in range(fold.p):
        steps = list(fold.halving(v))
        for peer, give, _ in steps:
            assert fold.virtual(peer) == v ^ (give[1] - give[0])
        assert (steps[-1][2] if steps else (0, fold.p)) == (v, v + 1)
        held = {v}
        for _peer, mine, theirs in fold.doubling(v):
            assert set(range(*mine)) == held
            held |= set(range(*theirs))
        assert held == set(range(fold.p))

"""bfloat16 / float8 and the bitwise reduce ops through every collective, in process.

World sizes 1, 2, 3, 5, 8 with the ring and mesh algorithms, against numpy. The CCL buffer
is 2 KiB, so the 3000-element counts run in several slices even at one byte per element.

The float inputs are chosen so that every partial result, in any reduction order, is
exactly representable in the narrow type (small integers, powers of two). The results are
then compared with a float64 reference value for value (NaN equal to NaN, -0 equal to +0),
not within a tolerance: a reduction that lost the dtype, truncated, or went through a
narrower type would fail. On two ranks a reduction is one rounding of one operation, so
there arbitrary values (NaN, inf and subnormals included) must match the correctly rounded
float64 result exactly.
"""

from __future__ import annotations

import functools
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import ahcomm

from support.inproc import run_inproc
from support.numerics import REDUCE_UFUNCS, assert_close, reduce_ref

# NaN and inf inputs (and float8 overflow) make numpy's loops warn, in the library's streams too
pytestmark = pytest.mark.filterwarnings("ignore:(invalid value|overflow) encountered:RuntimeWarning")

SIZES = [1, 2, 3, 5, 8]
ALGOS = ["ring", "mesh"]
COUNTS = [0, 1, 37, 3000]
SMALL_BUFF = 2048

BF16, E4M3, E5M2 = (np.dtype(t) for t in (ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2))
ML_DTYPES = [BF16, E4M3, E5M2]
FLOAT_OPS = ["sum", "prod", "max", "min", "avg"]
INT_DTYPES = [np.dtype(t) for t in (np.int8, np.int32, np.uint64, np.bool_)]
BIT_OPS = ["band", "bor", "bxor"]
# sum: |every partial sum| <= 8 ranks * bound stays an exact integer of the type
SUM_BOUND = {BF16: 4, E4M3: 2, E5M2: 1}


def every_value(dt: np.dtype) -> np.ndarray:
    return np.arange(1 << (8 * dt.itemsize), dtype=f"u{dt.itemsize}").view(dt)


def float_inputs(rng: np.random.Generator, size: int, count: int, dt: np.dtype, op: str) -> list[np.ndarray]:
    if op == "prod":  # products of +-2**k, |k| <= 1, over 8 ranks: 2**-8..2**8, exact in all three
        return [rng.choice(np.array([-2, -1, -0.5, 0.5, 1, 2]), count).astype(dt) for _ in range(size)]
    if op in ("max", "min"):  # any bit pattern: NaN, inf, -0, subnormals; max/min never round
        return [rng.choice(every_value(dt), count) for _ in range(size)]
    b = SUM_BOUND[dt]
    return [rng.integers(-b, b + 1, count).astype(dt) for _ in range(size)]


def int_inputs(rng: np.random.Generator, size: int, count: int, dt: np.dtype) -> list[np.ndarray]:
    if dt == np.bool_:
        return [rng.integers(0, 2, count).astype(bool) for _ in range(size)]
    info = np.iinfo(dt)
    return [rng.integers(info.min, info.max, count, dtype=dt, endpoint=True) for _ in range(size)]


def exact_ref(xs: list[np.ndarray], op: str) -> np.ndarray:
    """The reduction in float64 (exact for our inputs), rounded once to the inputs' dtype."""
    dt = xs[0].dtype
    with np.errstate(all="ignore"):
        acc = functools.reduce(REDUCE_UFUNCS[op], [x.astype(np.float64) for x in xs])
        if op == "avg":
            acc = acc / len(xs)
        return np.asarray(acc).astype(dt)


def assert_same_values(got: np.ndarray, want: np.ndarray) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape, want.dtype, want.shape)
    np.testing.assert_array_equal(got.astype(np.float32), want.astype(np.float32))  # NaN == NaN here


def assert_same_bits(got: np.ndarray, want: np.ndarray) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape, want.dtype, want.shape)
    uint = f"u{max(got.dtype.itemsize, 1)}"
    assert got.tobytes() == want.tobytes(), np.flatnonzero(got.view(uint) != want.view(uint))[:10]


async def run_case(comm: ahcomm.Comm, op: str, x: np.ndarray, red: str, root: int, algo: str) -> np.ndarray:
    if op == "all_reduce":
        return await comm.all_reduce(x, red, algorithm=algo)
    if op == "reduce_scatter":
        return await comm.reduce_scatter(x, red, algorithm=algo)
    if op == "all_gather":
        return await comm.all_gather(x, algorithm=algo)
    return await comm.broadcast(x, root, algorithm=algo)


async def run_cases(size: int, algo: str, data: list[tuple[str, list[np.ndarray], str, int]]) -> list[list[np.ndarray]]:
    async def body(comm: ahcomm.Comm) -> list[np.ndarray]:
        out = []
        for op, xs, red, root in data:
            x = xs[comm.rank]
            before = x.copy()
            out.append(await run_case(comm, op, x, red, root, algo))
            assert x.tobytes() == before.tobytes()  # inputs are never modified
        return out
    return await run_inproc(size, body, buffsize=SMALL_BUFF)


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("size", SIZES)
async def test_ml_float_collectives(size: int, algo: str, rng: np.random.Generator) -> None:
    data: list[tuple[str, list[np.ndarray], str, int]] = []
    for i, dt in enumerate(ML_DTYPES):
        for j, red in enumerate(FLOAT_OPS):
            n = COUNTS[(i + j) % len(COUNTS)]
            data.append(("all_reduce", float_inputs(rng, size, n, dt, red), red, 0))
            n = COUNTS[(i + j + 1) % len(COUNTS)]
            data.append(("reduce_scatter", float_inputs(rng, size, n * size, dt, red), red, 0))
        for k, n in enumerate((37, 3000)):  # data movement: every bit pattern must arrive unchanged
            data.append(("all_gather", [rng.choice(every_value(dt), n) for _ in range(size)], "", 0))
            data.append(("broadcast", [rng.choice(every_value(dt), n) for _ in range(size)], "", (i + k) % size))
    results = await run_cases(size, algo, data)

    for k, (op, xs, red, root) in enumerate(data):
        for rank in range(size):
            got = results[rank][k]
            if op == "all_gather":
                assert_same_bits(got, np.concatenate(xs))
            elif op == "broadcast":
                assert_same_bits(got, xs[root])
            else:
                want = exact_ref(xs, red)
                if op == "reduce_scatter":
                    want = np.split(want, size)[rank]
                assert_same_values(got, want)
                ref = reduce_ref(xs, red)  # conftest's rank-order reference agrees (exact inputs)
                assert_close(got, np.split(ref, size)[rank] if op == "reduce_scatter" else ref)
        if op == "all_reduce" and red in ("sum", "prod", "avg"):  # exact inputs: every rank has the same bits
            for rank in range(1, size):
                assert_same_bits(results[rank][k], results[0][k])


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("dt", ML_DTYPES, ids=str)
async def test_two_ranks_round_once_like_float32(dt: np.dtype, algo: str, rng: np.random.Generator) -> None:
    """Arbitrary values on two ranks: each element is a+b (a*b, ...) rounded once to the type.

    This is the float32-then-round contract of the ml_dtypes ufuncs: computing in the narrow
    type by truncation, or through float16, would differ here (ties, subnormals, overflow).
    """
    n = 3000
    vals = every_value(dt)
    xs = [rng.choice(vals, 2 * n) for _ in range(2)]
    with np.errstate(all="ignore"):
        near = xs[0][:n].astype(np.float32) * rng.uniform(-2, 2, n).astype(np.float32)
        xs[1][:n] = near.astype(dt)  # half the pairs of similar magnitude, where rounding bites

    async def body(comm: ahcomm.Comm) -> list[np.ndarray]:
        x = xs[comm.rank]
        return [await comm.all_reduce(x, red, algorithm=algo) for red in FLOAT_OPS] + \
            [await comm.reduce_scatter(x, red, algorithm=algo) for red in FLOAT_OPS]

    results = await run_inproc(2, body, buffsize=SMALL_BUFF)
    for i, red in enumerate(FLOAT_OPS):
        if red == "avg":  # the sum, rounded, then halved and rounded
            with np.errstate(all="ignore"):
                want = (exact_ref(xs, "sum").astype(np.float64) / 2).astype(dt)
        else:
            want = exact_ref(xs, red)
        for rank in range(2):
            assert_same_values(results[rank][i], want)
            assert_same_values(results[rank][len(FLOAT_OPS) + i], np.split(want, 2)[rank])


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("size", SIZES)
async def test_bitwise_collectives(size: int, algo: str, rng: np.random.Generator) -> None:
    data: list[tuple[str, list[np.ndarray], str, int]] = []
    for i, dt in enumerate(INT_DTYPES):
        for j, red in enumerate(BIT_OPS):
            n = COUNTS[(i + j) % len(COUNTS)]
            data.append(("all_reduce", int_inputs(rng, size, n, dt), red, 0))
            n = COUNTS[(i + j + 2) % len(COUNTS)]
            data.append(("reduce_scatter", int_inputs(rng, size, n * size, dt), red, 0))
    results = await run_cases(size, algo, data)

    py = {"band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor}
    for k, (op, xs, red, _) in enumerate(data):
        want = functools.reduce(py[red], xs)  # on bool numpy's bitwise ops are the logical ones
        assert want.dtype == xs[0].dtype
        assert_same_bits(reduce_ref(xs, red), want)
        for rank in range(size):
            got = results[rank][k]
            assert_same_bits(got, np.split(want, size)[rank] if op == "reduce_scatter" else want)


async def test_bitwise_ops_select_the_bits(rng: np.random.Generator) -> None:
    """Hand-checked: each rank sets its own bit; and of all is 0, or is all bits, xor of two copies is 0."""
    size = 5

    async def body(comm: ahcomm.Comm) -> list[np.ndarray]:
        mine = np.array([1 << comm.rank, 0xFF, 1 << 63], np.uint64)
        return [await comm.all_reduce(mine, red) for red in BIT_OPS] + \
            [await comm.all_reduce(np.array([True, comm.rank % 2 == 1, False]), red) for red in BIT_OPS]

    for res in await run_inproc(size, body):
        assert res[0].tolist() == [0, 0xFF, 1 << 63]
        assert res[1].tolist() == [0b11111, 0xFF, 1 << 63]
        assert res[2].tolist() == [0b11111, 0xFF, 1 << 63]  # odd number of ranks: x ^ x ^ ... ^ x == x
        assert res[3].tolist() == [True, False, False]
        assert res[4].tolist() == [True, True, False]
        assert res[5].tolist() == [True, False, False]  # two odd ranks: True ^ True; five Trues: True


@pytest.mark.parametrize("algo", ALGOS)
async def test_ml_float_shapes_inplace_and_strided(algo: str, rng: np.random.Generator) -> None:
    size = 3
    base = [rng.integers(-4, 5, (6, 4, 5)).astype(BF16) for _ in range(size)]

    async def body(comm: ahcomm.Comm) -> dict[str, Any]:
        x = base[comm.rank]
        res: dict[str, Any] = {}
        res["strided_in"] = await comm.all_reduce(x[:, ::2, :], "sum", algorithm=algo)
        y = x.copy()
        res["inplace"] = await comm.all_reduce(y, "avg", out=y, algorithm=algo)
        res["inplace_is_y"] = res["inplace"] is y
        out = np.empty((5, 4, 6), BF16).transpose(2, 1, 0)
        res["strided_out"] = await comm.reduce_scatter(np.concatenate([x] * size), "max", out=out, algorithm=algo)
        res["strided_out_is_out"] = res["strided_out"] is out
        return res

    want_sum = exact_ref([b[:, ::2, :] for b in base], "sum")
    for res in await run_inproc(size, body, buffsize=SMALL_BUFF):
        assert_same_values(res["strided_in"], want_sum)
        assert res["inplace_is_y"] and res["strided_out_is_out"]
        assert_same_values(res["inplace"], exact_ref(base, "avg"))
        assert_same_values(res["strided_out"], exact_ref(base, "max"))


async def test_bad_op_dtype_pairs_raise_at_the_call_and_leave_the_comm_usable() -> None:
    async def body(comm: ahcomm.Comm) -> np.ndarray:
        for dt in (*ML_DTYPES, np.dtype(np.float32)):
            for red in BIT_OPS:
                with pytest.raises(ahcomm.InvalidDtype, match=f"'{red}'.*{dt}"):
                    comm.all_reduce(np.ones(4, dt), red)
                with pytest.raises(ahcomm.InvalidDtype, match=f"'{red}'.*{dt}"):
                    comm.reduce_scatter(np.ones(4 * comm.size, dt), red)
        for dt in (np.int8, np.uint64, np.bool_):
            with pytest.raises(ahcomm.InvalidDtype, match="'avg' needs a floating dtype"):
                comm.all_reduce(np.ones(4, dt), "avg")
        with pytest.raises(ahcomm.InvalidArgument, match="band, bor, bxor"):
            comm.all_reduce(np.ones(4, np.int8), "xor")
        return await comm.all_reduce(np.full(4, comm.rank + 1, BF16), "avg")

    for got in await run_inproc(3, body):
        assert_same_values(got, np.full(4, 2, BF16))

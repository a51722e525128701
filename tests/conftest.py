"""Shared helpers: in-process jobs and references."""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable

import ml_dtypes
import numpy as np
import pytest

import ahcomm
from ahcomm._dtypes import ML_FLOAT_DTYPES


@pytest.fixture(autouse=True, scope="session")
def _flight_records_in_a_temp_dir(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Flight records of the failures the tests provoke go to pytest's temp dir, not /tmp."""
    import os

    os.environ.setdefault("AHCOMM_FLIGHT_DIR", str(tmp_path_factory.mktemp("flight")))


REDUCE_UFUNCS = {"sum": np.add, "prod": np.multiply, "max": np.maximum, "min": np.minimum, "avg": np.add,
                 "band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor}
BOOL_UFUNCS = {"sum": np.logical_or, "prod": np.logical_and, "max": np.logical_or, "min": np.logical_and,
               "band": np.logical_and, "bor": np.logical_or, "bxor": np.logical_xor}


async def run_inproc(size: int, body: Callable[[ahcomm.Comm], Awaitable[Any]], *, buffsize: int = 1 << 16,
                     algo: str = "") -> list[Any]:
    """Run ``body(comm)`` on every rank of an in-process job; return the per-rank results."""
    comms = await ahcomm.init_inprocess(size, buffsize=buffsize, algo=algo)
    try:
        return list(await asyncio.wait_for(asyncio.gather(*(body(c) for c in comms)), timeout=60))
    finally:
        await asyncio.gather(*(c.close() for c in comms))


def reduce_ref(xs: list[np.ndarray], op: str) -> np.ndarray:
    """numpy reference of a reduction across ranks, in rank order, in the inputs' dtype."""
    dtype = xs[0].dtype
    ufunc = BOOL_UFUNCS[op] if dtype == np.bool_ else REDUCE_UFUNCS[op]
    out = xs[0].copy()
    for x in xs[1:]:
        out = ufunc(out, x).astype(dtype, copy=False)
    if op == "avg":
        out = (out / len(xs)).astype(dtype)
    return out


def assert_close(got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, got.dtype, want.shape, want.dtype)
    if got.dtype in ML_FLOAT_DTYPES:  # bfloat16, float8_*: compare in float32, within one ulp of the type
        tol = float(ml_dtypes.finfo(got.dtype).eps)
        np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), rtol=tol, atol=tol)
    elif got.dtype.kind == "f":
        tol = 1e-2 if got.dtype.itemsize == 2 else 1e-5
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    else:
        np.testing.assert_array_equal(got, want)


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)

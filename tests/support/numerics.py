"""numpy references and comparisons for collective results."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from ahcomm._dtypes import ML_FLOAT_DTYPES
from ahcomm.testing import BOOL_UFUNCS, REDUCE_UFUNCS
from ahcomm.testing import reduce_reference as reduce_ref

__all__ = ["BOOL_UFUNCS", "REDUCE_UFUNCS", "assert_close", "exact_values", "redops", "reduce_ref"]


def assert_close(got: np.ndarray, want: np.ndarray) -> None:
    """Equal where exact, within one ulp of the type for floats (bfloat16, float8 in float32)."""
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, got.dtype, want.shape, want.dtype)
    if got.dtype in ML_FLOAT_DTYPES:  # bfloat16, float8_*: compare in float32, within one ulp of the type
        tol = float(ml_dtypes.finfo(got.dtype).eps)
        np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), rtol=tol, atol=tol)
    elif got.dtype.kind == "f":
        tol = 1e-2 if got.dtype.itemsize == 2 else 1e-5
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    else:
        np.testing.assert_array_equal(got, want)


def exact_values(rng: np.random.Generator, count: int, dtype: Any, op: str = "sum") -> np.ndarray:
    """``count`` small integers as ``dtype``, whose reduction by ``op`` over a few ranks is exact
    in every dtype and any order (products of 1s and 2s; sums within bfloat16's integers)."""
    dt = np.dtype(dtype)
    if dt == np.bool_:
        return rng.integers(0, 2, count).astype(bool)
    lo, hi = (1, 3) if op == "prod" else ((-8, 9) if dt.kind in "fV" or dt == ml_dtypes.bfloat16 else
                                          (0 if dt.kind == "u" else -3, 4))
    return rng.integers(lo, hi, count).astype(dt)


def redops(dtype: Any) -> list[str]:
    """The reduce ops that apply to ``dtype`` (avg: floating types only)."""
    floating = np.dtype(dtype).kind == "f" or np.dtype(dtype) == ml_dtypes.bfloat16
    return ["sum", "prod", "max", "min"] + (["avg"] if floating else [])

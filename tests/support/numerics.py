"""numpy references and comparisons for collective results."""

from __future__ import annotations

import ml_dtypes
import numpy as np

from ahcomm._dtypes import ML_FLOAT_DTYPES
from ahcomm.testing import BOOL_UFUNCS, REDUCE_UFUNCS
from ahcomm.testing import reduce_reference as reduce_ref

__all__ = ["BOOL_UFUNCS", "REDUCE_UFUNCS", "assert_close", "reduce_ref"]


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

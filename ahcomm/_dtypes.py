"""Supported dtypes, reduce ops, and the elementwise kernels that apply them.

Besides numpy's own dtypes, ahcomm moves and reduces the 8- and 16-bit floats of
``ml_dtypes``: ``bfloat16``, ``float8_e4m3fn`` and ``float8_e5m2``. ml_dtypes registers
numpy ufunc loops for them (add, multiply, maximum, minimum, divide) that convert each
element to float32, compute in float32, and round the result once back to the narrow type
(round to nearest even). float32 has more than twice their significand bits plus two, so
that single rounding gives the correctly rounded result of the exact operation: each
pairwise reduction step is exact-then-rounded, the best a result stored in the narrow
type can be. Across ranks the partial results are stored in the array's dtype, so a
reduction over ``n`` ranks rounds ``n - 1`` times (as it does for float16).

Overflow follows the type:

- ``bfloat16`` and ``float8_e5m2`` have infinities: a sum or product past the largest
  finite value (about 3.39e38 and 57344) becomes ``+-inf``.
- ``float8_e4m3fn`` has no infinity (the "fn" is "finite, NaN"): its largest value is 448,
  results up to 464 round to 448, and anything larger in magnitude becomes NaN (it does
  not saturate). Keep e4m3fn sums and products well inside +-448, or scale first.
"""

from __future__ import annotations

import enum

import ml_dtypes
import numpy as np

from ._errors import InvalidArgument, InvalidDtype

BFLOAT16: np.dtype = np.dtype(ml_dtypes.bfloat16)
FLOAT8_E4M3FN: np.dtype = np.dtype(ml_dtypes.float8_e4m3fn)
FLOAT8_E5M2: np.dtype = np.dtype(ml_dtypes.float8_e5m2)
#: The ml_dtypes floats. numpy gives bfloat16 and float8_e4m3fn kind "V" (and float8_e5m2
#: kind "f"), so "is it a float" is asked through is_float(), never dtype.kind.
ML_FLOAT_DTYPES: tuple[np.dtype, ...] = (BFLOAT16, FLOAT8_E4M3FN, FLOAT8_E5M2)
_ML_FLOATS = frozenset(ML_FLOAT_DTYPES)

SUPPORTED_DTYPES: tuple[np.dtype, ...] = tuple(
    np.dtype(t)
    for t in (
        np.bool_,
        np.int8, np.int16, np.int32, np.int64,
        np.uint8, np.uint16, np.uint32, np.uint64,
        np.float16, np.float32, np.float64,
    )
) + ML_FLOAT_DTYPES
_SUPPORTED = frozenset(SUPPORTED_DTYPES)


class ReduceOp(enum.Enum):
    """Reduction applied elementwise across ranks.

    ``band``/``bor``/``bxor`` are bitwise and/or/xor, for integer and bool dtypes only
    (on bool they are logical and/or/xor).
    """

    SUM = "sum"
    PROD = "prod"
    MAX = "max"
    MIN = "min"
    AVG = "avg"
    BAND = "band"
    BOR = "bor"
    BXOR = "bxor"

    @classmethod
    def parse(cls, op: "ReduceOp | str") -> "ReduceOp":
        if isinstance(op, ReduceOp):
            return op
        if isinstance(op, str):
            try:
                return cls(op.strip().lower())
            except ValueError:
                pass
        names = ", ".join(o.value for o in cls)
        raise InvalidArgument(f"unknown reduce op {op!r}; expected one of: {names}")


_BITWISE = frozenset({ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR})

_UFUNC: dict[ReduceOp, np.ufunc] = {
    ReduceOp.SUM: np.add,
    ReduceOp.AVG: np.add,  # summed, then divided once at the end
    ReduceOp.PROD: np.multiply,
    ReduceOp.MAX: np.maximum,
    ReduceOp.MIN: np.minimum,
    ReduceOp.BAND: np.bitwise_and,
    ReduceOp.BOR: np.bitwise_or,
    ReduceOp.BXOR: np.bitwise_xor,
}
_BOOL_UFUNC: dict[ReduceOp, np.ufunc] = {
    ReduceOp.SUM: np.logical_or,
    ReduceOp.PROD: np.logical_and,
    ReduceOp.MAX: np.logical_or,
    ReduceOp.MIN: np.logical_and,
    ReduceOp.BAND: np.logical_and,
    ReduceOp.BOR: np.logical_or,
    ReduceOp.BXOR: np.logical_xor,
}


def is_float(dtype: np.dtype) -> bool:
    """True for numpy's floats and the ml_dtypes floats (bfloat16, float8_*)."""
    return dtype.kind == "f" or dtype in _ML_FLOATS


def check_dtype(dtype: np.dtype, what: str = "array") -> np.dtype:
    """Return ``dtype`` if ahcomm can move it, else raise InvalidDtype naming it."""
    dtype = np.dtype(dtype)
    if dtype not in _SUPPORTED or not dtype.isnative:
        names = ", ".join(str(d) for d in SUPPORTED_DTYPES)
        raise InvalidDtype(f"{what} has dtype {dtype}, which is not supported; supported: {names}")
    return dtype


def check_reduce(op: ReduceOp, dtype: np.dtype) -> None:
    """Reject op/dtype pairs with no meaning: avg of integers or booleans, bitwise ops on floats."""
    if op is ReduceOp.AVG and not is_float(dtype):
        raise InvalidDtype(f"reduce op 'avg' needs a floating dtype, got {dtype}; use 'sum' and divide")
    if op in _BITWISE and is_float(dtype):
        raise InvalidDtype(f"reduce op '{op.value}' (bitwise) needs an integer or bool dtype, got {dtype}; "
                           f"view the data as an unsigned integer type of the same width to combine bits")


def ufunc_for(op: ReduceOp, dtype: np.dtype) -> np.ufunc:
    """The binary ufunc that combines two contributions of ``dtype`` under ``op``.

    It is called as ``ufunc(a, b, out=dst)`` with all three of ``dtype``. For the
    ml_dtypes floats numpy's own ufuncs already compute each element in float32 and round
    once (see the module docstring), so no wrapper is needed.
    """
    check_reduce(op, dtype)
    if dtype == np.bool_:
        return _BOOL_UFUNC[op]
    return _UFUNC[op]


def finish_avg(out: np.ndarray, world_size: int) -> None:
    """Turn a summed result into the mean, in place (for bfloat16/float8: divided in float32, rounded once)."""
    np.divide(out, world_size, out=out, casting="unsafe")

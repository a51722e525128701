"""Supported dtypes, reduce ops, and the elementwise kernels that apply them."""

from __future__ import annotations

import enum
import numpy as np

from ._errors import InvalidArgument, InvalidDtype

SUPPORTED_DTYPES: tuple[np.dtype, ...] = tuple(
    np.dtype(t)
    for t in (
        np.bool_,
        np.int8, np.int16, np.int32, np.int64,
        np.uint8, np.uint16, np.uint32, np.uint64,
        np.float16, np.float32, np.float64,
    )
)
_SUPPORTED = frozenset(SUPPORTED_DTYPES)


class ReduceOp(enum.Enum):
    """Reduction applied elementwise across ranks."""

    SUM = "sum"
    PROD = "prod"
    MAX = "max"
    MIN = "min"
    AVG = "avg"

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


_UFUNC: dict[ReduceOp, np.ufunc] = {
    ReduceOp.SUM: np.add,
    ReduceOp.AVG: np.add,  # summed, then divided once at the end
    ReduceOp.PROD: np.multiply,
    ReduceOp.MAX: np.maximum,
    ReduceOp.MIN: np.minimum,
}
_BOOL_UFUNC: dict[ReduceOp, np.ufunc] = {
    ReduceOp.SUM: np.logical_or,
    ReduceOp.PROD: np.logical_and,
    ReduceOp.MAX: np.logical_or,
    ReduceOp.MIN: np.logical_and,
}


def check_dtype(dtype: np.dtype, what: str = "array") -> np.dtype:
    """Return ``dtype`` if ahcomm can move it, else raise InvalidDtype naming it."""
    dtype = np.dtype(dtype)
    if dtype not in _SUPPORTED or not dtype.isnative:
        names = ", ".join(str(d) for d in SUPPORTED_DTYPES)
        raise InvalidDtype(f"{what} has dtype {dtype}, which is not supported; supported: {names}")
    return dtype


def check_reduce(op: ReduceOp, dtype: np.dtype) -> None:
    """Reject op/dtype pairs with no meaning (avg of integers or booleans)."""
    if op is ReduceOp.AVG and dtype.kind != "f":
        raise InvalidDtype(f"reduce op 'avg' needs a floating dtype, got {dtype}; use 'sum' and divide")


def ufunc_for(op: ReduceOp, dtype: np.dtype) -> np.ufunc:
    """The binary ufunc that combines two contributions of ``dtype`` under ``op``."""
    if dtype == np.bool_:
        if op is ReduceOp.AVG:
            check_reduce(op, dtype)
        return _BOOL_UFUNC[op]
    return _UFUNC[op]


def finish_avg(out: np.ndarray, world_size: int) -> None:
    """Turn a summed result into the mean, in place."""
    np.divide(out, world_size, out=out, casting="unsafe")

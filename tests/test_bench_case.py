"""The benchmark's buffers hold their own pages before any timing (ahcomm.bench.Case)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import numpy as np
import pytest

from ahcomm.bench import Case

PAGE = os.sysconf("SC_PAGE_SIZE")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux's /proc/self/statm")
@pytest.mark.parametrize("op", ["all_gather", "broadcast"])
def test_case_buffers_are_faulted_in(op: str) -> None:
    """An untouched np.zeros is the kernel's shared zero page: a read-only input (all_gather's, a
    broadcast root's) then reads from the cache and the timing flatters. Case writes every page,
    so the resident set grows by the buffers' size (the old code's np.zeros grew it by ~0)."""
    comm = SimpleNamespace(size=2, rank=0)
    before = _rss()
    case = Case(comm, op, 64 << 20, np.dtype(np.float32), "sum", 0, None, inplace=op == "broadcast")
    grown = _rss() - before
    held = case.src.nbytes + (0 if case.dst is None or case.dst is case.src else case.dst.nbytes)
    assert grown >= 0.9 * held, f"{grown >> 20} MiB resident after making {held >> 20} MiB of buffers"
    assert not case.src.any() and (case.dst is None or not case.dst.any())


def test_case_buffers_of_every_dtype_are_zeros() -> None:
    from ahcomm import SUPPORTED_DTYPES
    comm = SimpleNamespace(size=3, rank=1)
    for dtype in SUPPORTED_DTYPES:
        case = Case(comm, "all_gather", 3000, np.dtype(dtype), "sum", 0, None, inplace=False)
        assert case.src.dtype == dtype and not case.src.astype(np.float64).any()
        assert case.dst is not None and case.dst.size == 3 * case.src.size

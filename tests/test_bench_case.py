"""The benchmark's buffers hold their own pages before any timing (ahcomm._bench_case.Case)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import numpy as np
import pytest

from ahcomm._bench_case import Case

PAGE = os.sysconf("SC_PAGE_SIZE")


def _present(array: np.ndarray) -> float:
    """The fraction of ``array``'s pages that have a page of their own in memory (bit 63 of each
    page's /proc/self/pagemap entry). A page never written is not present (a later read would map
    the shared zero page). Unlike the resident set's growth, this does not depend on whether the
    allocator reused memory an earlier test had already faulted in."""
    first = array.ctypes.data // PAGE
    last = (array.ctypes.data + array.nbytes - 1) // PAGE
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first * 8)
        entries = np.frombuffer(f.read((last - first + 1) * 8), np.uint64)
    return float(np.count_nonzero(entries >> np.uint64(63))) / entries.size


@pytest.mark.skipif(not os.path.exists("/proc/self/pagemap"), reason="needs Linux's /proc/self/pagemap")
@pytest.mark.parametrize("op", ["all_gather", "broadcast"])
def test_case_buffers_are_faulted_in(op: str) -> None:
    """An untouched np.zeros is the kernel's shared zero page: a read-only input (all_gather's, a
    broadcast root's) then reads from the cache and the timing flatters. Case writes every page,
    so every page of its buffers is present (the old code's np.zeros left fresh pages absent)."""
    comm = SimpleNamespace(size=2, rank=0)
    case = Case(comm, op, 64 << 20, np.dtype(np.float32), "sum", 0, None, inplace=op == "broadcast")
    for buf in (case.src, case.dst):
        if buf is not None:
            assert _present(buf) == 1.0, f"{_present(buf):.0%} of a {buf.nbytes >> 20} MiB buffer's pages present"
    assert not case.src.any() and (case.dst is None or not case.dst.any())


@pytest.mark.skipif(not os.path.exists("/proc/self/pagemap"), reason="needs Linux's /proc/self/pagemap")
def test_present_sees_an_untouched_buffer() -> None:
    """The check above can fail: a fresh anonymous mapping of 64 MiB has no page present until
    written, and every page once written. (A fresh np.zeros usually is such a mapping, but one
    CI run found all 64 MiB of one present: what the allocator hands out is not ours to test.)"""
    import mmap

    with mmap.mmap(-1, 64 << 20) as region:
        fresh = np.frombuffer(region, np.uint8)
        assert _present(fresh) < 0.1
        fresh[::PAGE] = 1
        assert _present(fresh) == 1.0
        del fresh


def test_case_buffers_of_every_dtype_are_zeros() -> None:
    from ahcomm import SUPPORTED_DTYPES
    comm = SimpleNamespace(size=3, rank=1)
    for dtype in SUPPORTED_DTYPES:
        case = Case(comm, "all_gather", 3000, np.dtype(dtype), "sum", 0, None, inplace=False)
        assert case.src.dtype == dtype and not case.src.astype(np.float64).any()
        assert case.dst is not None and case.dst.size == 3 * case.src.size


class _Comm:
    """A 2-rank comm's rank 0 whose all_gather writes the right answer only while ``right``."""

    size, rank = 2, 0
    right = True

    async def all_gather(self, src: np.ndarray, *, out: np.ndarray, algorithm: str | None) -> np.ndarray:
        if self.right:
            from ahcomm._bench_case import expected

            out[:] = expected("all_gather", 0, 2, src.size, src.dtype, "sum", 0)
        return out


@pytest.mark.parametrize("dtype", [np.float32, np.int8, np.int32, np.bool_])
async def test_check_counts_an_output_left_unwritten(dtype: type) -> None:
    """The tuning job checks every algorithm on one Case in turn: one that writes nothing must not
    inherit the previous one's right answer (the old check left the output as it was)."""
    comm = _Comm()
    case = Case(comm, "all_gather", 4096, np.dtype(dtype), "sum", 0, None, inplace=False)
    assert await case.check() == 0
    comm.right = False
    assert await case.check() == case.dst.size


@pytest.mark.parametrize(("dtype", "redop", "n"), [(np.bool_, "bxor", 2), (np.int8, "bor", 10), (np.uint8, "max", 51)])
async def test_the_poison_differs_from_every_right_answer(dtype: type, redop: str, n: int) -> None:
    """Even where the right answer is a fixed value a constant poison could equal (bxor of bools
    over an even number of ranks is all False; int8 bor over 10 ranks is 127)."""
    from ahcomm._bench_case import _poison, expected

    want = expected("all_reduce", 0, n, 1000, np.dtype(dtype), redop, 0)
    out = np.empty_like(want)
    _poison(out, want)
    assert not np.any(out == want)

"""Byte copies that stay off the CPU's slow string-copy case.

``numpy.copyto`` of contiguous memory is glibc's ``memmove``, which copies pieces of 2 KiB up
to about 1 MiB with ``rep movsb``; the kernel's ``process_vm_readv`` copies every page with it.
On this host (AMD EPYC, FSRM) that instruction runs 2-5x slower where the destination lies
1-31 bytes past the source within a 4 KiB page (``(dst - src) % 4096``). Measured out of cache,
512 KiB pieces of a 16 MiB copy, GB/s by that distance: 0: 15.6, 8: 3.3, 16: 6.9, 24: 7.0,
32-56: 13.7-19.2, 72-4048 (8 or 16 modulo 64): 13.5-15.9, -16 and -8: 21; ``process_vm_readv``:
0: 12.5, 8: 3.1, 16: 5.9, 24: 5.7, elsewhere 9.8-12.9. numpy's own vector loop (``np.positive``
over uint8) runs 16-19 GB/s at every distance (results/2026-11-26-aligned-copies.md).

The case is common: numpy places a large array 16 bytes past a page, while CCL buffers,
mailbox slots and torch tensors start on 64 bytes (16 bytes apart), and arrays from the heap
or sliced at an odd element fall anywhere. ``copy`` takes the vector loop for such a pair;
``read_bounced`` lets a single-copy read go through a small buffer placed at the source's
alignment (the kernel's copy fast) and then the vector loop (process_vm_readv 8 bytes apart:
3.1 GB/s directly, 6.4 bounced; 16: 5.9 against 6.6). Elsewhere a bounce costs more than it
saves (72-4048 bytes apart: 10.2-12.2 directly, 6.7-8.1 bounced), so only the slow case takes it.

A collective's large output that nobody reads soon is written with non-temporal stores
(``copy(..., stream=True)``, ``streams``): glibc's ``memmove`` takes them only from a size fixed
at process start (181 MiB on an Intel VM), and below it reads every cold destination line into
the cache before writing it. There, 32 MiB cold to cold: 11.8 GB/s against ``np.copyto``'s 7.0;
oneshot's all_gather of 32-64 MiB 1.3-1.4x faster at np=2 and np=4, direct's 1.1-1.2x at np=2
(results/2026-11-26-nt-stores.md). The stores come from an optional C extension
(``ahcomm/_ntcopy.c``); without it, or with ``AHCOMM_NT_STORES=0``, such copies are plain.
"""

from __future__ import annotations

import ctypes
import functools
import importlib
import os
import threading
from collections.abc import Callable, Iterator
from types import ModuleType

import numpy as np

from ._config import _flag

_ntcopy: ModuleType | None
try:  # the optional C extension (by name: a static ``from . import`` would tie this leaf to the package)
    _ntcopy = importlib.import_module(f"{__package__}._ntcopy")
except ImportError:  # not built (no C compiler at install): plain copies
    _ntcopy = None

PAGE = 4096  # rep movsb is slow where 0 < (dst - src) % PAGE < NEAR
NEAR = 32
LINE = 64  # the bounce buffer's placement: the source's offset in a cache line
MIN_BYTES = 2112  # below this glibc copies with vector moves anyway (x86_rep_movsb_threshold 0x840)
BOUNCE_BYTES = 1 << 20  # a bounced read's piece: stays in a core's 1 MiB L2 between its two copies
# A call's output from which copies into it bypass the cache (``streams``). Measured on the Intel VM
# (results/2026-11-26-nt-stores.md, us, plain / streamed): all_gather of 16 MiB, oneshot np=2 2692 /
# 2450, np=4 5680 / 4996, direct np=4 5897 / 5301, but direct np=2 1871 / 2087; from 32 MiB every
# case faster. A smaller output may still be in the cache when its owner reads it.
STREAM_BYTES = 16 << 20
STREAM_PIECE = 64 << 10  # a piece below this is copied plainly (the stores' fence, the call's cost)


@functools.cache
def non_temporal() -> bool:
    """Whether this process writes large outputs with non-temporal stores: the extension is built
    with them (x86-64) and ``AHCOMM_NT_STORES`` does not turn them off (read once)."""
    on = _flag(os.environ, "AHCOMM_NT_STORES", True)  # a bad value raises (``Config.from_env`` names it at init)
    return on and _ntcopy is not None and bool(_ntcopy.NON_TEMPORAL)


def streams(nbytes: int | float) -> bool:
    """Whether copies into a call's output of ``nbytes`` should bypass the cache (``copy``'s ``stream``)."""
    return nbytes >= STREAM_BYTES and non_temporal()


def misaligned(dst_addr: int, src_addr: int, nbytes: int) -> bool:
    """Whether a copy of ``nbytes`` from ``src_addr`` to ``dst_addr`` would hit the slow case."""
    return nbytes >= MIN_BYTES and 0 < (dst_addr - src_addr) % PAGE < NEAR


_EXPORTED = frozenset("?bBhHiIlLqQefdgFDG")  # dtype chars numpy's buffer export takes (not ml_dtypes')


def _address(array: np.ndarray) -> int:
    """``array.ctypes.data`` (about 1 us), in half the time where the buffer protocol can give it
    (a writeable array of a builtin number dtype)."""
    if array.flags.writeable and array.dtype.char in _EXPORTED:
        return ctypes.addressof(ctypes.c_char.from_buffer(array))  # type: ignore[arg-type]
    return array.ctypes.data


def at_address(address: int, nbytes: int) -> np.ndarray:
    """This process's ``nbytes`` at ``address`` as a uint8 array (which does not keep them alive)."""
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(address)) if nbytes else np.empty(0, np.uint8)


def _flat(array: np.ndarray) -> np.ndarray:
    return array.reshape(-1).view(np.uint8)


def copy(dst: np.ndarray, src: np.ndarray, stream: bool = False) -> None:
    """``np.copyto(dst, src)``; a large contiguous copy of the same dtype whose addresses are
    misaligned (``misaligned``) and that do not overlap runs numpy's vector loop instead.
    ``stream`` (a large output nobody reads soon: ``streams``): such a copy of at least
    ``STREAM_PIECE`` bypasses the cache, at any alignment, where ``non_temporal()``.

    The cheap tests come first: an address costs 0.4-1 us (``_address``), more than a small
    ``np.copyto``. Arrays of references (object dtype, or fields of it) are never
    copied as bytes (no uint8 view of them exists, and their references must be counted)."""
    if (stream and dst.nbytes >= STREAM_PIECE and _ntcopy is not None and non_temporal() and dst.flags.writeable
            and _as_bytes(dst, src) and not np.may_share_memory(dst, src)):
        _ntcopy.copy(_address(dst), _address(src), dst.nbytes)
        return
    if (dst.nbytes >= MIN_BYTES and _as_bytes(dst, src) and misaligned(_address(dst), _address(src), dst.nbytes)
            and not np.may_share_memory(dst, src)):
        np.positive(_flat(src), out=_flat(dst))
        return
    np.copyto(dst, src)


def _as_bytes(dst: np.ndarray, src: object) -> bool:
    """Whether ``copy`` may move ``src`` into ``dst`` as plain bytes: one contiguous run each, of
    the same dtype and shape, holding no references."""
    return (isinstance(src, np.ndarray) and dst.dtype == src.dtype and not dst.dtype.hasobject
            and dst.shape == src.shape and dst.flags.c_contiguous and src.flags.c_contiguous)


class _Bounce(threading.local):
    buf: np.ndarray | None = None


_bounce = _Bounce()


def read_bounced(dst: np.ndarray, addr: int, read: Callable[[np.ndarray, int], None]) -> None:
    """Fill the contiguous ``dst`` from ``addr`` with ``read(into, addr)`` (a raw single-copy
    read): directly where the two are aligned, else in ``BOUNCE_BYTES`` pieces through this
    thread's bounce buffer, placed at ``addr``'s alignment, copied out with the vector loop."""
    if not dst.flags.c_contiguous:  # a reshape would copy it, and the read would land in the copy
        raise ValueError("a single-copy read needs a contiguous destination")
    raw = _flat(dst)
    if not misaligned(_address(raw), addr, raw.nbytes):
        read(raw, addr)
        return
    for lo, piece in _bounce_pieces(raw.nbytes, addr):
        read(piece, addr + lo)
        np.positive(piece, out=raw[lo:lo + piece.nbytes])


def write_bounced(src: np.ndarray, addr: int, write: Callable[[np.ndarray, int], None]) -> None:
    """Write the contiguous ``src`` to ``addr`` with ``write(from, addr)`` (a raw single-copy
    write): directly where the two are aligned, else in ``BOUNCE_BYTES`` pieces copied with the
    vector loop into this thread's bounce buffer, placed at ``addr``'s alignment, first."""
    if not src.flags.c_contiguous:
        raise ValueError("a single-copy write needs a contiguous source")
    raw = _flat(src)
    if not misaligned(addr, _address(raw), raw.nbytes):
        write(raw, addr)
        return
    for lo, piece in _bounce_pieces(raw.nbytes, addr):
        np.positive(raw[lo:lo + piece.nbytes], out=piece)
        write(piece, addr + lo)


def _bounce_pieces(nbytes: int, addr: int) -> Iterator[tuple[int, np.ndarray]]:
    """(offset, piece of this thread's bounce buffer at ``addr + offset``'s place in a cache
    line) for each ``BOUNCE_BYTES`` of a bounced transfer of ``nbytes`` at ``addr``."""
    buf = _bounce_buffer()
    base = _address(buf)
    for lo in range(0, nbytes, BOUNCE_BYTES):
        at = (addr + lo - base) % LINE
        yield lo, buf[at:at + min(BOUNCE_BYTES, nbytes - lo)]


def _bounce_buffer() -> np.ndarray:
    buf = _bounce.buf
    if buf is None:
        buf = _bounce.buf = np.empty(BOUNCE_BYTES + LINE, np.uint8)
    return buf

"""Single-copy reads of another process's memory (Linux cross-memory attach).

``process_vm_readv`` copies straight from a peer's address space into ours, the way an
SDMA engine reads a peer's memory: one copy instead of staging through shared memory.
It needs ptrace-level permission over the peer (same user, no restrictive Yama policy);
``probe`` finds out before anything relies on it. ctypes releases the GIL for the call.
"""

from __future__ import annotations

import ctypes
import functools
import os

import numpy as np

from .._memcopy import read_bounced


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


_libc = ctypes.CDLL(None, use_errno=True)
_readv = getattr(_libc, "process_vm_readv", None)
if _readv is not None:
    _readv.argtypes = [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.POINTER(_IoVec),
                       ctypes.c_ulong, ctypes.c_ulong]
    _readv.restype = ctypes.c_ssize_t


def read(pid: int, dst: np.ndarray, addr: int) -> None:
    """Copy ``dst.nbytes`` bytes at ``addr`` in process ``pid`` into ``dst`` (contiguous); a
    misaligned pair through a bounce buffer (``_memcopy.read_bounced``: the kernel copies each
    page with ``rep movsb``)."""
    read_bounced(dst, addr, functools.partial(_read, pid))


def _read(pid: int, dst: np.ndarray, addr: int) -> None:
    if _readv is None:
        raise OSError("process_vm_readv is not available")
    done, total, base = 0, dst.nbytes, dst.ctypes.data
    while done < total:
        local = _IoVec(base + done, total - done)
        remote = _IoVec(addr + done, total - done)
        got = _readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        if got <= 0:
            err = ctypes.get_errno()
            raise OSError(err, f"process_vm_readv from pid {pid} failed: {os.strerror(err)}")
        done += got


def probe(pid: int, addr: int, nbytes: int = 64) -> bool:
    """Whether we may read ``nbytes`` at ``addr`` in ``pid``."""
    try:
        read(pid, np.empty(nbytes, np.uint8), addr)
        return True
    except OSError:
        return False

"""Single-copy reads and writes of another process's memory (Linux cross-memory attach).

``process_vm_readv`` copies straight from a peer's address space into ours, and
``process_vm_writev`` from ours into the peer's, the way an SDMA engine reads or writes a
peer's memory: one copy instead of staging through shared memory. Both need the same
ptrace-level permission over the peer (same user, no restrictive Yama policy; the kernel checks
PTRACE_MODE_ATTACH_REALCREDS for either); ``probe`` finds out before anything relies on it.
ctypes releases the GIL for the call.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

import numpy as np


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


_libc = ctypes.CDLL(None, use_errno=True)


def _syscall(name: str) -> Any:
    fn = getattr(_libc, name, None)
    if fn is not None:
        fn.argtypes = [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.POINTER(_IoVec),
                       ctypes.c_ulong, ctypes.c_ulong]
        fn.restype = ctypes.c_ssize_t
    return fn


_readv = _syscall("process_vm_readv")
_writev = _syscall("process_vm_writev")


def _move(fn: Any, name: str, pid: int, local: int, remote: int, total: int) -> None:
    if fn is None:
        raise OSError(f"{name} is not available")
    done = 0
    while done < total:  # the kernel may move less than asked (a partial transfer): go on from there
        mine, theirs = _IoVec(local + done, total - done), _IoVec(remote + done, total - done)
        got = fn(pid, ctypes.byref(mine), 1, ctypes.byref(theirs), 1, 0)
        if got <= 0:
            err = ctypes.get_errno()
            raise OSError(err, f"{name} with pid {pid} failed: {os.strerror(err)}")
        done += got


def read(pid: int, dst: np.ndarray, addr: int) -> None:
    """Copy ``dst.nbytes`` bytes at ``addr`` in process ``pid`` into ``dst`` (contiguous)."""
    _move(_readv, "process_vm_readv", pid, dst.ctypes.data, addr, dst.nbytes)


def write(pid: int, src: np.ndarray, addr: int) -> None:
    """Copy ``src`` (contiguous) to ``addr`` in process ``pid``."""
    _move(_writev, "process_vm_writev", pid, src.ctypes.data, addr, src.nbytes)


def probe(pid: int, addr: int, nbytes: int = 64) -> bool:
    """Whether we may read ``nbytes`` at ``addr`` in ``pid``."""
    try:
        read(pid, np.empty(nbytes, np.uint8), addr)
        return True
    except OSError:
        return False

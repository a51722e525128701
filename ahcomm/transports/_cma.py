"""Single-copy reads and writes of another process's memory (Linux cross-memory attach).

``process_vm_readv`` copies straight from a peer's address space into ours, the way an
SDMA engine reads a peer's memory: one copy instead of staging through shared memory;
``process_vm_writev`` the other way (the same permission covers both).
It needs ptrace-level permission over the peer (same user, no restrictive Yama policy);
``probe`` finds out before anything relies on it. ctypes releases the GIL for the call.

Where Yama's ``ptrace_scope`` is 1 (Ubuntu's default), a process may read only its
descendants: ranks, which are siblings, may not read each other. ``allow_peers`` lifts that for
this process (``prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY)``: any process of the same user may
then read, or attach to, this one), as OpenMPI's and MPICH's CMA support do at init.
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
from typing import Any

import numpy as np

from .._memcopy import read_bounced, write_bounced


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


_libc = ctypes.CDLL(None, use_errno=True)


def _syscall(name: str) -> Any:
    """``process_vm_readv`` or ``process_vm_writev`` (the same signature), or None."""
    fn = getattr(_libc, name, None)
    if fn is not None:
        fn.argtypes = [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.POINTER(_IoVec),
                       ctypes.c_ulong, ctypes.c_ulong]
        fn.restype = ctypes.c_ssize_t
    return fn


_readv, _writev = _syscall("process_vm_readv"), _syscall("process_vm_writev")


def read(pid: int, dst: np.ndarray, addr: int) -> None:
    """Copy ``dst.nbytes`` bytes at ``addr`` in process ``pid`` into ``dst`` (contiguous); a
    misaligned pair through a bounce buffer (``_memcopy.read_bounced``: the kernel copies each
    page with ``rep movsb``)."""
    read_bounced(dst, addr, functools.partial(_read, pid))


def write(pid: int, src: np.ndarray, addr: int) -> None:
    """Copy ``src`` (contiguous) into process ``pid``'s memory at ``addr``; a misaligned pair
    through a bounce buffer placed at ``addr``'s alignment (``_memcopy.write_bounced``)."""
    write_bounced(src, addr, functools.partial(_write, pid))


def read_word(pid: int, addr: int) -> int:
    """The int64 at ``addr`` (8-aligned) in process ``pid``: one ``process_vm_readv`` call."""
    word = ctypes.c_int64()
    Pipe(pid).read(ctypes.addressof(word), addr, 8)
    return word.value


def _read(pid: int, dst: np.ndarray, addr: int) -> None:
    Pipe(pid).read(dst.ctypes.data, addr, dst.nbytes)


def _write(pid: int, src: np.ndarray, addr: int) -> None:
    Pipe(pid).write(src.ctypes.data, addr, src.nbytes)


class Pipe:
    """Raw transfers with one process by address, piece after piece from one thread: the I/O
    vectors are made once (``read``/``write`` above make a pipe, and their arrays' checks, at each
    call: several microseconds in Python, where a 256 KiB piece takes about 25, which a push loop
    of 128 pieces a call pays 256 times). The caller keeps the pairs aligned
    (``_memcopy.misaligned``): nothing bounces here."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._local, self._remote = _IoVec(), _IoVec()
        self._vectors = (ctypes.byref(self._local), 1, ctypes.byref(self._remote), 1, 0)

    def read(self, local: int, remote: int, nbytes: int) -> None:
        """``nbytes`` at ``remote`` in the process into ``local`` here."""
        self._move(_readv, "process_vm_readv from", local, remote, nbytes)

    def write(self, local: int, remote: int, nbytes: int) -> None:
        """``nbytes`` at ``local`` here into ``remote`` in the process."""
        self._move(_writev, "process_vm_writev to", local, remote, nbytes)

    def _move(self, call: Any, what: str, local: int, remote: int, nbytes: int) -> None:
        if call is None:
            raise OSError(f"{what.split()[0]} is not available")
        done = 0
        while done < nbytes:
            self._local.base, self._remote.base = local + done, remote + done
            self._local.len = self._remote.len = nbytes - done
            got = call(self.pid, *self._vectors)
            if got <= 0:
                raise _failed(what, self.pid)
            done += got


def _failed(what: str, pid: int) -> OSError:
    err = ctypes.get_errno()
    return OSError(err, f"{what} pid {pid} failed: {os.strerror(err)}")


def probe(pid: int, addr: int, nbytes: int = 64) -> bool:
    """Whether we may read ``nbytes`` at ``addr`` in ``pid`` and write them there: the bytes read
    go back unchanged (``addr`` is memory the peer does not change meanwhile: its CCL_In at
    start-up). The kernel's permission covers both calls, but a sandbox's system-call filter may
    let one through and not the other, and a link's pipe does both (mesh's push writes)."""
    try:
        pipe, here = Pipe(pid), np.empty(nbytes, np.uint8)
        pipe.read(here.ctypes.data, addr, nbytes)
        pipe.write(here.ctypes.data, addr, nbytes)
        return True
    except OSError:
        return False


YAMA_SCOPE = "/proc/sys/kernel/yama/ptrace_scope"
PR_SET_PTRACER = 0x59616D61
PR_SET_PTRACER_ANY = ctypes.c_ulong(-1).value


_allowed = 0  # communicators of this process that lifted Yama's scope (``allow_peers``, ``Grant.release``)
_allowed_lock = threading.Lock()


def _set_ptracer(value: int) -> int:
    prctl = getattr(_libc, "prctl", None)
    if prctl is None:
        return -1
    return int(prctl(ctypes.c_int(PR_SET_PTRACER), ctypes.c_ulong(value), ctypes.c_ulong(0), ctypes.c_ulong(0),
                     ctypes.c_ulong(0)))


class Grant:
    """What ``allow_peers`` found (``said``), and its undoing: ``release`` once, however often called."""

    def __init__(self, said: str) -> None:
        self.said = said
        self._held = said == "allowed"

    def release(self) -> None:
        """Undo this grant (a communicator closed, failed to start, or agreed on no single copy):
        the last one held puts Yama's default back (only descendants may read us)."""
        global _allowed
        if not self._held:
            return
        self._held = False
        with _allowed_lock:
            _allowed -= 1
            if _allowed == 0:
                _set_ptracer(0)


def allow_peers(scope_file: str = YAMA_SCOPE) -> Grant:
    """Let this user's other processes read this one's memory where Yama asks for it (see the
    module's text), until the grant is released. Its ``said``: "open" (no Yama, or scope 0:
    nothing to do), "allowed" (scope 1, lifted for this process), or "refused: ..." (scope 2 or
    3, which no process can lift for itself, or prctl failed)."""
    global _allowed
    try:
        with open(scope_file) as f:
            scope = f.read().strip()
    except OSError:
        return Grant("open")
    if scope == "0":
        return Grant("open")
    if scope != "1":
        return Grant(f"refused: Yama ptrace_scope is {scope}")
    if getattr(_libc, "prctl", None) is None:
        return Grant("refused: no prctl")
    with _allowed_lock:
        if _set_ptracer(PR_SET_PTRACER_ANY) != 0:
            return Grant(f"refused: prctl(PR_SET_PTRACER) failed: {os.strerror(ctypes.get_errno())}")
        _allowed += 1
    return Grant("allowed")

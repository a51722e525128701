"""Memory that this host's peers map: ``alloc`` (NCCL's ``ncclMemAlloc`` and registration in one).

A single-copy collective (mesh's all_reduce, all_gather, broadcast) reads its peers' user
buffers by address. Ordinary memory is private, so a reader goes through the kernel
(``process_vm_readv``: pages pinned at every call, and all_reduce stages each piece in a scratch
buffer before reducing it). An array from ``alloc`` lives in a POSIX shared-memory segment
instead: a reader maps the segment once and then reads or reduces straight out of it, at the
speed of a ``memcpy`` (2-rank in-place all_reduce of 64 MiB on the 2-core Intel VM: about 6 ms
of copies and sums against 12 through the kernel). Mapped reads also work where the kernel
forbids cross-memory attach (a ptrace policy, a container).

The owner lists its segments in a small table, itself a segment named in the rendezvous: a
version (odd while the owner edits it; a reader copies the table and retries until it read
one even version twice) and ``SLOTS`` rows of (id, address, bytes); a segment's name is the
table's plus its id, and ids are never reused, so a reader's cached mapping cannot stand for
newer memory at the same address. A segment is freed (its row cleared, its name unlinked) when
its array is no longer referenced; by then every collective that posted its address has ended,
and with it every peer's read.
"""

from __future__ import annotations

import atexit
import math
import mmap
import os
import secrets
import threading
import weakref
from typing import Any

import numpy as np

from ._buffers import SHM_DIR, SHM_PREFIX, MiB, SharedRegion, room
from ._errors import AhcommError, ConfigError, UsageError

SLOTS = 255  # segments one process may have at once
_ROW = 3  # id, address, bytes
TABLE_BYTES = 8 * (1 + SLOTS * _ROW)
_RETRIES = 1000  # reads of a table that keeps changing before a reader gives up (and reads through the kernel)


class _Owner:
    """This process's table and segments (one per process: ``_owner``)."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.name = f"{SHM_PREFIX}{self.pid}-mem-{secrets.token_hex(4)}"
        self.lock = threading.Lock()
        self._table: SharedRegion | None = None
        self._rows: np.ndarray | None = None
        self._next_id = 1
        # id -> (address, bytes, the region (its name), its mapping while an array holds it)
        self.segments: dict[int, tuple[int, int, SharedRegion, weakref.ref[mmap.mmap]]] = {}

    def _rows_of_table(self) -> np.ndarray:
        if self._rows is None:
            self._table = SharedRegion(self.name, TABLE_BYTES, create=True)
            atexit.register(self.close)
            self._rows = self._table.array.view(np.int64)
        return self._rows

    def add(self, nbytes: int) -> tuple[int, mmap.mmap]:
        """A new segment of ``nbytes``, listed: (its id, its mapping, which only its arrays keep)."""
        with self.lock:
            rows = self._rows_of_table()
            free = np.flatnonzero(rows[1::_ROW] == 0)
            if free.size == 0:
                raise UsageError(f"ahcomm.alloc: this process already holds {SLOTS} arrays from alloc "
                                  "(free some: an array is freed when nothing refers to it)")
            ident = self._next_id
            self._next_id += 1
            region = SharedRegion(f"{self.name}-{ident}", max(nbytes, 1), create=True)
            address = int(region.array.ctypes.data)
            mapping = region.detach()
            slot = 1 + int(free[0]) * _ROW
            rows[0] += 1  # odd: a reader retries
            rows[slot + 1], rows[slot + 2] = address, nbytes
            rows[slot] = ident
            rows[0] += 1
            self.segments[ident] = (address, nbytes, region, weakref.ref(mapping))
            return ident, mapping

    def free(self, ident: int) -> None:
        """Unlist segment ``ident`` and unlink its name (its mapping is gone, or going)."""
        with self.lock:
            _, _, region, _ = self.segments.pop(ident)
            rows = self._rows
            if rows is not None:
                hit = np.flatnonzero(rows[1::_ROW] == ident)
                rows[0] += 1
                for i in hit:
                    rows[1 + int(i) * _ROW: 1 + (int(i) + 1) * _ROW] = 0
                rows[0] += 1
            region.unlink()

    def find(self, address: int, nbytes: int) -> np.ndarray | None:
        """A view of this process's own allocation at ``address`` (the in-process transport)."""
        with self.lock:
            for base, size, _, ref in self.segments.values():
                mapping = ref()
                if mapping is not None and base <= address and address + nbytes <= base + size:
                    return np.frombuffer(mapping, np.uint8, nbytes, address - base)
        return None

    def close(self) -> None:
        if os.getpid() != self.pid:  # a forked child's exit: the names are its parent's
            return
        with self.lock:
            for _, _, region, _ in self.segments.values():
                region.unlink()
            if self._table is not None:
                self._table.unlink()


_owners: dict[int, _Owner] = {}
_owners_lock = threading.Lock()


def _owner() -> _Owner:
    pid = os.getpid()
    with _owners_lock:
        owner = _owners.get(pid)
        if owner is None:  # first use in this process (a forked child gets its own)
            owner = _owners[pid] = _Owner()
        return owner


def table_name() -> str:
    """The name of this process's table (peers learn it at rendezvous; it exists once ``alloc`` ran)."""
    return _owner().name


def alloc(shape: int | tuple[int, ...], dtype: Any = np.float32) -> np.ndarray:
    """A zeroed array in memory that this host's peers map (see the module's text): collectives
    that read peers' buffers directly read or reduce straight out of it. Use it for buffers that
    are reused (a model's activations, a benchmark's): each call makes a shared-memory segment
    (a /dev/shm file and a mapping, tens of microseconds). Freed when nothing refers to it."""
    dt = np.dtype(dtype)
    dims = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
    if any(not isinstance(d, (int, np.integer)) or d < 0 for d in dims):
        raise ValueError(f"ahcomm.alloc: shape must be non-negative integers, got {shape!r}")
    if dt.hasobject:
        raise TypeError(f"ahcomm.alloc: dtype {dt} holds Python objects, which cannot be shared")
    nbytes = math.prod(dims) * dt.itemsize
    owner = _owner()
    try:
        ident, mapping = owner.add(nbytes)
    except ConfigError:
        have = room()
        where = f"{SHM_DIR} has {have[1] / MiB:.1f} MiB free" if have else f"{SHM_DIR} is full"
        raise ConfigError(f"ahcomm.alloc of {nbytes / MiB:.1f} MiB: {where} (a container's default is 64 MiB: "
                          "docker run --shm-size=1g). An ordinary array works too: collectives read it "
                          "through the kernel") from None
    array: np.ndarray = np.frombuffer(mapping, np.uint8, nbytes).view(dt).reshape(dims)
    weakref.finalize(mapping, owner.free, ident)  # numpy's views all hold the mapping, not this array
    return array


def local_view(address: int, nbytes: int) -> np.ndarray | None:
    """This process's ``alloc`` memory at ``address`` as uint8, or None (not from ``alloc``)."""
    owner = _owners.get(os.getpid())
    return None if owner is None else owner.find(address, nbytes)


class PeerMemory:
    """A reader's view of one peer's ``alloc`` memory, by the peer's table name."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._lock = threading.Lock()
        self._table: SharedRegion | None = None
        self._version = -1
        self._rows: list[tuple[int, int, int]] = []
        self._maps: dict[int, SharedRegion] = {}
        self.closed = False

    def view(self, address: int, nbytes: int) -> np.ndarray | None:
        """The peer's memory at ``address`` as uint8 (mapped here), or None where it is not from
        the peer's ``alloc`` (the caller reads through the kernel)."""
        with self._lock:
            for ident, base, size in self._current():
                if base <= address and address + nbytes <= base + size:
                    region = self._maps.get(ident)
                    if region is None:
                        try:
                            region = self._maps[ident] = SharedRegion.attach(f"{self.name}-{ident}", size)
                        except (OSError, AhcommError):
                            return None  # freed meanwhile: not a buffer in use
                    return region.array[address - base:address - base + nbytes]
        return None

    def _current(self) -> list[tuple[int, int, int]]:
        if self.closed:
            return []
        if self._table is None:
            try:
                self._table = SharedRegion.attach(self.name, TABLE_BYTES)
            except (OSError, AhcommError):
                return []  # the peer has not allocated yet
        rows = self._table.array.view(np.int64)
        if int(rows[0]) == self._version:
            return self._rows
        for _ in range(_RETRIES):
            before = int(rows[0])
            if before & 1:
                continue
            copy = rows.copy()
            if int(rows[0]) == before:
                break
        else:
            return []
        table = copy[1:].reshape(SLOTS, _ROW)
        self._rows = [(int(i), int(a), int(n)) for i, a, n in table[table[:, 0] != 0]]
        self._version = before
        live = {ident for ident, _, _ in self._rows}
        for ident in [i for i in self._maps if i not in live]:  # freed by the peer: let go of its pages
            self._maps.pop(ident).close()
        return self._rows

    def close(self) -> None:
        with self._lock:
            self.closed = True
            for region in self._maps.values():
                region.close()
            self._maps.clear()
            if self._table is not None:
                self._table.close()
                self._table = None

"""Memory that this host's peers map: ``alloc`` (NCCL's ``ncclMemAlloc`` and registration in one).

A single-copy collective (mesh's all_reduce, all_gather, broadcast; direct) reads its peers'
user buffers by address. Ordinary memory is private, so a reader goes through the kernel
(``process_vm_readv``: pages pinned at every call, and all_reduce stages each piece in a scratch
buffer before reducing it). An array from ``alloc`` lives in a POSIX shared-memory segment
instead: a reader maps the segment once (read-only) and then reads or reduces straight out of
it, at the speed of a ``memcpy`` (2-rank in-place all_reduce of 64 MiB on the 2-core Intel VM:
7.5 ms against 13 through the kernel). The single-copy paths run only where the kernel lets
ranks read each other's memory (``Topology.single_copy``): ``alloc`` makes them faster, it
does not turn them on.

The owner lists its segments in a small table, itself a segment named in the rendezvous: a
version (odd while the owner edits it; a reader copies the table and retries until it read
one even version twice: sound on x86's ordered stores, not proven on weaker memory models)
and ``SLOTS`` rows of (id, address, bytes); a segment's name is the table's plus its id. Ids
are never reused and a reader takes the newest row that covers an address; a new segment
unlists any older row over its addresses (one unmapped whose free has not run yet), so a
cached mapping never stands for newer memory at the same address. A segment is unlisted and
its name unlinked when its mapping goes (when no array refers to it): by then every collective
that posted its address has ended, and with it every peer's read. A peer lets go of its own
mapping at its next read from the owner (or at ``suspend``), so the pages are returned then.
A forked child shares the parent's segments (``MAP_SHARED``: its writes show in the parent)
and leaves the table alone.
"""

from __future__ import annotations

import atexit
import collections
import errno
import math
import mmap
import os
import secrets
import threading
import weakref
from typing import Any

import numpy as np

from ._buffers import SHM_DIR, SHM_PREFIX, MiB, SharedRegion, room
from ._errors import AhcommError, ConfigError, InvalidArgument, InvalidDtype, UsageError

SLOTS = 255  # segments one process may have at once
_ROW = 3  # id, address, bytes
TABLE_BYTES = 8 * (1 + SLOTS * _ROW)
PEER_MAPS = 64  # a reader's mappings of one peer's segments at most (each holds a file descriptor;
# cycling through more maps the oldest again at each read)
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
        self._dead: collections.deque[int] = collections.deque()  # freed, not yet unlisted

    def _rows_of_table(self) -> np.ndarray:
        if self._rows is None:
            self._table = SharedRegion(self.name, TABLE_BYTES, create=True)
            atexit.register(self.close)
            self._rows = self._table.array.view(np.int64)
        return self._rows

    def _unlist(self, rows: np.ndarray, hit: np.ndarray) -> None:
        rows[0] += 1  # odd: a reader retries
        for i in hit:
            rows[1 + int(i) * _ROW: 1 + (int(i) + 1) * _ROW] = 0
        rows[0] += 1

    def _reap(self) -> None:
        """Unlist and unlink the segments freed since (the lock held)."""
        while self._dead:
            ident = self._dead.popleft()
            entry = self.segments.pop(ident, None)
            if entry is None:
                continue
            if self._rows is not None:
                self._unlist(self._rows, np.flatnonzero(self._rows[1::_ROW] == ident))
            entry[2].unlink()

    def add(self, nbytes: int) -> tuple[int, mmap.mmap]:
        """A new segment of ``nbytes``, listed: (its id, its mapping, which only its arrays keep)."""
        with self.lock:
            self._reap()
            rows = self._rows_of_table()
            free = np.flatnonzero(rows[1::_ROW] == 0)
            if free.size == 0:
                raise UsageError(f"ahcomm.alloc: this process already holds {SLOTS} arrays from alloc "
                                 "(an array is freed when nothing refers to it)")
            ident = self._next_id
            self._next_id += 1
            region = SharedRegion(f"{self.name}-{ident}", max(nbytes, 1), create=True)
            address = int(region.array.ctypes.data)
            mapping = region.detach()
            # A row over these addresses is a segment already unmapped whose free has not run yet
            # (munmap comes before the weakref callbacks): unlist it now, or a reader might map it.
            table = rows[1:].reshape(SLOTS, _ROW)
            stale = np.flatnonzero((table[:, 0] != 0) & (table[:, 1] < address + max(nbytes, 1))
                                   & (table[:, 1] + np.maximum(table[:, 2], 1) > address))
            if stale.size:
                self._unlist(rows, stale)
                for i in stale:
                    self._dead.append(int(table[int(i), 0]))
            slot = 1 + int(free[0]) * _ROW
            rows[0] += 1
            rows[slot + 1], rows[slot + 2] = address, nbytes
            rows[slot] = ident
            rows[0] += 1
            self.segments[ident] = (address, nbytes, region, weakref.ref(mapping))
            self._reap()
            return ident, mapping

    def free(self, ident: int) -> None:
        """Segment ``ident``'s mapping is gone (or going): unlist it and unlink its name, now if the
        lock is free, else at the next ``add`` (this may run from a garbage collection inside
        ``add`` on this very thread). Only in the process that made it: a forked child shares the
        table with its parent."""
        if os.getpid() != self.pid:
            return
        self._dead.append(ident)
        if self.lock.acquire(blocking=False):
            try:
                self._reap()
            finally:
                self.lock.release()

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


def _cgroup_room(root: str = "/sys/fs/cgroup", cgroup_file: str = "/proc/self/cgroup") -> int | None:
    """Bytes this process's memory cgroup may still take (its limit less its usage), where it has
    a limit: v2 (``memory.max``, ``memory.current``) or v1 (``memory.limit_in_bytes``,
    ``memory.usage_in_bytes``). A container's shared-memory pages count against it."""
    candidates: list[tuple[str, str]] = []
    try:
        with open(cgroup_file) as f:
            for line in f:
                parts = line.strip().split(":", 2)
                if len(parts) != 3:
                    continue
                path = parts[2].lstrip("/")
                if parts[0] == "0" and parts[1] == "":
                    base = os.path.join(root, path)
                    candidates.append((os.path.join(base, "memory.max"), os.path.join(base, "memory.current")))
                elif "memory" in parts[1].split(","):
                    base = os.path.join(root, "memory", path)
                    candidates.append((os.path.join(base, "memory.limit_in_bytes"),
                                       os.path.join(base, "memory.usage_in_bytes")))
    except OSError:
        pass
    # in a container the cgroup's own directory is usually the mount's root
    candidates += [(os.path.join(root, "memory.max"), os.path.join(root, "memory.current")),
                   (os.path.join(root, "memory", "memory.limit_in_bytes"),
                    os.path.join(root, "memory", "memory.usage_in_bytes"))]
    for limit_file, usage_file in candidates:
        try:
            with open(limit_file) as f:
                limit = f.read().strip()
            with open(usage_file) as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if limit == "max" or not limit.isdigit() or int(limit) >= 1 << 60:  # v1 says "no limit" with a huge number
            return None
        return max(0, int(limit) - usage)
    return None


def _available() -> int | None:
    """Bytes of memory the kernel could still give this process: the host's ``MemAvailable``, or
    less where its cgroup has a limit (a container's)."""
    host = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    host = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        pass
    room = _cgroup_room()
    known = [x for x in (host, room) if x is not None]
    return min(known) if known else None


def _dims(shape: Any) -> tuple[int, ...]:
    """``shape`` as a tuple of ints (an int, or an iterable of them, none negative and no bool)."""
    try:
        dims = tuple((shape,) if isinstance(shape, (int, np.integer)) else shape)
    except TypeError:
        dims = (shape,)
    if any(isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d < 0 for d in dims):
        raise InvalidArgument(f"ahcomm.alloc: shape must be a non-negative integer or a tuple of them, "
                              f"got {shape!r}")
    return tuple(int(d) for d in dims)


def alloc(shape: int | tuple[int, ...], dtype: Any = np.float32) -> np.ndarray:
    """A zeroed array in memory that this host's peers map (see the module's text): collectives
    that read peers' buffers directly read or reduce straight out of it. Use it for buffers that
    are reused (a model's activations, a benchmark's, a collective's ``out=``): each call makes a
    shared-memory segment (a /dev/shm file whose pages are reserved and faulted in at once: 3-4 ms
    per 8 MiB on the 2-core VM, against about 1.5 for ``np.zeros`` and a fill), holding one file
    descriptor here and one in each peer that reads it (a peer keeps at most ``PEER_MAPS``: cycling
    through more remaps each one at its next read), at
    most ``SLOTS`` at once per process. Freed when nothing refers to it."""
    dims = _dims(shape)
    if dtype is None:
        raise InvalidDtype("ahcomm.alloc: dtype is None; pass one (the default is float32)")
    try:
        dt = np.dtype(dtype)
    except (TypeError, ValueError, SyntaxError) as exc:
        raise InvalidDtype(f"ahcomm.alloc: {dtype!r} is not a dtype ({exc})") from None
    if dt.hasobject:
        raise InvalidDtype(f"ahcomm.alloc: dtype {dt} holds Python objects, which cannot be shared")
    if dt.subdtype is not None:  # as numpy does: (float32, (3,)) is three float32s more per element
        dt, more = dt.subdtype
        dims += more
    if dt.itemsize == 0:
        raise InvalidDtype(f"ahcomm.alloc: dtype {dt} has no size")
    nbytes = math.prod(dims) * dt.itemsize
    free = _available()
    if free is not None and nbytes > free:
        raise ConfigError(f"ahcomm.alloc of {nbytes / MiB:.1f} MiB: only {free / MiB:.1f} MiB of memory is "
                          "available (the host's, or what its container's limit leaves; the pages are reserved "
                          "at once)")
    owner = _owner()
    try:
        ident, mapping = owner.add(nbytes)
    except ConfigError:
        have = room()
        where = f"{SHM_DIR} has {have[1] / MiB:.1f} MiB free" if have else f"{SHM_DIR} is full"
        raise ConfigError(f"ahcomm.alloc of {nbytes / MiB:.1f} MiB: {where} (a container's default is 64 MiB: "
                          "docker run --shm-size=1g). An ordinary array works too: collectives read it "
                          "through the kernel") from None
    except OSError as exc:
        if exc.errno != errno.EMFILE:
            raise
        raise UsageError("ahcomm.alloc: this process has no file descriptor left (each array from alloc holds "
                         "one while it lives: free some, or raise the limit, ulimit -n)") from None
    weakref.finalize(mapping, owner.free, ident)  # numpy's views all hold the mapping, not this array
    array: np.ndarray = np.frombuffer(mapping, np.uint8, nbytes).view(dt).reshape(dims)
    return array


def local_view(address: int, nbytes: int) -> np.ndarray | None:
    """This process's ``alloc`` memory at ``address`` as uint8, or None (not from ``alloc``)."""
    owner = _owners.get(os.getpid())
    return None if owner is None else owner.find(address, nbytes)


class PeerMemory:
    """A reader's view of one peer's ``alloc`` memory, by the peer's table name (mapped read-only)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._path = os.path.join(SHM_DIR, name)
        self._lock = threading.Lock()
        self._table: SharedRegion | None = None
        self._version = -1
        self._rows: list[tuple[int, int, int]] = []
        self._maps: dict[int, SharedRegion] = {}
        self.closed = False

    def view(self, address: int, nbytes: int) -> np.ndarray | None:
        """The peer's memory at ``address`` as read-only uint8 (mapped here), or None where it is
        not from the peer's ``alloc`` (the caller reads through the kernel)."""
        with self._lock:
            for ident, base, size in self._current():  # newest first
                if base <= address and address + nbytes <= base + size:
                    region = self._maps.pop(ident, None)
                    if region is None:
                        try:
                            region = SharedRegion.attach(f"{self.name}-{ident}", size, readonly=True)
                        except (OSError, ValueError, AhcommError):
                            return None  # freed meanwhile, or no descriptor left: read through the kernel
                        while len(self._maps) >= PEER_MAPS:  # the least recently read goes (a view
                            self._maps.pop(next(iter(self._maps))).close()  # in use keeps it mapped)
                    self._maps[ident] = region  # last: the most recently read
                    return region.array[address - base:address - base + nbytes]
        return None

    def _current(self) -> list[tuple[int, int, int]]:
        if self.closed:
            return []
        if self._table is None:
            if not os.path.exists(self._path):
                return []  # the peer has not allocated yet
            try:
                self._table = SharedRegion.attach(self.name, TABLE_BYTES, readonly=True)
            except (OSError, ValueError, AhcommError):
                return []
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
        live = table[(table[:, 0] != 0) & (table[:, 2] > 0)]
        self._rows = sorted(((int(i), int(a), int(n)) for i, a, n in live), reverse=True)
        self._version = before
        ids = {ident for ident, _, _ in self._rows}
        for ident in [i for i in self._maps if i not in ids]:  # freed by the peer: let go of its pages
            self._maps.pop(ident).close()
        return self._rows

    def release(self) -> int:
        """Let go of every mapping (``Comm.suspend``); later views map again. Returns 0: the
        pages are the peer's."""
        with self._lock:
            for region in self._maps.values():
                region.close()
            self._maps.clear()
            if self._table is not None:
                self._table.close()
                self._table = None
            self._version = -1
        return 0

    def close(self) -> None:
        self.release()
        self.closed = True

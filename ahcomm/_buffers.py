"""CCL buffers: fixed-address byte regions that peers can reach.

A ``SharedRegion`` is a POSIX shared-memory file mapped into this process; peers on the
same host map it by name. ``LocalRegion`` is plain memory (in-process transport, or a
rank whose peers are all remote). Both expose ``.array``, a uint8 numpy view.

Names are ``ahcomm-<creator pid>-<tag>-<random>``. A name is unlinked as soon as every
peer has mapped it, so only a job that dies during set-up leaves names behind;
``reclaim_stale()`` (run before this process creates its own) unlinks those whose creator
is no longer alive.
"""

from __future__ import annotations

import mmap
import os
import re
import secrets

import numpy as np

SHM_DIR = "/dev/shm"
SHM_PREFIX = "ahcomm-"
_NAME = re.compile(rf"^{re.escape(SHM_PREFIX)}(\d+)-")


def _alive(pid: int) -> bool:
    if pid <= 0:
        return True  # not a name of ours: leave it
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # alive, another user's
    return True


def reclaim_stale(directory: str = SHM_DIR) -> list[str]:
    """Unlink the shared-memory segments of dead ahcomm processes on this host (their creator's
    pid, encoded in the name, no longer runs); return the names removed. Segments of live
    processes and of other users stay; errors are ignored (best effort, safe to race)."""
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    uid = os.getuid() if hasattr(os, "getuid") else None
    for name in names:
        match = _NAME.match(name)
        if match is None or _alive(int(match.group(1))):
            continue
        path = os.path.join(directory, name)
        try:
            if uid is not None and os.lstat(path).st_uid != uid:
                continue
            os.unlink(path)
        except OSError:
            continue
        removed.append(name)
    return removed


class Region:
    """A byte region with a uint8 numpy view."""

    name: str = ""
    array: np.ndarray

    def close(self) -> None:  # pragma: no cover - overridden where there is work
        pass

    @property
    def nbytes(self) -> int:
        return int(self.array.nbytes)


class LocalRegion(Region):
    """Process-private memory, pre-faulted so the hot path never takes page faults."""

    def __init__(self, nbytes: int) -> None:
        self.array = np.zeros(nbytes, dtype=np.uint8)
        self.array.fill(0)


class SharedRegion(Region):
    """A mapping of /dev/shm/<name>; created by its owner, attached by peers."""

    def __init__(self, name: str, nbytes: int, *, create: bool) -> None:
        self.name = name
        self._path = os.path.join(SHM_DIR, name)
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(self._path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, nbytes)
            elif os.fstat(fd).st_size < nbytes:
                raise ValueError(f"shared region {name} is smaller than {nbytes} bytes")
            populate = getattr(mmap, "MAP_POPULATE", 0)
            self._map = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | populate)
        finally:
            os.close(fd)
        self.array = np.frombuffer(self._map, dtype=np.uint8, count=nbytes)
        if create:
            self.array.fill(0)  # fault every page in now, not during a collective

    @classmethod
    def create(cls, nbytes: int, tag: str) -> "SharedRegion":
        return cls(f"{SHM_PREFIX}{os.getpid()}-{tag}-{secrets.token_hex(4)}", nbytes, create=True)

    @classmethod
    def attach(cls, name: str, nbytes: int) -> "SharedRegion":
        return cls(name, nbytes, create=False)

    def unlink(self) -> None:
        """Remove the name; mappings stay valid until closed (no leak if the job dies)."""
        try:
            os.unlink(self._path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        self.array = np.empty(0, dtype=np.uint8)
        try:
            self._map.close()
        except BufferError:
            # A view is still alive somewhere; the mapping goes when it does.
            pass


class CclBuffers:
    """CCL_In and CCL_Out of one rank."""

    def __init__(self, ccl_in: Region, ccl_out: Region) -> None:
        self.ccl_in = ccl_in
        self.ccl_out = ccl_out

    @classmethod
    def local(cls, nbytes: int) -> "CclBuffers":
        return cls(LocalRegion(nbytes), LocalRegion(nbytes))

    @classmethod
    def shared(cls, nbytes: int, tag: str) -> "CclBuffers":
        """CCL_In and CCL_Out in shared memory (stale segments of dead jobs are reclaimed first)."""
        reclaim_stale()
        ccl_in = SharedRegion.create(nbytes, f"{tag}-in")
        try:
            ccl_out = SharedRegion.create(nbytes, f"{tag}-out")
        except BaseException:
            ccl_in.unlink()
            ccl_in.close()
            raise
        return cls(ccl_in, ccl_out)

    def get(self, which: str) -> Region:
        return self.ccl_in if which == "in" else self.ccl_out

    @property
    def nbytes(self) -> int:
        return self.ccl_in.nbytes

    def unlink(self) -> None:
        for region in (self.ccl_in, self.ccl_out):
            if isinstance(region, SharedRegion):
                region.unlink()

    def close(self) -> None:
        self.unlink()
        self.ccl_in.close()
        self.ccl_out.close()

"""CCL buffers: fixed-address byte regions that peers can reach.

A ``SharedRegion`` is a POSIX shared-memory file mapped into this process; peers on the
same host map it by name. ``LocalRegion`` is plain memory (in-process transport, or a
rank whose peers are all remote). Both expose ``.array``, a uint8 numpy view.

Names are ``ahcomm-<creator pid>-<tag>-<random>``. A name is unlinked as soon as every
peer has mapped it. Until then a SIGTERM (whose default would end the process with the
names still there) unlinks them first (``_pending``); only a job killed outright (SIGKILL)
during set-up leaves names behind, and ``reclaim_stale()`` (run before this process creates
its own) unlinks those whose creator is no longer alive.

Room: /dev/shm is a tmpfs that is often small (64 MiB in Docker and Kubernetes). A segment
is reserved with ``posix_fallocate`` before it is mapped, so a shortfall is an error here,
not a SIGBUS when a page is first touched. ``fit()`` decides beforehand, from the size of
/dev/shm and the number of ranks on this host (the same on every rank of the host, so they
all decide alike), whether the default buffer size is shrunk (with a warning) or the job
fails with a ConfigError that names the fixes.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import re
import secrets
import signal
import threading
import weakref
from collections.abc import Collection
from types import FrameType
from typing import Protocol

import numpy as np

from ._errors import ConfigError, ConnectError

SHM_DIR = "/dev/shm"
SHM_PREFIX = "ahcomm-"
_NAME = re.compile(rf"^{re.escape(SHM_PREFIX)}(\d+)-")
MiB = 1 << 20
MIN_SHRUNK = 1 * MiB  # the smallest CCL buffer fit() shrinks to; below that the job fails instead
WORDS_PAGE = 4096  # what a CCL_Out's words (``WORDS``, past its bytes) add to its file at most
log = logging.getLogger("ahcomm")


def _mib(nbytes: int) -> str:
    return f"{nbytes / MiB:.4g} MiB"


def room(directory: str = SHM_DIR) -> tuple[int, int] | None:
    """(size, free bytes) of the file system holding ``directory``; None if it cannot be read."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return None
    return st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize


def _shortfall(what: str, need: int, local_ranks: int, nbytes: int, directory: str) -> str:
    have = room(directory)
    size = f"{_mib(have[0])} ({_mib(have[1])} free)" if have else "of unknown size"
    per = max(1, (have[0] // 2) // (2 * local_ranks * MiB)) if have else 8
    return (f"not enough shared memory for the CCL buffers: {directory} is {size}; {what} "
            f"{local_ranks} rank(s) on this host x 2 buffers x {_mib(nbytes)} = {_mib(need)}. Fixes: give "
            f"the container a bigger /dev/shm (docker run --shm-size=1g; Kubernetes: an emptyDir with "
            f"medium: Memory mounted on /dev/shm), or smaller buffers (AHCOMM_BUFFSIZE={per}, in MB per "
            f"buffer), or AHCOMM_TRANSPORT=rdma (no shared memory)")


def fit(nbytes: int, local_ranks: int, *, shrink: bool, directory: str = SHM_DIR) -> int:
    """The CCL buffer size to create: ``nbytes`` when ``local_ranks`` ranks' buffers (2 each) fit
    in ``directory``'s file system; else, when ``shrink``, the largest power of two (at least
    ``MIN_SHRUNK``) whose buffers fill at most half of it, with a warning; else ConfigError.
    Decided from the file system's size, not its free room, so every rank of a host agrees.
    Buffers as asked must fit with each CCL_Out's words (``WORDS``: a page past its bytes); shrunk
    ones leave half the file system free anyway."""
    have = room(directory)
    local_ranks = max(1, local_ranks)
    need = (2 * nbytes + WORDS_PAGE) * local_ranks
    if have is None or need <= have[0]:
        return nbytes
    if shrink:
        fitted = MIN_SHRUNK
        while 2 * (2 * fitted) * local_ranks <= have[0] // 2 and 2 * fitted < nbytes:
            fitted *= 2
        if 2 * fitted * local_ranks <= have[0] // 2:
            log.warning("%s is %s, too small for %d rank(s) x 2 CCL buffers x %s: using %s buffers (large "
                        "collectives run in more pieces); docker run --shm-size=1g or AHCOMM_BUFFSIZE=%d "
                        "silences this", directory, _mib(have[0]), local_ranks, _mib(nbytes), _mib(fitted),
                        fitted // MiB)
            return fitted
    raise ConfigError(_shortfall("it needs", need, local_ranks, nbytes, directory))


# -- SIGTERM while names exist: unlink them, then die of SIGTERM as before ---------------------
class Named(Protocol):
    """Something that holds names in /dev/shm and removes them with ``unlink()``."""

    def unlink(self) -> None: ...


_pending: "weakref.WeakSet[Named]" = weakref.WeakSet()
_installed = False


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    for region in list(_pending):
        region.unlink()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def guard(region: Named) -> None:
    """Unlink ``region``'s names on SIGTERM until it calls ``unguard``; only where SIGTERM would simply end
    the process (its default), from the main thread (an application's own handler stays)."""
    global _installed
    _pending.add(region)
    if _installed or threading.current_thread() is not threading.main_thread():
        return
    try:
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, _on_sigterm)
            _installed = True
    except (ValueError, OSError):
        pass


def unguard(region: Named) -> None:
    global _installed
    _pending.discard(region)
    if _installed and not _pending and threading.current_thread() is threading.main_thread():
        try:
            if signal.getsignal(signal.SIGTERM) is _on_sigterm:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
            _installed = False
        except (ValueError, OSError):
            pass


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


def reclaim_stale(directory: str = SHM_DIR, pids: Collection[int] | None = None) -> list[str]:
    """Unlink the shared-memory segments of dead ahcomm processes on this host (their creator's
    pid, encoded in the name, no longer runs), or of those of ``pids`` that are dead; return the
    names removed. Segments of live processes and of other users stay; errors are ignored (best
    effort, safe to race)."""
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    uid = os.getuid() if hasattr(os, "getuid") else None
    for name in names:
        match = _NAME.match(name)
        if match is None or (pids is not None and int(match.group(1)) not in pids) or _alive(int(match.group(1))):
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


WORDS = 8  # int64 flags after a CCL_Out's bytes (``Region.words``)


def _own_words(words: np.ndarray) -> np.ndarray:
    """``words`` with word 0 set to their own address here: a peer that maps them finds where a
    word its owner names by address lies (``MappedAccess.words``)."""
    words[0] = words.ctypes.data
    return words


class Region:
    """A byte region with a uint8 numpy view, and ``words``: flags of the owner after the bytes,
    which peers that map the region see (mesh's push gates, ``algorithms._push``; word 0 holds
    the words' own address in the owner's process), or a private stand-in."""

    name: str = ""
    array: np.ndarray
    words: np.ndarray = np.zeros(0, np.int64)

    def close(self) -> None:  # pragma: no cover - overridden where there is work
        pass

    @property
    def nbytes(self) -> int:
        return int(self.array.nbytes)


class LocalRegion(Region):
    """Process-private memory, pre-faulted so the hot path never takes page faults."""

    def __init__(self, nbytes: int, *, prefault: bool = True) -> None:
        self.array = np.zeros(nbytes, dtype=np.uint8)
        self.words = _own_words(np.zeros(WORDS, np.int64))
        if prefault:
            self.array.fill(0)


class SharedRegion(Region):
    """A mapping of /dev/shm/<name>; created by its owner, attached by peers."""

    def __init__(self, name: str, nbytes: int, *, create: bool, local_ranks: int = 1, prefault: bool = True,
                 readonly: bool = False, words: bool = False) -> None:
        self.name = name
        self._path = os.path.join(SHM_DIR, name)
        flags = (os.O_RDONLY if readonly and not create else os.O_RDWR) | (os.O_CREAT | os.O_EXCL if create else 0)
        try:
            fd = os.open(self._path, flags, 0o600)
        except FileNotFoundError:
            if create:
                raise ConfigError(f"cannot create shared memory: {SHM_DIR} does not exist on this host "
                                  "(mount a tmpfs there, or AHCOMM_TRANSPORT=rdma)") from None
            match = _NAME.match(name)
            raise ConnectError(f"a peer's CCL buffer {self._path} (created by pid "
                               f"{match.group(1) if match else '?'}) is gone before this rank mapped it: removed "
                               f"from {SHM_DIR} during init (a clean-up of /dev/shm, or its rank died)") from None
        at = -(-nbytes // 8) * 8  # the owner's flags after the bytes, 8-aligned
        extra = at - nbytes + WORDS * 8 if words else 0
        try:
            if create:
                guard(self)
                self._reserve(fd, nbytes + extra, local_ranks)
            else:
                size = os.fstat(fd).st_size
                if size < nbytes:
                    raise ConnectError(f"shared region {self._path} is smaller than {nbytes} bytes")
                extra = extra if size >= nbytes + extra else 0  # an owner that made none
            populate = getattr(mmap, "MAP_POPULATE", 0) if prefault else 0
            prot = mmap.PROT_READ | (0 if readonly and not create else mmap.PROT_WRITE)
            self._map: mmap.mmap | None = mmap.mmap(fd, nbytes + extra, flags=mmap.MAP_SHARED | populate, prot=prot)
        except BaseException:
            if create:
                self.unlink()
            raise
        finally:
            os.close(fd)
        self.array = np.frombuffer(self._map, dtype=np.uint8, count=nbytes)
        if extra:
            self.words = np.frombuffer(self._map, dtype=np.int64, count=WORDS, offset=at)
            if create:
                _own_words(self.words)
        if create and prefault:
            self.array.fill(0)  # fault every page in now, not during a collective

    def _reserve(self, fd: int, nbytes: int, local_ranks: int) -> None:
        """Size the segment and reserve its pages: a tmpfs without room says ENOSPC here rather
        than SIGBUS at the first touch of a page it cannot supply."""
        try:
            os.posix_fallocate(fd, 0, nbytes)
            return
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
                raise ConfigError(_shortfall("this rank could not reserve its part of", 2 * nbytes * local_ranks,
                                             local_ranks, nbytes, SHM_DIR)) from None
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise
        os.ftruncate(fd, nbytes)  # a file system without fallocate: size it at least

    @classmethod
    def create(cls, nbytes: int, tag: str, local_ranks: int = 1, *, prefault: bool = True,
               words: bool = False) -> "SharedRegion":
        return cls(f"{SHM_PREFIX}{os.getpid()}-{tag}-{secrets.token_hex(4)}", nbytes, create=True,
                   local_ranks=local_ranks, prefault=prefault, words=words)

    @classmethod
    def attach(cls, name: str, nbytes: int, *, readonly: bool = False, words: bool = False) -> "SharedRegion":
        """A peer's region; ``words``: and its owner's words after the bytes, where it made them."""
        return cls(name, nbytes, create=False, readonly=readonly, words=words)

    def unlink(self) -> None:
        """Remove the name; mappings stay valid until closed (no leak if the job dies)."""
        unguard(self)
        try:
            os.unlink(self._path)
        except FileNotFoundError:
            pass

    def detach(self) -> mmap.mmap:
        """Hand the mapping to the caller (its arrays keep it alive); the region keeps its name."""
        mapping, self._map = self._map, None
        self.array = np.empty(0, dtype=np.uint8)
        assert mapping is not None
        return mapping

    def close(self) -> None:
        self.array = np.empty(0, dtype=np.uint8)
        self.words = np.zeros(0, np.int64)
        if self._map is None:
            return
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
    def local(cls, nbytes: int, *, prefault: bool = True) -> "CclBuffers":
        """Process-private buffers; ``prefault=False`` leaves the pages to their first use (quick to make)."""
        return cls(LocalRegion(nbytes, prefault=prefault), LocalRegion(nbytes, prefault=prefault))

    @classmethod
    def shared(cls, nbytes: int, tag: str, *, local_ranks: int = 1, shrink: bool = False,
               prefault: bool = True) -> "CclBuffers":
        """CCL_In and CCL_Out in shared memory (stale segments of dead jobs are reclaimed first),
        of ``fit(nbytes, local_ranks, shrink=shrink)`` bytes each."""
        reclaim_stale()
        nbytes = fit(nbytes, local_ranks, shrink=shrink)
        ccl_in = SharedRegion.create(nbytes, f"{tag}-in", local_ranks, prefault=prefault)
        try:
            ccl_out = SharedRegion.create(nbytes, f"{tag}-out", local_ranks, prefault=prefault, words=True)
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

    @property
    def in_shared_memory(self) -> bool:
        """Whether the regions are in shared memory (peers on this host map them by name)."""
        return isinstance(self.ccl_in, SharedRegion)

    def release(self) -> int:
        """Close both regions and keep empty ones in their place (``Comm.suspend``: whoever holds
        this object - links, channel - sees no memory until ``adopt``); the bytes released."""
        nbytes = self.ccl_in.nbytes + self.ccl_out.nbytes
        self.close()
        self.ccl_in, self.ccl_out = LocalRegion(0), LocalRegion(0)
        return nbytes

    def adopt(self, other: "CclBuffers") -> None:
        """Take ``other``'s regions (``Comm.resume``: new buffers where the old ones were)."""
        self.ccl_in, self.ccl_out = other.ccl_in, other.ccl_out

"""In-process transport: every rank in one event loop, links are direct calls.

Used by tests to run wide matrices (world sizes 1..16) without processes. Buffers are
plain numpy arrays, so links are mapped, exactly like SDMA links on one host. Nothing is
encoded: a peer hands over Python objects by direct call, so these links cannot receive a
malformed message (and never call ``peer_broke_protocol``).
"""

from __future__ import annotations

import ctypes
import itertools
import weakref
from collections.abc import Awaitable
from typing import Any

import numpy as np

from .._buffers import CclBuffers
from .._memcopy import read_bounced
from .._peer_memory import local_view
from .base import (
    EAGER_BYTES,
    MAX_CONTROL,
    DomainInUse,
    Link,
    MappedAccess,
    MemoryRunner,
    MessageKey,
    ProgressHook,
    as_bytes,
)


def _memmove(dst: np.ndarray, addr: int) -> None:
    read_bounced(dst, addr, _raw_memmove)


def _raw_memmove(dst: np.ndarray, addr: int) -> None:
    ctypes.memmove(dst.ctypes.data, addr, dst.nbytes)


class _MemmovePipe:
    """``Pipe`` in one address space."""

    def __init__(self, link: "InprocLink") -> None:
        self._link = link

    def read(self, local: int, remote: int, nbytes: int) -> None:
        self._link.bytes_received += nbytes
        ctypes.memmove(local, remote, nbytes)

    def write(self, local: int, remote: int, nbytes: int) -> None:
        self._link.bytes_sent += nbytes
        ctypes.memmove(remote, local, nbytes)


class InprocLink(MappedAccess, Link):
    kind = "inproc"
    single_copy = True  # one address space: a read is a memmove
    eager_limit = EAGER_BYTES

    def __init__(self, rank: int, peer: int, peer_buffers: CclBuffers, on_progress: ProgressHook | None,
                 world: "InprocWorld | None" = None, ends: tuple[int, int] | None = None) -> None:
        super().__init__(rank, peer, on_progress)
        self._remote = (peer_buffers.ccl_in.array, peer_buffers.ccl_out.array)
        self._remote_words = peer_buffers.ccl_out.words
        self.twin: InprocLink | None = None  # the peer's link back to us
        self.world = world
        self.ends = ends or (rank, peer)  # (this rank, the peer) in the world's numbering
        self.domain_key = (0, *self.ends)

    def describe_buffers(self, buffers: CclBuffers) -> dict[str, Any]:
        assert self.world is not None
        return {"buffsize": buffers.nbytes, "token": self.world.export(buffers)}

    def child(self, domain: int, rank: int, peer: int, buffers: CclBuffers, peer_buffers: dict[str, Any],
              on_progress: ProgressHook | None) -> "InprocLink":
        assert self.world is not None
        return self.world.pair(domain, self.ends, InprocLink(rank, peer, self.world.imported(peer_buffers["token"]),
                                                             on_progress, self.world, self.ends))

    def map_peer_buffers(self, peer_buffers: dict[str, Any]) -> None:
        assert self.world is not None
        buffers = self.world.imported(peer_buffers["token"])
        self._remote = (buffers.ccl_in.array, buffers.ccl_out.array)
        self._remote_words = buffers.ccl_out.words

    def close(self) -> None:
        if self.world is not None:
            self.world.unpair(self)

    def post(self, signal: int, index: int, seq: int, value: int = 0, fingerprint: int = 0) -> None:
        assert self.twin is not None
        self.signals_sent += 1
        self.twin.deliver(signal, index, seq, value, fingerprint)

    def send_control(self, payload: bytes) -> None:
        assert self.twin is not None
        self._check_size("a control message", len(payload), MAX_CONTROL)
        self.twin.control(bytes(payload))

    def read(self, dst: np.ndarray, addr: int, run: MemoryRunner) -> "Awaitable[Any] | None":
        self.bytes_received += dst.nbytes
        return run(_memmove, dst, addr)

    def read_word(self, addr: int) -> int:
        return ctypes.c_int64.from_address(addr).value

    def pipe(self) -> _MemmovePipe:
        return _MemmovePipe(self)

    def view(self, addr: int, nbytes: int) -> np.ndarray | None:
        src = local_view(addr, nbytes)  # one process: the peer's alloc memory is this process's
        if src is not None:  # handed out to be read: counted as received
            self.bytes_received += nbytes
        return src

    def send_message(self, key: MessageKey, meta: bytes, data: np.ndarray) -> "Awaitable[None] | None":
        assert self.twin is not None
        if self._error is not None:
            raise self._error
        self.bytes_sent += data.nbytes
        self.twin.deliver_message(key, meta, as_bytes(data).copy())  # the sender may reuse data at once
        return None

    def send_eager(self, seq: int, fingerprint: int, data: np.ndarray | None) -> None:
        assert self.twin is not None
        if self._error is not None:
            raise self._error
        payload = b"" if data is None else as_bytes(data).tobytes()  # the sender may reuse data at once
        self._check_size("an eager message", len(payload), EAGER_BYTES)
        self.bytes_sent += len(payload)
        self.twin.deliver_eager(seq, fingerprint, payload)

    def send_progress(self, seq: int) -> None:
        assert self.twin is not None
        self.twin.progress(seq)

    def send_abort(self, reason: str) -> None:
        assert self.twin is not None
        self.twin.peer_aborted(reason)


class InprocWorld:
    """The shared state of an in-process job: each rank's buffers and links."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.buffers: dict[int, CclBuffers] = {}
        self.links: dict[tuple[int, int, int], InprocLink] = {}  # (domain, rank, peer) -> link
        self._exported: weakref.WeakValueDictionary[int, CclBuffers] = weakref.WeakValueDictionary()
        self._tokens = itertools.count(1)

    def register(self, rank: int, buffers: CclBuffers) -> None:
        self.buffers[rank] = buffers

    def connect(self, rank: int, on_progress: ProgressHook | None) -> dict[int, InprocLink]:
        """Create this rank's links; needs every rank registered first."""
        links: dict[int, InprocLink] = {}
        for peer in range(self.size):
            if peer == rank:
                continue
            links[peer] = self.pair(0, (rank, peer), InprocLink(rank, peer, self.buffers[peer], on_progress, self))
        return links

    def pair(self, domain: int, ends: tuple[int, int], link: InprocLink) -> InprocLink:
        """Register ``link`` (domain, this rank, the peer) and join it to its twin if that exists."""
        rank, peer = ends
        if (domain, rank, peer) in self.links:
            raise DomainInUse(f"in-process link {rank}->{peer}: domain {domain} is in use")
        self.links[(domain, rank, peer)] = link
        link.domain_key = (domain, rank, peer)
        twin = self.links.get((domain, peer, rank))
        if twin is not None:
            link.twin, twin.twin = twin, link
        return link

    def unpair(self, link: InprocLink) -> None:
        if self.links.get(link.domain_key) is link:
            del self.links[link.domain_key]

    def export(self, buffers: CclBuffers) -> int:
        """A token for a sub-communicator's buffers that the other ranks of this world can map."""
        token = next(self._tokens)
        self._exported[token] = buffers
        return token

    def imported(self, token: Any) -> CclBuffers:
        return self._exported[int(token)]

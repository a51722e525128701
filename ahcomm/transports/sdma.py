"""SDMA-like links between ranks on one host.

Notifies travel through the peer's shared-memory inbox where it has one (``_notify_ring``:
a record and a byte into its FIFO), else over ZeroMQ ipc, which also carries everything else
(eager messages, control, goodbyes); the bytes do not: each rank's CCL_In/CCL_Out live in
POSIX shared memory that its peers map, so a put is a direct copy into the peer's
buffer and a mesh algorithm can read or reduce straight out of it.
"""

from __future__ import annotations

import errno
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import zmq

from .._buffers import CclBuffers, SharedRegion
from .._errors import ConnectError, PeerFailure, TransportError
from .._memcopy import at_address, copy, misaligned
from .._peer_memory import PeerMemory
from . import _cma
from ._notify_ring import Outbox
from ._wire import Malformed
from ._zmq import Channel, ZmqLink
from .base import MappedAccess, MemoryRunner, ProgressHook, Signal


class _KernelPipe:
    """``Pipe`` through the kernel (``_cma.Pipe``); a misaligned pair goes the link's way (bounced)."""

    def __init__(self, link: "SdmaLink") -> None:
        self._link, self._pipe = link, _cma.Pipe(link.pid)

    def read(self, local: int, remote: int, nbytes: int) -> None:
        link = self._link
        link.bytes_received += nbytes
        link.kernel_read_bytes += nbytes
        slow = misaligned(local, remote, nbytes)
        self._move("reading", _cma.read if slow else None, self._pipe.read, local, remote, nbytes)

    def write(self, local: int, remote: int, nbytes: int) -> None:
        link = self._link
        link.bytes_sent += nbytes
        link.kernel_write_bytes += nbytes
        slow = misaligned(remote, local, nbytes)
        self._move("writing", _cma.write if slow else None, self._pipe.write, local, remote, nbytes)

    def _move(self, doing: str, bounced: Callable[[int, np.ndarray, int], None] | None,
              direct: Callable[[int, int, int], None], local: int, remote: int, nbytes: int) -> None:
        """``direct`` by address, or, for a pair the kernel copies slowly, ``bounced`` with an array."""
        link = self._link
        try:
            if bounced is not None:
                bounced(link.pid, at_address(local, nbytes), remote)
            else:
                direct(local, remote, nbytes)
        except OSError as exc:
            raise link._failed(doing, exc) from (None if exc.errno == errno.ESRCH else exc)


class SdmaLink(MappedAccess, ZmqLink):
    kind = "sdma"

    def __init__(self, rank: int, peer: int, channel: Channel, endpoint: str, shm_in: str, shm_out: str,
                 nbytes: int, on_progress: ProgressHook | None, pid: int = 0, probe_addr: int = 0, *,
                 parent: "SdmaLink | None" = None, domain: int = 0, notify: dict[str, Any] | None = None,
                 notify_ring: int = -1, memory: str | None = None) -> None:
        self._regions = (SharedRegion.attach(shm_in, nbytes), SharedRegion.attach(shm_out, nbytes, words=True))
        self._remote = (self._regions[0].array, self._regions[1].array)
        self._remote_words = self._regions[1].words
        try:
            super().__init__(rank, peer, channel, endpoint, on_progress, parent=parent, domain=domain)
        except BaseException:
            for region in self._regions:
                region.close()
            raise
        self.pid = pid
        self._notify_ring = notify_ring  # this rank's ring in the peer's inbox (its place among the host's ranks)
        self._outbox: Outbox | None = None  # (a connection's first link) that ring, mapped here
        self._memory: PeerMemory | None = None  # (a connection's first link) the peer's ahcomm.alloc memory
        self.mapped_read_bytes = 0  # read() served from the peer's alloc memory, mapped here
        self.kernel_read_bytes = 0  # read() through process_vm_readv
        self.kernel_write_bytes = 0  # write() through process_vm_writev
        if parent is not None:
            self.single_copy = parent.single_copy  # the same process: probed already
        else:
            self.single_copy = bool(pid and probe_addr and _cma.probe(pid, probe_addr))
            self._outbox = self._open_outbox(notify)
            self._memory = PeerMemory(memory) if memory else None

    @property
    def outbox(self) -> Outbox | None:
        """This rank's ring in the peer's inbox: the connection's, which its sub-communicators' links
        share (a record carries the domain)."""
        root = self.root
        return root._outbox if isinstance(root, SdmaLink) else None

    def _open_outbox(self, notify: Any) -> Outbox | None:
        if not isinstance(notify, dict) or self._notify_ring < 0:
            return None
        try:
            return Outbox(notify, self._notify_ring)
        except (OSError, ValueError, KeyError, TypeError, ConnectError, TransportError):  # ZeroMQ carries them
            return None

    def describe_buffers(self, buffers: CclBuffers) -> dict[str, Any]:
        about: dict[str, Any] = {"buffsize": buffers.nbytes, "shm": [buffers.ccl_in.name, buffers.ccl_out.name]}
        notify = self.channel.notify_description()
        if notify is not None:  # resume: this rank's new inbox
            about["notify"] = notify
        return about

    def child(self, domain: int, rank: int, peer: int, buffers: CclBuffers, peer_buffers: dict[str, Any],
              on_progress: ProgressHook | None) -> "SdmaLink":
        shm_in, shm_out, nbytes = self._shared_names(peer_buffers, "buffers for a sub-communicator")
        return SdmaLink(rank, peer, self.channel, self.endpoint, shm_in, shm_out, nbytes, on_progress, self.pid,
                        parent=self, domain=domain)

    def _shared_names(self, peer_buffers: dict[str, Any], what: str) -> tuple[str, str, int]:
        """(CCL_In name, CCL_Out name, bytes) of a peer's ``describe_buffers``, or a TransportError."""
        try:
            shm_in, shm_out = (str(name) for name in peer_buffers["shm"])
            return shm_in, shm_out, int(peer_buffers["buffsize"])
        except (KeyError, TypeError, ValueError):
            raise TransportError(f"sdma link {self.rank}->{self.peer}: the peer's {what} are not in shared "
                                 f"memory ({peer_buffers!r})") from None

    def unmap_peer_buffers(self) -> int:
        self._remote = (np.empty(0, np.uint8), np.empty(0, np.uint8))  # no view may keep the mapping
        self._remote_words = np.zeros(0, np.int64)
        if self._memory is not None:  # the peer's alloc memory: mapped again at the next read
            self._memory.release()
        nbytes = sum(region.nbytes for region in self._regions)
        for region in self._regions:
            region.close()
        return nbytes

    def map_peer_buffers(self, peer_buffers: dict[str, Any]) -> None:
        shm_in, shm_out, nbytes = self._shared_names(peer_buffers, "new buffers")
        self._regions = (SharedRegion.attach(shm_in, nbytes), SharedRegion.attach(shm_out, nbytes, words=True))
        self._remote = (self._regions[0].array, self._regions[1].array)
        self._remote_words = self._regions[1].words
        if self.root is self:  # and the peer's new inbox, if it made one (its first post through it comes
            if self._outbox is not None:  # after resume's last round: every earlier one over ZeroMQ is read)
                self._outbox.close()
            self._outbox = self._open_outbox(peer_buffers.get("notify"))

    def post(self, signal: int, index: int, seq: int, value: int = 0, fingerprint: int = 0) -> None:
        box = self.outbox
        if box is None or self._error is not None or not box.post(self.domain, signal, index, seq, value, fingerprint):
            super().post(signal, index, seq, value, fingerprint)
            return
        self.signals_sent += 1

    def stop_shared_notifies(self) -> None:
        if self.root is self and self._outbox is not None:  # the connection's ring: its sub-communicators' too
            self._outbox.close()

    def release_shared_notifies(self) -> int:
        return self.channel.release_notifies() if self.root is self else 0

    def renew_shared_notifies(self) -> None:
        if self.root is self:
            self.channel.renew_notifies()

    def settle_shared_notifies(self) -> None:
        if self.root is self:
            self.channel.unlink()

    def hello(self, index: int) -> None:
        ZmqLink.post(self, Signal.ACK, index, 0)  # proves the ZeroMQ connection, which carries goodbyes and aborts

    def stats(self) -> dict[str, Any]:
        out = super().stats()
        box = self.outbox
        out["notifies"] = "zeromq" if box is None or box.sticky else "shared memory"  # how posts travel now
        out["read_bytes"] = {"mapped": self.mapped_read_bytes, "kernel": self.kernel_read_bytes}
        out["write_bytes"] = {"kernel": self.kernel_write_bytes}
        return out

    def _view(self, addr: int, nbytes: int) -> np.ndarray | None:
        root = self.root
        memory = root._memory if isinstance(root, SdmaLink) else None
        return None if memory is None else memory.view(addr, nbytes)

    def pipe(self) -> _KernelPipe | None:
        return _KernelPipe(self) if self.single_copy else None

    def view(self, addr: int, nbytes: int) -> np.ndarray | None:
        src = self._view(addr, nbytes)
        if src is not None:  # handed out to be read: counted as received
            self.bytes_received += nbytes
            self.mapped_read_bytes += nbytes
        return src

    def read(self, dst: np.ndarray, addr: int, run: MemoryRunner) -> "Awaitable[Any] | None":
        self.bytes_received += dst.nbytes
        src = self._view(addr, dst.nbytes) if dst.flags.c_contiguous else None
        if src is not None:
            self.mapped_read_bytes += dst.nbytes
            return run(copy, dst.reshape(-1).view(np.uint8), src)
        self.kernel_read_bytes += dst.nbytes
        return run(self._read, dst, addr)

    def _read(self, dst: np.ndarray, addr: int) -> None:
        try:
            _cma.read(self.pid, dst, addr)
        except OSError as exc:
            raise self._failed("reading", exc) from (None if exc.errno == errno.ESRCH else exc)

    def read_word(self, addr: int) -> int:
        try:
            return _cma.read_word(self.pid, addr)
        except OSError as exc:
            raise self._failed("reading", exc) from (None if exc.errno == errno.ESRCH else exc)

    def _failed(self, doing: str, exc: OSError) -> Exception:
        """The peer's process is gone (often noticed here first), or its memory is not there."""
        if exc.errno == errno.ESRCH:
            return PeerFailure(f"rank {self.peer} is lost: its process (pid {self.pid}) is gone "
                               f"(noticed by rank {self.rank} {doing} its memory)", rank=self.peer)
        return TransportError(f"sdma link {self.peer}->{self.rank}: {doing} rank {self.peer}'s memory "
                              f"failed: {exc}")

    def on_data_message(self, kind: int, a: int, index: int, nbytes: int, seq: int, offset: int,
                        sock: zmq.Socket[Any]) -> None:
        raise Malformed(f"sdma link {self.peer}->{self.rank}: unknown message kind {kind}")

    def close(self) -> None:
        super().close()
        if self._outbox is not None:
            self._outbox.close()
            self._outbox = None
        if self._memory is not None:
            self._memory.close()
            self._memory = None
        self._remote = (np.empty(0, np.uint8), np.empty(0, np.uint8))  # no view may keep the mapping
        self._remote_words = np.zeros(0, np.int64)
        for region in self._regions:
            region.close()

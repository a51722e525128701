"""SDMA-like links between ranks on one host.

Notifies travel over ZeroMQ ipc; the bytes do not: each rank's CCL_In/CCL_Out live in
POSIX shared memory that its peers map, so a put is a direct copy into the peer's
buffer and a mesh algorithm can read or reduce straight out of it.
"""

from __future__ import annotations

import errno
from collections.abc import Awaitable
from typing import Any

import numpy as np
import zmq

from .._buffers import CclBuffers, SharedRegion
from .._errors import PeerFailure, TransportError
from . import _cma
from ._wire import Malformed
from ._zmq import Channel, ZmqLink
from .base import MappedAccess, MemoryRunner, ProgressHook


class SdmaLink(MappedAccess, ZmqLink):
    kind = "sdma"

    def __init__(self, rank: int, peer: int, channel: Channel, endpoint: str, shm_in: str, shm_out: str,
                 nbytes: int, on_progress: ProgressHook | None, pid: int = 0, probe_addr: int = 0, *,
                 parent: "SdmaLink | None" = None, domain: int = 0) -> None:
        self._regions = (SharedRegion.attach(shm_in, nbytes), SharedRegion.attach(shm_out, nbytes))
        self._remote = (self._regions[0].array, self._regions[1].array)
        try:
            super().__init__(rank, peer, channel, endpoint, on_progress, parent=parent, domain=domain)
        except BaseException:
            for region in self._regions:
                region.close()
            raise
        self.pid = pid
        if parent is not None:
            self.single_copy = parent.single_copy  # the same process: probed already
        else:
            self.single_copy = bool(pid and probe_addr and _cma.probe(pid, probe_addr))

    def describe_buffers(self, buffers: CclBuffers) -> dict[str, Any]:
        return {"buffsize": buffers.nbytes, "shm": [buffers.ccl_in.name, buffers.ccl_out.name]}

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
        nbytes = sum(region.nbytes for region in self._regions)
        for region in self._regions:
            region.close()
        return nbytes

    def map_peer_buffers(self, peer_buffers: dict[str, Any]) -> None:
        shm_in, shm_out, nbytes = self._shared_names(peer_buffers, "new buffers")
        self._regions = (SharedRegion.attach(shm_in, nbytes), SharedRegion.attach(shm_out, nbytes))
        self._remote = (self._regions[0].array, self._regions[1].array)

    def read(self, dst: np.ndarray, addr: int, run: MemoryRunner) -> "Awaitable[Any] | None":
        self.bytes_received += dst.nbytes
        return run(self._read, dst, addr)

    def _read(self, dst: np.ndarray, addr: int) -> None:
        try:
            _cma.read(self.pid, dst, addr)
        except OSError as exc:  # the peer's process is gone (often noticed here first), or its memory is
            if exc.errno == errno.ESRCH:
                raise PeerFailure(f"rank {self.peer} is lost: its process (pid {self.pid}) is gone "
                                  f"(noticed by rank {self.rank} reading its memory)", rank=self.peer) from None
            raise TransportError(f"sdma link {self.peer}->{self.rank}: reading rank {self.peer}'s memory "
                                 f"failed: {exc}") from exc

    def on_data_message(self, kind: int, a: int, index: int, nbytes: int, seq: int, offset: int,
                        sock: zmq.Socket[Any]) -> None:
        raise Malformed(f"sdma link {self.peer}->{self.rank}: unknown message kind {kind}")

    def close(self) -> None:
        super().close()
        self._remote = (np.empty(0, np.uint8), np.empty(0, np.uint8))  # no view may keep the mapping
        for region in self._regions:
            region.close()

"""The mailboxes of the ranks of one host: a shared-memory box and a wake-up FIFO per rank.

A rank creates its box (``SharedRegion``) and a FIFO in /dev/shm before the rendezvous and
opens the FIFO for reading and writing (so it is never at end of file, and peers can open it
for writing at once); the names travel in the rendezvous table. Once every rank is known to
be on this host, each maps every peer's box and opens every peer's FIFO for writing (non
blocking). A wake-up is one byte written to the peer's FIFO; the owner reads its FIFO on its
event loop (``loop.add_reader``) and hands the wake-up to the waiting collective. Names are
unlinked once every peer holds them; a job that dies before leaves names that
``reclaim_stale`` removes (they carry the creator's pid). Sub-communicators' boxes
(``Mailbox.derive``) are shared regions too (``_ShmStore``), woken through the same FIFOs.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from .._buffers import SharedRegion, guard, unguard
from ._wake import WakeFifo, Waker, close_fd, open_waker
from .mailbox import Box, Mailbox, box_bytes


class _ShmBox:
    """A derived mailbox's box in /dev/shm: made here (``owner``) or a peer's, mapped here."""

    def __init__(self, region: SharedRegion, owner: bool) -> None:
        self.region, self.owner = region, owner

    @property
    def array(self) -> np.ndarray:
        return self.region.array

    def describe(self) -> dict[str, Any]:
        return {"box": self.region.name}

    def unlink(self) -> None:
        if self.owner:
            self.region.unlink()

    def close(self) -> None:
        self.unlink()
        self.region.close()


class _ShmStore:
    shared = True

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def create(self, nbytes: int) -> Box:
        return _ShmBox(SharedRegion.create(nbytes, f"r{self.rank}-gbox"), True)

    def open(self, description: dict[str, Any], nbytes: int) -> Box:
        return _ShmBox(SharedRegion.attach(str(description["box"]), nbytes), False)


class HostMailbox:
    """This rank's box and FIFO, and (after ``attach``) its ``Mailbox`` over every rank's."""

    def __init__(self, rank: int, capacity: int) -> None:
        self.rank = rank
        self.capacity = capacity
        self.region = SharedRegion.create(box_bytes(capacity), f"r{rank}-mbox")
        self._peers: list[SharedRegion] = []
        self._wfds: list[int] = []
        self.mailbox: Mailbox | None = None
        try:
            self.wake = WakeFifo(f"r{rank}-wake")
        except BaseException:
            self.region.unlink()
            self.region.close()
            raise
        guard(self)  # a SIGTERM during init removes the FIFO's name too

    def describe(self) -> dict[str, Any]:
        return {"box": self.region.name, "wake": self.wake.path, "capacity": self.capacity}

    @staticmethod
    def usable(table: list[dict[str, Any]]) -> bool:
        """Whether every rank of the rendezvous table offered a mailbox of one capacity on one host
        (decided from the table alone, so every rank decides the same)."""
        boxes = [e.get("mailbox") for e in table]
        return (len({e["host"] for e in table}) == 1 and all(isinstance(b, dict) for b in boxes)
                and len({b["capacity"] for b in boxes if isinstance(b, dict)}) == 1)

    def attach(self, table: list[dict[str, Any]]) -> Mailbox:
        """Map every peer's box and open its FIFO (``table`` in rank order, as the rendezvous gives)."""
        arrays: list[np.ndarray] = []
        wakers: list[Waker | None] = []
        for entry in table:
            peer, desc = int(entry["rank"]), entry["mailbox"]
            if peer == self.rank:
                arrays.append(self.region.array)
                wakers.append(None)
                continue
            region = SharedRegion.attach(str(desc["box"]), box_bytes(self.capacity))
            self._peers.append(region)
            fd, wake = open_waker(str(desc["wake"]))
            self._wfds.append(fd)
            arrays.append(region.array)
            wakers.append(wake)
        self.mailbox = Mailbox(self.rank, arrays, wakers, self.capacity, _ShmStore(self.rank))
        return self.mailbox

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.wake.watch(loop, self._woken)

    def _woken(self) -> None:
        if self.mailbox is not None:
            self.mailbox.woken()

    def unlink(self) -> None:
        """Remove the names (every peer holds its mapping and descriptor)."""
        unguard(self)
        self.region.unlink()
        self.wake.unlink()

    def close(self) -> None:
        if self.mailbox is not None:
            self.mailbox.close()  # and any derived one left open: no more wake-ups
        self.wake.close()
        for fd in self._wfds:
            close_fd(fd)
        self._wfds = []
        self.unlink()
        self.mailbox = None  # its views go with it, before the mappings are closed
        for region in (*self._peers, self.region):
            region.close()
        self._peers = []

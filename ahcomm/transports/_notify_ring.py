"""Notifies between the ranks of one host through shared memory: a ring per sender in the
receiver's inbox, and a wake-up FIFO.

Through ZeroMQ a notify crosses four threads (the poster's, its I/O thread, the receiver's I/O
thread, the receiver's event loop): 80-90 us a hop on 2 busy cores (np=2, 8 B all_reduce: ring
363 us, mesh 127, oneshot through the mailboxes 33). Here a post is one 64-byte record in a
single-producer, single-consumer ring of the receiver's inbox, which the sender maps, and one
byte into the receiver's FIFO, which its event loop watches (``loop.add_reader``): one wake-up,
no thread in between.

Every rank makes an inbox with a ring per rank of its host (at most ``MAX_RINGS``; ring i: the
posts of the host's i-th rank in rank order, its sub-communicators' included: a record carries
its domain; a rank beyond the rings posts over ZeroMQ). A ring is a line
with ``head`` (records written; only the sender writes it), a line with ``tail`` (records read;
only the receiver writes it) and ``CAPACITY`` records of (domain, signal, index, seq, value,
fingerprint). The sender writes a record, then ``head``; the receiver reads ``head``, then the
records: x86 keeps stores, and loads, in program order (as the mailboxes rely on; elsewhere
``usable()`` is false and notifies stay on ZeroMQ).

A post that cannot go here (its ring is full: the receiver is ``CAPACITY`` posts behind; a
field outside the ZeroMQ header's range, which then raises there as before) goes through
ZeroMQ, and so does every later post of that ring (``Outbox.sticky``): the receiver drains the
sender's ring after it reads each ZeroMQ message's header and before it acts on it
(``Channel``), so a link's notifies, and its goodbye or abort after them, arrive in the order
they were posted.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from .._buffers import SharedRegion, guard, unguard
from .._config import _flag
from ._wake import WakeFifo, close_fd, open_waker
from .mailbox import stores_in_order

MAX_RINGS = 64  # rings of an inbox at most (8.3 KiB each)
CAPACITY = 128  # records per ring (8 KiB): a receiver this many posts behind makes the sender fall back to ZeroMQ
LINE = 8  # int64 words per cache line (and per record)
HEAD, TAIL, RECORDS = 0, LINE, 2 * LINE  # word offsets within a ring
RING_WORDS = RECORDS + CAPACITY * LINE
UINT64, INT64 = 1 << 64, 1 << 63
# the ZeroMQ header's ranges (``_wire.HEADER``): signal B, index H, fingerprint I, seq q, value Q, domain H
U8, U16, U32 = 1 << 8, 1 << 16, 1 << 32

Dispatch = Callable[[int, int, int, int, int, int, int], None]  # (wire rank, domain, signal, index, seq, value, fp)


def usable() -> bool:
    """Whether this host keeps stores in order (``mailbox.stores_in_order``) and
    ``AHCOMM_SHM_NOTIFY`` is not 0 (a bad value raises; ``Config.from_env`` names it at init)."""
    return _flag(os.environ, "AHCOMM_SHM_NOTIFY", True) and stores_in_order()


def inbox_bytes(rings: int) -> int:
    return rings * RING_WORDS * 8


class Inbox:
    """This rank's rings (one per sender) and its wake-up FIFO."""

    def __init__(self, rank: int, rings: int) -> None:
        self.rank, self.rings = rank, rings
        self.region = SharedRegion.create(inbox_bytes(rings), f"r{rank}-inbox")
        try:
            self.wake = WakeFifo(f"r{rank}-notify")
        except BaseException:
            self.region.unlink()
            self.region.close()
            raise
        guard(self)
        self.words = self.region.array.view(np.int64).reshape(rings, RING_WORDS)
        self.senders = list(range(rings))

    def describe(self) -> dict[str, Any]:
        return {"inbox": self.region.name, "wake": self.wake.path, "rings": self.rings}

    def start(self, loop: asyncio.AbstractEventLoop, dispatch: Dispatch) -> None:
        def woken() -> None:
            self.drain(dispatch)
        self.wake.watch(loop, woken)

    @property
    def senders(self) -> list[int]:
        """Ring i -> the wire rank that posts into it (``Channel.bind_notifies``)."""
        return self._senders

    @senders.setter
    def senders(self, ranks: list[int]) -> None:
        self._senders = list(ranks[:self.rings])
        self._ring_of = {wire: i for i, wire in enumerate(self._senders)}

    def drain(self, dispatch: Dispatch) -> int:
        """Hand every record written so far to ``dispatch``, ring by ring in order; how many."""
        return sum(self._drain_ring(i, dispatch) for i in range(len(self._senders)))

    def drain_from(self, wire: int, dispatch: Dispatch) -> int:
        """Hand on the records of ``wire``'s ring (its ZeroMQ message is next: they come first)."""
        at_ring = self._ring_of.get(wire)
        return 0 if at_ring is None else self._drain_ring(at_ring, dispatch)

    def _drain_ring(self, at_ring: int, dispatch: Dispatch) -> int:
        ring, sender = self.words[at_ring], self._senders[at_ring]
        head, handed = int(ring[HEAD]), 0
        while (tail := int(ring[TAIL])) < head:  # only this rank writes ``tail``
            at = RECORDS + (tail % CAPACITY) * LINE
            domain, signal, index, seq, value, fingerprint = ring[at:at + 6].tolist()
            ring[TAIL] = tail + 1  # before it is acted on: the slot is free, a nested drain skips it
            handed += 1
            dispatch(sender, domain, signal, index, seq, value % UINT64, fingerprint)
        return handed

    def unlink(self) -> None:
        """Remove the names (every peer holds its mapping and descriptor)."""
        unguard(self)
        self.region.unlink()
        self.wake.unlink()

    def close(self) -> None:
        self.wake.close()
        self.unlink()
        self.words = np.empty((0, RING_WORDS), np.int64)  # no view may keep the mapping
        self.region.close()


class Outbox:
    """This rank's ring in a peer's inbox (``ring``: this rank's place among its host's ranks)."""

    def __init__(self, description: dict[str, Any], ring: int) -> None:
        rings = int(description["rings"])
        if not 0 <= ring < rings:
            raise ValueError(f"ring {ring} is not in an inbox of {rings}")
        self.region = SharedRegion.attach(str(description["inbox"]), inbox_bytes(rings))
        try:
            self.fd, self._wake = open_waker(str(description["wake"]))
        except BaseException:
            self.region.close()
            raise
        self.ring = self.region.array.view(np.int64).reshape(rings, RING_WORDS)[ring]
        self.sticky = False  # a post went through ZeroMQ: every later one does too
        self.posts = 0

    def post(self, domain: int, signal: int, index: int, seq: int, value: int, fingerprint: int) -> bool:
        """Write the record and wake the receiver; False (and from now on) where it must go through ZeroMQ."""
        if self.sticky:
            return False
        ring = self.ring
        head = int(ring[HEAD])  # only this rank writes it
        if (head - int(ring[TAIL]) >= CAPACITY or not (0 <= value < UINT64 and 0 <= signal < U8 and 0 <= index < U16
                                                       and 0 <= fingerprint < U32 and -INT64 <= seq < INT64
                                                       and 0 <= domain < U16)):
            self.sticky = True
            return False
        at = RECORDS + (head % CAPACITY) * LINE
        ring[at:at + 6] = (domain, signal, index, seq, value - UINT64 if value >= INT64 else value, fingerprint)
        ring[HEAD] = head + 1
        self.posts += 1
        self._wake()
        return True

    def close(self) -> None:
        close_fd(self.fd)
        self.fd = -1
        self._wake = _nothing
        self.ring = np.empty(0, np.int64)
        self.sticky = True
        self.region.close()


def _nothing() -> None:
    """A closed outbox's waker."""

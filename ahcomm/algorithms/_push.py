"""Writes into peers' outputs that stop when the output's owner stops (mesh's single-copy all_reduce).

Mesh's single-copy all_reduce pushes: each rank writes every piece of its reduced share into
each peer's output (``DataLink.write``: ``process_vm_writev``) while the piece is still in its
cache, instead of each peer reading the share out of memory afterwards. On the Intel VM, a
2-rank in-place all_reduce of 64 MiB: 8.8-9.1 ms a call against 10.8-11.1 with reads
(``benchmarks/results/2026-11-27-push.md``).

A rank's output is then written by its peers, so a call that fails or is cancelled on one rank
must not return while a peer may still write there (the output may be a user's ``out=``, reused
at once). Each rank keeps two words in its own memory (``Gates.words``), which its peers read
through their links:

- its *gate*: the sequence number of the call whose output peers may write (0: closed). A
  writer reads each owner's gate before its first write into it and again every
  ``CHECK_BYTES``, and stops (``PeerFailure``) once it is closed;
- its *release*: the last call for which it writes into no peer any more, set when its push
  loop ends, however it ends, or when its call fails before the loop began.

A rank posts its output's address only once it holds every peer's words' address (the run's
first round), and marks the call *exposed* then. A call that fails after that closes its gate
and waits (``settle``) until its own loop and every peer still alive has released the call, at
most ``RELEASE_WAIT`` (a live peer that neither finishes nor fails in that time is stuck outside
its loop, where it will see the closed gate before it writes).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Mapping

import numpy as np

from .._errors import PeerFailure
from ..transports.base import DataLink

GATE, RELEASED = 0, 1  # the words' indexes
WORD = 8  # bytes of one word (int64)
CHECK_BYTES = 2 << 20  # a writer reads each owner's gate again after pushing this many bytes to it
RELEASE_WAIT = 1.0  # seconds a failed call waits for its writers' releases at most
POLL = 0.001  # seconds between two looks at the releases

_IDLE, _PENDING, _RUNNING = 0, 1, 2
log = logging.getLogger("ahcomm")


def _inline(fn: Callable[..., object], *args: object, **kwargs: object) -> None:
    fn(*args, **kwargs)


class Gates:
    """One communicator's side of the protocol: its words, the calls' state, the peers' words."""

    def __init__(self) -> None:
        self.words = np.zeros(2, np.int64)  # [gate, release]; never moves while the executor lives
        self.peers: dict[int, int] = {}  # peer -> address of its words (the current call's)
        self._lock = threading.Lock()  # the push loop may run on a copy engine's thread
        self._seq = 0
        self._state = _IDLE
        self._exposed = 0  # the last call whose output's address was posted

    @property
    def address(self) -> int:
        return int(self.words.ctypes.data)

    def open(self, seq: int) -> None:
        """At the call's start, before anything is posted: peers may write its output for ``seq``."""
        with self._lock:
            self._seq, self._state = seq, _PENDING
        self.peers = {}
        self.words[GATE] = seq

    def expose(self, seq: int, peers: Mapping[int, int]) -> None:
        """Every peer's words are known (``peers``), and the output's address goes out now."""
        self.peers = dict(peers)
        self._exposed = seq

    def begin(self, seq: int) -> bool:
        """The push loop starts; False where the call already ended (the loop must not run)."""
        with self._lock:
            if self._seq != seq or self._state != _PENDING:
                return False
            self._state = _RUNNING
            return True

    def done(self, seq: int) -> None:
        """The push loop ended, however: this rank writes into no peer for ``seq`` any more."""
        with self._lock:
            if self._seq == seq:
                self._state = _IDLE
        self.words[RELEASED] = seq

    def is_open(self, seq: int) -> bool:
        return int(self.words[GATE]) == seq

    def close(self, seq: int) -> bool:
        """The call failed: close the gate; a loop that has not begun never will. Whether this
        rank's own loop is still running (``settle`` waits for it)."""
        self.words[GATE] = 0
        with self._lock:
            if self._seq == seq and self._state == _PENDING:
                self._state = _IDLE
                self.words[RELEASED] = seq
            return self._seq == seq and self._state == _RUNNING

    def exposed(self, seq: int) -> bool:
        return self._exposed == seq


def check(gates: Gates, seq: int, op: str, rank: int, owners: list[tuple[DataLink, int, int]],
          word: np.ndarray) -> None:
    """Before a writer's next writes: raise unless this rank's call and every owner's
    (``(link, peer, words' address)``) still accept them. ``word``: an int64 of one element."""
    if not gates.is_open(seq):
        raise PeerFailure(f"rank {rank}'s {op} #{seq} ended while it was writing its share into its peers' "
                          f"outputs: it stopped", rank=rank, op=op, seq=seq)
    for link, peer, at in owners:
        link.read(word, at + GATE * WORD, _inline)
        if int(word[0]) != seq:
            raise PeerFailure(f"rank {peer} ended {op} #{seq} (it failed there) before rank {rank} had written "
                              f"its share into rank {peer}'s output: rank {rank} stopped", rank=peer, op=op, seq=seq)


async def settle(gates: Gates, links: Mapping[int, DataLink], seq: int, op: str) -> None:
    """After a failed call (``seq``): close the gate, then wait until no peer (nor this rank's
    own loop) may still write into the call's output: each has released the call or is gone;
    at most ``RELEASE_WAIT``."""
    running = gates.close(seq)
    pending = dict(gates.peers) if gates.exposed(seq) else {}
    if not running and not pending:
        return
    word = np.zeros(1, np.int64)
    deadline = time.monotonic() + RELEASE_WAIT
    while True:
        for peer, at in list(pending.items()):
            try:
                links[peer].read(word, at + RELEASED * WORD, _inline)
            except Exception:  # noqa: BLE001 - gone (PeerFailure), or its memory is: it writes no more
                word[0] = seq
            if int(word[0]) >= seq:
                del pending[peer]
        if int(gates.words[RELEASED]) >= seq:
            running = False
        if not running and not pending:
            return
        if time.monotonic() >= deadline:
            log.warning("%s #%d failed; ranks %s had not released its output after %.1f s (their writes "
                        "into it stop at their next look at its closed gate)", op, seq,
                        sorted(pending) or "(this rank's own loop)", RELEASE_WAIT)
            return
        await asyncio.sleep(POLL)


def owners(links: Mapping[int, DataLink], gates: Gates, peers: list[int]) -> list[tuple[DataLink, int, int]]:
    """(link, peer, words' address) of each peer this rank writes into."""
    return [(links[p], p, gates.peers[p]) for p in peers]


__all__ = ["CHECK_BYTES", "Gates", "check", "owners", "settle"]

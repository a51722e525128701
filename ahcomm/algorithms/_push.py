"""Writes into peers' outputs that stop when the output's owner stops (mesh's single-copy
all_reduce, direct's forwarded broadcast).

Mesh's single-copy all_reduce pushes: each rank writes every piece of its reduced share into
each peer's output (``DataLink.pipe``: ``process_vm_writev``) while the piece is still in its
cache, instead of each peer reading the share out of memory afterwards. On the Intel VM, a
2-rank in-place all_reduce of 64 MiB, interleaved with the reads over an afternoon whose host
slowed: 9.0-10.0 ms a call against 11.1-15.3, later 12.2-12.3 against 12.8-13.4
(``benchmarks/results/2026-11-27-push.md``).

A rank's output is then written by its peers, so a call that fails or is cancelled on one rank
must not return while a peer may still write there (the output may be a user's ``out=``, reused
at once). Each rank keeps two words in its own memory (``Gates.words``: after its CCL_Out's
bytes, ``Region.words``, where it is shared memory), which its peers map (``DataLink.words``: a
look is a load) or else read through the kernel (``DataLink.read_word``); a word holds a call's
sequence number plus one, so that 0 means "none" (a communicator's first call is number 0):

- its *gate*: the call whose output peers may write (0: closed). A writer reads each owner's
  gate before each piece it writes there, and stops (``PeerFailure``) at a closed one. An abort
  closes it at once (``Gates.shut``), so that this rank's own loop stops too;
- its *release*: the last call for which it writes into no peer any more, set when its push
  loop ends, however it ends, or when its call fails before the loop began;
- its *cause*: the rank whose failure ended its call (plus one; 0: none known), set before the
  gate closes, so that a writer stopped there names the rank that failed first.

In mesh a rank posts its output's address only once it holds every peer's words' address (the
run's first round), and marks the call *exposed* then. direct's forwarded broadcast posts both
in one mailbox publication, and a reader that fails waits only for the forwarders whose
publication it sees once its gate is closed (``direct._settle``: the others are past every look
at its gate). A call that fails after exposing its output closes its gate and waits
(``settle``, which a cancellation does not cut short) until its own loop and every writer still
alive has released the call, at most ``RELEASE_WAIT``. What that cannot cover: a
writer that stalls for longer than that between reading a gate and finishing the one piece
it then writes (a stopped process, say).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Mapping

import numpy as np

from .._errors import PeerFailure
from ..transports.base import DataLink, Pipe

GATE, RELEASED, CAUSE = 0, 1, 2  # the words' indexes
WORDS = 3
WORD = 8  # bytes of one word (int64)
RELEASE_WAIT = 1.0  # seconds a failed call waits for its writers' releases at most
POLL = 0.001  # seconds between two looks at the releases

_IDLE, _PENDING, _RUNNING = 0, 1, 2
log = logging.getLogger("ahcomm")


class Gates:
    """One communicator's side of the protocol: its words, the calls' state, the peers' words."""

    def __init__(self) -> None:
        self.words = np.zeros(WORDS, np.int64)  # [gate, release, cause] (seq + 1, rank + 1; 0: none); ``bind``
        self.peers: dict[int, int] = {}  # peer -> address of its words (the current call's)
        self._lock = threading.Lock()  # the push loop may run on a copy engine's thread
        self._seq = -1
        self._state = _IDLE
        self._exposed = -1  # the last call whose output's address was posted
        self._stale: np.ndarray | None = None  # words left by ``bind`` while a loop ran (its release goes there too)

    @property
    def address(self) -> int:
        return int(self.words.ctypes.data)

    def bind(self, words: np.ndarray | None) -> None:
        """Keep the words in ``words`` (``WORDS`` int64s; None: private ones) from now on, their values
        carried over: the CCL buffers' words at creation and after ``Comm.resume``, private ones
        while suspended or closed (no view may keep the buffers mapped). Between calls: each call
        posts the address anew; a loop still running (one that outlived ``settle``'s wait)
        releases into the old words too, where its peers look."""
        with self._lock:
            old, self.words = self.words, np.zeros(WORDS, np.int64) if words is None else words
            self.words[:] = old
            old[GATE] = 0  # a peer still looking at the old ones finds them closed
            self._stale = old if self._state == _RUNNING else None

    def open(self, seq: int) -> None:
        """At the call's start, before anything is posted: peers may write its output for ``seq``."""
        with self._lock:
            self._seq, self._state = seq, _PENDING
        self.peers = {}
        self.words[CAUSE] = 0
        self.words[GATE] = seq + 1

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
            self._release(seq)

    def is_open(self, seq: int) -> bool:
        return int(self.words[GATE]) == seq + 1

    def shut(self, cause: int | None = None) -> None:
        """The communicator aborts (``cause``: on that rank's failure): no more writes into this
        rank's output, nor out of its loop."""
        self._closing(cause)

    def close(self, seq: int, cause: int | None = None) -> bool:
        """The call failed (``cause``: on that rank's failure): close the gate; a loop that has not
        begun never will. Whether this rank's own loop is still running (``settle`` waits for it).
        The gate's store comes before the caller's next loads: the lock taken after it is a locked
        instruction (a full fence)."""
        self._closing(cause)
        with self._lock:
            if self._seq == seq and self._state == _PENDING:
                self._state = _IDLE
                self._release(seq)
            return self._seq == seq and self._state == _RUNNING

    def _closing(self, cause: int | None) -> None:
        if cause is not None and int(self.words[GATE]) != 0:  # the first failure's rank stands
            self.words[CAUSE] = cause + 1  # before the gate: a writer that finds it closed finds why
        self.words[GATE] = 0

    def released(self, seq: int) -> bool:
        return int(self.words[RELEASED]) > seq

    def exposed(self, seq: int) -> bool:
        return self._exposed == seq

    def _release(self, seq: int) -> None:  # under the lock; never backwards (a late loop's end)
        self.words[RELEASED] = max(int(self.words[RELEASED]), seq + 1)
        if self._stale is not None:
            self._stale[RELEASED] = self.words[RELEASED]
            self._stale = None


def pipe(link: DataLink) -> Pipe:
    """``link``'s pipe (single copy runs only where every link gives one)."""
    made = link.pipe()
    assert made is not None, "single copy runs only where every link has a pipe"
    return made


Owner = tuple[DataLink, int, int, "np.ndarray | None"]  # (link, peer, words' address, the words mapped here)


def check(gates: Gates, seq: int, op: str, rank: int, owners: list[Owner]) -> None:
    """Before a writer's next piece: raise unless this rank's call and every owner's still
    accept it."""
    if not gates.is_open(seq):
        raise PeerFailure(f"rank {rank}'s {op} #{seq} ended while it was writing its share into its peers' "
                          f"outputs: it stopped", rank=rank, op=op, seq=seq)
    for link, peer, at, mapped in owners:
        gate = int(mapped[GATE]) if mapped is not None else link.read_word(at + GATE * WORD)
        if gate != seq + 1:
            cause = (int(mapped[CAUSE]) if mapped is not None else link.read_word(at + CAUSE * WORD)) - 1
            mapped = None  # the error's traceback must not keep the peer's buffer mapped
            why = f"on rank {cause}'s failure" if cause >= 0 else "(it failed there)"
            raise PeerFailure(f"rank {peer} ended {op} #{seq} {why} before rank {rank} had written its share into "
                              f"rank {peer}'s output: rank {rank} stopped", rank=cause if cause >= 0 else peer,
                              op=op, seq=seq)


async def settle(gates: Gates, links: Mapping[int, DataLink], seq: int, op: str,
                 cause: int | None = None) -> None:
    """After a failed call (``seq``; ``cause``: on that rank's failure): close the gate, then wait
    until no peer (nor this rank's own loop) may still write into the call's output: each has
    released the call or is gone; at most ``RELEASE_WAIT``. A cancellation meanwhile is raised
    once the wait is over."""
    running = gates.close(seq, cause)
    pending = dict(gates.peers) if gates.exposed(seq) else {}
    deadline = time.monotonic() + RELEASE_WAIT
    cancelled: asyncio.CancelledError | None = None
    while True:
        for peer, at in list(pending.items()):
            try:
                if links[peer].read_word(at + RELEASED * WORD) > seq:
                    del pending[peer]
            except PeerFailure:  # its process is gone: it writes no more
                del pending[peer]
            except Exception:  # noqa: BLE001 - unreadable now (its permission withdrawn?): ask again
                pass
        running = running and not gates.released(seq)
        if not running and not pending:
            break
        if time.monotonic() >= deadline:
            log.warning("%s #%d failed here; after %.1f s %s not released its output: a piece under way "
                        "may still land in it (a peer that has not reached its writes finds the gate closed)",
                        op, seq, RELEASE_WAIT,
                        f"ranks {sorted(pending)} had" if pending else "this rank's own push had")
            break
        try:
            await asyncio.sleep(POLL)
        except asyncio.CancelledError as exc:  # the worker is being stopped: finish the wait first
            cancelled = cancelled or exc
    if cancelled is not None:
        raise cancelled


def owners(links: Mapping[int, DataLink], words: Mapping[int, int]) -> list[Owner]:
    """(link, peer, words' address, its words mapped here or None) of each peer this rank writes
    into (``words``: each one's words' address, as it posted it). A cross-process look through
    the kernel cost 6-9 us a piece on the Intel VM, and slowed the copies beside it (a 2-process
    copy of the 64 MiB loop: 14.8-14.9 ms a call against 12.1-12.2)."""
    return [(links[p], p, at, links[p].words(at, WORDS)) for p, at in words.items()]


def cause_of(error: BaseException) -> int | None:
    """The rank whose failure ``error`` reports (a ``PeerFailure``'s), if any."""
    return error.rank if isinstance(error, PeerFailure) else None


__all__ = ["Gates", "cause_of", "check", "owners", "pipe", "settle"]

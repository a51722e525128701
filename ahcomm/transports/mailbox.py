"""Mailboxes: one-shot exchange of small payloads between the ranks of one host.

Every rank owns a box that every rank of the host maps (shared memory, or plain memory in
one process). A box holds a header (the asleep word) and ``SLOTS`` slots; a slot is a
64-byte header (a flag, the call's sequence number and fingerprint, the payload's size)
and up to ``capacity`` bytes of payload. Ranks publish in step (every one-shot run,
or slice of one, publishes once on every rank), so the count of publications so far, the
*tick*, is the same on every rank: publication ``tick`` goes to slot ``tick & 1``. A rank
writes the payload, then the call's sequence number and fingerprint, then the flag
``tick + 1`` (NCCL's LL idea: the flag only grows, so a slot is never reset; a reader that
sees the flag sees the payload, as x86 keeps stores, and loads, in program order). Peers that
wait are woken through a descriptor their event loop watches (a FIFO read by
``loop.add_reader``, or a direct call in one process): no thread hop, no ZeroMQ message.

A slot is rewritten by publication ``tick + 2`` only after its writer has seen every peer's
publication ``tick + 1``, which each peer made after it finished reading publication
``tick``: no reader is still at it. A run usually waits for every peer's publication anyway;
one that waits for some only (a broadcast's non-root: the root's) leaves its tick ``loose``,
and the next publication waits for the rest first.

A waiter checks the flags it needs; only when one is missing does it mark itself asleep (a
word in its box's header), fence, check again and wait for ``on_wake``. A publisher sets its
flag, fences, and looks at every other rank's flag of this publication: if one is missing,
that rank publishes later and wakes the sleepers itself; else (it is the last) it wakes the
ranks marked asleep. With a fence between each store and the loads after it, the last
publisher sees every flag, and a sleeper's second look or that publisher sees the other's
store (Dekker's argument; the fence is a locked instruction): no wake-up is lost, each
sleeper gets at most one per publication (not one per peer), and a rank that is not
waiting gets none (no syscall, no event-loop callback). Wake-ups are level-triggered (a FIFO
byte stays until it is read).

A sub-communicator (``split``, ``new_group``) gets a mailbox of its own (``Mailbox.derive``):
new boxes (``offer``: one per member, made where the host's boxes are made, found by the
members through a small description), woken through the host's descriptors: a wake-up
reaches every mailbox of the woken rank (``woken`` fans out), and a waiter that finds its
flags still down simply sleeps again.
"""

from __future__ import annotations

import os
import platform
import threading
from collections.abc import Sequence
from typing import Any, Literal, Protocol

import numpy as np

from .._config import _float, usable_cores
from .._memcopy import copy
from ._wake import Waker

HEADER = 64  # bytes of a slot's header (a cache line): int64 flag and seq, uint32 fingerprint and size
SLOTS = 2  # one slot per sequence-number parity
# Payload bytes of a slot (AHCOMM_MAILBOX_BYTES; 0 turns mailboxes off). A call larger than a slot
# runs in slot-sized slices, each a publish-and-wait step: at 2 MiB the steps, not the copies (in
# cache), were the time. Measured with 1 MiB against 256 KiB slots (np=2, 3 interleaved rounds,
# load 1.5-3, us at 2 MiB): broadcast 96-524 vs 838-1215, all_reduce 340-970 vs 515-1916,
# all_gather 400-629 vs 333-876, reduce_scatter 612-873 vs 1097-2090 (results/2026-11-25-bw2.md).
DEFAULT_CAPACITY = 1 << 20
SPIN_US = 30.0  # microseconds a waiter may poll before it sleeps (AHCOMM_SPIN_US; only ranks <= cores)
YIELD_US = 200.0  # the same, yielding its core between looks (AHCOMM_YIELD_US; only cores < ranks <= 2 cores)


def stores_in_order() -> bool:
    """Whether this processor keeps stores, and loads, in program order (x86's TSO), as the
    mailboxes and the notify inboxes (``_notify_ring``) rely on."""
    return platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


def capacity_from_env() -> int:
    """Payload bytes per slot: AHCOMM_MAILBOX_BYTES (0: no mailboxes), rounded to 64 bytes.

    Mailboxes rely on the processor keeping stores and loads in order (``stores_in_order``);
    other architectures get none (the other algorithms run instead)."""
    if not stores_in_order():
        return 0
    raw = os.environ.get("AHCOMM_MAILBOX_BYTES", "").strip()
    try:
        value = int(raw) if raw else DEFAULT_CAPACITY
    except ValueError:
        from .._errors import ConfigError
        raise ConfigError(f"AHCOMM_MAILBOX_BYTES must be a number of bytes, got {raw!r}") from None
    return max(0, value) // 64 * 64


def box_bytes(capacity: int) -> int:
    """Bytes of one rank's box for slots of ``capacity`` payload bytes (the box's own header,
    then the slots)."""
    return HEADER + SLOTS * (HEADER + capacity)


_FENCE = threading.Lock()


def fence() -> None:
    """A full memory barrier: taking and releasing a lock is a locked read-modify-write (glibc's
    semaphore or mutex), which x86 never reorders a load across."""
    _FENCE.acquire()
    _FENCE.release()


def _micros(var: str, default: float) -> float:
    """Microseconds from ``var`` (0 or more; ``Config.from_env`` checks it at init too)."""
    return _float(os.environ, var, default, allow_zero=True)


def spin_budget(ranks: int) -> float:
    """Seconds a waiter may spin before it sleeps: AHCOMM_SPIN_US (default ``SPIN_US``), and 0
    where the host's ranks outnumber this process's cores (a spinning rank would keep a peer it
    waits for off its core)."""
    us = _micros("AHCOMM_SPIN_US", SPIN_US)
    return us * 1e-6 if ranks <= usable_cores() else 0.0


def yield_budget(ranks: int) -> float:
    """Seconds a waiter may look at its flags, giving its core away (``sched_yield``) between
    looks, before it sleeps: AHCOMM_YIELD_US (default ``YIELD_US``), only where the host's ranks
    outnumber the cores by at most 2x. There the peer a waiter waits for is often on the
    waiter's own core: the yield hands it the core at once, and the waiter sees the flag
    without a wake-up (FIFO, epoll, event-loop turn). Measured at 4 ranks on 2 cores: 8 B
    all_reduce p50 100-136 us against 300-380 sleeping, CPU per call 50-60 us against 100;
    at 6 and 8 ranks it did not help (8: 1.2-1.7x slower), so it is off there."""
    cores = usable_cores()
    return _micros("AHCOMM_YIELD_US", YIELD_US) * 1e-6 if cores < ranks <= 2 * cores else 0.0


def spin_policy(ranks: int) -> "Spin":
    """The waiters' policy for ``ranks`` on this host: a busy spin where every rank has a core,
    a yielding one where they share cores two to one, else none (sleep at once)."""
    budget = spin_budget(ranks)
    if budget:
        return Spin(budget)
    budget = yield_budget(ranks)
    return Spin(budget, yields=bool(budget))


class Spin:
    """A bounded, adaptive spin: up to ``budget`` seconds of polling before sleeping; after
    ``GIVE_UP`` spins in a row that found nothing, none for the next ``REST`` waits (the
    peers are slower than the budget: spinning would only burn CPU), then a new try.
    ``yields``: the waiter gives its core away (``sched_yield``) between looks."""

    GIVE_UP = 8
    REST = 256

    __slots__ = ("budget", "hits", "misses", "rest", "spins", "yields")

    def __init__(self, budget: float, yields: bool = False) -> None:
        self.budget = budget
        self.yields = yields  # give the core away (sched_yield) between looks
        self.misses = 0  # spins in a row that found nothing
        self.rest = 0  # waits left without spinning
        self.hits = 0  # spins that found every peer (counters, for the benchmark's report)
        self.spins = 0

    def allowed(self) -> float:
        """The seconds this wait may spin (0: sleep at once)."""
        if self.budget <= 0.0:
            return 0.0
        if self.rest:
            self.rest -= 1
            return 0.0
        return self.budget

    def result(self, found: bool) -> None:
        """A yielding spin weighs a miss as two hits (it rests once fewer than two looks in three
        find every peer: on a host busy with other work a yield hands the core to that work for
        a whole time slice, and sleeping, woken by the FIFO, was measured faster there)."""
        self.spins += 1
        if found:
            self.hits += 1
            self.misses = max(0, self.misses - 1) if self.yields else 0
        else:
            self.misses += 2 if self.yields else 1
            if self.misses >= self.GIVE_UP * (2 if self.yields else 1):
                self.misses, self.rest = 0, self.REST


def _words(region: np.ndarray, fmt: Literal["q", "I"]) -> "memoryview[int]":
    """``region`` (uint8) as a memoryview of ``fmt`` items (``q``: int64, ``I``: uint32)."""
    return region.data.cast("B").cast(fmt)


class Box(Protocol):
    """One box of a derived mailbox, as this rank holds it (made here, or a peer's mapped here)."""

    @property
    def array(self) -> np.ndarray: ...
    def describe(self) -> dict[str, Any]: ...  # how the members find it (msgpack-able)
    def unlink(self) -> None: ...  # every member holds it: its name may go
    def close(self) -> None: ...


class BoxStore(Protocol):
    """Where the boxes of derived mailboxes live: shared memory on a host, arrays in one process."""

    shared: bool  # in shared memory (a suspend releases it; else the ranks' objects share it)

    def create(self, nbytes: int) -> Box: ...
    def open(self, description: dict[str, Any], nbytes: int) -> Box: ...


class Mailbox:
    """This rank's view of the host's boxes: ``boxes[r]`` is rank r's (uint8, mapped here),
    ``wakers[r]`` wakes rank r (None for this rank). ``store``, where set, makes the boxes of
    derived mailboxes (``offer``, ``derive``)."""

    def __init__(self, rank: int, boxes: list[np.ndarray], wakers: list[Waker | None], capacity: int,
                 store: BoxStore | None = None) -> None:
        self.rank = rank
        self.store = store
        self._wakers = wakers
        self._children: list[Mailbox] = []  # derived mailboxes: woken through this one's descriptor
        self._parent: Mailbox | None = None
        self._owned: list[Box] = []  # a derived mailbox's peers' boxes (closed with it)
        self.own_box: Box | None = None  # a derived mailbox's box made here (``offer``; the caller closes it)
        self.size = len(boxes)
        self.capacity = capacity
        self.tick = 0  # publications so far (the same count on every rank: they publish in step)
        stride = HEADER + capacity
        # Header words as memoryviews: an item is a plain aligned load or store (a numpy scalar
        # access costs ten times more); the payloads stay numpy.
        self._asleep = [_words(box[:8], "q") for box in boxes]  # 1: its owner waits for a wake-up
        boxes = [box[HEADER:] for box in boxes]
        self._head = [[_words(box[s * stride:s * stride + 16], "q") for s in range(SLOTS)] for box in boxes]
        self._meta = [[_words(box[s * stride + 16:s * stride + 24], "I") for s in range(SLOTS)] for box in boxes]
        self._data = [[box[s * stride + HEADER:(s + 1) * stride] for s in range(SLOTS)] for box in boxes]
        self._peers = [(self._asleep[r], w) for r, w in enumerate(wakers) if r != rank and w is not None]
        self._others = [self._head[r] for r in range(self.size) if r != rank]
        self.wakes = 0  # wake-ups sent (the others found their peer awake)
        self.rechecks = 0  # looks a sleeping waiter took without a wake-up (oneshot's safety net)
        self.spin = spin_policy(self.size)
        self.on_wake: Waker | None = None  # set by whoever waits; called when a peer published
        # (tick, seq, fingerprint) of this rank's last publication whose run waited for some peers
        # only (a broadcast's non-root): every peer's must be seen before the next one (``publish``)
        self.loose: tuple[int, int, int] | None = None
        self.closed = False

    def publish(self, seq: int, fingerprint: int, data: np.ndarray | None = None,
                skip: tuple[int, int] | None = None) -> tuple[int, np.ndarray]:
        """Write ``data`` (any array of at most ``capacity`` bytes, strided too, or None: a header
        only) for collective ``seq`` into this rank's next slot, set its flag and wake every peer;
        returns (the publication's tick, the slot's payload as written). ``skip``: a [start, stop)
        range of ``data``'s first axis that no peer reads, left out of the copy (the slot's bytes
        there are stale)."""
        assert self.loose is None, "a loose publication is settled first (algorithms._mailbox_sync.publish)"
        assert skip is None or (data is not None and data.ndim >= 1), "skip is a range of data's first axis"
        tick = self.tick
        self.tick = tick + 1
        slot = tick & 1
        payload = self._data[self.rank][slot]
        nbytes = 0
        if data is not None:
            nbytes = data.nbytes
            if nbytes > self.capacity:
                raise ValueError(f"mailbox: {nbytes} bytes do not fit a slot of {self.capacity}")
            if nbytes:
                view = payload[:nbytes].view(data.dtype).reshape(data.shape)
                if skip is None:
                    copy(view, data)
                else:
                    copy(view[:skip[0]], data[:skip[0]])
                    copy(view[skip[1]:], data[skip[1]:])
        meta = self._meta[self.rank][slot]
        meta[0] = fingerprint
        meta[1] = nbytes
        head = self._head[self.rank][slot]
        head[1] = seq
        head[0] = tick + 1  # last: the flag
        fence()  # the flag, before we look at the others' (``sleep`` does the mirror image)
        flag = tick + 1
        for heads in self._others:
            if heads[slot][0] != flag:
                return tick, payload[:nbytes]  # a later publisher wakes the sleepers
        for asleep, wake in self._peers:
            if asleep[0]:
                self.wakes += 1
                wake()
        return tick, payload[:nbytes]

    def sleep(self) -> None:
        """About to wait for a wake-up: from now on publishers wake this rank. The caller
        checks the flags once more after this (Dekker: a publisher either sees this rank
        asleep, or this rank sees its flag)."""
        self._asleep[self.rank][0] = 1
        fence()

    def awake(self) -> None:
        """Done waiting: publishers need not wake this rank."""
        self._asleep[self.rank][0] = 0

    def arrived(self, owner: int, tick: int) -> tuple[int, int] | None:
        """(seq, fingerprint) of ``owner``'s publication ``tick``; None while it has not made it."""
        slot = tick & 1
        head = self._head[owner][slot]
        if head[0] != tick + 1:
            return None
        return head[1], self._meta[owner][slot][0]

    def payload(self, owner: int, tick: int) -> np.ndarray:
        """The bytes of ``owner``'s publication ``tick`` (uint8; read only after ``arrived``)."""
        slot = tick & 1
        return self._data[owner][slot][:self._meta[owner][slot][1]]

    def woken(self) -> None:
        """Called by the wake-up descriptor's reader (or a peer in this process); every derived
        mailbox hears it too (the rank's descriptor is shared: a waiter not concerned looks at
        its flags and sleeps again)."""
        if self.on_wake is not None:
            self.on_wake()
        for child in self._children:
            child.woken()

    # -- derived mailboxes (sub-communicators) --------------------------------------------------
    def offer(self) -> Box | None:
        """This rank's box for a derived mailbox (None: no store here); its ``describe()``
        goes to the other members, then ``derive``."""
        return self.store.create(box_bytes(self.capacity)) if self.store is not None else None

    def derive(self, members: Sequence[int], mine: Box, descriptions: Sequence[dict[str, Any]]) -> "Mailbox":
        """The mailbox of the sub-communicator of ``members`` (ranks of this one, in its order):
        ``mine`` from ``offer``, ``descriptions[i]`` member i's ``describe()``. Woken through
        this one's descriptors; ``close`` unmaps the peers' boxes (``mine`` stays the caller's)."""
        assert self.store is not None
        nbytes = box_bytes(self.capacity)
        opened: list[Box] = []
        boxes: list[np.ndarray] = []
        try:
            for p, desc in zip(members, descriptions, strict=True):
                if p == self.rank:
                    boxes.append(mine.array)
                else:
                    opened.append(self.store.open(desc, nbytes))
                    boxes.append(opened[-1].array)
        except BaseException:
            for box in opened:
                box.close()
            raise
        child = Mailbox(list(members).index(self.rank), boxes, [self._wakers[p] for p in members], self.capacity,
                        self.store)
        child.spin = Spin(self.spin.budget, self.spin.yields)  # the host's ranks and cores decide, not the group's
        child._parent, child._owned, child.own_box = self, opened, mine
        self._children.append(child)
        return child

    @property
    def derived_in_shared_memory(self) -> bool:
        """Made by ``derive`` (a sub-communicator's) in shared memory: it goes when the mailbox
        it came from is closed (a parent's suspend), so a suspend releases it with its own box."""
        return self.own_box is not None and self.store is not None and self.store.shared

    def close(self) -> None:
        """No more wake-ups for this mailbox and every one derived from it, their views dropped;
        a derived one unmaps its peers' boxes (the host's boxes are closed by their maker)."""
        self.closed = True
        self.on_wake = None
        for child in list(self._children):
            child.close()
        if self._parent is not None and self in self._parent._children:
            self._parent._children.remove(self)
        self._asleep, self._head, self._meta, self._data, self._others, self._peers = [], [], [], [], [], []
        owned, self._owned = self._owned, []
        for box in owned:
            box.close()


class _ArrayBox:
    """A box in plain memory, found by the other ranks of the process by its token."""

    def __init__(self, store: "_ArrayStore", token: int, array: np.ndarray) -> None:
        self.store, self.token, self.array = store, token, array

    def describe(self) -> dict[str, Any]:
        return {"token": self.token}

    def unlink(self) -> None:
        self.store.boxes.pop(self.token, None)

    def close(self) -> None:
        self.unlink()


class _ArrayStore:
    """Derived boxes of ranks that share one process."""

    shared = False

    def __init__(self) -> None:
        self.boxes: dict[int, np.ndarray] = {}
        self.tokens = 0

    def create(self, nbytes: int) -> Box:
        self.tokens += 1
        self.boxes[self.tokens] = array = np.zeros(nbytes, np.uint8)
        return _ArrayBox(self, self.tokens, array)

    def open(self, description: dict[str, Any], nbytes: int) -> Box:
        array = self.boxes[int(description["token"])]
        assert array.nbytes == nbytes
        return _ArrayBox(self, -1, array)


class InprocMailboxes:
    """Mailboxes of ranks that share one event loop (tests): wakes are direct calls."""

    def __init__(self, size: int, capacity: int = DEFAULT_CAPACITY) -> None:
        boxes = [np.zeros(box_bytes(capacity), np.uint8) for _ in range(size)]
        self.boxes: list[Mailbox] = []
        wakers: list[Waker | None] = [lambda r=r: self.boxes[r].woken() for r in range(size)]  # type: ignore[misc]
        store = _ArrayStore()
        self.boxes = [Mailbox(r, boxes, [None if p == r else wakers[p] for p in range(size)], capacity, store)
                      for r in range(size)]
        for box in self.boxes:
            box.spin = Spin(0.0)  # one event loop: a spinning rank would keep its peers from running

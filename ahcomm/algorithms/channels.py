"""Channels: point-to-point transfers inside one run, through the receivers' CCL_In.

The building block of the catalogue's step-wise algorithms (tree, RHD, NHR, Bruck,
pairwise): each step sends a block to one peer and receives a block from another, of any
size, on any link kind. It is HCCL's link handshake, pipelined:

* the receiver's CCL_In half is cut into one region per possible sender (region of sender
  ``s`` at receiver ``r``: ``(s - r - 1) mod n``; with ``Senders``, one per rank that sends
  to ``r`` in this run) and each region into ``slots`` slots;
* a send cuts its block into pieces of at most one slot; piece ``k`` on a link goes to slot
  ``k mod slots`` (put, then DataSignal(slot)); from the ``slots``-th piece on, the sender
  first waits for the receiver's Ack(slot) (credit) for the piece that used the slot before;
* a receive waits for DataSignal(slot), copies (or reduces) the piece out of the slot, and
  posts Ack(slot) back.

Both sides cut a block the same way, so ``recv(..., done=[K])`` and ``send(..., after=K)`` of
the same block pipeline piece by piece: piece ``i`` is forwarded once it has landed (local
notify ``(K, i)``). A block forwarded to several peers names one key per send in ``done``
(a notify is waited once). Keep every send to one peer on one stream, and every receive from one
peer on one stream, within a run. ``finish()`` collects the outstanding credits, so that
every flag is back at 0 when the run ends (the framework's protocol rule): call it after
the last send and before ``ctx.synchronize()``.

Blocks of the same (sender, receiver) pair are received in the order they are sent. Zero-
length blocks move nothing (both sides skip them). A block's source must stay unchanged
until its receiver has it (RDMA-like links send large pieces zero-copy): rewrite it only in
a task that depends on what the receiver sent back (a later step), never in the same step.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence

import numpy as np

from .._errors import ConfigError
from .._stream import Stream
from ..transports.base import Signal
from .base import Context, OpRun, aligned
from .cost import HALF_BYTES

SLOTS = 4  # credits per (sender, receiver) pair: pieces in flight on one link
PIECE_BYTES = 1 << 20  # largest piece: small enough to pipeline a step, big enough to amortise a notify


def channel_piece(n: int, half_bytes: int = HALF_BYTES) -> int:
    """The largest piece ``Channels`` sends on ``n`` ranks: a slot of the sender's region at the
    receiver (``half_bytes / (n - 1) / SLOTS``), at most ``PIECE_BYTES``: 8 KiB at 1,024 ranks
    with the default buffers, so costs that count pieces must not assume ``PIECE_BYTES``."""
    return max(64, min(PIECE_BYTES, half_bytes // max(1, n - 1) // SLOTS))


class Senders:
    """Who sends to whom in a run, where that is fewer than every peer: the receiver's CCL_In
    half is then cut into ``regions`` regions only (sender ``s`` at receiver ``r``: region
    ``index[r][s]``), so pieces are larger (at 4,096 ranks hier all_reduce's ranks hear from
    about 17 peers: 460 KiB slots where 4,095 regions gave 2 KiB). Every rank of the run must
    build the same ``Senders`` (a function of the topology and the call)."""

    __slots__ = ("index", "regions")

    def __init__(self, senders: Sequence[Iterable[int]]) -> None:
        self.index: list[dict[int, int]] = [{s: i for i, s in enumerate(sorted(set(ss)))} for ss in senders]
        self.regions = max(1, max((len(ix) for ix in self.index), default=1))


class Channels:
    """Sends and receives of one run (one collective, one slice); with ``senders``, the CCL_In
    regions go to the peers that send to each rank, not to all of them."""

    def __init__(self, ctx: Context, *, piece_bytes: int = PIECE_BYTES, senders: Senders | None = None) -> None:
        self.ctx = ctx
        self.senders = senders
        n, item = ctx.size, ctx.call.itemsize
        regions = senders.regions if senders is not None else n - 1
        region = aligned(ctx.ccl_in.nbytes // max(1, regions), item)
        unit = aligned(max(64, item), item) or item
        self.slots = min(SLOTS, region // unit) if unit else 0
        if self.slots < 1:
            raise ConfigError(f"AHCOMM_BUFFSIZE is too small for {ctx.call.op} on {n} ranks: a CCL_In half of "
                              f"{ctx.ccl_in.nbytes} bytes cannot give {n - 1} peers a slot of {unit} bytes")
        self.region_bytes = region
        self.slot_bytes = aligned(region // self.slots, item)
        self.step = max(1, min(self.slot_bytes, piece_bytes) // item)  # elements per piece
        self._sent: dict[int, int] = {}  # pieces sent to each peer so far in this run
        self._received: dict[int, int] = {}
        self._tx: dict[int, Stream] = {}  # the stream that sends to each peer

    def _region(self, sender: int, receiver: int) -> int:
        if self.senders is not None:
            index = self.senders.index[receiver].get(sender)
            if index is None:
                raise RuntimeError(f"Channels: rank {sender} is not one of rank {receiver}'s senders in this run")
            return index * self.region_bytes
        return ((sender - receiver - 1) % self.ctx.size) * self.region_bytes

    def pieces(self, count: int) -> list[tuple[int, int]]:
        """How a block of ``count`` elements is cut: [start, stop) ranges (none if empty)."""
        return [(a, min(a + self.step, count)) for a in range(0, count, self.step)]

    def send(self, stream: Stream, peer: int, src: np.ndarray, *, after: Hashable | None = None) -> None:
        """Enqueue on ``stream``: send ``src`` (1-D, contiguous) to ``peer``.

        With ``after``, piece ``i`` first waits for the local notify ``(after, i)``.
        """
        ctx = self.ctx
        if self._tx.setdefault(peer, stream) is not stream:
            raise RuntimeError(f"Channels: sends to rank {peer} must stay on one stream")
        base = self._region(ctx.rank, peer)
        k = self._sent.get(peer, 0)
        for i, (a, b) in enumerate(self.pieces(src.size)):
            if after is not None:
                stream.wait(ctx.local((after, i)))
            slot = k % self.slots
            if k >= self.slots:
                ctx.wait(stream, peer, Signal.ACK, slot)
            ctx.put(stream, peer, src[a:b], "in", base + slot * self.slot_bytes)
            ctx.post(stream, peer, Signal.DATA, slot)
            k += 1
        self._sent[peer] = k

    def recv(self, stream: Stream, peer: int, dst: np.ndarray, *, reduce_with: np.ndarray | None = None,
             done: Sequence[Hashable] = ()) -> None:
        """Enqueue on ``stream``: receive ``dst.size`` elements from ``peer`` into ``dst``.

        With ``reduce_with``, ``dst = ufunc(reduce_with, landed)`` (``reduce_with`` may be
        ``dst``). For each key ``K`` in ``done`` the local notify ``(K, i)`` is posted once
        piece ``i`` is in.
        """
        ctx = self.ctx
        base = self._region(peer, ctx.rank)
        k = self._received.get(peer, 0)
        for i, (a, b) in enumerate(self.pieces(dst.size)):
            slot = k % self.slots
            ctx.wait(stream, peer, Signal.DATA, slot)
            landed = ctx.typed(ctx.ccl_in, base + slot * self.slot_bytes, b - a)
            if reduce_with is None:
                stream.copy(dst[a:b], landed)
            else:
                assert ctx.ufunc is not None, "a reducing receive needs a reduce op"
                stream.reduce(ctx.ufunc, dst[a:b], reduce_with[a:b], landed)
            ctx.post(stream, peer, Signal.ACK, slot)
            for key in done:
                stream.post(ctx.local((key, i)))
            k += 1
        self._received[peer] = k

    def finish(self) -> None:
        """Enqueue the waits for the credits still out, each on the stream that sent."""
        for peer, sent in self._sent.items():
            for k in range(max(0, sent - self.slots), sent):
                self.ctx.wait(self._tx[peer], peer, Signal.ACK, k % self.slots)


def channel_run(plan: Callable[[Context, Channels], None]) -> OpRun:
    """An op's run (for ``Algorithm.runs``) that enqueues ``plan(ctx, channels)``, collects the
    credits still out and waits for the run's streams."""

    async def run(algorithm: object, ctx: Context) -> None:
        channels = Channels(ctx)
        plan(ctx, channels)
        channels.finish()
        await ctx.synchronize()

    return run


class Lane:
    """Sends on ``tx`` and receives on ``rx`` through ``ch``, forwarding as data lands: a send
    from an array waits, piece by piece, for exactly the pieces of this lane's earlier
    receives into that same array that it overlaps."""

    def __init__(self, ctx: Context, ch: Channels, tx: Stream, rx: Stream, tag: object) -> None:
        self.ctx, self.ch, self.tx, self.rx, self.tag = ctx, ch, tx, rx, tag
        self._landed: list[tuple[np.ndarray, int, int]] = []
        self._waited: set[tuple[int, int]] = set()

    def send(self, peer: int, arr: np.ndarray, lo: int, hi: int) -> None:
        """Send ``arr[lo:hi]`` (a flat array) to ``peer``, each piece once its data is in."""
        step = self.ch.step
        for a in range(lo, hi, step):
            b = min(a + step, hi)
            for key in self._needed(arr, a, b):
                self.tx.wait(self.ctx.local(key))
            self.ch.send(self.tx, peer, arr[a:b])

    def recv(self, peer: int, arr: np.ndarray, lo: int, hi: int, operand: np.ndarray | None = None) -> None:
        """Receive ``arr[lo:hi]`` from ``peer``; with ``operand`` (same length): reduce with it."""
        key = len(self._landed)
        self._landed.append((arr, lo, hi))
        self.ch.recv(self.rx, peer, arr[lo:hi], reduce_with=operand, done=[("lane", self.tag, key)])

    def _needed(self, arr: np.ndarray, a: int, b: int) -> Iterator[tuple[tuple[str, object, int], int]]:
        step = self.ch.step
        for key, (into, lo, hi) in enumerate(self._landed):
            if into is not arr or hi <= a or b <= lo:
                continue
            for i in range((max(a, lo) - lo) // step, (min(b, hi) - 1 - lo) // step + 1):
                if (key, i) not in self._waited:
                    self._waited.add((key, i))
                    yield ("lane", self.tag, key), i

"""Retiring a collective that was rejected after it took its sequence number (a part of ``Health``).

A call is rejected after it took its number when a check can only run once its turn comes
(``out=`` or ``algorithm=`` of an uneven collective whose counts are exchanged first, rows of
different sizes across ranks) or when only some ranks can make it (a root-only argument:
``_collectives``' ``_reject``). Nothing was sent for it, so the rank *retires* the number: the caller
gets the error, the peers are told that this rank is past it (their next collective on the
same CCL buffer half no longer waits for it) and that it was rejected and why.

Where every rank rejects the call the communicator stays usable: the next collective meets
its twin. Where some rank runs it instead (it passed the check there), the ranks disagree
about the call and the communicator fails on every rank with ``CollectiveMismatchError``
naming the rank that rejected it and its error. Either rank may notice first: the one that
ran it when the rejection notice arrives (or before it starts the call), the one that
rejected it when a signal of the other's run arrives (or had arrived).
"""

from __future__ import annotations

from typing import Any, Protocol

from ._core import CommState
from ._errors import CollectiveMismatchError
from .algorithms._executor import Executor
from .algorithms.base import Call

MAX_RETIRED = 256  # rejected calls remembered here (peers are never more than 2 collectives apart)


class Failing(Protocol):
    """What ``Retirement`` uses of ``Health`` (its owner)."""

    @property
    def final(self) -> BaseException | None: ...
    @property
    def early(self) -> dict[int, list[tuple[int, int]]]: ...

    def name(self, rank: int) -> str: ...
    def record(self, reason: str) -> tuple[str, str | None]: ...
    def fail(self, error: BaseException, *, tell: tuple[str, str] | None = None, record: bool = True,
             extra: dict[str, Any] | None = None) -> None: ...
    def send_all(self, msg: dict[str, Any]) -> None: ...


class Retirement:
    """Rejected calls' sequence numbers: retire them here, agree with the peers about them."""

    def __init__(self, comm: CommState, executor: Executor, health: Failing) -> None:
        self._comm = comm
        self._executor = executor
        self._health = health
        self.mine: dict[int, tuple[str, str]] = {}  # seq -> (op, error) of calls rejected here
        # seq -> (peer, op, error, whether it had started the run) for calls not reached here yet
        self.peers: dict[int, tuple[int, str, str, bool]] = {}

    def retire(self, call: Call, exc: BaseException) -> None:
        """``call`` was rejected here before anything was sent (its caller has ``exc``): tell the peers."""
        seq = call.seq
        if self._comm.size == 1:
            return
        text = f"{type(exc).__name__}: {exc}"
        if len(self.mine) >= MAX_RETIRED:
            del self.mine[min(self.mine)]
        self.mine[seq] = (call.op, text)
        # rejected by the executor (the algorithm's resources): on every rank alike
        ran = self._comm._started_seq >= seq
        self._health.send_all({"t": "ret", "seq": seq, "op": call.op, "msg": text[:4000], "ran": ran})
        for link in self._executor.links.values():
            try:
                link.send_progress(seq + 1)  # done with seq: its CCL buffer half is free
            except Exception:  # noqa: BLE001 - a broken link is reported by the transport
                pass
        early = self._health.early.pop(seq, None)
        if early:  # a peer's signal for this call arrived already: it runs it
            self._disagree(seq, call.op, self._comm.rank, text, early[0][0])
        else:
            self.peers.pop(seq, None)  # it rejected it too: agreed

    def on_retired(self, peer: int, msg: dict[str, Any]) -> None:
        """``peer`` rejected its call ``seq`` (a control message)."""
        seq, op, text = int(msg["seq"]), str(msg.get("op", "collective")), str(msg.get("msg", ""))
        ran = bool(msg.get("ran"))
        if self._health.final is not None or seq in self.mine:
            return
        if seq <= self._comm._done_seq or (seq <= self._comm._started_seq and not ran):  # this rank runs (or ran) it
            self._disagree(seq, op, peer, text, self._comm.rank)
        elif len(self.peers) < MAX_RETIRED:  # checked when this rank starts it, or agreed when it rejects it
            self.peers[seq] = (peer, op, text, ran)

    def retired_elsewhere(self, seq: int) -> None:
        """Called before this rank starts its call ``seq`` when a peer rejected that call."""
        peer, op, text, _ = self.peers.pop(seq)
        self._disagree(seq, op, peer, text, self._comm.rank)

    def ran_retired(self, peer: int, seq: int) -> bool:
        """A signal of ``peer``'s call ``seq`` arrived: if this rank rejected that call, they disagree."""
        got = self.mine.get(seq)
        if got is None:
            return False
        self._disagree(seq, got[0], self._comm.rank, got[1], peer)
        return True

    def _disagree(self, seq: int, op: str, rejected: int, text: str, called: int) -> None:
        if self._health.final is not None:
            return
        name = self._health.name
        message = (f"{op} #{seq} mismatch: {name(rejected)} rejected it ({text}), {name(called)} "
                   f"called it; the communicator is now unusable")
        suffix, path = self._health.record(message)
        error = CollectiveMismatchError(message + suffix, seq=seq, ranks=tuple(sorted((rejected, called))))
        error.flight_record = path
        self._health.fail(error, tell=("mismatch", message), record=False)

"""Retiring a collective that was rejected after it took its sequence number (a mixin of ``Comm``).

A call is rejected after it took its number when a check can only run once its turn comes
(``out=`` or ``algorithm=`` of an uneven collective whose counts are exchanged first, rows of
different sizes across ranks) or when only some ranks can make it (a root-only argument:
``Comm._reject``). Nothing was sent for it, so the rank *retires* the number: the caller
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

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from ._collectives import retrieved
from ._errors import CollectiveMismatchError, UsageError
from ._health import _pack
from .algorithms.base import Call

if TYPE_CHECKING:
    from ._comm import _Job
    from ._flight import Entry
    from .algorithms._executor import Executor

MAX_RETIRED = 256  # rejected calls remembered here (peers are never more than 2 collectives apart)


class Retirement:
    """Rejected calls' sequence numbers: retire them here, agree with the peers about them."""

    rank: int
    size: int

    if TYPE_CHECKING:
        _executor: Executor
        _final: BaseException | None
        _error: BaseException | None
        _started_seq: int
        _done_seq: int
        _early: dict[int, list[tuple[int, int]]]

        _seq: int
        _closed: bool

        def _name(self, rank: int) -> str: ...
        def _submit(self, call: Call, src: np.ndarray, dst: np.ndarray, result: Any,
                    finish: Callable[[], None] | None, algorithm: str | None, *,
                    prepare: Callable[[_Job], None] | None = None,
                    later: bool = False, timeout: float | None = None) -> asyncio.Future[Any]: ...
        def _record(self, reason: str) -> tuple[str, str | None]: ...
        def _fail(self, error: BaseException, *, tell: tuple[str, str] | None = None, record: bool = True,
                  extra: dict[str, Any] | None = None) -> None: ...
        @staticmethod
        def _mark(entry: Entry, exc: BaseException) -> None: ...

    def _retire_init(self) -> None:
        self._retired: dict[int, tuple[str, str]] = {}  # seq -> (op, error) of calls rejected here
        # seq -> (peer, op, error, whether it had started the run) for calls not reached here yet
        self._peer_retired: dict[int, tuple[int, str, str, bool]] = {}

    def _reject(self, op: str, exc: UsageError, root: int = 0) -> UsageError:
        """``exc`` is a check that only some ranks can make (a root-only argument, this rank's
        own rows): the call still takes its sequence number here and is retired in its turn,
        so every rank agrees about it. Returns ``exc`` for the caller to raise."""
        if self.size > 1 and self._error is None and not self._closed:
            empty = np.empty(0, np.uint8)

            def rejected(job: _Job) -> None:
                raise exc

            call = Call(op=op, seq=self._seq, dtype=empty.dtype, count=0, root=int(root))
            done = self._submit(call, empty, empty, None, None, None, prepare=rejected, later=True)
            done.add_done_callback(retrieved)  # the caller gets exc at once
        return exc

    def _retire(self, job: _Job, exc: BaseException) -> None:
        """``job`` was rejected here before anything was sent: give the caller ``exc``, tell the peers."""
        call = job.call
        seq = call.seq
        if job.entry is not None:
            self._mark(job.entry, exc)
        if not job.future.done():
            job.future.set_exception(exc)
        if self.size == 1:
            return
        text = f"{type(exc).__name__}: {exc}"
        if len(self._retired) >= MAX_RETIRED:
            del self._retired[min(self._retired)]
        self._retired[seq] = (call.op, text)
        ran = self._started_seq >= seq  # rejected by the executor (the algorithm's resources): on every rank alike
        notice = _pack({"t": "ret", "seq": seq, "op": call.op, "msg": text[:4000], "ran": ran})
        for peer, link in self._executor.links.items():
            self._executor.send_control(peer, notice)
            try:
                link.send_progress(seq + 1)  # done with seq: its CCL buffer half is free
            except Exception:  # noqa: BLE001 - a broken link is reported by the transport
                pass
        early = self._early.pop(seq, None)
        if early:  # a peer's signal for this call arrived already: it runs it
            self._disagree(seq, call.op, self.rank, text, early[0][0])
        else:
            self._peer_retired.pop(seq, None)  # it rejected it too: agreed

    def _on_retired(self, peer: int, msg: dict[str, Any]) -> None:
        """``peer`` rejected its call ``seq`` (a control message)."""
        seq, op, text = int(msg["seq"]), str(msg.get("op", "collective")), str(msg.get("msg", ""))
        ran = bool(msg.get("ran"))
        if self._final is not None or seq in self._retired:
            return
        if seq <= self._done_seq or (seq <= self._started_seq and not ran):  # this rank runs (or ran) it
            self._disagree(seq, op, peer, text, self.rank)
        elif len(self._peer_retired) < MAX_RETIRED:  # checked when this rank starts it, or agreed when it rejects it
            self._peer_retired[seq] = (peer, op, text, ran)

    def _retired_elsewhere(self, seq: int) -> None:
        """Called before this rank starts its call ``seq`` when a peer rejected that call."""
        peer, op, text, _ = self._peer_retired.pop(seq)
        self._disagree(seq, op, peer, text, self.rank)

    def _ran_retired(self, peer: int, seq: int) -> bool:
        """A signal of ``peer``'s call ``seq`` arrived: if this rank rejected that call, they disagree."""
        got = self._retired.get(seq)
        if got is None:
            return False
        self._disagree(seq, got[0], self.rank, got[1], peer)
        return True

    def _disagree(self, seq: int, op: str, rejected: int, text: str, called: int) -> None:
        if self._final is not None:
            return
        message = (f"{op} #{seq} mismatch: {self._name(rejected)} rejected it ({text}), {self._name(called)} "
                   f"called it; the communicator is now unusable")
        suffix, path = self._record(message)
        error = CollectiveMismatchError(message + suffix, seq=seq, ranks=tuple(sorted((rejected, called))))
        error.flight_record = path
        self._fail(error, tell=("mismatch", message), record=False)

"""The communicator's health: mismatch detection, timeouts, the control protocol between
ranks, failure handling and diagnosis (see ``_comm``'s docstring).

``Health`` is a component of ``Comm``: it owns the failure state (the first error and the
final verdict, the fingerprints of unfinished calls, the jobs held while a diagnosis runs,
the watchdog, the requests to peers) and reads the communicator through ``CommState``,
a read-only view (``_core``). Rejected calls are ``Retirement``'s (``_retire``), a part of it.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Coroutine
from typing import Any

from ._control import Requests, unpack
from ._core import CommState, Job, cancel_and_wait
from ._errors import (
    AhcommError,
    CollectiveMismatchError,
    CollectiveTimeout,
    PeerFailure,
    TransportError,
    UsageError,
)
from ._flight import Entry, FlightRecorder, describe
from ._retire import Retirement
from ._watchdog import Watchdog
from .algorithms._executor import Executor
from .algorithms.base import Call

NOTICE_WAIT = 0.1  # seconds a failing rank waits for its notice to reach the peers before raising
REPLY_WAIT = 1.0  # seconds to wait for peers' answers (a call's description, where they stand)
MAX_EARLY = 4096  # fingerprints kept for calls not issued here yet (bounded: peers run <= 2 ahead)

def mark(entry: Entry, exc: BaseException) -> None:
    """Mark a flight-recorder entry as failed with ``exc``."""
    entry.state, entry.error = "failed", f"{type(exc).__name__}: {exc}"[:300]
    entry.ended = entry.ended or time.monotonic()


class Health:
    """Mismatch detection, timeouts, control messages, failures and diagnosis of one communicator."""

    def __init__(self, comm: CommState, executor: Executor, flight: FlightRecorder) -> None:
        self._comm = comm
        self._executor = executor
        self._flight = flight
        self.error: BaseException | None = None  # set when the communicator stops (first failure)
        self.final: BaseException | None = None  # the error every call gets (None while diagnosing)
        self.fps: dict[int, int] = {}  # seq -> fingerprint of this rank's unfinished calls (0: not known yet)
        self.early: dict[int, list[tuple[int, int]]] = {}  # seq -> [(peer, fingerprint)] not checkable yet
        self.held: list[Job] = []  # jobs that failed while a diagnosis runs: they get its verdict
        self.diagnosis: asyncio.Task[None] | None = None
        self.notice: asyncio.Task[None] | None = None  # waits for the peers to acknowledge the failure notice
        self.undelivered: list[tuple[asyncio.Future[Any], BaseException]] = []  # errors held until then
        self.control = Requests(executor)  # control messages to the peers, replies awaited
        self.watchdog = Watchdog(comm, self)  # probes long collectives, times out overdue ones
        self.retired = Retirement(comm, executor, self)

    # -- mismatch detection -----------------------------------------------------------------
    def on_fingerprint(self, peer: int, seq: int, fp: int) -> None:
        """Every signal a peer posts: is its call ``seq`` ours? (the hot path: one dict lookup)"""
        if self.fps.get(seq) != fp:
            try:
                self._fingerprint_differs(peer, seq, fp)
            except Exception:  # noqa: BLE001 - never break the transport's reader
                pass

    def _fingerprint_differs(self, peer: int, seq: int, fp: int) -> None:
        mine = self.fps.get(seq)
        if mine is None and seq < self._comm._seq:  # finished here (or failed): the flight record knows it
            if self.retired.ran_retired(peer, seq):  # it was rejected here
                return
            entry = self._flight.find(seq)
            if entry is None or not entry.call._fp:
                return  # too old to check, or never prepared
            mine = entry.call._fp
            if mine == fp:
                return
        elif not mine:  # not issued here yet, or its counts are not known yet: check it then
            if sum(len(v) for v in self.early.values()) < MAX_EARLY:
                self.early.setdefault(seq, []).append((peer, fp))
            return
        self._mismatch(peer, seq, fp)

    def register(self, seq: int, fp: int) -> None:
        """This rank's call ``seq`` has fingerprint ``fp``: check what peers sent for it already."""
        self.fps[seq] = fp
        if self.early:
            for peer, theirs in self.early.pop(seq, ()):
                if theirs != fp:
                    self._mismatch(peer, seq, theirs)
                    return

    def _call_for(self, seq: int) -> Call | None:
        entry = self._flight.find(seq)
        if entry is not None:
            return entry.call
        for job in (self._comm._running, *self.held, *self._comm._queue):
            if job is not None and job.call.seq == seq:
                return job.call
        return None

    def _mismatch(self, peer: int, seq: int, theirs: int) -> None:
        if self.error is not None or self._comm._closed:
            return
        call = self._call_for(seq)
        mine = describe(call) if call is not None else "an unknown collective"
        op = call.op if call is not None else "collective"
        text = (f"{op} #{seq} mismatch: {self.name(self._comm.rank)} called {mine}, {self.name(peer)} called a "
                f"different collective (fingerprint {theirs:#010x})")
        error = CollectiveMismatchError(text, seq=seq, ranks=tuple(sorted((self._comm.rank, peer))))
        self.freeze(error, self._diagnose_mismatch(peer, seq, theirs, call))

    async def _diagnose_mismatch(self, peer: int, seq: int, theirs: int,
                                 call: Call | None) -> tuple[BaseException, tuple[str, str]]:
        reply = await self.control.ask(peer, {"t": "desc?", "seq": seq}, REPLY_WAIT)
        mine = describe(call) if call is not None else "an unknown collective"
        my_op = call.op if call is not None else None
        if reply is not None and reply.get("desc"):
            other, other_op = str(reply["desc"]), reply.get("op")
        else:
            other, other_op = (f"a different collective (fingerprint {theirs:#010x}; it did not describe it "
                               f"within {REPLY_WAIT:g} s)"), None
        sides = sorted([(self._comm.rank, mine), (peer, other)])
        name = my_op if my_op is not None and other_op == my_op else "collective"
        text = f"{name} #{seq} mismatch: " + ", ".join(f"{self.name(r)} called {d}" for r, d in sides)
        their_algo = str(reply.get("algo") or "") if reply is not None else ""
        if other == mine and call is not None and their_algo and their_algo != call.algorithm:
            ours = sorted([(self._comm.rank, call.algorithm), (peer, their_algo)])
            text += " with different algorithms (" + ", ".join(f"{self.name(r)} runs {a}" for r, a in ours) + \
                    "; pass the same algorithm= or AHCOMM_ALGO on every rank)"
        elif other == mine:
            text += f" (fingerprints {call._fp if call else 0:#010x} and {theirs:#010x} differ)"
        suffix, path = self.record(text)
        error = CollectiveMismatchError(text + suffix, seq=seq, ranks=tuple(r for r, _ in sides))
        error.flight_record = path
        return error, ("mismatch", text)

    # -- control messages -------------------------------------------------------------------
    def on_control(self, peer: int, payload: bytes) -> None:
        if self._comm._closed:
            return
        try:
            msg = unpack(payload)
            if msg is None:
                return
            kind = msg.get("t")
            if kind == "fp":
                self.on_fingerprint(peer, int(msg["seq"]), int(msg["fp"]))
            elif kind == "re":
                self.control.replied(msg)
            elif kind == "desc?":
                call = self._call_for(int(msg["seq"]))
                desc = ({"op": call.op, "desc": describe(call), "algo": call.algorithm} if call is not None
                        else {"desc": None})
                self.control.reply(peer, msg, desc)
            elif kind == "st?":
                self.control.reply(peer, msg, self._status())
            elif kind == "fail":
                if "id" in msg:  # acknowledged on arrival: the sender may now raise (and exit)
                    self.control.reply(peer, msg, {})
                self._told(peer, msg)
            elif kind == "ret":
                self.retired.on_retired(peer, msg)
        except Exception:  # noqa: BLE001 - a malformed message must not break the transport's reader
            pass

    def send_all(self, msg: dict[str, Any]) -> None:
        """Send the control message ``msg`` to every peer."""
        self.control.send_all(msg)

    def _status(self) -> dict[str, Any]:
        job = self._comm._running
        last = self._call_for(self._comm._seq - 1) if self._comm._seq else None
        return {
            "next": self._comm._seq, "running": job.call.seq if job is not None else -1,
            "running_op": job.call.op if job is not None else None,
            "algorithm": job.algorithm.name if job is not None and job.algorithm is not None else None,
            "started": self._comm._started_seq, "done": self._comm._done_seq, "queued": len(self._comm._queue),
            "last_op": last.op if last is not None else None,
            "failed": str(self.error) if self.error is not None else None,
        }

    # -- failures ---------------------------------------------------------------------------
    @property
    def diagnosing(self) -> bool:
        """A failure is being diagnosed: ``error`` is set, its verdict (``final``) is on its way."""
        return self.error is not None and self.final is None and self.diagnosis is not None \
            and not self.diagnosis.done()

    def freeze(self, error: BaseException,
                diagnosis: "Coroutine[Any, Any, tuple[BaseException, tuple[str, str]]]") -> None:
        """Stop at once (nothing more runs, no result is delivered) and diagnose; the verdict
        fails every pending call and is sent to the peers."""
        if self.error is not None:
            diagnosis.close()
            return
        self.error = error
        self._executor.abort(error)
        assert self._comm._loop is not None
        self.diagnosis = self._comm._loop.create_task(self._settle(error, diagnosis),
                                                      name=f"ahcomm-diagnosis-{self._comm.rank}")

    async def _settle(self, error: BaseException,
                      diagnosis: "Coroutine[Any, Any, tuple[BaseException, tuple[str, str]]]") -> None:
        try:
            final, tell = await diagnosis
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - the diagnosis is best effort; the first error stands
            final, tell = error, (type(error).__name__, str(error))
        if self.final is None:
            self.fail(final, tell=tell, record=False)

    def record(self, reason: str) -> tuple[str, str | None]:
        """Mark what is pending as failed and write the flight record: (" (flight record: PATH)", PATH)."""
        job = self._comm._running
        for j in (job, *self.held, *self._comm._queue):
            if j is not None and j.entry is not None and j.entry.state in ("queued", "running"):
                j.entry.state, j.entry.error, j.entry.ended = "failed", reason[:300], time.monotonic()
        state = {"next_seq": self._comm._seq, "last_completed": self._comm._done_seq,
                 "running": job.call.seq if job is not None else None, "queued": len(self._comm._queue)}
        path = self._flight.dump(reason, state)
        return (f" (flight record: {path})" if path else "", path)

    def fail(self, error: BaseException, *, tell: tuple[str, str] | None = None, record: bool = True,
              extra: dict[str, Any] | None = None) -> None:
        """The communicator fails for good with ``error``: every pending call gets it, the peers
        are told (``tell`` = (kind, message)), and the flight record is written."""
        if self.final is not None:
            return
        self.final = self.error = error
        task = self.diagnosis
        if task is not None and not task.done() and task is not asyncio.current_task():
            task.cancel()
        self._executor.abort(error)
        if record:
            _, path = self.record(f"{type(error).__name__}: {error}")
            if path is not None:
                try:
                    if isinstance(error, AhcommError):
                        error.flight_record = path
                    error.add_note(f"flight record: {path}")
                except Exception:  # noqa: BLE001 - an exception type that takes no notes
                    pass
        if tell is not None:
            kind, text = tell
            facts = {key: getattr(error, key) for key in ("op", "seq") if getattr(error, key, None) is not None}
            missing = getattr(error, "missing", None)
            if missing:
                facts["missing"] = list(missing)
            self._notify({"t": "fail", "kind": kind, "msg": text[:16000], **facts, **(extra or {})})
            self._executor.tell_peers(text)
        pending = [*self.held, *self._comm._drain_queue()]
        self.held.clear()
        for job in pending:
            if job.entry is not None and job.entry.state != "failed":
                mark(job.entry, error)
            self._deliver(job.future, error)

    def _notify(self, msg: dict[str, Any]) -> None:
        """Send the failure notice ``msg`` to every peer; errors are delivered to the callers
        once the peers acknowledged it or NOTICE_WAIT passed, so that a caller whose program
        ends on the error (the process exits, ZeroMQ's queues with it) does not take it along."""
        try:
            acks = self.control.send_all_acked(msg)
        except RuntimeError:  # no running loop (closing from elsewhere): unacknowledged
            self.control.send_all(msg)
            return
        if acks:
            self.notice = asyncio.get_running_loop().create_task(self._await_acks(acks),
                                                                 name=f"ahcomm-notice-{self._comm.rank}")

    async def _await_acks(self, acks: list["asyncio.Future[dict[str, Any]]"]) -> None:
        try:
            await asyncio.wait(acks, timeout=NOTICE_WAIT)
        finally:
            self.control.forget(acks)
            undelivered, self.undelivered = self.undelivered, []
            for fut, error in undelivered:
                if not fut.done():
                    fut.set_exception(error)

    def _deliver(self, fut: "asyncio.Future[Any]", error: BaseException) -> None:
        """Fail ``fut`` with ``error``, once the failure notice on its way was acknowledged."""
        if fut.done():
            return
        if self.notice is not None and not self.notice.done():
            self.undelivered.append((fut, error))
        else:
            fut.set_exception(error)

    def job_failed(self, job: Job, exc: BaseException) -> None:
        """A usage error (found before anything was sent: the call's checks, the algorithm's
        resources) retires the call's sequence number (``_retire``: the communicator stays
        usable if every rank rejected it, else fails everywhere); any other failure leaves peers
        mid-protocol, so the communicator fails and they are told. While a diagnosis runs
        (mismatch, timeout) the job waits for its verdict."""
        call = job.call
        self.fps.pop(call.seq, None)
        if self.error is None:
            if isinstance(exc, UsageError):  # a check (a few in the executor: resources) before any send
                if job.entry is not None:
                    mark(job.entry, exc)
                if not job.future.done():
                    job.future.set_exception(exc)
                self.retired.retire(call, exc)
                return
            self.fail(exc, tell=("failure", f"{call.op} #{call.seq} failed on {self.name(self._comm.rank)}: "
                                            f"{type(exc).__name__}: {exc}"))
        elif self.final is None and not isinstance(exc, UsageError):
            self.held.append(job)
            return
        elif self.final is not None and exc is not self.final and not isinstance(exc, UsageError):
            exc = self.final  # the communicator's failure is what ended this job
        if job.entry is not None and job.entry.state != "failed":
            mark(job.entry, exc)
        self._deliver(job.future, exc)

    async def settle(self) -> None:
        """Closing: let a diagnosis on its way (bounded by REPLY_WAIT) give the pending calls its
        verdict, then fail them with the first error if none came."""
        if self.diagnosis is not None and not self.diagnosis.done():
            try:
                await asyncio.wait_for(asyncio.shield(self.diagnosis), REPLY_WAIT * 3)
            except BaseException:  # noqa: BLE001
                pass
        if self.final is None and self.error is not None:
            self.fail(self.error, record=False)
        if self.notice is not None and not self.notice.done():
            await asyncio.wait([self.notice], timeout=NOTICE_WAIT * 2)  # the errors it holds are delivered

    async def close(self) -> None:
        """Stop the watchdog and the diagnosis, drop the requests and what was kept for checks."""
        self.watchdog.cancel()
        await cancel_and_wait(self.diagnosis)
        self.control.close()
        self.early.clear()
        self.fps.clear()

    def _told(self, peer: int, msg: dict[str, Any]) -> None:
        """A peer failed and says why: fail here with the same kind of error."""
        if self.final is not None:
            return
        kind, text = str(msg.get("kind", "")), str(msg.get("msg", ""))
        error: AhcommError
        if kind == "mismatch":
            suffix, path = self.record(text)
            error = CollectiveMismatchError(f"{text} (found by {self.name(peer)}){suffix}", seq=msg.get("seq"))
        elif kind == "timeout":
            message = f"{self.name(peer)} aborted its communicator: {text}"
            suffix, path = self.record(message)
            error = CollectiveTimeout(message + suffix, op=msg.get("op"), seq=msg.get("seq"),
                                      missing=tuple(msg.get("missing") or ()))
        elif kind == "lost":
            lost = int(msg.get("lost", peer))
            message = (f"{self.name(lost)} was lost ({text}; found by {self.name(peer)}); "
                       f"{self.name(self._comm.rank)} can no longer run collectives on it")
            suffix, path = self.record(message)
            error = PeerFailure(message + suffix, rank=lost, **self._current())
        elif kind == "malformed":
            sender, by = int(msg.get("from", -1)), int(msg.get("by", peer))
            who = f"this rank ({self.name(sender)})" if sender == self._comm.rank else self.name(sender)
            message = (f"{self.name(by)} rejected a message from {who}: {text}; {self.name(sender)} no longer "
                       f"follows the link protocol (do all ranks run the same ahcomm version?), so "
                       f"{self.name(self._comm.rank)} can no longer run collectives on this communicator")
            suffix, path = self.record(message)
            error = TransportError(message + suffix)
            error.flight_record = path
            # passed on: it reaches each peer before anything this rank sends later (its goodbye)
            self.fail(error, record=False, tell=("malformed", text), extra={"from": sender, "by": by})
            return
        else:  # "abort" (the peer's own abort()) or a failure of its own: as an abort message would say
            self.on_abort(peer, text)
            return
        error.flight_record = path
        self.fail(error, record=False)

    def on_abort(self, peer: int, reason: str) -> None:
        if self.final is None:
            message = (f"{self.name(peer)} aborted its communicator ({reason}) {self._during()}; "
                       f"{self.name(self._comm.rank)} can no longer run collectives on it")
            suffix, path = self.record(message)
            error = PeerFailure(message + suffix, rank=peer, **self._current())
            error.flight_record = path
            self.fail(error, record=False)

    def _current(self) -> dict[str, Any]:
        """op= and seq= of the collective running or next in line here (none while idle)."""
        job = self._comm._running
        if job is None:
            job = self.held[0] if self.held else self._comm._queue[0] if self._comm._queue else None
        return {"op": job.call.op, "seq": job.call.seq} if job is not None else {}

    def _during(self) -> str:
        job = self._comm._running
        if job is not None:
            return f"during {job.call.op} #{job.call.seq}"
        pending = self.held[0] if self.held else self._comm._queue[0] if self._comm._queue else None
        if pending is not None:
            return f"with {pending.call.op} #{pending.call.seq} pending"
        return f"while idle (last collective: #{self._comm._done_seq})"

    def on_lost(self, peer: int, reason: str) -> None:
        """The transport says ``peer`` is gone (socket closed, heartbeats stopped)."""
        if threading.get_ident() != self._comm._thread and self._comm._loop is not None:
            self._comm._loop.call_soon_threadsafe(self.on_lost, peer, reason)
            return
        if self.final is not None or self._comm._closed:
            return
        message = (f"{self.name(peer)} was lost ({reason}) {self._during()}; "
                   f"{self.name(self._comm.rank)} can no longer run collectives on it")
        if self._comm._closing:  # after close()'s barrier peers go away: end quietly
            self.fail(PeerFailure(message, rank=peer, **self._current()), record=False)
            return
        suffix, path = self.record(message)
        error = PeerFailure(message + suffix, rank=peer, **self._current())
        error.flight_record = path
        self.fail(error, record=False, tell=("lost", f"{reason}, {self._during()} on {self.name(self._comm.rank)}"),
                   extra={"lost": peer})

    def on_broken(self, peer: int, reason: str) -> None:
        """The transport rejected a message from ``peer`` (``reason``: what was wrong with it). The
        peer is alive but out of step, and only this rank knows: fail here and tell every peer, so
        that no rank waits on a link that will never deliver (a ring would wait for its timeout)."""
        if self.final is not None or self._comm._closed:
            return
        text = f"{reason} ({self._during()} on {self.name(self._comm.rank)})"
        message = (f"{self.name(self._comm.rank)} rejected a message from {self.name(peer)}: {text}; {self.name(peer)} "
                   "no longer follows the link protocol (do all ranks run the same ahcomm version?), so the "
                   "communicator is failed on every rank")
        suffix, path = self.record(message)
        error = TransportError(message + suffix)
        error.flight_record = path
        self.fail(error, record=False, tell=("malformed", text), extra={"from": peer, "by": self._comm.rank})

    @property
    def reply_wait(self) -> float:
        """Seconds to wait for the peers' answers (``REPLY_WAIT``, read when asked)."""
        return REPLY_WAIT

    def name(self, rank: int) -> str:
        """How messages name a rank of this communicator (a sub-communicator's with its world rank)."""
        if self._comm._parent is None or not 0 <= rank < len(self._comm.world_ranks):
            return f"rank {rank}"
        return f"rank {rank} (world rank {self._comm.world_ranks[rank]})"

    # -- diagnosis --------------------------------------------------------------------------
    def status_line(self) -> str:
        """One line: what this rank is doing (printed on SIGUSR1)."""
        head = f"ahcomm rank {self._comm.rank}/{self._comm.size}"
        job = self._comm._running
        if job is not None:
            now = self._comm._loop.time() if self._comm._loop is not None else self._comm._started
            algo = f" [{job.algorithm.name}]" if job.algorithm is not None else ""
            took = now - self._comm._started
            doing = f"running {job.call.op} #{job.call.seq} {describe(job.call)}{algo} for {took:.1f} s"
        else:
            doing = "idle"
        last = self._call_for(self._comm._done_seq) if self._comm._done_seq >= 0 else None
        done = f"last completed #{self._comm._done_seq} ({last.op})" if last is not None else \
            f"last completed #{self._comm._done_seq}"
        state = "closed" if self._comm._closed else f"failed: {self.error}" if self.error is not None else "ok"
        return f"{head}: {doing}; {done}; {len(self._comm._queue)} queued; next seq #{self._comm._seq}; {state}"

    def flight_record(self) -> list[dict[str, Any]]:
        """This rank's last collectives (op, seq, dtype, count, algorithm, state, timestamps)."""
        wall = time.time() - time.monotonic()
        return [e.as_dict(wall) for e in self._flight.entries()]


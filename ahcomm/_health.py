"""The communicator's health: mismatch detection, timeouts, the control protocol between
ranks, failure handling and diagnosis (a mixin of ``Comm``; see ``_comm``'s docstring)."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections import deque
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

import msgpack

from ._errors import AhcommError, CollectiveMismatchError, CollectiveTimeout, PeerFailure, TransportError
from ._flight import Entry, FlightRecorder, describe
from .algorithms._executor import Executor
from .algorithms.base import Call

if TYPE_CHECKING:
    from ._comm import _Job

PROBE_AFTER = 1.0  # seconds a collective runs before it announces its fingerprint to every peer
REPLY_WAIT = 1.0  # seconds to wait for peers' answers (a call's description, where they stand)
MAX_EARLY = 4096  # fingerprints kept for calls not issued here yet (bounded: peers run <= 2 ahead)
_CONTROL = b"AHc1"  # prefix of this layer's control messages (msgpack follows)


def _pack(msg: dict[str, Any]) -> bytes:
    packed: bytes = msgpack.packb(msg, use_bin_type=True)
    return _CONTROL + packed


class Health:
    """Mismatch detection, timeouts, control messages, failures and diagnosis."""

    # set by Comm.__init__
    rank: int
    size: int
    world_ranks: tuple[int, ...]
    _parent: object | None
    _executor: Executor
    _exec_timeout: float
    _seq: int
    _queue: deque[_Job]
    _error: BaseException | None
    _final: BaseException | None
    _closed: bool
    _closing: bool
    _running: _Job | None
    _started: float
    _watchdog: asyncio.TimerHandle | None
    _done_seq: int
    _started_seq: int
    _flight: FlightRecorder
    _fps: dict[int, int]
    _early: dict[int, list[tuple[int, int]]]
    _held: list[_Job]
    _diagnosis: asyncio.Task[None] | None
    _requests: dict[int, asyncio.Future[dict[str, Any]]]
    _request_ids: itertools.count[int]
    _thread: int
    _loop: asyncio.AbstractEventLoop | None

    if TYPE_CHECKING:  # Retirement (``_retire``)
        def _on_retired(self, peer: int, msg: dict[str, Any]) -> None: ...
        def _ran_retired(self, peer: int, seq: int) -> bool: ...

    # -- mismatch detection -----------------------------------------------------------------
    def _on_fingerprint(self, peer: int, seq: int, fp: int) -> None:
        """Every signal a peer posts: is its call ``seq`` ours? (the hot path: one dict lookup)"""
        if self._fps.get(seq) != fp:
            try:
                self._fingerprint_differs(peer, seq, fp)
            except Exception:  # noqa: BLE001 - never break the transport's reader
                pass

    def _fingerprint_differs(self, peer: int, seq: int, fp: int) -> None:
        mine = self._fps.get(seq)
        if mine is None and seq < self._seq:  # finished here (or failed): the flight record knows it
            if self._ran_retired(peer, seq):  # it was rejected here
                return
            entry = self._flight.find(seq)
            if entry is None or not entry.call._fp:
                return  # too old to check, or never prepared
            mine = entry.call._fp
            if mine == fp:
                return
        elif not mine:  # not issued here yet, or its counts are not known yet: check it then
            if sum(len(v) for v in self._early.values()) < MAX_EARLY:
                self._early.setdefault(seq, []).append((peer, fp))
            return
        self._mismatch(peer, seq, fp)

    def _register(self, seq: int, fp: int) -> None:
        """This rank's call ``seq`` has fingerprint ``fp``: check what peers sent for it already."""
        self._fps[seq] = fp
        if self._early:
            for peer, theirs in self._early.pop(seq, ()):
                if theirs != fp:
                    self._mismatch(peer, seq, theirs)
                    return

    def _call_for(self, seq: int) -> Call | None:
        entry = self._flight.find(seq)
        if entry is not None:
            return entry.call
        for job in (self._running, *self._held, *self._queue):
            if job is not None and job.call.seq == seq:
                return job.call
        return None

    def _mismatch(self, peer: int, seq: int, theirs: int) -> None:
        if self._error is not None or self._closed:
            return
        call = self._call_for(seq)
        mine = describe(call) if call is not None else "an unknown collective"
        op = call.op if call is not None else "collective"
        text = (f"{op} #{seq} mismatch: {self._name(self.rank)} called {mine}, {self._name(peer)} called a different "
                f"collective (fingerprint {theirs:#010x})")
        error = CollectiveMismatchError(text, seq=seq, ranks=tuple(sorted((self.rank, peer))))
        self._freeze(error, self._diagnose_mismatch(peer, seq, theirs, call))

    async def _diagnose_mismatch(self, peer: int, seq: int, theirs: int,
                                 call: Call | None) -> tuple[BaseException, tuple[str, str]]:
        reply = await self._ask(peer, {"t": "desc?", "seq": seq})
        mine = describe(call) if call is not None else "an unknown collective"
        my_op = call.op if call is not None else None
        if reply is not None and reply.get("desc"):
            other, other_op = str(reply["desc"]), reply.get("op")
        else:
            other, other_op = (f"a different collective (fingerprint {theirs:#010x}; it did not describe it "
                               f"within {REPLY_WAIT:g} s)"), None
        sides = sorted([(self.rank, mine), (peer, other)])
        name = my_op if my_op is not None and other_op == my_op else "collective"
        text = f"{name} #{seq} mismatch: " + ", ".join(f"{self._name(r)} called {d}" for r, d in sides)
        their_algo = str(reply.get("algo") or "") if reply is not None else ""
        if other == mine and call is not None and their_algo and their_algo != call.algorithm:
            ours = sorted([(self.rank, call.algorithm), (peer, their_algo)])
            text += " with different algorithms (" + ", ".join(f"{self._name(r)} runs {a}" for r, a in ours) + \
                    "; pass the same algorithm= or AHCOMM_ALGO on every rank)"
        elif other == mine:
            text += f" (fingerprints {call._fp if call else 0:#010x} and {theirs:#010x} differ)"
        suffix, path = self._record(text)
        error = CollectiveMismatchError(text + suffix, seq=seq, ranks=tuple(r for r, _ in sides))
        error.flight_record = path
        return error, ("mismatch", text)

    # -- timeouts ---------------------------------------------------------------------------
    def _arm(self, job: _Job, now: float) -> None:
        """(Re)start the watchdog for ``job``, which starts now."""
        limit = job.timeout if job.timeout is not None else self._exec_timeout
        if self._watchdog is not None:
            self._watchdog.cancel()
        assert self._loop is not None
        self._watchdog = self._loop.call_at(now + min(PROBE_AFTER, limit / 2), self._check_timeout)

    def _check_timeout(self) -> None:
        """The watchdog: one timer per communicator, not one per collective. A collective that
        runs long announces its fingerprint to the peers once; one past its limit times out."""
        self._watchdog = None
        job = self._running
        if job is None or self._error is not None or self._loop is None:
            return
        now = self._loop.time()
        limit = job.timeout if job.timeout is not None else self._exec_timeout
        elapsed = now - self._started
        if elapsed >= limit:
            self._timed_out(job, limit)
            return
        probe = min(PROBE_AFTER, limit / 2)
        if not job.probed:
            if elapsed < probe:
                self._watchdog = self._loop.call_at(self._started + probe, self._check_timeout)
                return
            job.probed = True
            self._announce(job)
        self._watchdog = self._loop.call_at(self._started + limit, self._check_timeout)

    def _announce(self, job: _Job) -> None:
        """Send the running call's fingerprint to every peer (which checks it as if a signal carried it)."""
        if self.size > 1 and job.call._fp:
            payload = _pack({"t": "fp", "seq": job.call.seq, "fp": job.call._fp})
            for peer in self._executor.links:
                self._executor.send_control(peer, payload)

    def _timed_out(self, job: _Job, limit: float) -> None:
        call = job.call
        source = f"timeout={limit:g}" if job.timeout is not None else "AHCOMM_EXEC_TIMEOUT"
        head = f"{call.op} #{call.seq} on {self._name(self.rank)} did not complete within {limit:g} s ({source})"
        self._freeze(CollectiveTimeout(head, op=call.op, seq=call.seq), self._diagnose_timeout(job, head))

    async def _diagnose_timeout(self, job: _Job, head: str) -> tuple[BaseException, tuple[str, str]]:
        """Ask every peer where it stands; name the ranks that had not reached the call."""
        seq = job.call.seq
        replies = await self._ask_all({"t": "st?"})
        missing: list[int] = []
        notes: list[str] = []
        algorithms: dict[str, list[int]] = {}
        if job.algorithm is not None:
            algorithms[job.algorithm.name] = [self.rank]
        for peer in sorted(replies):
            st = replies[peer]
            if st is None:
                missing.append(peer)
                notes.append(f"{self._name(peer)} did not answer within {REPLY_WAIT:g} s")
                continue
            nxt, running, done = int(st.get("next", 0)), int(st.get("running", -1)), int(st.get("done", -1))
            if int(st.get("started", -1)) >= seq or done >= seq:  # it reached the call (it may have failed since)
                if running == seq and st.get("algorithm"):
                    algorithms.setdefault(str(st["algorithm"]), []).append(peer)
                continue
            missing.append(peer)
            completed = f"last completed: #{done}" if done >= 0 else "none completed"
            failed = f"; its communicator failed: {st['failed']}" if st.get("failed") else ""
            if nxt <= seq:
                last = f"its last call: #{nxt - 1} {st.get('last_op')}" if nxt > 0 else "no collective called yet"
                notes.append(f"{self._name(peer)} has not called it yet ({last}, {completed}){failed}")
            elif running >= 0:
                notes.append(f"{self._name(peer)} is still in {st.get('running_op')} #{running}{failed}")
            else:
                notes.append(f"{self._name(peer)} has it queued ({completed}){failed}")
        if missing:
            who = ", ".join(str(p) for p in missing)
            diag = f"rank{'s' if len(missing) > 1 else ''} {who} had not arrived: {'; '.join(notes)}"
        else:
            diag = "every rank had arrived, so the collective itself is stuck"
            if len(algorithms) > 1:
                diag += " (the ranks run different algorithms: " + ", ".join(
                    f"{name} on rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}"
                    for name, r in algorithms.items()) + ")"
        text = f"{head}: {diag}; the communicator is now unusable"
        suffix, path = self._record(text)
        error = CollectiveTimeout(text + suffix, op=job.call.op, seq=seq, missing=tuple(missing))
        error.flight_record = path
        return error, ("timeout", text)

    # -- control messages -------------------------------------------------------------------
    def _on_control(self, peer: int, payload: bytes) -> None:
        if self._closed or not payload.startswith(_CONTROL):
            return
        try:
            msg = msgpack.unpackb(payload[len(_CONTROL):], raw=False)
            if not isinstance(msg, dict):
                return
            kind = msg.get("t")
            if kind == "fp":
                self._on_fingerprint(peer, int(msg["seq"]), int(msg["fp"]))
            elif kind == "re":
                fut = self._requests.pop(int(msg.get("id", 0)), None)
                if fut is not None and not fut.done():
                    fut.set_result(msg)
            elif kind == "desc?":
                call = self._call_for(int(msg["seq"]))
                desc = ({"op": call.op, "desc": describe(call), "algo": call.algorithm} if call is not None
                        else {"desc": None})
                self._reply(peer, msg, desc)
            elif kind == "st?":
                self._reply(peer, msg, self._status())
            elif kind == "fail":
                self._told(peer, msg)
            elif kind == "ret":
                self._on_retired(peer, msg)
        except Exception:  # noqa: BLE001 - a malformed message must not break the transport's reader
            pass

    def _reply(self, peer: int, request: dict[str, Any], answer: dict[str, Any]) -> None:
        self._executor.send_control(peer, _pack({"t": "re", "id": request.get("id", 0), **answer}))

    def _status(self) -> dict[str, Any]:
        job = self._running
        last = self._call_for(self._seq - 1) if self._seq else None
        return {
            "next": self._seq, "running": job.call.seq if job is not None else -1,
            "running_op": job.call.op if job is not None else None,
            "algorithm": job.algorithm.name if job is not None and job.algorithm is not None else None,
            "started": self._started_seq, "done": self._done_seq, "queued": len(self._queue),
            "last_op": last.op if last is not None else None,
            "failed": str(self._error) if self._error is not None else None,
        }

    async def _ask(self, peer: int, msg: dict[str, Any]) -> dict[str, Any] | None:
        """Send a request to ``peer``; its reply (None if none came within REPLY_WAIT)."""
        return (await self._ask_all(msg, [peer])).get(peer)

    async def _ask_all(self, msg: dict[str, Any], peers: list[int] | None = None) -> dict[int, dict[str, Any] | None]:
        """Send ``msg`` to every peer (or ``peers``); their replies within REPLY_WAIT (None: no reply)."""
        loop = asyncio.get_running_loop()
        waiting: dict[int, asyncio.Future[dict[str, Any]]] = {}
        ids = []
        for peer in (peers if peers is not None else list(self._executor.links)):
            rid = next(self._request_ids)
            fut: asyncio.Future[dict[str, Any]] = loop.create_future()
            self._requests[rid] = fut
            ids.append(rid)
            if self._executor.send_control(peer, _pack({**msg, "id": rid})):
                waiting[peer] = fut
        try:
            if waiting:
                await asyncio.wait(list(waiting.values()), timeout=REPLY_WAIT)
        finally:
            for rid in ids:
                self._requests.pop(rid, None)
        asked = peers if peers is not None else self._executor.links
        out: dict[int, dict[str, Any] | None] = dict.fromkeys(asked)
        for peer, fut in waiting.items():
            if fut.done() and not fut.cancelled():
                out[peer] = fut.result()
            else:
                fut.cancel()
        return out

    # -- failures ---------------------------------------------------------------------------
    def _freeze(self, error: BaseException,
                diagnosis: "Coroutine[Any, Any, tuple[BaseException, tuple[str, str]]]") -> None:
        """Stop at once (nothing more runs, no result is delivered) and diagnose; the verdict
        fails every pending call and is sent to the peers."""
        if self._error is not None:
            diagnosis.close()
            return
        self._error = error
        self._executor.abort(error)
        assert self._loop is not None
        self._diagnosis = self._loop.create_task(self._settle(error, diagnosis), name=f"ahcomm-diagnosis-{self.rank}")

    async def _settle(self, error: BaseException,
                      diagnosis: "Coroutine[Any, Any, tuple[BaseException, tuple[str, str]]]") -> None:
        try:
            final, tell = await diagnosis
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - the diagnosis is best effort; the first error stands
            final, tell = error, (type(error).__name__, str(error))
        if self._final is None:
            self._fail(final, tell=tell, record=False)

    def _record(self, reason: str) -> tuple[str, str | None]:
        """Mark what is pending as failed and write the flight record: (" (flight record: PATH)", PATH)."""
        job = self._running
        for j in (job, *self._held, *self._queue):
            if j is not None and j.entry is not None and j.entry.state in ("queued", "running"):
                j.entry.state, j.entry.error, j.entry.ended = "failed", reason[:300], time.monotonic()
        state = {"next_seq": self._seq, "last_completed": self._done_seq,
                 "running": job.call.seq if job is not None else None, "queued": len(self._queue)}
        path = self._flight.dump(reason, state)
        return (f" (flight record: {path})" if path else "", path)

    @staticmethod
    def _mark(entry: Entry, exc: BaseException) -> None:
        entry.state, entry.error = "failed", f"{type(exc).__name__}: {exc}"[:300]
        entry.ended = entry.ended or time.monotonic()

    def _fail(self, error: BaseException, *, tell: tuple[str, str] | None = None, record: bool = True,
              extra: dict[str, Any] | None = None) -> None:
        """The communicator fails for good with ``error``: every pending call gets it, the peers
        are told (``tell`` = (kind, message)), and the flight record is written."""
        if self._final is not None:
            return
        self._final = self._error = error
        task = self._diagnosis
        if task is not None and not task.done() and task is not asyncio.current_task():
            task.cancel()
        self._executor.abort(error)
        if record:
            _, path = self._record(f"{type(error).__name__}: {error}")
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
            payload = _pack({"t": "fail", "kind": kind, "msg": text[:16000], **facts, **(extra or {})})
            for peer in self._executor.links:
                self._executor.send_control(peer, payload)
            self._executor.tell_peers(text)
        pending = [*self._held, *self._queue]
        self._held.clear()
        self._queue.clear()
        for job in pending:
            if job.entry is not None and job.entry.state != "failed":
                self._mark(job.entry, error)
            if not job.future.done():
                job.future.set_exception(error)

    def _told(self, peer: int, msg: dict[str, Any]) -> None:
        """A peer failed and says why: fail here with the same kind of error."""
        if self._final is not None:
            return
        kind, text = str(msg.get("kind", "")), str(msg.get("msg", ""))
        error: AhcommError
        if kind == "mismatch":
            suffix, path = self._record(text)
            error = CollectiveMismatchError(f"{text} (found by {self._name(peer)}){suffix}", seq=msg.get("seq"))
        elif kind == "timeout":
            message = f"{self._name(peer)} aborted its communicator: {text}"
            suffix, path = self._record(message)
            error = CollectiveTimeout(message + suffix, op=msg.get("op"), seq=msg.get("seq"),
                                      missing=tuple(msg.get("missing") or ()))
        elif kind == "lost":
            lost = int(msg.get("lost", peer))
            message = (f"{self._name(lost)} was lost ({text}; found by {self._name(peer)}); "
                       f"{self._name(self.rank)} can no longer run collectives on it")
            suffix, path = self._record(message)
            error = PeerFailure(message + suffix, rank=lost)
        elif kind == "malformed":
            sender, by = int(msg.get("from", -1)), int(msg.get("by", peer))
            who = f"this rank ({self._name(sender)})" if sender == self.rank else self._name(sender)
            message = (f"{self._name(by)} rejected a message from {who}: {text}; {self._name(sender)} no longer "
                       f"follows the link protocol (do all ranks run the same ahcomm version?), so "
                       f"{self._name(self.rank)} can no longer run collectives on this communicator")
            suffix, path = self._record(message)
            error = TransportError(message + suffix)
            error.flight_record = path
            # passed on: it reaches each peer before anything this rank sends later (its goodbye)
            self._fail(error, record=False, tell=("malformed", text), extra={"from": sender, "by": by})
            return
        else:  # "abort" (the peer's own abort()) or a failure of its own: as an abort message would say
            self._peer_aborted(peer, text)
            return
        error.flight_record = path
        self._fail(error, record=False)

    def _peer_aborted(self, peer: int, reason: str) -> None:
        if self._final is None:
            message = (f"{self._name(peer)} aborted its communicator ({reason}); "
                       f"{self._name(self.rank)} can no longer run collectives on it")
            suffix, path = self._record(message)
            error = PeerFailure(message + suffix, rank=peer)
            error.flight_record = path
            self._fail(error, record=False)

    def _during(self) -> str:
        job = self._running
        if job is not None:
            return f"during {job.call.op} #{job.call.seq}"
        pending = self._held[0] if self._held else self._queue[0] if self._queue else None
        if pending is not None:
            return f"with {pending.call.op} #{pending.call.seq} pending"
        return f"while idle (last collective: #{self._done_seq})"

    def _on_lost(self, peer: int, reason: str) -> None:
        """The transport says ``peer`` is gone (socket closed, heartbeats stopped)."""
        if threading.get_ident() != self._thread and self._loop is not None:
            self._loop.call_soon_threadsafe(self._on_lost, peer, reason)
            return
        if self._final is not None or self._closed:
            return
        message = (f"{self._name(peer)} was lost ({reason}) {self._during()}; "
                   f"{self._name(self.rank)} can no longer run collectives on it")
        if self._closing:  # after close()'s barrier peers go away: end quietly
            self._fail(PeerFailure(message, rank=peer), record=False)
            return
        suffix, path = self._record(message)
        error = PeerFailure(message + suffix, rank=peer)
        error.flight_record = path
        self._fail(error, record=False, tell=("lost", f"{reason}, {self._during()} on {self._name(self.rank)}"),
                   extra={"lost": peer})

    def _on_broken(self, peer: int, reason: str) -> None:
        """The transport rejected a message from ``peer`` (``reason``: what was wrong with it). The
        peer is alive but out of step, and only this rank knows: fail here and tell every peer, so
        that no rank waits on a link that will never deliver (a ring would wait for its timeout)."""
        if self._final is not None or self._closed:
            return
        text = f"{reason} ({self._during()} on {self._name(self.rank)})"
        message = (f"{self._name(self.rank)} rejected a message from {self._name(peer)}: {text}; {self._name(peer)} "
                   "no longer follows the link protocol (do all ranks run the same ahcomm version?), so the "
                   "communicator is failed on every rank")
        suffix, path = self._record(message)
        error = TransportError(message + suffix)
        error.flight_record = path
        self._fail(error, record=False, tell=("malformed", text), extra={"from": peer, "by": self.rank})

    def _name(self, rank: int) -> str:
        """How messages name a rank of this communicator (a sub-communicator's with its world rank)."""
        if self._parent is None or not 0 <= rank < len(self.world_ranks):
            return f"rank {rank}"
        return f"rank {rank} (world rank {self.world_ranks[rank]})"

    # -- diagnosis --------------------------------------------------------------------------
    def status_line(self) -> str:
        """One line: what this rank is doing (printed on SIGUSR1)."""
        head = f"ahcomm rank {self.rank}/{self.size}"
        job = self._running
        if job is not None:
            now = self._loop.time() if self._loop is not None else self._started
            algo = f" [{job.algorithm.name}]" if job.algorithm is not None else ""
            doing = f"running {job.call.op} #{job.call.seq} {describe(job.call)}{algo} for {now - self._started:.1f} s"
        else:
            doing = "idle"
        last = self._call_for(self._done_seq) if self._done_seq >= 0 else None
        done = f"last completed #{self._done_seq} ({last.op})" if last is not None else \
            f"last completed #{self._done_seq}"
        state = "closed" if self._closed else f"failed: {self._error}" if self._error is not None else "ok"
        return f"{head}: {doing}; {done}; {len(self._queue)} queued; next seq #{self._seq}; {state}"

    def flight_record(self) -> list[dict[str, Any]]:
        """This rank's last collectives (op, seq, dtype, count, algorithm, state, timestamps)."""
        wall = time.time() - time.monotonic()
        return [e.as_dict(wall) for e in self._flight.entries()]


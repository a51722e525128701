"""The watchdog of a communicator's collectives (a part of ``Health``, ``_health``).

One timer per communicator, not one per collective. A collective that runs longer than
``PROBE_AFTER`` (or half its limit) announces its fingerprint to every peer once, so calls
whose signals never meet are still compared; one past its limit (``AHCOMM_EXEC_TIMEOUT`` or
its ``timeout=``) times out: every peer is asked where it stands, and ``CollectiveTimeout``
names the ranks that had not arrived.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, Protocol

from ._control import Requests
from ._core import CommState, Job
from ._errors import CollectiveTimeout

PROBE_AFTER = 1.0  # seconds a collective runs before it announces its fingerprint to every peer


class Stopping(Protocol):
    """What the watchdog uses of ``Health`` (its owner)."""

    @property
    def error(self) -> BaseException | None: ...
    @property
    def control(self) -> Requests: ...
    @property
    def reply_wait(self) -> float: ...

    def name(self, rank: int) -> str: ...
    def record(self, reason: str) -> tuple[str, str | None]: ...
    def freeze(self, error: BaseException,
               diagnosis: Coroutine[Any, Any, tuple[BaseException, tuple[str, str]]]) -> None: ...


class Watchdog:
    """Probes long collectives and times out overdue ones."""

    def __init__(self, comm: CommState, health: Stopping) -> None:
        self._comm = comm
        self._health = health
        self.timer: asyncio.TimerHandle | None = None

    def arm(self, job: Job, now: float) -> None:
        """(Re)start the timer for ``job``, which starts now."""
        limit = job.timeout if job.timeout is not None else self._comm._exec_timeout
        if self.timer is not None:
            self.timer.cancel()
        assert self._comm._loop is not None
        self.timer = self._comm._loop.call_at(now + min(PROBE_AFTER, limit / 2), self._check)

    def _check(self) -> None:
        """The watchdog: one timer per communicator, not one per collective. A collective that
        runs long announces its fingerprint to the peers once; one past its limit times out."""
        self.timer = None
        job = self._comm._running
        if job is None or self._health.error is not None or self._comm._loop is None:
            return
        now = self._comm._loop.time()
        limit = job.timeout if job.timeout is not None else self._comm._exec_timeout
        elapsed = now - self._comm._started
        if elapsed >= limit:
            self._timed_out(job, limit)
            return
        probe = min(PROBE_AFTER, limit / 2)
        if not job.probed:
            if elapsed < probe:
                self.timer = self._comm._loop.call_at(self._comm._started + probe, self._check)
                return
            job.probed = True
            self._announce(job)
        self.timer = self._comm._loop.call_at(self._comm._started + limit, self._check)

    def _announce(self, job: Job) -> None:
        """Send the running call's fingerprint to every peer (which checks it as if a signal carried it)."""
        if self._comm.size > 1 and job.call._fp:
            self._health.control.send_all({"t": "fp", "seq": job.call.seq, "fp": job.call._fp})

    def _timed_out(self, job: Job, limit: float) -> None:
        call = job.call
        source = f"timeout={limit:g}" if job.timeout is not None else "AHCOMM_EXEC_TIMEOUT"
        me = self._health.name(self._comm.rank)
        head = f"{call.op} #{call.seq} on {me} did not complete within {limit:g} s ({source})"
        self._health.freeze(CollectiveTimeout(head, op=call.op, seq=call.seq), self._diagnose(job, head))

    async def _diagnose(self, job: Job, head: str) -> tuple[BaseException, tuple[str, str]]:
        """Ask every peer where it stands; name the ranks that had not reached the call."""
        seq = job.call.seq
        wait = self._health.reply_wait
        replies = await self._health.control.ask_all({"t": "st?"}, wait)
        missing: list[int] = []
        notes: list[str] = []
        algorithms: dict[str, list[int]] = {}
        if job.algorithm is not None:
            algorithms[job.algorithm.name] = [self._comm.rank]
        for peer in sorted(replies):
            st = replies[peer]
            if st is None:
                missing.append(peer)
                notes.append(f"{self._health.name(peer)} did not answer within {wait:g} s")
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
                notes.append(f"{self._health.name(peer)} has not called it yet ({last}, {completed}){failed}")
            elif running >= 0:
                notes.append(f"{self._health.name(peer)} is still in {st.get('running_op')} #{running}{failed}")
            else:
                notes.append(f"{self._health.name(peer)} has it queued ({completed}){failed}")
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
        suffix, path = self._health.record(text)
        error = CollectiveTimeout(text + suffix, op=job.call.op, seq=seq, missing=tuple(missing))
        error.flight_record = path
        return error, ("timeout", text)

    def cancel(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

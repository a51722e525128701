"""The flight recorder: each communicator's last collectives, for diagnosis.

Every collective gets an entry when it is issued (op, seq, dtype, count, root, reduce op)
that follows it through its states - ``queued``, ``running`` (with the algorithm chosen),
``done`` or ``failed`` - with monotonic timestamps. The recorder keeps the last
``AHCOMM_FLIGHT_ENTRIES`` (default 256) in a ring indexed by sequence number, so recording
costs one small object per call and lookups by seq are O(1).

When a communicator fails (timeout, mismatch, lost or failed peer, broken link) the record
is written as JSON to ``AHCOMM_FLIGHT_DIR`` (default: the temp dir, where only this user's
newest ``KEEP_IN_TEMP`` records are kept) and the error names the file. On SIGUSR1 every
communicator of the process prints its state to stderr (current op and seq, last completed,
queue length): ``watch`` installs that handler on the loop when
the loop runs in the main thread and nobody else handles SIGUSR1 (default or ignored; an
ignored SIGUSR1, as ahcomm-run gives its ranks, is ignored again once the last communicator
closes).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import socket
import sys
import tempfile
import threading
import time
import weakref
from typing import Any, Protocol

from .algorithms.base import Call

DEFAULT_ENTRIES = 256
KEEP_IN_TEMP = 256  # records kept in the default (temp) directory: the newest; a chosen directory keeps all
PREFIX = "ahcomm-flight-"
ROOTED = frozenset({"broadcast", "reduce", "gather", "gather_v", "scatter", "scatter_v"})
_dumps = itertools.count()


def describe(call: Call) -> str:
    """``all_reduce(float32, count=8, sum)``: what every rank must agree on, readable."""
    if call.op == "barrier":
        return f"barrier() in {call.caller}" if call.caller else "barrier()"
    parts = [call.dtype.name]
    if call.counts is not None and call.op != "all_to_all_v":
        counts = list(call.counts)
        parts.append(f"counts={counts if len(counts) <= 16 else str(counts[:16])[:-1] + ', ...]'}")
    else:
        parts.append(f"count={call.count}")
    if call.redop is not None:
        parts.append(call.redop.value)
    if call.op in ROOTED:
        parts.append(f"root={call.root}")
    return f"{call.op}({', '.join(parts)})"


def entries_setting() -> int:
    try:
        return max(16, int(os.environ.get("AHCOMM_FLIGHT_ENTRIES", "") or DEFAULT_ENTRIES))
    except ValueError:
        return DEFAULT_ENTRIES


def _prune(directory: str, keep: int) -> None:
    """Remove all but this user's newest ``keep`` records in ``directory`` (best effort)."""
    try:
        uid = os.getuid()
        records = []
        with os.scandir(directory) as it:
            for e in it:
                if e.name.startswith(PREFIX) and e.name.endswith(".json") and e.is_file(follow_symlinks=False):
                    st = e.stat(follow_symlinks=False)
                    if st.st_uid == uid:
                        records.append((st.st_mtime, e.path))
        records.sort()
        for _, path in records[:-keep] if len(records) > keep else []:
            os.unlink(path)
    except OSError:
        pass


def _write_whole(path: str, data: bytes) -> bool:
    """Write ``data`` to a new file ``path``, whole or not at all: into a hidden temporary name
    first (a new file, never through a planted link, readable by this user alone), renamed
    into place once written and synced; a full disk leaves no partial or empty record."""
    directory, name = os.path.split(path)
    tmp = os.path.join(directory, f".{name}.{os.getpid()}.tmp")
    try:
        os.makedirs(directory, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    except OSError:
        return False
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        if os.path.lexists(path):
            raise FileExistsError(path)
        os.rename(tmp, path)
        return True
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        return False


class Entry:
    """One collective's record (``call`` is the communicator's own Call: no data arrays)."""

    __slots__ = ("algorithm", "call", "ended", "error", "issued", "started", "state", "timeout")

    def __init__(self, call: Call, timeout: float | None) -> None:
        self.call = call
        self.algorithm = ""
        self.state = "queued"
        self.issued = time.monotonic()
        self.started = 0.0
        self.ended = 0.0
        self.error = ""
        self.timeout = timeout

    def as_dict(self, wall: float) -> dict[str, Any]:
        call = self.call
        out: dict[str, Any] = {
            "seq": call.seq, "op": call.op, "call": describe(call), "dtype": call.dtype.name,
            "count": call.count, "counts": list(call.counts) if call.counts is not None else None,
            "redop": call.redop.value if call.redop is not None else None, "root": call.root,
            "fingerprint": f"{call.fingerprint:#010x}" if call._fp else None,
            "algorithm": self.algorithm or None, "state": self.state,
            "issued": round(self.issued + wall, 6),
            "started": round(self.started + wall, 6) if self.started else None,
            "ended": round(self.ended + wall, 6) if self.ended else None,
            "seconds": round((self.ended or time.monotonic()) - self.started, 6) if self.started else None,
        }
        if self.timeout is not None:
            out["timeout"] = self.timeout
        if self.error:
            out["error"] = self.error
        return out


class FlightRecorder:
    """The last ``capacity`` collectives of one rank."""

    def __init__(self, rank: int, size: int, capacity: int | None = None) -> None:
        self.rank = rank
        self.size = size
        self.capacity = capacity or entries_setting()
        self._ring: list[Entry | None] = [None] * self.capacity

    def issue(self, call: Call, timeout: float | None = None) -> Entry:
        entry = Entry(call, timeout)
        self._ring[call.seq % self.capacity] = entry
        return entry

    def find(self, seq: int) -> Entry | None:
        entry = self._ring[seq % self.capacity]
        return entry if entry is not None and entry.call.seq == seq else None

    def entries(self) -> list[Entry]:
        return sorted((e for e in self._ring if e is not None), key=lambda e: e.call.seq)

    def dump(self, reason: str, state: dict[str, Any]) -> str | None:
        """Write the record as JSON; return its path (None if it could not be written)."""
        wall = time.time() - time.monotonic()
        doc = {
            "rank": self.rank, "size": self.size, "pid": os.getpid(), "host": socket.gethostname(),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "reason": reason, **state,
            "entries": [e.as_dict(wall) for e in self.entries()],
        }
        chosen = os.environ.get("AHCOMM_FLIGHT_DIR")
        directory = chosen or tempfile.gettempdir()
        name = f"{PREFIX}{time.strftime('%Y%m%d-%H%M%S')}-p{os.getpid()}-r{self.rank}-{next(_dumps)}.json"
        path = os.path.join(directory, name)
        if not _write_whole(path, json.dumps(doc, indent=1, default=str).encode()):
            return None
        if not chosen:
            _prune(directory, KEEP_IN_TEMP)
        return path


# -- SIGUSR1: every communicator of the process prints its state ------------------------------
class Reporter(Protocol):
    def status_line(self) -> str: ...


_watched: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, weakref.WeakSet[Any]]" = weakref.WeakKeyDictionary()
_before: dict[int, Any] = {}  # id(loop) -> the SIGUSR1 disposition found when the handler went in


def _report(loop: asyncio.AbstractEventLoop) -> None:
    comms = _watched.get(loop)
    lines = [c.status_line() for c in list(comms or ())]
    if not lines:
        lines = ["ahcomm: no open communicator"]
    try:
        sys.stderr.write("".join(f"{line}\n" for line in lines))
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


def watch(comm: Reporter, loop: asyncio.AbstractEventLoop) -> bool:
    """Print ``comm``'s state on SIGUSR1 (installs the loop's handler once; False if it cannot:
    not the main thread, a loop without signal support, or SIGUSR1 already handled)."""
    comms = _watched.get(loop)
    if comms is None:
        sig = getattr(signal, "SIGUSR1", None)
        if sig is None or threading.current_thread() is not threading.main_thread():
            return False
        try:
            before = signal.getsignal(sig)
            if before not in (signal.SIG_DFL, signal.SIG_IGN, None):
                return False  # the application's own handler stays
            loop.add_signal_handler(sig, _report, loop)
        except (NotImplementedError, RuntimeError, ValueError, OSError):
            return False
        _before[id(loop)] = before
        comms = _watched[loop] = weakref.WeakSet()
    comms.add(comm)
    return True


def _ours(loop: asyncio.AbstractEventLoop) -> bool:
    """Whether the loop's SIGUSR1 handler is still ours (the application may have replaced it)."""
    handlers = getattr(loop, "_signal_handlers", None)  # asyncio's unix loops keep them here
    if not isinstance(handlers, dict):
        return True
    handle = handlers.get(signal.SIGUSR1)
    return handle is not None and getattr(handle, "_callback", None) is _report


def unwatch(comm: Reporter, loop: asyncio.AbstractEventLoop) -> None:
    comms = _watched.get(loop)
    if comms is None:
        return
    comms.discard(comm)
    if not comms:
        del _watched[loop]
        before = _before.pop(id(loop), None)
        try:
            if not loop.is_closed() and _ours(loop):
                loop.remove_signal_handler(signal.SIGUSR1)  # leaves SIG_DFL
                if before is signal.SIG_IGN:  # e.g. ahcomm-run's ranks: ignored again, never fatal
                    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        except (NotImplementedError, RuntimeError, ValueError, OSError):
            pass

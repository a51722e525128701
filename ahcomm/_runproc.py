"""ahcomm-run's side of each rank process: how it starts, and how its output is shown.

A rank starts in its own session (a terminal's Ctrl-C reaches the launcher alone, which
passes it on), with SIGINT and SIGTERM at their defaults (a launcher started from a
background job inherits SIGINT ignored; its ranks must not), and on Linux with a parent-death
signal: if the launcher dies, even by SIGKILL, the kernel sends each rank SIGTERM. That
reaches the rank process only; a watchdog (a tiny process of its own, reading a pipe from
the launcher) also stops each rank's whole process group when the pipe closes without a
goodbye, so a rank started through a wrapper (``sh -c ...``) ends with its children too.

Output: with tagging on, each line a rank writes is prefixed ``[rank] `` and written whole; a
traceback that ends in KeyboardInterrupt is shown as one line, ``[rank] KeyboardInterrupt``.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from typing import BinaryIO

PR_SET_PDEATHSIG = 1
HOLD_SECONDS = 0.5  # a traceback's last lines wait this long for a chained one before they are shown
_CHAIN = (b"Traceback (most recent call last):", b"During handling of the above exception",
          b"The above exception was the direct cause")


def _prctl() -> Callable[[int, int], int] | None:
    """libc's prctl, loaded before any fork (the child only calls it)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.prctl
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_ulong]
    fn.restype = ctypes.c_int
    return fn  # type: ignore[no-any-return]


def child_setup(cores: set[int] | None = None) -> Callable[[], None]:
    """A ``preexec_fn`` for a rank: default SIGINT/SIGTERM, SIGTERM when the launcher dies, and
    bound to ``cores`` (before it starts a thread: every thread it makes inherits them)."""
    prctl = _prctl()
    launcher = os.getpid()

    def setup() -> None:
        if cores is not None:  # cores the launcher may no longer use (a changed cpuset): left free
            try:
                usable = cores & os.sched_getaffinity(0)
                if usable:
                    os.sched_setaffinity(0, usable)
            except OSError:
                pass
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        if prctl is not None:
            prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
            if os.getppid() != launcher:  # the launcher died before prctl took effect
                os._exit(128 + signal.SIGTERM)

    return setup


def _is_frame(line: bytes) -> bool:
    return line[:1] in (b" ", b"\t") or not line.strip() or line.startswith(_CHAIN)


async def _next_line(stream: asyncio.StreamReader) -> bytes:
    """A line; a line over the reader's limit comes in pieces, nothing is dropped; b"" at the end."""
    try:
        return await stream.readuntil(b"\n")
    except asyncio.IncompleteReadError as exc:
        return exc.partial
    except asyncio.LimitOverrunError as exc:
        return await stream.read(max(exc.consumed, 1))


class Tagger:
    """One rank's stream, written line by line to ``out`` with ``prefix``."""

    def __init__(self, prefix: bytes, out: BinaryIO) -> None:
        self.prefix = prefix
        self.out = out
        self.held: list[bytes] = []  # a traceback being read
        self.exception = b""  # its last exception line so far
        self.ended = False  # the last line that was not blank was an exception line

    def _write(self, lines: list[bytes]) -> None:
        if lines:
            self.out.write(b"".join(self.prefix + (ln if ln.endswith(b"\n") else ln + b"\n") for ln in lines))
            self.out.flush()

    def flush(self) -> None:
        """Show what is held: a KeyboardInterrupt's traceback as one line, anything else as it is."""
        if self.exception.startswith(b"KeyboardInterrupt"):
            self._write([b"KeyboardInterrupt"])
        else:
            self._write(self.held)
        self.held, self.exception, self.ended = [], b"", False

    def line(self, line: bytes) -> None:
        if self.held and self.ended and not _is_frame(line):
            self.flush()  # the traceback ended before this line
        if not self.held and not line.startswith(_CHAIN[0]):
            self._write([line])
            return
        self.held.append(line)
        if not _is_frame(line):
            self.exception, self.ended = line, True
        elif line.strip():
            self.ended = False  # a frame, or a chained traceback follows

    async def pump(self, stream: asyncio.StreamReader) -> None:
        while True:
            try:
                if self.held:
                    line = await asyncio.wait_for(_next_line(stream), HOLD_SECONDS)
                else:
                    line = await _next_line(stream)
            except TimeoutError:
                self.flush()
                continue
            if not line:
                self.flush()
                return
            self.line(line)


_WATCHDOG = """
import os, signal, sys, time
groups = []
for line in sys.stdin:
    if line == "done\\n":
        sys.exit(0)
    groups.append(int(line))
for sig in (signal.SIGTERM, signal.SIGKILL):
    for group in groups:
        try:
            os.killpg(group, sig)
        except OSError:
            pass
    time.sleep(float(sys.argv[1]) if sig == signal.SIGTERM else 0)
"""


class Watchdog:
    """Stops the ranks' process groups (SIGTERM, then SIGKILL after ``grace`` s) if the launcher
    dies without saying goodbye: its pipe closes when the launcher's process ends, however."""

    def __init__(self, grace: float) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", _WATCHDOG, str(grace)], stdin=subprocess.PIPE,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)

    def watch(self, group: int) -> None:
        self._send(f"{group}\n")

    def close(self) -> None:
        """The launcher ends normally: the watchdog goes without touching anything."""
        self._send("done\n")
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()

    def _send(self, line: str) -> None:
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(line.encode())
            self.proc.stdin.flush()
        except (OSError, ValueError):
            pass  # the watchdog is gone: the parent-death signal still covers the ranks

"""Wake-ups between the processes of one host: a FIFO in /dev/shm that its owner's event loop
watches (``loop.add_reader``), and one byte written to it by a peer (the mailboxes' and the
notify inboxes' doorbell: one wake-up, no thread in between)."""

from __future__ import annotations

import asyncio
import os
import secrets
from collections.abc import Callable

from .._buffers import SHM_DIR, SHM_PREFIX

Waker = Callable[[], None]


class WakeFifo:
    """This process's FIFO (``tag`` names it), open for reading and writing: never at end of file,
    and a peer can open it for writing at once."""

    def __init__(self, tag: str) -> None:
        self.path = os.path.join(SHM_DIR, f"{SHM_PREFIX}{os.getpid()}-{tag}-{secrets.token_hex(4)}")
        self.fd = -1
        self._loop: asyncio.AbstractEventLoop | None = None
        os.mkfifo(self.path, 0o600)
        try:
            self.fd = os.open(self.path, os.O_RDWR | os.O_NONBLOCK)
        except BaseException:
            self.unlink()
            raise

    def watch(self, loop: asyncio.AbstractEventLoop, callback: Callable[[], None]) -> None:
        """Run ``callback`` on ``loop`` whenever a wake-up is pending (the bytes read first)."""
        self._loop = loop
        loop.add_reader(self.fd, self._readable, callback)

    def _readable(self, callback: Callable[[], None]) -> None:
        try:
            os.read(self.fd, 4096)
        except OSError:
            pass
        callback()

    def unlink(self) -> None:
        try:
            os.unlink(self.path)
        except OSError:
            pass

    def close(self) -> None:
        """Stop watching, close the descriptor and remove the name."""
        if self._loop is not None and self.fd >= 0:
            try:
                self._loop.remove_reader(self.fd)
            except (ValueError, RuntimeError):
                pass
        self._loop = None
        close_fd(self.fd)
        self.fd = -1
        self.unlink()


def open_waker(path: str) -> tuple[int, Waker]:
    """A peer's FIFO opened for writing (non blocking) and the call that wakes it.

    Opened for reading too (Linux allows it on a FIFO): the FIFO then never loses its last
    reader, so a write after the peer died fills the pipe (EAGAIN, ignored) instead of raising
    SIGPIPE, whose default action - which CLIs that pipe into ``head`` restore - would kill this
    process before its link could report the loss."""
    fd = os.open(path, os.O_RDWR | os.O_NONBLOCK)

    def wake() -> None:
        try:
            os.write(fd, b"\x01")
        except OSError:  # full (a wake-up is pending anyway) or the peer is gone (its link reports it)
            pass
    return fd, wake


def close_fd(fd: int) -> None:
    if fd >= 0:
        try:
            os.close(fd)
        except OSError:
            pass

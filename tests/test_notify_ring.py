"""Notifies through the peers' shared-memory inboxes (``transports._notify_ring``): the ring's
records in order, the fall back to ZeroMQ when a ring is full (for good: the receiver drains its
inbox before any ZeroMQ message, so a link's posts keep their order), and links made as init
makes them posting through the inbox."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import zmq

from ahcomm import ConnectError, _bootstrap
from ahcomm._buffers import SHM_DIR
from ahcomm._config import Config
from ahcomm.algorithms._executor import Progress
from ahcomm.testing import local_links, local_world
from ahcomm.transports import _notify_ring as ring
from ahcomm.transports.base import Signal

Record = tuple[int, int, int, int, int, int, int]


@pytest.fixture
def inbox() -> ring.Inbox:
    box = ring.Inbox(0, 3)
    yield box
    box.close()


def test_records_arrive_in_order_per_sender(inbox: ring.Inbox) -> None:
    got: list[Record] = []
    one, two = ring.Outbox(inbox.describe(), 1), ring.Outbox(inbox.describe(), 2)
    try:
        assert one.post(0, 1, 5, 7, 1 << 40, 0xDEADBEEF) and two.post(3, 2, 0, 8, (1 << 64) - 5, 0)
        assert one.post(0, 1, 6, 7, 9, 1)
        assert inbox.drain(lambda *r: got.append(r)) == 3
        assert got == [(1, 0, 1, 5, 7, 1 << 40, 0xDEADBEEF), (1, 0, 1, 6, 7, 9, 1), (2, 3, 2, 0, 8, (1 << 64) - 5, 0)]
        assert inbox.drain(lambda *r: got.append(r)) == 0  # nothing twice
    finally:
        one.close()
        two.close()


def test_a_full_ring_falls_back_for_good(inbox: ring.Inbox) -> None:
    box = ring.Outbox(inbox.describe(), 1)
    try:
        assert all(box.post(0, 1, i, 0, i, 0) for i in range(ring.CAPACITY))
        assert not box.post(0, 1, 0, 1, 0, 0) and box.sticky  # the receiver is CAPACITY posts behind
        got: list[Record] = []
        assert inbox.drain(lambda *r: got.append(r)) == ring.CAPACITY
        assert [r[3] for r in got] == list(range(ring.CAPACITY))
        assert not box.post(0, 1, 0, 2, 0, 0)  # room again, but a post went through ZeroMQ: so do the rest
    finally:
        box.close()


@pytest.mark.parametrize("field, bad", [("value", -1), ("value", 1 << 64), ("index", 1 << 16),
                                        ("fingerprint", 1 << 32), ("signal", 256), ("domain", -1)])
def test_what_the_wire_refuses_falls_back(inbox: ring.Inbox, field: str, bad: int) -> None:
    """A field outside the ZeroMQ header's range goes that way (and fails there, as before)."""
    box = ring.Outbox(inbox.describe(), 2)
    try:
        args = {"domain": 0, "signal": 1, "index": 0, "seq": 0, "value": 0, "fingerprint": 0, field: bad}
        assert not box.post(**args) and box.sticky
    finally:
        box.close()


def test_a_sender_without_a_ring_is_refused(inbox: ring.Inbox) -> None:
    with pytest.raises(ValueError, match="ring 3 is not in an inbox of 3"):
        ring.Outbox(inbox.describe(), 3)


def test_rings_belong_to_the_hosts_ranks(inbox: ring.Inbox) -> None:
    """Ring i carries the posts of the host's i-th rank (``Channel.bind_notifies``): records
    reach the dispatcher under that rank's wire number."""
    inbox.senders = [4, 9, 12]
    got: list[Record] = []
    box = ring.Outbox(inbox.describe(), 1)
    try:
        assert box.post(2, 1, 0, 3, 0, 0)
        inbox.drain(lambda *r: got.append(r))
        assert got == [(9, 2, 1, 0, 3, 0, 0)]
    finally:
        box.close()


def test_the_names_go_once_unlinked(inbox: ring.Inbox) -> None:
    desc = inbox.describe()
    inbox.unlink()
    with pytest.raises(ConnectError, match="gone"):
        ring.Outbox(desc, 1)


@pytest.mark.parametrize("shm", [True, False])
async def test_sdma_links_post_through_the_inbox(shm: bool) -> None:
    """Links as init makes them post through the peer's inbox (stats say so) and the values and
    fingerprints arrive; without inboxes, over ZeroMQ, alike. A ring that fills up hands the
    link to ZeroMQ and every post still arrives, in order."""
    made = await local_links(2, transport="sdma", shm_notify=shm)
    try:
        a, b = made.links[0][1], made.links[1][0]
        assert a.stats()["notifies"] == ("shared memory" if shm else "zeromq")
        a.post(Signal.DATA, 3, 4, value=12345)
        await asyncio.wait_for(b.wait(Signal.DATA, 3, 4), 10)
        assert b.value(Signal.DATA, 3, 4) == 12345
        for i in range(ring.CAPACITY + 10):  # no await between: the receiver falls behind
            a.post(Signal.ACK, i, 0, value=i)
        assert a.stats()["notifies"] == "zeromq"
        for i in range(ring.CAPACITY + 10):
            await asyncio.wait_for(b.wait(Signal.ACK, i, 0), 10)
            assert b.value(Signal.ACK, i, 0) == i
        a.post(Signal.DATA, 0, 1, value=7)  # then a key twice: the later value stays
        a.post(Signal.ACK, 0, 1, value=8)
        await asyncio.wait_for(b.wait(Signal.ACK, 0, 1), 10)
        assert b.value(Signal.DATA, 0, 1) == 7 and b.value(Signal.ACK, 0, 1) == 8
    finally:
        made.close()


async def test_suspend_releases_the_inbox_and_resume_makes_a_new_one() -> None:
    """While suspended a rank holds no inbox (notifies over ZeroMQ); resume makes a new one that
    the peers post into once it returns, and every op is right on both sides of it."""
    comms = await local_world(3, transport="sdma", buffsize=1 << 16)

    def paths() -> set[str]:
        return {link["notifies"] for c in comms for link in c.stats()["links"].values()}

    try:
        assert paths() == {"shared memory"}
        await asyncio.wait_for(asyncio.gather(*(c.suspend() for c in comms)), 30)
        assert paths() == {"zeromq"}
        assert all(c._executor.links[(c.rank + 1) % 3].receiver().inbox is None for c in comms)
        await asyncio.wait_for(asyncio.gather(*(c.resume() for c in comms)), 30)
        assert paths() == {"shared memory"}
        for c in comms:  # the new inboxes' names are gone once every peer holds them
            inbox = c._executor.links[(c.rank + 1) % 3].receiver().inbox
            assert inbox is not None and not os.path.exists(os.path.join(SHM_DIR, inbox.region.name))
            assert not os.path.exists(inbox.wake.path)
        outs = await asyncio.wait_for(asyncio.gather(*(
            c.all_reduce(np.full(5000, c.rank + 1.0), algorithm="ring") for c in comms)), 30)
        for out in outs:
            np.testing.assert_array_equal(out, 6.0)
    finally:
        await asyncio.gather(*(c.close() for c in comms), return_exceptions=True)


class _Control:
    """Link events that run ``hook`` on a control message (the peer's posts then come while the
    receiver is inside its ZeroMQ reader)."""

    def __init__(self, hook: Callable[[bytes], None]) -> None:
        self.hook = hook

    def on_control(self, peer: int, payload: bytes) -> None:
        self.hook(payload)

    def on_abort(self, peer: int, reason: str) -> None: ...
    def on_fingerprint(self, peer: int, seq: int, fp: int) -> None: ...
    def on_lost(self, peer: int, reason: str) -> None: ...
    def on_broken(self, peer: int, reason: str) -> None: ...


def _until_readable(channel: Any) -> None:
    deadline = time.monotonic() + 5
    while not channel.router.getsockopt(zmq.EVENTS) & zmq.POLLIN:
        assert time.monotonic() < deadline, "the ZeroMQ message never arrived"
        time.sleep(0.001)


async def test_a_notify_comes_before_the_zeromq_message_posted_after_it() -> None:
    """While the receiver reads ZeroMQ messages, the sender posts through its ring and then sends
    a goodbye (and, the ring full, a later value of the same key over ZeroMQ): the notify, and the
    ring's value, come first (the reader drains the sender's ring before acting on each message)."""
    made = await local_links(2, transport="sdma")
    try:
        a, b = made.links[0][1], made.links[1][0]

        def hook(payload: bytes) -> None:
            a.post(Signal.DATA, 0, 0, value=42)  # through the ring
            for i in range(ring.CAPACITY - 2):
                a.post(Signal.ACK, 100 + i, 0)
            a.post(Signal.ACK, 0, 1, value=7)  # the ring's last slot
            a.post(Signal.ACK, 0, 1, value=8)  # full: over ZeroMQ, after it
            assert a.outbox is not None and a.outbox.sticky
            a.say_goodbye()
            _until_readable(made.channels[1])  # both ZeroMQ messages wait behind the ring's records

        b.attach(_Control(hook))  # type: ignore[arg-type]
        waiter = asyncio.ensure_future(b.wait(Signal.DATA, 0, 0))
        await asyncio.sleep(0.05)
        a.send_control(b"go")
        await asyncio.wait_for(waiter, 5)  # not failed by the goodbye
        assert b.value(Signal.DATA, 0, 0) == 42 and b.value(Signal.ACK, 0, 1) == 8
    finally:
        made.close()


async def test_the_hello_goes_over_the_connection() -> None:
    """The handshake proves the ZeroMQ connection (goodbyes, aborts and messages travel there):
    its hello is not a ring's record."""
    made = await local_links(3, transport="sdma")
    try:
        for links in made.links:
            for link in links.values():
                assert link.outbox is not None and link.outbox.posts == 0 and link.up
    finally:
        made.close()


async def test_a_partial_table_leaves_the_rings_alone() -> None:
    """grow connects a replacement with its entry alone: the inbox's rings keep their ranks."""
    made = await local_links(3, transport="sdma")
    try:
        channel = made.channels[2]
        assert channel.inbox is not None and channel.inbox.senders == [0, 1, 2]
        cfg = Config.from_env({})
        _bootstrap._connect(2, [], channel, cfg, "local", Progress(2, 3))
        assert channel.inbox.senders == [0, 1, 2]
    finally:
        made.close()


WAKE_DEAD_PEER = r'''
import signal, sys
signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # as a CLI that pipes into head restores it
from ahcomm.transports._wake import WakeFifo, close_fd, open_waker
fifo = WakeFifo("t")
fd, wake = open_waker(fifo.path)
fifo.close()  # the owner is gone: its end of the FIFO is closed
for _ in range(70_000):  # past the pipe's 64 KiB: full, not fatal
    wake()
close_fd(fd)
print("alive")
'''


def test_waking_a_dead_peer_never_raises_sigpipe() -> None:
    """A process with SIGPIPE's default action that wakes a peer whose process is gone (the notify
    inbox's and the mailboxes' doorbell) lives on: its link reports the loss. Before, the write
    to a FIFO without a reader killed it (status 141)."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", WAKE_DEAD_PEER], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "alive", (proc.returncode, proc.stderr)

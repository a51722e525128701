"""Jobs inside the test's event loop, and the one place tests reach a communicator's links."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

import ahcomm
from ahcomm.testing import local_world
from ahcomm.transports.base import Link, Mailboxes

JOB_TIMEOUT = 60.0  # seconds an in-process job may take before the test fails instead of hanging


async def run_inproc(size: int, body: Callable[[ahcomm.Comm], Awaitable[Any]], *, buffsize: int = 1 << 16,
                     algo: str = "", transport: str = "inproc", single_copy: bool = True) -> list[Any]:
    """Run ``body(comm)`` on every rank of a job in this event loop; return the per-rank results.

    ``transport``: "inproc" (direct calls), or real "sdma" / "rdma" links made in this process.
    ``single_copy=False``: in-process ranks that cannot read each other's memory.
    """
    comms = await local_world(size, transport=transport, buffsize=buffsize, algo=algo, single_copy=single_copy)
    try:
        return list(await asyncio.wait_for(asyncio.gather(*(body(c) for c in comms)), timeout=JOB_TIMEOUT))
    finally:
        await asyncio.gather(*(c.close() for c in comms))


def links_of(comm: ahcomm.Comm) -> dict[int, Link]:
    """``comm``'s links by peer rank (internals: kept here so that no test reaches into the executor)."""
    return comm._executor.links


def mailbox_of(comm: ahcomm.Comm) -> Mailboxes | None:
    """``comm``'s host mailboxes (None where it has none)."""
    return comm._executor.mailbox


async def issue_each(comm: ahcomm.Comm, cases: list[Any], issue: Callable[[ahcomm.Comm, Any], Awaitable[Any]],
                     in_place: Callable[[Any], bool],
                     after: Callable[[ahcomm.Comm], None] | None = None) -> list[Any]:
    """Issue every case (``case[1][rank]`` is this rank's input) in order, awaiting each; an input
    not ``in_place`` is never modified. ``after(comm)``: more checks after each call."""
    out = []
    for case in cases:
        x = case[1][comm.rank]
        before = np.array(x, copy=True)
        out.append(await issue(comm, case))
        if not in_place(case):
            assert np.array_equal(x, before)  # inputs are never modified
        if after is not None:
            after(comm)
    return out


def busy_flags(comm: ahcomm.Comm) -> list[tuple[int, tuple[int, int, int]]]:
    """(peer, flag key) of every link notify left at 1 or posted twice: the algorithms' protocol
    rule is that none is, once a collective has returned."""
    return [(peer, key) for peer, link in links_of(comm).items() for key, flag in link._notifies.items()
            if flag.value or flag.overruns]

"""Waiting on the host's mailboxes (``transports.mailbox``), for the algorithms that publish there
(``oneshot``, ``direct``): publish once every peer's previous publication is seen (``publish``,
``settle``), and wait for the peers' publications (``arrivals``: spin, then sleep until woken,
with a timer as the safety net for a lost wake-up), checking each peer's call on the way."""

from __future__ import annotations

import asyncio
import os
import time

import numpy as np

from .._notify import Notify
from ..transports.base import Mailboxes
from .base import Context

RECHECK = 0.05  # seconds a sleeping waiter waits before it looks at the flags again, woken or not


async def publish(ctx: Context, data: np.ndarray | None,
                  skip: tuple[int, int] | None = None) -> tuple[int, np.ndarray]:
    """This run's next publication (``Mailbox.publish``; ``skip``: a range of ``data``'s first axis
    no peer reads), once every peer's previous one is seen (``settle``)."""
    box = ctx.mailbox
    assert box is not None
    if box.loose is not None:
        await settle(ctx)
    return box.publish(ctx.call.seq, ctx.fingerprint, data, skip)


async def settle(ctx: Context) -> None:
    """Until every peer has made this rank's last publication too (a run that waited for some
    peers only left it ``loose``: their slots may still be read; their calls are checked)."""
    box = ctx.mailbox
    assert box is not None
    loose = box.loose
    if loose is not None:
        tick, seq, fp = loose
        await arrivals(ctx, tick, call=(seq, fp))
        box.loose = None


async def arrivals(ctx: Context, tick: int, peers: tuple[int, ...] | None = None,
                    call: tuple[int, int] | None = None, may_spin: bool = True) -> None:
    """Until every peer (or those of ``peers``) has made publication ``tick``; each one's call is
    checked on the way against this run's (or ``call``: the seq and fingerprint of ``tick``'s).
    ``may_spin=False``: a wait known to be long sleeps at once (and does not count as a miss of the
    adaptive spin, which would turn spinning off for the short waits after it)."""
    box = ctx.mailbox
    assert box is not None
    seq, fp = call if call is not None else (ctx.call.seq, ctx.fingerprint)
    pending = [p for p in range(ctx.size) if p != ctx.rank] if peers is None else list(peers)
    flag = None
    spin = box.spin.allowed() if may_spin else 0.0
    yields = spin and box.spin.yields
    deadline = 0.0
    net: asyncio.TimerHandle | None = None
    try:
        while True:
            left = []
            for p in pending:
                theirs = box.arrived(p, tick)
                if theirs is None:
                    left.append(p)
                elif theirs != (seq, fp):
                    _differs(ctx, p, *theirs)
                    left.append(p)  # its slot holds another call: never read it
            if not left:
                if spin:
                    box.spin.result(True)
                return
            pending = left
            if spin:  # poll a little before sleeping (the peers are on other cores)
                if deadline == 0.0:
                    deadline = time.perf_counter() + spin
                    continue
                if time.perf_counter() < deadline:
                    if yields:
                        os.sched_yield()
                    continue
                box.spin.result(False)
                spin = 0.0
            if flag is None:
                flag = ctx.local("mailbox")
                box.on_wake = flag.post
                box.sleep()
                continue  # a publish may have landed before we were marked asleep: look once more
            if net is not None:
                net.cancel()
            # the safety net: a wake-up lost for any reason costs RECHECK, never a hang
            net = asyncio.get_running_loop().call_later(RECHECK, _poke, flag, box)
            await flag.wait()
    finally:
        if flag is not None:
            box.awake()
            box.on_wake = None
        if net is not None:
            net.cancel()


def _poke(flag: Notify, box: Mailboxes) -> None:
    """The safety net's timer: look at the flags again."""
    box.rechecks += 1
    flag.post()


def _differs(ctx: Context, peer: int, seq: int, fp: int) -> None:
    """``peer`` published another call: the communicator's fingerprint check (the link's hook)
    fails the communicator, which fails this run's wake-up notify with the verdict."""
    ctx.links[peer].check_fingerprint(seq, fp)

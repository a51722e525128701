"""An elastic replicated service: a replica dies, the others go on; its restart rejoins.

    ahcomm-run -n 4 --on-failure restart python examples/elastic_service.py --ticks 60 --crash 2@15

Every replica serves one request per tick and the cluster keeps the total of requests served
with ``all_reduce`` (as a counter service keeps cluster-wide totals). ``--crash R@T`` makes
replica R SIGKILL itself at tick T (a stand-in for a crash; only in its first life).

- The survivors' all_reduce fails with a ``CommunicationError`` (``PeerFailure``) within about
  half a second; they ``shrink()`` to a communicator of themselves, agree on the state (the
  lowest survivor's, by ``broadcast_object``) and go on serving, the tick that failed again.
- ``ahcomm-run --on-failure restart`` starts the dead replica again (same rank, plus
  ``AHCOMM_RESTART_COUNT``). Its ``ahcomm.init()`` joins the running job and waits until the
  survivors call ``grow()``, which they do ``--grow-after`` ticks after the shrink (a decision
  every survivor makes alike, so no extra message is needed).
- The grown communicator is the whole job again. The replacement has no state: a survivor
  sends it (``broadcast_object``), so it continues at the same tick with the same total.

Each replica ends printing its tick and total; with --crash R@T on N replicas the total is
N*T + (N-1)*G + N*(ticks - T - G), G = --grow-after (the failed tick is served again).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
from typing import Any

import numpy as np

import ahcomm


async def agree(comm: ahcomm.Comm, state: dict[str, int] | None) -> dict[str, int]:
    """Everyone takes the state of the lowest rank that has one (the replacement has none)."""
    mine = comm.rank if state is not None else comm.size
    root = int((await comm.all_reduce(np.array([mine], np.int64), "min"))[0])
    got: dict[str, int] = await comm.broadcast_object(state, root=root)
    return got


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ticks", type=int, default=60)
    parser.add_argument("--crash", default=None, help="R@T: replica R crashes at tick T (first life only)")
    parser.add_argument("--grow-after", type=int, default=10, help="ticks on the survivors before they grow")
    parser.add_argument("--interval", type=float, default=0.02, help="seconds between ticks")
    args = parser.parse_args()
    crash_rank, crash_tick = (int(x) for x in args.crash.split("@")) if args.crash else (-1, -1)
    replacement = int(os.environ.get("AHCOMM_RESTART_COUNT", "0") or 0) > 0

    comm = await ahcomm.init()
    rank = comm.rank
    retired: list[Any] = []  # communicators replaced by a shrink or a grow (closed at the end)
    state: dict[str, int] | None = None if replacement else {"tick": 0, "total": 0}
    grow_at: int | None = None
    if replacement:
        print(f"replica {rank}: restarted, joined the job; catching up", flush=True)
        state = await agree(comm, None)
    assert state is not None
    while state["tick"] < args.ticks:
        if rank == crash_rank and state["tick"] == crash_tick and not replacement:
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            served = await comm.all_reduce(np.ones(1, np.int64))
        except (ahcomm.CommunicationError, ahcomm.CommClosedError) as exc:
            survivors = await comm.shrink()
            assert survivors is not None
            retired.append(comm)
            comm = survivors
            state = await agree(comm, state)
            grow_at = state["tick"] + args.grow_after
            print(f"replica {rank}: {type(exc).__name__} at tick {state['tick']}; going on with "
                  f"{comm.size} replicas (world ranks {list(comm.world_ranks)})", flush=True)
            continue
        state["tick"] += 1
        state["total"] += int(served[0])
        if grow_at is not None and state["tick"] == grow_at:
            grown = await comm.grow()
            retired.append(comm)
            comm, grow_at = grown, None
            state = await agree(comm, state)
            print(f"replica {rank}: grown back to {comm.size} replicas at tick {state['tick']}", flush=True)
        await asyncio.sleep(args.interval)
    print(f"replica {rank}: tick {state['tick']} total {state['total']}", flush=True)
    await comm.close()
    for old in reversed(retired):
        await old.close()


if __name__ == "__main__":
    asyncio.run(main())

"""Issue 17.3: a communicator belongs to one event loop (other threads call in through
call_threadsafe / comm.sync, in order). Issue 16: a rank that leaves ``async with comm`` on an
exception tells its peers what it was; a send refused on the sender is raised by its recv."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import ahcomm

from jobs import run_job
from support.inproc import run_inproc

T = 20


async def test_a_call_from_another_threads_loop_raises_at_once() -> None:
    """It used to never wake (the collective ran on a loop that nothing drove)."""
    comms = await ahcomm.init_inprocess(2)
    try:
        def from_a_thread_with_its_own_loop() -> str:
            async def call() -> None:
                await comms[0].all_reduce(np.ones(2))
            try:
                asyncio.run(call())
            except ahcomm.WrongLoopError as exc:
                return str(exc)
            return "no error"

        def from_a_thread_without_a_loop() -> str:
            try:
                comms[0].barrier()
            except ahcomm.WrongLoopError as exc:
                return str(exc)
            return "no error"

        text = await asyncio.wait_for(asyncio.to_thread(from_a_thread_with_its_own_loop), 5)
        assert "belongs to event loop" in text and "another event loop" in text and "call_threadsafe" in text
        assert threading.current_thread().name in text  # the owning thread is named
        text = await asyncio.wait_for(asyncio.to_thread(from_a_thread_without_a_loop), 5)
        assert "a thread with no running event loop" in text
        assert isinstance(ahcomm.WrongLoopError("x"), ahcomm.UsageError)
        assert comms[0].seq == 0  # nothing was issued
        got = await asyncio.gather(*(c.all_reduce(np.ones(2), timeout=T) for c in comms))
        assert all(np.all(g == 2) for g in got)
    finally:
        await asyncio.gather(*(c.close() for c in comms))


async def test_call_threadsafe_keeps_one_threads_calls_in_order() -> None:
    """One caller thread per rank issues 60 collectives without waiting: each meets its twin."""
    comms = await ahcomm.init_inprocess(2)
    try:
        def caller(comm: ahcomm.Comm) -> list[float]:
            futures = [comm.call_threadsafe(comm.all_reduce, np.full(3, float(i * (comm.rank + 1))), timeout=T)
                       for i in range(60)]
            return [float(f.result(timeout=3 * T)[0]) for f in futures]

        got = await asyncio.gather(*(asyncio.to_thread(caller, c) for c in comms))
        assert got[0] == got[1] == [3.0 * i for i in range(60)]
    finally:
        await asyncio.gather(*(c.close() for c in comms))


async def test_two_threads_per_rank_taking_turns_through_sync_get_every_result_right() -> None:
    """Threads sharing a communicator must agree on an order: here they take turns. (Through
    run_coroutine_threadsafe with no agreed order, 282 of 400 results were wrong.)"""
    comms = await ahcomm.init_inprocess(2)
    rounds = 40
    try:
        def rank_threads(comm: ahcomm.Comm) -> list[tuple[int, float]]:
            turn = threading.Condition()
            state = {"next": 0}
            results: list[tuple[int, float]] = []

            def worker(k: int) -> None:
                for i in range(rounds):
                    with turn:
                        turn.wait_for(lambda: state["next"] % 2 == k)
                        value = float(100 * k + i)
                        got = comm.sync.all_reduce(np.full(2, value), timeout=T)
                        results.append((k, float(got[0]) / 2 - value))
                        state["next"] += 1
                        turn.notify_all()

            threads = [threading.Thread(target=worker, args=(k,)) for k in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(5 * T)
            return results

        got = await asyncio.gather(*(asyncio.to_thread(rank_threads, c) for c in comms))
        for results in got:
            assert len(results) == 2 * rounds and all(diff == 0 for _, diff in results)
    finally:
        await asyncio.gather(*(c.close() for c in comms))


async def test_threads_with_their_own_sub_communicators_run_concurrently() -> None:
    """The way to let threads issue without agreeing on an order: one communicator each."""
    comms = await ahcomm.init_inprocess(2)
    try:
        subs = await asyncio.gather(*(asyncio.gather(c.split(0), c.split(0)) for c in comms))

        def worker(sub: ahcomm.Comm, k: int) -> list[float]:
            return [float(sub.sync.all_reduce(np.full(2, float(k * 1000 + i)), timeout=T)[0]) for i in range(30)]

        got = await asyncio.gather(*(asyncio.to_thread(worker, pair[k], k) for pair in subs for k in range(2)))
        for n, results in enumerate(got):
            k = n % 2
            assert results == [2.0 * (k * 1000 + i) for i in range(30)]
        # blocking from the loop's own thread would deadlock: refused
        with pytest.raises(ahcomm.UsageError, match="would block"):
            comms[0].sync.barrier()
        assert comms[0].sync.rank == 0
    finally:
        await asyncio.gather(*(c.close() for c in comms))


async def test_leaving_async_with_on_an_exception_tells_the_peers_what_it_was() -> None:
    """Issue 16: the peer used to see 'collective #0 mismatch: ... rank 1 called barrier()'."""
    comms = await ahcomm.init_inprocess(3)

    async def failing(comm: ahcomm.Comm) -> None:
        with pytest.raises(ValueError):
            async with comm:
                await asyncio.sleep(0.05)  # the others are inside their all_reduce by now
                raise ValueError("boom on purpose")

    async def waiting(comm: ahcomm.Comm) -> None:
        async with comm:
            start = time.monotonic()
            with pytest.raises(ahcomm.PeerFailure, match=r"rank 1 aborted its communicator \(it left `async with` "
                                                         r"on ValueError: boom on purpose\)") as info:
                await comm.all_reduce(np.ones(2), timeout=T)
            assert info.value.rank == 1 and time.monotonic() - start < T / 2
            # and which of its own collectives it was in (a newcomer's report: no op, no seq)
            assert info.value.op == "all_reduce" and info.value.seq is not None
            assert f"during all_reduce #{info.value.seq}" in str(info.value)

    await asyncio.wait_for(asyncio.gather(waiting(comms[0]), failing(comms[1]), waiting(comms[2])), 3 * T)
    assert all(c.closed for c in comms)


PROGRAM = """
import asyncio, numpy as np, ahcomm
async def main():
    comm = await ahcomm.init()
    async with comm:
        if comm.rank == 1:
            raise KeyError("no such key on rank one")
        try:
            await comm.all_reduce(np.ones(2), timeout=60)
        except ahcomm.PeerFailure as exc:  # rank 1's word came while it waited
            print("PEER-FAILURE:", exc, flush=True)
        except ahcomm.CommClosedError as exc:  # or before it called
            print("PEER-FAILURE:", exc.__cause__, flush=True)
asyncio.run(main())
"""


def test_leaving_async_with_on_an_exception_tells_peers_in_real_processes(tmp_path: Path) -> None:
    prog = tmp_path / "prog.py"
    prog.write_text(PROGRAM)
    done = run_job(2, sys.executable, str(prog), env={"AHCOMM_BUFFSIZE": "0.0625", "AHCOMM_CONNECT_TIMEOUT": "60"},
                   timeout=120)
    out = done.stdout + done.stderr
    assert done.returncode != 0, out
    assert "PEER-FAILURE: rank 1 aborted its communicator (it left `async with` on KeyError: " \
           "'no such key on rank one')" in out, out
    assert "mismatch" not in out, out


async def test_a_send_refused_on_the_sender_is_raised_by_the_matching_recv() -> None:
    """Issue 16 (p2p): the receiver waited for a message that was never sent."""
    async def body(comm: ahcomm.Comm) -> None:
        if comm.rank == 0:
            with pytest.raises(ahcomm.InvalidDtype, match="complex128"):
                comm.send(np.ones(2, np.complex128), 1, tag=3)
            await comm.send(np.arange(3.0), 1, tag=3)
        else:
            with pytest.raises(ahcomm.InvalidArgument, match=r"recv from rank 0 \(tag 3, #0\): rank 0 could not "
                                                             r"send it: InvalidDtype: .*complex128"):
                await comm.recv(0, tag=3, timeout=T)
            got = await comm.recv(0, tag=3, timeout=T)  # the next message pairs up
            assert list(got) == [0.0, 1.0, 2.0]

    await run_inproc(2, body)

"""oneshot (mailboxes, one host) against numpy, in process, world sizes 1..9.

Every op it claims (all_reduce with every reduction, reduce_scatter, all_gather, broadcast
from every kind of root, barrier), dtypes from bool to bfloat16, counts 0, 1, odd and up to
a slot's capacity, in place and not; results bit-identical on every rank; slots reused by
back-to-back calls; selection (small calls on one host, not beyond a slot, not with
AHCOMM_MAILBOX_BYTES=0); mismatch and abort while a rank waits in its mailbox.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import ahcomm
from ahcomm.transports import mailbox

from support.failing import abort_fails_the_waiters, mismatch_fails_every_rank
from support.inproc import issue_each, run_inproc
from support.numerics import assert_close, redops, reduce_ref
from support.numerics import exact_values as values

SIZES = [1, 2, 3, 4, 5, 6, 7, 8, 9]
DTYPES = [np.float32, np.float64, np.int32, np.int8, np.float16, np.bool_, np.uint64, ml_dtypes.bfloat16]
COUNTS = [0, 1, 37, 1001]


def cases(rng: np.random.Generator, size: int) -> list[tuple[Any, ...]]:
    out: list[tuple[Any, ...]] = []
    for i, dtype in enumerate(DTYPES):
        count = COUNTS[i % len(COUNTS)]
        inplace = i % 2 == 1
        for redop in redops(dtype):
            out.append(("all_reduce", [values(rng, count, dtype, redop) for _ in range(size)], redop, 0, inplace))
        out.append(("reduce_scatter", [values(rng, count * size, dtype) for _ in range(size)], "sum", 0, False))
        out.append(("reduce_scatter", [values(rng, count * size, dtype, "max") for _ in range(size)], "max", 0, False))
        out.append(("all_gather", [values(rng, count, dtype) for _ in range(size)], "", 0, False))
        out.append(("broadcast", [values(rng, count, dtype) for _ in range(size)], "", (2 * i + 1) % size, inplace))
        out.append(("barrier", [np.empty(0)] * size, "", 0, False))
    return out


async def issue(comm: ahcomm.Comm, case: tuple[Any, ...]) -> Any:
    op, xs, redop, root, inplace = case
    x = xs[comm.rank].copy() if inplace else xs[comm.rank]
    if op == "all_reduce":
        got = await comm.all_reduce(x, redop, out=x if inplace else None, algorithm="oneshot")
        assert got is x or not inplace
        return got
    if op == "reduce_scatter":
        return await comm.reduce_scatter(x, redop, algorithm="oneshot")
    if op == "all_gather":
        return await comm.all_gather(x, algorithm="oneshot")
    if op == "broadcast":
        return await comm.broadcast(x, root, out=x if inplace else None, algorithm="oneshot")
    return await comm.barrier()


def want(case: tuple[Any, ...], rank: int, size: int) -> Any:
    op, xs, redop, root, _ = case
    if op == "all_reduce":
        return reduce_ref(xs, redop)
    if op == "reduce_scatter":
        block = xs[0].size // size
        return reduce_ref(xs, redop)[rank * block:(rank + 1) * block]
    if op == "all_gather":
        return np.concatenate(xs)
    if op == "broadcast":
        return xs[root]
    return None


@pytest.mark.parametrize("size", SIZES)
async def test_matrix(size: int, rng: np.random.Generator) -> None:
    todo = cases(rng, size)

    results = await run_inproc(size, lambda comm: issue_each(comm, todo, issue, in_place=lambda case: case[4]))
    for k, case in enumerate(todo):
        for rank in range(size):
            expected = want(case, rank, size)
            if expected is None:
                assert results[rank][k] is None
            else:
                assert_close(results[rank][k].reshape(-1), expected)
        if case[0] == "all_reduce":  # one reduction order everywhere: the same bits on every rank
            assert all(results[0][k].tobytes() == results[r][k].tobytes() for r in range(size))


@pytest.mark.parametrize("size", [2, 3, 5])
async def test_matrix_in_slices(size: int, rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    """Slots of 192 bytes: the 37- and 1001-element calls run in many slices (publications),
    one slot's reader still at slice k while its writer is at slice k + 1."""
    monkeypatch.setenv("AHCOMM_MAILBOX_BYTES", "192")
    await test_matrix(size, rng)


@pytest.mark.parametrize("size", [2, 3, 7])
async def test_rank_order_bit_identical(size: int, rng: np.random.Generator) -> None:
    """Random floats: rank 0 + rank 1 + ... in that order, bit for bit, on every rank."""
    xs = [rng.standard_normal(513).astype(np.float32) for _ in range(size)]
    results = await run_inproc(size, lambda c: c.all_reduce(xs[c.rank], algorithm="oneshot"))
    for got in results:
        np.testing.assert_array_equal(got, reduce_ref(xs, "sum"))


async def test_back_to_back_calls_reuse_slots(rng: np.random.Generator) -> None:
    """Forty calls issued before any completes, oneshot and ring alternating: each slot parity is
    rewritten only once every peer has read it."""
    size = 4
    xs = [[values(rng, 1 + k % 5, np.int64) for _ in range(size)] for k in range(40)]

    async def body(comm: ahcomm.Comm) -> list[Any]:
        futs = [comm.all_reduce(xs[k][comm.rank], algorithm="oneshot" if k % 3 else "ring") for k in range(40)]
        return list(await asyncio.gather(*futs))

    results = await run_inproc(size, body)
    for rank in range(size):
        for k in range(40):
            np.testing.assert_array_equal(results[rank][k], sum(xs[k]))


@pytest.mark.parametrize("size", [3, 4, 5])
async def test_broadcasts_leave_slots_loose_and_later_calls_wait_for_them(size: int, rng: np.random.Generator) -> None:
    """A broadcast's non-roots wait for the root only, so a rank may finish it before its peers
    published theirs: its next publication must wait for them (their slots may still hold data
    that is being read). Sixty calls issued before any completes - broadcasts from every root
    between all_gathers and ring all_reduces (which wait for the peers' progress through the
    CCL buffers: told at their start where broadcasts did not show it) - each checked."""
    kinds = ["broadcast", "broadcast", "all_gather", "broadcast", "ring"]
    plan = [(kinds[k % len(kinds)], 1 + k % 7, (k * 7) % size) for k in range(60)]
    xs = [[values(rng, count * (2 if kind == "ring" else 1), np.int64) for _ in range(size)]
          for kind, count, _ in plan]

    def issue(comm: ahcomm.Comm, k: int) -> "asyncio.Future[Any]":
        kind, _, root = plan[k]
        x = xs[k][comm.rank]
        if kind == "broadcast":
            return comm.broadcast(x, root, algorithm="oneshot")
        if kind == "all_gather":
            return comm.all_gather(x, algorithm="oneshot")
        return comm.all_reduce(x, algorithm="ring")

    async def body(comm: ahcomm.Comm) -> list[Any]:
        return list(await asyncio.wait_for(asyncio.gather(*(issue(comm, k) for k in range(len(plan)))), 30))

    results = await run_inproc(size, body)
    for rank in range(size):
        for k, (kind, _, root) in enumerate(plan):
            want = xs[k][root] if kind == "broadcast" else np.concatenate(xs[k]) if kind == "all_gather" else sum(xs[k])
            np.testing.assert_array_equal(results[rank][k].reshape(-1), want, err_msg=f"rank {rank} call {k} {kind}")


async def test_all_gather_writes_its_own_row_while_it_waits_for_the_peers() -> None:
    """The own row is copied before the wait, while the slot is in the cache and the peers still
    publish (the old code copied every row after the wait); the others only once they arrive."""
    comms = await ahcomm.init_inprocess(2)
    try:
        x = [np.full(1000, r + 1, np.float32) for r in range(2)]
        out = [np.zeros(2000, np.float32) for _ in range(2)]
        first = comms[0].all_gather(x[0], out=out[0], algorithm="oneshot")
        for _ in range(50):  # rank 1 has not called yet
            await asyncio.sleep(0.002)
            if out[0][:1000].any():
                break
        assert not first.done()
        np.testing.assert_array_equal(out[0][:1000], x[0])
        assert not out[0][1000:].any()
        await asyncio.wait_for(asyncio.gather(first, comms[1].all_gather(x[1], out=out[1], algorithm="oneshot")), 20)
        for o in out:
            np.testing.assert_array_equal(o, np.concatenate(x))
    finally:
        await asyncio.gather(*(c.close() for c in comms), return_exceptions=True)


async def test_broadcast_roots_that_differ_fail_every_rank() -> None:
    """Ranks 0 and 1 each think they are the root: the root waits for every peer's publication
    and checks it, so both raise CollectiveMismatchError at once (a non-root checks the root's)."""
    comms = await ahcomm.init_inprocess(3)
    try:
        futs = [comms[r].broadcast(np.ones(4, np.float32), root=min(r, 1), algorithm="oneshot") for r in range(3)]
        results = await asyncio.wait_for(asyncio.gather(*futs, return_exceptions=True), 20)
        assert all(isinstance(r, ahcomm.CollectiveMismatchError) for r in results[:2]), results
        assert all("#0 mismatch" in str(r) for r in results[:2]), results
    finally:
        await asyncio.gather(*(c.close() for c in comms), return_exceptions=True)


async def test_selected_for_small_calls_on_one_host(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("AHCOMM_CORES", "2")  # the defaults on 2 cores: the picks below were measured so
    monkeypatch.setenv("AHCOMM_TUNING_FILE", str(tmp_path / "none.json"))
    comms = await ahcomm.init_inprocess(4)
    try:
        comm = comms[0]
        cap = comm.topology.mailbox
        assert cap == mailbox.DEFAULT_CAPACITY
        for op in ("all_reduce", "broadcast", "all_gather"):
            assert comm.explain(op, 2, np.float32)[0] == "oneshot"
            assert comm.explain(op, 8192, np.float32)[0] == "oneshot"  # 32 KiB
            # 64 MiB: a slice per slot (1 MiB); all_gather's copies through the slots send half
            # their traffic through memory (cost.STAGED)
            big = comm.explain(op, 1 << 24, np.float32)[0]
            assert big == "oneshot" if op == "all_gather" else big != "oneshot"
        assert comm.explain("reduce_scatter", 2, np.float32)[0] == "oneshot"
    finally:
        await asyncio.gather(*(c.close() for c in comms))
    monkeypatch.setenv("AHCOMM_MAILBOX_BYTES", "0")
    comms = await ahcomm.init_inprocess(2)
    try:
        assert comms[0].topology.mailbox == 0
        assert "oneshot" not in comms[0].explain("all_reduce", 2, np.float32)[1]
        with pytest.raises(ahcomm.InvalidArgument, match="oneshot"):
            comms[0].all_reduce(np.ones(2, np.float32), algorithm="oneshot")
    finally:
        await asyncio.gather(*(c.close() for c in comms))


async def test_mismatch_in_the_mailbox_fails_every_rank() -> None:
    """Both ranks run oneshot at seq 0, one an all_reduce, the other an all_gather: the
    fingerprints in the slots differ, and both ranks raise naming the mismatch."""
    await mismatch_fails_every_rank(await ahcomm.init_inprocess(2), "oneshot")


async def test_abort_while_waiting_in_the_mailbox() -> None:
    await abort_fails_the_waiters(lambda c: c.all_reduce(np.ones(4, np.float32), algorithm="oneshot"), 1)


def test_only_the_last_publisher_wakes_and_only_sleepers() -> None:
    """Three ranks, rank 0 published and sleeps: rank 1's publication wakes nobody (rank 2's
    flag is still down, rank 2 will), rank 2's wakes rank 0 once and never rank 1 (awake)."""
    boxes = mailbox.InprocMailboxes(3, 64).boxes
    woken = [0, 0, 0]
    for r, box in enumerate(boxes):
        box.on_wake = lambda r=r: woken.__setitem__(r, woken[r] + 1)
    boxes[0].publish(0, 7, np.ones(2, np.float32))
    boxes[0].sleep()
    boxes[1].publish(0, 7, np.ones(2, np.float32))
    assert woken == [0, 0, 0]
    boxes[2].publish(0, 7, np.ones(2, np.float32))
    assert woken == [1, 0, 0]
    assert [boxes[0].arrived(p, 0) for p in range(3)] == [(0, 7)] * 3
    boxes[0].awake()
    for box in boxes:  # the next tick: nobody sleeps, nobody is woken
        box.publish(1, 7)
    assert woken == [1, 0, 0]
    assert boxes[1].arrived(0, 1) == (1, 7) and boxes[1].arrived(0, 0) == (0, 7)  # the other slot


async def test_reduce_scatter_into_its_own_input_row() -> None:
    """``out`` a view of the rank's own row of its input (the row oneshot reads from the input,
    not from its slot): every rank gets numpy's answer. (The API hands the algorithm a copy of
    an input that ``out`` overlaps, so the algorithm's own guard against it, kept for callers
    inside the package, is not reached from here.)"""
    n, k = 4, 1000
    comms = await ahcomm.init_inprocess(n)
    try:
        xs = [np.random.default_rng(r).standard_normal(n * k).astype(np.float32) for r in range(n)]
        want = sum(x.astype(np.float64) for x in xs)
        ins = [x.copy() for x in xs]
        outs = await asyncio.gather(*(c.reduce_scatter(ins[r], out=ins[r][r * k:(r + 1) * k], algorithm="oneshot")
                                      for r, c in enumerate(comms)))
        for r in range(n):
            assert np.shares_memory(outs[r], ins[r])
            np.testing.assert_allclose(outs[r], want[r * k:(r + 1) * k], rtol=1e-5, atol=1e-5)
    finally:
        await asyncio.gather(*(c.close() for c in comms), return_exceptions=True)


@pytest.mark.parametrize(("lo", "hi"), [(0, 10), (10, 20), (4, 12), (0, 40), (6, 6), (39, 40)])
def test_a_publication_leaves_out_the_rows_no_peer_reads(lo: int, hi: int) -> None:
    """twoshot's own share, reduce_scatter's own row: ``skip`` leaves rows [lo, hi) of the slot as
    they were and copies the rest (a strided input too: the sliced reduce_scatter's rows); the
    publication still says the whole size (peers index the other rows by offset)."""
    for data in (np.arange(40, dtype=np.float32), np.arange(400, dtype=np.float32).reshape(40, 10)[:, 2:5]):
        boxes = mailbox.InprocMailboxes(2, 1024).boxes
        boxes[0].publish(0, 7, np.full(data.shape, 9.0, np.float32))  # slot 0's old bytes: 9.0
        boxes[0].publish(1, 7)
        _, written = boxes[0].publish(2, 7, data, skip=(lo, hi))  # slot 0 again
        want = data.copy()
        want[lo:hi] = 9.0
        np.testing.assert_array_equal(written.view(np.float32).reshape(data.shape), want)
        assert boxes[1].payload(0, 2).nbytes == data.nbytes


def test_spin_only_where_ranks_do_not_outnumber_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mailbox.os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.delenv("AHCOMM_SPIN_US", raising=False)
    assert mailbox.spin_budget(2) == pytest.approx(mailbox.SPIN_US * 1e-6)
    assert mailbox.spin_budget(3) == 0.0 and mailbox.spin_budget(8) == 0.0
    monkeypatch.setenv("AHCOMM_SPIN_US", "0")
    assert mailbox.spin_budget(2) == 0.0
    spin = mailbox.Spin(30e-6)
    for _ in range(mailbox.Spin.GIVE_UP):  # fruitless spins in a row: it rests
        assert spin.allowed() > 0
        spin.result(False)
    assert all(spin.allowed() == 0.0 for _ in range(mailbox.Spin.REST))
    assert spin.allowed() > 0


def test_yielding_spin_only_where_ranks_share_cores_two_to_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """A busy spin where every rank has a core; a yielding one (sched_yield between looks) at up
    to two ranks per core; none beyond (measured slower there); AHCOMM_YIELD_US=0 turns it off."""
    monkeypatch.setattr(mailbox.os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.delenv("AHCOMM_SPIN_US", raising=False)
    monkeypatch.delenv("AHCOMM_YIELD_US", raising=False)
    policies = {n: mailbox.spin_policy(n) for n in (1, 2, 3, 4, 5, 8)}
    assert [(p.budget > 0, p.yields) for p in policies.values()] == [
        (True, False), (True, False), (True, True), (True, True), (False, False), (False, False)]
    assert policies[4].budget == pytest.approx(mailbox.YIELD_US * 1e-6)
    monkeypatch.setenv("AHCOMM_YIELD_US", "0")
    assert mailbox.spin_policy(4).budget == 0.0 and mailbox.spin_policy(2).budget > 0
    calm, busy = mailbox.Spin(200e-6, yields=True), mailbox.Spin(200e-6, yields=True)
    for i in range(40 * mailbox.Spin.GIVE_UP):  # 3 hits in 4 looks: never rests
        assert calm.allowed() > 0
        calm.result(i % 4 != 0)
    for i in range(4 * mailbox.Spin.GIVE_UP):  # 1 in 2 (a host busy with other work): it rests
        if busy.allowed() == 0.0:
            break
        busy.result(i % 2 == 0)
    else:
        raise AssertionError("a yielding spin that misses every other time never rests")
    monkeypatch.setenv("AHCOMM_YIELD_US", "soon")
    with pytest.raises(ahcomm.ConfigError, match="AHCOMM_YIELD_US"):
        mailbox.spin_policy(4)


async def test_a_lost_wake_up_costs_a_recheck_not_a_hang() -> None:
    """Every wake-up dropped: a sleeping rank still finds its peers' flags (RECHECK)."""
    from ahcomm.algorithms._mailbox_sync import RECHECK

    comms = await ahcomm.init_inprocess(3)
    try:
        boxes = [c._executor.mailbox for c in comms]
        for box in boxes:
            assert box is not None
            box._peers = [(asleep, lambda: None) for asleep, _ in box._peers]  # type: ignore[misc]

        async def late(comm: ahcomm.Comm) -> Any:
            await asyncio.sleep(0.02 * comm.rank)  # rank 0 sleeps in its mailbox first
            return await comm.all_reduce(np.full(3, comm.rank + 1, np.int32), algorithm="oneshot")

        results = await asyncio.wait_for(asyncio.gather(*(late(c) for c in comms)), 10 * RECHECK + 5)
        for got in results:
            np.testing.assert_array_equal(got, [6, 6, 6])
        assert sum(box.rechecks for box in boxes if box is not None) >= 1
    finally:
        await asyncio.gather(*(c.close() for c in comms))


@pytest.mark.parametrize("size", [2, 3, 4, 7])
async def test_twoshot_matrix(size: int, rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    """twoshot (all_reduce through the mailboxes in two rounds: each rank reduces its share,
    then every rank gathers the shares): every reduction and dtype, counts 0, 1, 37 and 1001
    (fewer elements than ranks: empty shares), in place and not, in slots of 1 MiB and of 192
    bytes (many slices); the same bits on every rank and as oneshot's."""
    todo = [case for case in cases(rng, size) if case[0] == "all_reduce"]

    async def issue2(comm: ahcomm.Comm, case: tuple[Any, ...]) -> Any:
        _, xs, redop, _, inplace = case
        x = xs[comm.rank].copy() if inplace else xs[comm.rank]
        got = await comm.all_reduce(x, redop, out=x if inplace else None, algorithm="twoshot")
        assert got is x or not inplace
        return got

    for slot in ("1048576", "192"):
        monkeypatch.setenv("AHCOMM_MAILBOX_BYTES", slot)
        results = await run_inproc(size, lambda comm: issue_each(comm, todo, issue2, in_place=lambda c: c[4]))
        for k, case in enumerate(todo):
            for rank in range(size):
                assert_close(results[rank][k].reshape(-1), want(case, rank, size))
            assert all(results[0][k].tobytes() == results[r][k].tobytes() for r in range(size))
    xs = [rng.standard_normal(1001).astype(np.float32) for _ in range(size)]
    two = await run_inproc(size, lambda c: c.all_reduce(xs[c.rank], algorithm="twoshot"))
    one = await run_inproc(size, lambda c: c.all_reduce(xs[c.rank], algorithm="oneshot"))
    assert all(t.tobytes() == one[0].tobytes() for t in two)


async def test_twoshot_back_to_back_with_other_mailbox_calls(rng: np.random.Generator) -> None:
    """Forty calls issued before any completes: twoshot (two publications a call), oneshot and
    broadcasts (loose publications) alternating: no slot is rewritten before every peer read it."""
    size = 4
    xs = [[values(rng, 3 + k % 50, np.int64) for _ in range(size)] for k in range(40)]

    def issue3(comm: ahcomm.Comm, k: int) -> Any:
        x = xs[k][comm.rank]
        if k % 3 == 0:
            return comm.broadcast(x, k % size, algorithm="oneshot")
        return comm.all_reduce(x, algorithm="twoshot" if k % 3 == 1 else "oneshot")

    async def body(comm: ahcomm.Comm) -> list[Any]:
        return list(await asyncio.gather(*(issue3(comm, k) for k in range(40))))

    results = await run_inproc(size, body)
    for rank in range(size):
        for k in range(40):
            np.testing.assert_array_equal(results[rank][k], xs[k][k % size] if k % 3 == 0 else sum(xs[k]))


async def test_twoshot_mismatch_and_abort_fail_every_waiter() -> None:
    """twoshot's publications carry the call's fingerprint like oneshot's: counts that differ
    fail both ranks naming call #0; an abort fails the ranks waiting in the mailbox."""
    comms = await ahcomm.init_inprocess(2)
    try:
        futs = [comms[0].all_reduce(np.ones(4, np.float32), algorithm="twoshot"),
                comms[1].all_reduce(np.ones(6, np.float32), algorithm="twoshot")]
        results = await asyncio.wait_for(asyncio.gather(*futs, return_exceptions=True), 20)
        assert all(isinstance(r, ahcomm.CollectiveMismatchError) and "#0 mismatch" in str(r) for r in results), results
    finally:
        await asyncio.gather(*(c.close() for c in comms))
    await abort_fails_the_waiters(lambda c: c.all_reduce(np.ones(4, np.float32), algorithm="twoshot"), 2)


async def test_twoshot_abort_between_the_rounds(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank that aborts after its first publication, before its share's: the ranks waiting
    for that share raise PeerFailure naming it, none hangs."""
    from ahcomm.algorithms import twoshot

    comms = await ahcomm.init_inprocess(3)
    real, made = twoshot.publish, [0, 0, 0]

    async def publish(ctx: Any, data: Any, **kw: Any) -> Any:
        made[ctx.rank] += 1
        if ctx.rank == 2 and made[2] == 2:  # rank 2 read every input, then stops
            comms[2].abort("stop")
            raise RuntimeError("stopped between the rounds")
        return await real(ctx, data, **kw)

    monkeypatch.setattr(twoshot, "publish", publish)
    try:
        futs = [c.all_reduce(np.ones(4, np.float32), algorithm="twoshot") for c in comms]
        got = await asyncio.wait_for(asyncio.gather(*futs, return_exceptions=True), 10)
        assert made[:2] == [2, 2], made  # ranks 0 and 1 published their shares and waited for rank 2's
        for r in (0, 1):
            assert isinstance(got[r], ahcomm.PeerFailure) and "rank 2 aborted" in str(got[r]), got
    finally:
        await asyncio.gather(*(c.close() for c in comms), return_exceptions=True)


def test_twoshot_picked_where_the_results_say() -> None:
    """The cost model's twoshot picks that README and results/2026-11-26-twoshot.md state: all_reduce
    at 512 KiB-2 MiB on 4 ranks of 2 cores (oneshot below, star above), up to 2 MiB on 6 (since
    star's crowded copies are priced: results/2026-11-26-star-phases.md, a tie measured there)
    and 1 MiB on 8, never at 2 ranks."""
    from ahcomm.algorithms import REGISTRY
    from ahcomm.algorithms._selection import Selector
    from ahcomm.algorithms.call import Call, Topology
    from ahcomm.algorithms.cost import CostModel

    def pick(n: int, kib: int) -> str:
        topo = Topology(rank=0, size=n, hosts=("h",) * n, link_kinds=("self",) + ("sdma",) * (n - 1),
                        all_mapped=True, single_copy=True, mailbox=mailbox.DEFAULT_CAPACITY)
        call = Call(op="all_reduce", seq=0, dtype=np.dtype(np.float32), count=kib * 256)
        return Selector(REGISTRY, "", CostModel(cores=2)).choose(call, topo).name

    assert [pick(4, kib) for kib in (256, 512, 1024, 2048, 4096)] == \
        ["oneshot", "twoshot", "twoshot", "twoshot", "star"]
    assert pick(6, 1024) == pick(8, 1024) == pick(6, 2048) == "twoshot" != pick(8, 2048)
    assert all(pick(2, kib) == "oneshot" for kib in (256, 1024, 2048, 8192))


def test_twoshot_is_picked_only_where_it_was_measured() -> None:
    """The selector gives it calls of at most 4 mailbox slots: with a core per rank the model
    would take 8 MiB all_reduces from mesh on 4 ranks, unmeasured (forced, it runs any size)."""
    from ahcomm.algorithms import REGISTRY
    from ahcomm.algorithms._selection import Selector
    from ahcomm.algorithms.call import Call, Topology
    from ahcomm.algorithms.cost import CostModel

    topo = Topology(rank=0, size=4, hosts=("h",) * 4, link_kinds=("self",) + ("sdma",) * 3,
                    all_mapped=True, single_copy=True, mailbox=1 << 20)
    sel = Selector(REGISTRY, "", CostModel(cores=4))
    calls = [Call(op="all_reduce", seq=0, dtype=np.dtype(np.float32), count=mib << 18) for mib in (4, 8)]
    assert [sel.choose(c, topo).name for c in calls] == ["twoshot", "mesh"]
    assert REGISTRY.algorithms["twoshot"].select(calls[1], topo)


@pytest.mark.parametrize("dtype", [np.float32, np.int64, ml_dtypes.bfloat16])
def test_fold_may_read_the_output_as_its_first_or_second_part_only(dtype: Any) -> None:
    """What oneshot's reduce_scatter and twoshot rely on to read their own part from an input
    that is also the output: a fold whose output is its first or second part gives the plain
    result; a later part that is the output does not, and ``fold_may_read`` says so."""
    from ahcomm.algorithms.base import fold, fold_may_read

    parts = [np.arange(1, 9).astype(dtype) * (k + 1) ** 2 for k in range(4)]
    want = np.zeros(8, dtype)
    fold(np.add, [p.copy() for p in parts], want)
    for index in range(4):
        got = [p.copy() for p in parts]
        out = got[index]
        fold(np.add, got, out)
        assert fold_may_read(index, got[index], out) == (index <= 1)
        assert np.array_equal(out, want) == (index <= 1), index
    assert fold_may_read(3, parts[3], np.zeros(8, dtype))  # no overlap: any part

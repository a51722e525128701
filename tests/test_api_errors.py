"""Bad input raises a clear error on the calling rank before anything is sent."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import ahcomm

from support.inproc import run_inproc


async def test_bad_inputs_are_named() -> None:
    async def body(comm: ahcomm.Comm) -> None:
        x = np.ones(8, np.float32)
        with pytest.raises(ahcomm.InvalidDtype, match="complex128"):
            comm.all_reduce(np.ones(4, np.complex128))
        with pytest.raises(TypeError, match="'avg' needs a floating dtype, got int32"):
            comm.all_reduce(np.ones(4, np.int32), "avg")
        with pytest.raises(ahcomm.InvalidArgument, match="unknown reduce op 'mean'"):
            comm.all_reduce(x, "mean")
        with pytest.raises(ahcomm.InvalidArgument, match=r"out has shape \(4,\).*expected shape \(8,\)"):
            comm.all_reduce(x, out=np.empty(4, np.float32))
        with pytest.raises(ahcomm.InvalidArgument, match="dtype float64"):
            comm.all_reduce(x, out=np.empty(8, np.float64))
        ro = np.empty(8, np.float32)
        ro.flags.writeable = False
        with pytest.raises(ahcomm.InvalidArgument, match="read-only"):
            comm.all_reduce(x, out=ro)
        with pytest.raises(ahcomm.InvalidArgument, match="root 5 is out of range for world size 2"):
            comm.broadcast(x, root=5)
        with pytest.raises(ahcomm.InvalidArgument, match="divisible by the world size.*pad x to a multiple of 2"):
            comm.reduce_scatter(np.ones(3, np.float32))
        with pytest.raises(ahcomm.InvalidArgument, match="must be a numpy array.*list"):
            comm.all_reduce([1.0, 2.0])
        with pytest.raises(ahcomm.InvalidArgument, match="'tree' cannot run all_reduce.*can: ring, mesh"):
            comm.all_reduce(x, algorithm="tree")
        # Nothing was issued by the failed calls: the next collective still pairs up.
        assert comm.seq == 0
        y = await comm.all_reduce(x)
        assert np.all(y == 2)

    await run_inproc(2, body)


async def test_closed_communicator_refuses() -> None:
    comms = await ahcomm.init_inprocess(2)
    await asyncio_gather_close(comms)
    with pytest.raises(ahcomm.CommClosedError, match="closed"):
        comms[0].all_reduce(np.ones(2))


async def asyncio_gather_close(comms: list[ahcomm.Comm]) -> None:
    import asyncio

    await asyncio.gather(*(c.close() for c in comms))


async def test_abort_fails_pending_and_later_calls() -> None:
    comms = await ahcomm.init_inprocess(2)
    pending = comms[0].all_reduce(np.ones(4))  # rank 1 never joins
    comms[0].abort("aborted by test")
    with pytest.raises(ahcomm.AhcommError, match="aborted by test"):
        await pending
    with pytest.raises(ahcomm.CommClosedError):
        comms[0].all_reduce(np.ones(4))
    await asyncio_gather_close(comms)


async def test_exec_timeout_names_op_and_seq(monkeypatch: pytest.MonkeyPatch) -> None:
    comms = await ahcomm.init_inprocess(2)
    comms[0]._exec_timeout = 0.2
    with pytest.raises(ahcomm.CollectiveTimeout, match=r"all_reduce #0 on rank 0 did not complete"):
        await comms[0].all_reduce(np.ones(4))
    await asyncio_gather_close(comms)


def test_module_api_without_init() -> None:
    with pytest.raises(ahcomm.CommClosedError, match="ahcomm.init"):
        ahcomm.get_rank()


async def test_init_without_environment_says_how() -> None:
    with pytest.raises(ahcomm.ConfigError, match="ahcomm-run"):
        await ahcomm.init(config=ahcomm.Config())


async def test_single_rank_init_needs_no_rendezvous() -> None:
    await ahcomm.init(rank=0, world_size=1, config=ahcomm.Config())
    assert ahcomm.get_rank() == 0 and ahcomm.get_world_size() == 1
    x = np.arange(5.0)
    np.testing.assert_array_equal(await ahcomm.all_reduce(x), x)
    np.testing.assert_array_equal(await ahcomm.all_gather(x), x)
    np.testing.assert_array_equal(await ahcomm.reduce_scatter(x), x)
    np.testing.assert_array_equal(await ahcomm.broadcast(x), x)
    await ahcomm.barrier()
    await ahcomm.finalize()
    with pytest.raises(ahcomm.CommClosedError):
        ahcomm.default_comm()


async def test_abort_reaches_the_peers() -> None:
    comms = await ahcomm.init_inprocess(3)
    waiting = [comms[1].all_reduce(np.ones(4)), comms[2].all_reduce(np.ones(4))]
    comms[0].abort("operator pressed stop")
    for fut in waiting:
        with pytest.raises(ahcomm.PeerFailure, match="rank 0 aborted its communicator \\(operator pressed stop\\)"):
            await fut
    for late in comms[1:]:  # later calls on the peers refuse at once, naming the abort
        with pytest.raises(ahcomm.CommClosedError, match="failed earlier: rank 0 aborted"):
            late.all_reduce(np.ones(4))
    await asyncio_gather_close(comms)


async def test_buffer_too_small_for_ring_reduce_scatter_is_a_clear_error() -> None:
    async def body(comm: ahcomm.Comm) -> str:
        with pytest.raises(ahcomm.ConfigError, match="AHCOMM_BUFFSIZE is too small for ring reduce_scatter on 12"):
            await comm.reduce_scatter(np.ones(24), algorithm="ring")
        return "ok"

    assert await run_inproc(12, body, buffsize=1024) == ["ok"] * 12


async def test_catalogue_bad_inputs_are_named_before_anything_is_sent() -> None:
    async def body(comm: ahcomm.Comm) -> int:
        x = np.ones((6, 2), np.float32)
        with pytest.raises(ahcomm.InvalidArgument, match="reduce: root 2 is out of range for world size 2"):
            comm.reduce(x, root=2)
        with pytest.raises(ahcomm.InvalidArgument, match=r"scatter: x.shape\[0\] \(5\) must be divisible.*scatter_v"):
            comm.scatter(np.ones(5))
        with pytest.raises(ahcomm.InvalidArgument, match=r"all_to_all: x.shape\[0\] \(3\).*all_to_all_v"):
            comm.all_to_all(np.ones(3))
        with pytest.raises(ahcomm.InvalidArgument, match="reduce_scatter_v: counts add up to 5 rows but x has 6"):
            comm.reduce_scatter_v(x, [2, 3])
        with pytest.raises(ahcomm.InvalidArgument, match=r"counts must be 2 non-negative integers.*\[1, -1\]"):
            comm.reduce_scatter_v(x, [1, -1])
        with pytest.raises(ahcomm.InvalidArgument, match=r"all_to_all_v: send_counts must be 2"):
            comm.all_to_all_v(x, [6])
        with pytest.raises(ahcomm.InvalidArgument, match=r"gather_v: counts\[\d\] is 4 but this rank's x has 6 rows"):
            comm.gather_v(x, counts=[4, 4])
        with pytest.raises(ahcomm.InvalidArgument, match="at least one dimension"):
            comm.all_gather_v(np.float32(1))
        with pytest.raises(ahcomm.InvalidArgument, match="scatter_v: x is required"):
            comm.scatter_v(None, [1, 1], root=0, out=None)
        with pytest.raises(ahcomm.InvalidDtype, match="'band'.*float32"):
            comm.reduce(x, "band")
        with pytest.raises(ahcomm.InvalidArgument, match="'pairwise' cannot run reduce.*can:"):
            comm.reduce(x, algorithm="pairwise")
        with pytest.raises(ahcomm.InvalidArgument, match=r"reduce: out has shape \(3,\)"):
            comm.reduce(x, root=comm.rank, out=np.empty(3, np.float32))
        # The checks only some ranks can make (a root's x or out=, this rank's own rows: the
        # scatter, scatter_v, gather_v and reduce out= calls above) took a sequence number and
        # retired it on every rank; the others issued nothing. The next collective pairs up.
        seq = comm.seq
        got = await comm.reduce_scatter_v(x, [2, 4])
        assert got.shape == ((2, 2) if comm.rank == 0 else (4, 2)) and np.all(got == 2)
        return seq

    assert await run_inproc(2, body) == [4, 4]


async def test_ahcomm_algo_names_catalogue_algorithms_per_op() -> None:
    """HCCL_ALGO's per-op grammar with upper-case names; alltoall= also covers all_to_all_v."""
    seen: dict[str, str] = {}

    async def body(comm: ahcomm.Comm) -> None:
        for op, count in (("all_reduce", 8), ("all_to_all", 4), ("all_to_all_v", 4), ("all_gather", 4)):
            seen[op] = comm.explain(op, count)[0]
        np.testing.assert_array_equal(await comm.all_reduce(np.ones(8)), np.full(8, 3.0))

    await run_inproc(3, body, algo="allreduce=level0:NHR/alltoall=level0:pairwise")
    assert seen["all_reduce"] == "nhr" and seen["all_to_all"] == "pairwise" and seen["all_to_all_v"] == "pairwise"
    assert seen["all_gather"] != "nhr"  # other ops keep the selector's choice


@pytest.mark.asyncio
async def test_explain_names_an_unknown_op_and_reads_as_text() -> None:
    comms = await ahcomm.init_inprocess(2)
    try:
        with pytest.raises(ahcomm.InvalidArgument, match="unknown op 'allreduce' .did you mean 'all_reduce'"):
            comms[0].explain("allreduce", 100)
        shown = repr(comms[0].explain("all_reduce", 1000))
        assert shown.startswith("Explanation(") and " us" in shown and "by " in shown, shown
        algorithm, costs = comms[0].explain("all_reduce", 1000)  # still the (algorithm, costs) pair
        assert algorithm in costs
    finally:
        await asyncio.gather(*(c.close() for c in comms))


@pytest.mark.asyncio
async def test_a_call_against_a_peer_s_close_names_close() -> None:
    """One collective too many on rank 0 meets rank 1's close(): the message says the barrier
    rank 1 "called" is close()'s, not one the user wrote."""
    comms = await ahcomm.init_inprocess(2)
    extra = comms[0].all_reduce(np.ones(4, np.float32))
    closing = asyncio.ensure_future(comms[1].close())
    with pytest.raises(ahcomm.CollectiveMismatchError, match=r"rank 1 called barrier\(\) in close\(\)"):
        await asyncio.wait_for(extra, 30)
    await asyncio.gather(closing, comms[0].close(), return_exceptions=True)

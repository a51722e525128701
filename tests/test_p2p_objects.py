"""Point-to-point (send, recv, batch_send_recv) and object collectives, in process."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import ahcomm
from ahcomm import P2POp

from support.inproc import run_inproc


@pytest.mark.parametrize("size", [2, 3, 5])
async def test_ring_shift_with_batch_send_recv(size: int) -> None:
    async def body(comm: ahcomm.Comm) -> list[np.ndarray | None]:
        r, n = comm.rank, comm.size
        x = np.arange(100_000, dtype=np.float64) + r  # 800 KB: zero-copy frames on real links
        out = np.empty_like(x)
        return await comm.batch_send_recv([P2POp("recv", out, (r - 1) % n), P2POp("send", x, (r + 1) % n)])

    results = await run_inproc(size, body)
    for r, (got, sent) in enumerate(results):
        assert sent is None
        assert got is not None
        np.testing.assert_array_equal(got, np.arange(100_000, dtype=np.float64) + (r - 1) % size)


async def test_messages_match_in_order_per_tag_and_carry_shape_and_dtype() -> None:
    async def body(comm: ahcomm.Comm) -> list[np.ndarray]:
        if comm.rank == 0:
            # Sent in an order the receiver does not follow: tags keep them apart, order within a tag holds.
            await asyncio.gather(comm.send(np.full((2, 3), 1, np.int16), 1, tag=7),
                                 comm.send(np.array([2.5]), 1),
                                 comm.send(np.full((2, 3), 3, np.int16), 1, tag=7),
                                 comm.send(np.zeros(0, np.uint8), 1))
            return []
        empty = await comm.recv(0)  # the second message of tag 0 is received after the first
        first7 = await comm.recv(0, tag=7)
        second7 = await comm.recv(0, tag=7, shape=(2, 3), dtype=np.int16)
        return [empty, first7, second7]

    _, (a, b, c) = await run_inproc(2, body)
    np.testing.assert_array_equal(a, [2.5])
    assert b.shape == (2, 3) and b.dtype == np.int16 and np.all(b == 1)
    assert np.all(c == 3)


async def test_recv_checks_what_arrived_against_what_was_expected() -> None:
    async def body(comm: ahcomm.Comm) -> None:
        if comm.rank == 0:
            await comm.send(np.ones(4, np.float32), 1)
            await comm.send(np.ones(4, np.float32), 1)
        else:
            with pytest.raises(ahcomm.CollectiveMismatchError, match=r"recv from rank 0 \(tag 0, #0\).*float64"):
                await comm.recv(0, out=np.empty(4, np.float64))
            with pytest.raises(ahcomm.CollectiveMismatchError, match=r"expected shape \(5,\)"):
                await comm.recv(0, shape=(5,), dtype=np.float32)

    await run_inproc(2, body)


async def test_p2p_bad_arguments_are_named() -> None:
    async def body(comm: ahcomm.Comm) -> None:
        with pytest.raises(ahcomm.InvalidArgument, match="peer rank 3 is out of range for world size 2"):
            comm.send(np.ones(2), 3)
        with pytest.raises(ahcomm.InvalidArgument, match="cannot recv itself"):
            comm.recv(comm.rank)
        with pytest.raises(ahcomm.InvalidArgument, match="tag must be an integer in 0..65535"):
            comm.send(np.ones(2), 1 - comm.rank, tag=-1)
        with pytest.raises(ahcomm.InvalidArgument, match="op kind must be 'send' or 'recv'"):
            comm.batch_send_recv([P2POp("put", np.ones(2), 1 - comm.rank)])

    await run_inproc(2, body)


async def test_p2p_does_not_wait_behind_collectives() -> None:
    """A recv completes while a collective that needs the receiver's peer is still pending."""
    async def body(comm: ahcomm.Comm) -> float:
        if comm.rank == 0:
            pending = comm.all_reduce(np.ones(3))  # rank 1 joins only after it got the message
            await comm.send(np.array([42.0]), 1)
            return float((await pending)[0])
        got = await comm.recv(0)
        total = await comm.all_reduce(np.ones(3))
        return float(got[0] + total[0])

    assert await run_inproc(2, body) == [2.0, 44.0]


@pytest.mark.parametrize("size", [1, 2, 4, 7])
async def test_object_collectives(size: int) -> None:
    async def body(comm: ahcomm.Comm) -> tuple[object, object, object]:
        r = comm.rank
        obj = {"rank": r, "name": f"r{r}", "blob": bytes(range(r % 256)) * 100, "nested": [r, None, 1.5]}
        b = await comm.broadcast_object(obj if r == size - 1 else None, root=size - 1)
        a = await comm.all_gather_object(obj)
        g = await comm.gather_object(r * "x", root=0)
        return b, a, g

    results = await run_inproc(size, body, buffsize=4096)
    objs = [{"rank": r, "name": f"r{r}", "blob": bytes(range(r % 256)) * 100, "nested": [r, None, 1.5]}
            for r in range(size)]
    for r, (b, a, g) in enumerate(results):
        assert b == objs[-1]
        assert a == objs
        assert g == ([p * "x" for p in range(size)] if r == 0 else None)


async def test_object_that_msgpack_cannot_encode_fails_the_call_on_every_rank() -> None:
    """Issue 16: an object only its rank can check (a set at broadcast_object's root) used to
    raise there alone while the others waited inside the call and later saw a mismatch. The
    rank sends its error instead: every rank raises it for that call and the job stays in step."""
    async def body(comm: ahcomm.Comm) -> float:
        with pytest.raises(ahcomm.InvalidArgument, match=r"broadcast_object: rank 0 could not send its object: "
                                                         r"broadcast_object: the object cannot be sent with msgpack"):
            await comm.broadcast_object({1, 2} if comm.rank == 0 else None, timeout=20)
        with pytest.raises(ahcomm.InvalidArgument, match="all_gather_object: rank 1 could not send its object: "
                                                         "all_gather_object: the object cannot be sent"):
            await comm.all_gather_object(object() if comm.rank == 1 else comm.rank, timeout=20)
        text = ("gather_object: rank 1 could not send its object: gather_object: the object cannot be sent"
                if comm.rank in (0, 1) else r"gather_object: rank 1 could not send its object \(its error")
        with pytest.raises(ahcomm.InvalidArgument, match=text):
            await comm.gather_object({1} if comm.rank == 1 else comm.rank, timeout=20)
        assert await comm.broadcast_object("fine", root=2, timeout=20) == "fine"
        assert await comm.all_gather_object(comm.rank, timeout=20) == [0, 1, 2]
        return float((await comm.all_reduce(np.ones(2), timeout=20))[0])

    assert await run_inproc(3, body) == [3.0] * 3

"""The link data-plane contract, checked on every link implementation (trio's ``check_*_stream``
idea; Gloo runs each test once per transport): inproc, sdma and rdma links made inside this
process by ``ahcomm.testing.local_links`` (the bootstrap's own transport table and handshake).

What an algorithm relies on: ``post`` sets the peer's flag to 1 carrying a value, ``wait``
consumes it (back to 0), a second post before the wait is one flag (an overrun), flags are
apart per (signal, index, seq parity); ``put`` then ``post`` (and ``flush`` where puts are not
copies) means the bytes have landed, for 0, 1, odd, large and multi-frame sizes, in order;
``remote`` maps the peer's buffers exactly where ``mapped``; ``read`` copies the peer's memory
where ``single_copy``, and ``pipe`` reads and writes it by address, piece after piece (bounced
where the kernel would copy slowly; ``read_word``: one int64); ``words`` maps the peer's CCL_Out
words where ``mapped``; ``fail`` wakes every waiter and every later wait raises.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import numpy as np
import pytest

from ahcomm import TransportError, _bootstrap
from ahcomm._memcopy import PAGE, misaligned
from ahcomm.testing import TRANSPORTS, LocalLinks, local_links
from ahcomm.transports.base import EAGER_BYTES, MAX_CONTROL, Link, Signal

from support.sizes import LINK_SIZES

# sdma twice: notifies through the peers' shared-memory inboxes (as init makes them), and over
# ZeroMQ alone (a host without inboxes, or a ring that filled up)
pytestmark = pytest.mark.parametrize("transport", [*TRANSPORTS, "sdma-zeromq"])


def _run(fn, *args):  # type: ignore[no-untyped-def]
    """The inline memory runner (``Stream.memory`` without a copy engine)."""
    fn(*args)


@pytest.fixture
async def pair(transport: str) -> AsyncIterator[LocalLinks]:
    kind, _, notify = transport.partition("-")
    made = await local_links(2, transport=kind, buffsize=max(LINK_SIZES) + 4096, shm_notify=notify != "zeromq")
    try:
        yield made
    finally:
        made.close()


def ends(made: LocalLinks) -> tuple[Link, Link]:
    return made.links[0][1], made.links[1][0]


async def until(cond: Callable[[], bool]) -> None:
    async with asyncio.timeout(10):
        while not cond():
            await asyncio.sleep(0.001)


async def settle(link: Link, signal: Signal, index: int, seq: int) -> None:
    await asyncio.wait_for(link.wait(signal, index, seq), 10)


async def test_kind_and_table(pair: LocalLinks, transport: str) -> None:
    a, b = ends(pair)
    assert a.kind == b.kind == transport.partition("-")[0] and a.peer == 1 and b.peer == 0
    assert [t.name for t in _bootstrap.TRANSPORTS] == ["sdma", "rdma"]  # tried in this order


async def test_post_sets_one_and_wait_consumes(pair: LocalLinks) -> None:
    a, b = ends(pair)
    a.post(Signal.DATA, 2, 7, 1234, 99)
    await settle(b, Signal.DATA, 2, 7)
    assert b.value(Signal.DATA, 2, 7) == 1234
    assert b.notify(Signal.DATA, 2, 7).value == 0  # consumed
    flag = b.notify(Signal.ACK, 0, 7)
    a.post(Signal.ACK, 0, 7)
    a.post(Signal.ACK, 0, 7)  # two posts before any wait: one flag at 1 (the second an overrun)
    await until(lambda: flag.overruns == 1)
    assert flag.value == 1
    await settle(b, Signal.ACK, 0, 7)
    assert flag.value == 0 and not flag.try_wait()


async def test_flags_apart_by_signal_index_and_seq_parity(pair: LocalLinks) -> None:
    a, b = ends(pair)
    for signal in (Signal.ACK, Signal.DATA, Signal.DATA_ACK):
        for index in (0, 1, 0xFFFE):
            for seq in (4, 5):
                a.post(signal, index, seq, value=int(signal) * 100000 + index * 10 + seq)
    for signal in (Signal.ACK, Signal.DATA, Signal.DATA_ACK):
        for index in (0, 1, 0xFFFE):
            for seq in (4, 5):
                await settle(b, signal, index, seq)
                assert b.value(signal, index, seq) == int(signal) * 100000 + index * 10 + seq
    assert all(f.overruns == 0 for f in b._notifies.values())


@pytest.mark.parametrize("nbytes", LINK_SIZES)
async def test_put_then_post_lands_in_order(pair: LocalLinks, nbytes: int) -> None:
    a, b = ends(pair)
    rng = np.random.default_rng(nbytes)
    first = rng.integers(0, 256, nbytes, dtype=np.uint8)
    second = rng.integers(0, 256, nbytes, dtype=np.uint8)
    for k, data in enumerate((first, second)):  # the second put overwrites the first: order holds
        pending = a.put(data, "in", 64, seq=k, run=_run)
        if pending is not None:
            await pending
        a.post(Signal.DATA, 0, k)
        await settle(b, Signal.DATA, 0, k)
        np.testing.assert_array_equal(pair.buffers[1].ccl_in.array[64:64 + nbytes], data)
    await asyncio.wait_for(a.flush(), 10)  # every put acknowledged (no-op where puts are copies)
    assert a.bytes_sent == 2 * nbytes


async def test_put_into_out_buffer_and_both_directions(pair: LocalLinks) -> None:
    a, b = ends(pair)
    x, y = np.arange(100, dtype=np.float64), -np.arange(50, dtype=np.int32)
    a.put(x, "out", 0, 1, _run)
    b.put(y, "out", 128, 1, _run)
    a.post(Signal.DATA, 0, 1)
    b.post(Signal.DATA, 0, 1)
    await settle(b, Signal.DATA, 0, 1)
    await settle(a, Signal.DATA, 0, 1)
    np.testing.assert_array_equal(pair.buffers[1].ccl_out.array[:800].view(np.float64), x)
    np.testing.assert_array_equal(pair.buffers[0].ccl_out.array[128:328].view(np.int32), y)


async def test_a_put_needs_a_contiguous_source(pair: LocalLinks) -> None:
    a, _ = ends(pair)
    with pytest.raises(ValueError, match="contiguous"):
        a.put(np.arange(10, dtype=np.uint8)[::2], "in", 0, 0, _run)


async def test_remote_maps_the_peers_buffers_where_mapped(pair: LocalLinks) -> None:
    a, _ = ends(pair)
    if not a.mapped:
        with pytest.raises(NotImplementedError):
            a.remote("in")
        return
    for buf, region in (("in", pair.buffers[1].ccl_in), ("out", pair.buffers[1].ccl_out)):
        view = a.remote(buf)
        assert view.dtype == np.uint8 and view.nbytes == region.array.nbytes
        region.array[:4] = [1, 2, 3, 4]
        np.testing.assert_array_equal(view[:4], [1, 2, 3, 4])  # the same memory, not a copy


async def test_read_copies_the_peers_memory_where_single_copy(pair: LocalLinks) -> None:
    a, b = ends(pair)
    src = np.arange(1000, dtype=np.uint32)  # "rank 1's user buffer": one process, one address space
    dst = np.zeros_like(src)
    if not a.single_copy:
        with pytest.raises(NotImplementedError):
            a.read(dst.view(np.uint8), int(src.ctypes.data), _run)
        return
    b.post(Signal.DATA, 2, 0, value=int(src.ctypes.data))  # the owner posts the address
    await settle(a, Signal.DATA, 2, 0)
    a.read(dst.view(np.uint8), a.value(Signal.DATA, 2, 0), _run)
    np.testing.assert_array_equal(dst, src)


async def test_read_word_reads_one_int64_of_the_peers_memory_where_single_copy(pair: LocalLinks) -> None:
    a, _b = ends(pair)
    words = np.array([7, -1 << 40, 3], np.int64)
    if not a.single_copy:
        with pytest.raises(NotImplementedError):
            a.read_word(int(words.ctypes.data))
        return
    received = a.stats()["bytes_received"]
    assert [a.read_word(int(words.ctypes.data) + 8 * i) for i in range(3)] == [7, -1 << 40, 3]
    words[1] = 5  # read now, not a copy from before
    assert a.read_word(int(words.ctypes.data) + 8) == 5
    assert a.stats()["bytes_received"] == received  # a flag, not data


@pytest.mark.parametrize("gap", [0, 8])  # (destination - source) % page: 8 is the kernel's slow case, bounced
async def test_pipe_reads_and_writes_the_peers_memory_by_address_where_single_copy(pair: LocalLinks,
                                                                                    gap: int) -> None:
    a, _b = ends(pair)
    pipe = a.pipe()
    if not a.single_copy:
        assert pipe is None
        return
    assert pipe is not None
    theirs = np.arange(6000, dtype=np.uint32)  # the peer's memory (one process, one address space)
    mine = np.zeros(8000, np.uint32)
    base, remote, nbytes = int(mine.ctypes.data), int(theirs.ctypes.data) + 4, 5000 * 4 - 4
    at = (remote + gap - base) % PAGE  # where in mine the read lands: (local - remote) % PAGE == gap
    assert misaligned(base + at, remote, nbytes) == (gap != 0)
    received, sent = a.stats()["bytes_received"], a.stats()["bytes_sent"]
    pipe.read(base + at, remote, nbytes)
    np.testing.assert_array_equal(mine.view(np.uint8)[at:at + nbytes], theirs.view(np.uint8)[4:4 + nbytes])
    assert not mine.view(np.uint8)[:at].any() and not mine.view(np.uint8)[at + nbytes:].any()
    mine.view(np.uint8)[:] = np.arange(mine.nbytes) % 251  # a pattern: a misplaced byte shows
    before = theirs.view(np.uint8).copy()
    at = (remote - gap - base) % PAGE  # where in mine the write comes from: (remote - local) % PAGE == gap
    assert misaligned(remote, base + at, nbytes) == (gap != 0)
    pipe.write(base + at, remote, nbytes)
    after = theirs.view(np.uint8)
    np.testing.assert_array_equal(after[4:4 + nbytes], mine.view(np.uint8)[at:at + nbytes])
    assert (after[:4] == before[:4]).all() and (after[4 + nbytes:] == before[4 + nbytes:]).all()  # nothing around
    stats = a.stats()
    assert (stats["bytes_received"] - received, stats["bytes_sent"] - sent) == (nbytes, nbytes)


async def test_words_maps_the_peers_ccl_out_words_live_where_mapped(pair: LocalLinks) -> None:
    a, _b = ends(pair)
    theirs = pair.buffers[1].ccl_out.words  # rank 1's; word 0 says where they lie in its process
    at = int(theirs.ctypes.data)
    assert int(theirs[0]) == at
    assert a.words(at + 8, 0) is None and a.words(at + 4, 1) is None  # nothing, misaligned
    assert a.words(int(np.zeros(2, np.int64).ctypes.data), 2) is None  # not its words: read_word reads it
    mapped = a.words(at + 8, 2)
    if not a.mapped:
        assert mapped is None
        return
    assert mapped is not None and mapped.dtype == np.int64
    theirs[1:3] = [7, -3]
    assert mapped.tolist() == [7, -3]  # live: the owner's later store shows
    assert not mapped.flags.writeable  # the owner's flags: a peer only looks
    assert a.words(at, 1) is None and a.words(at + 8 * (theirs.size - 1), 2) is None  # word 0, past the end


async def test_fail_wakes_waiters_and_later_waits_raise(pair: LocalLinks) -> None:
    _a, b = ends(pair)
    waiter = asyncio.ensure_future(b.wait(Signal.DATA, 0, 3))
    await asyncio.sleep(0.01)
    error = RuntimeError("link failed for the test")
    b.fail(error)
    with pytest.raises(RuntimeError, match="link failed for the test"):
        await asyncio.wait_for(waiter, 5)
    with pytest.raises(RuntimeError, match="link failed for the test"):
        await b.wait(Signal.ACK, 1, 4)  # a flag first asked for after the failure


@pytest.mark.parametrize("nbytes", [0, 1, 63, EAGER_BYTES])
async def test_eager_messages_before_and_after_they_are_asked_for(pair: LocalLinks, nbytes: int) -> None:
    """One message per (call, direction), matched by seq whether it arrives first or is asked for
    first; the source may be reused at once (copied on the way); None sends no bytes."""
    a, b = ends(pair)
    assert a.eager_limit == b.eager_limit == EAGER_BYTES
    src = np.arange(nbytes, dtype=np.uint8)
    a.send_eager(5, 0, src)  # arrives before it is asked for
    src[:] = 7  # reused at once
    waiting = b.eager(6)  # asked for before it is sent
    a.send_eager(6, 0, None)
    assert bytes(await asyncio.wait_for(b.eager(5), 10)) == bytes(np.arange(nbytes, dtype=np.uint8))
    assert bytes(await asyncio.wait_for(waiting, 10)) == b""
    b.send_eager(5, 0, src)  # the other direction, the same seq
    assert bytes(await asyncio.wait_for(a.eager(5), 10)) == bytes(src)
    assert not a._eager and not b._eager  # nothing left behind


async def test_oversized_eager_and_control_messages_are_refused_alike(pair: LocalLinks) -> None:
    """Every transport refuses a message over its limit with the same error, naming the link."""
    a, b = ends(pair)
    with pytest.raises(TransportError, match=rf"link 0->1: an eager message of {EAGER_BYTES + 1} bytes"):
        a.send_eager(3, 0, np.zeros(EAGER_BYTES + 1, np.uint8))
    with pytest.raises(TransportError, match=rf"link 0->1: a control message of {MAX_CONTROL + 1} bytes"):
        a.send_control(bytes(MAX_CONTROL + 1))
    a.send_eager(3, 0, np.ones(8, np.uint8))  # the link still works
    assert bytes(await asyncio.wait_for(b.eager(3), 10)) == bytes(8 * [1])


async def test_eager_fail_wakes_the_waiter(pair: LocalLinks) -> None:
    _a, b = ends(pair)
    waiting = b.eager(9)
    b.fail(RuntimeError("link failed for the test"))
    with pytest.raises(RuntimeError, match="link failed for the test"):
        await asyncio.wait_for(waiting, 5)
    with pytest.raises(RuntimeError, match="link failed for the test"):
        await b.eager(10)  # asked for after the failure


async def test_close_is_idempotent(pair: LocalLinks) -> None:
    a, b = ends(pair)
    a.close()
    a.close()
    b.close()

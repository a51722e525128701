"""eager (one message per peer, links without mailboxes) against numpy, world sizes 1..9.

In process with the host's mailboxes off (as between hosts, or over rdma): every op it claims,
every reduction, dtypes from bool to bfloat16, counts 0, 1, odd and up to a message, in place
and not; results bit-identical on every rank; back-to-back calls mixed with other algorithms;
selection (small calls without mailboxes, never beyond a message, oneshot where there are
mailboxes); early arrivals kept and bounded; mismatch and abort while a rank waits. Over real
rdma links in this process: the same matrix at 3 ranks (mp_eager.py runs real processes).
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import ahcomm
from ahcomm.testing import local_world
from ahcomm.transports.base import EAGER_AHEAD, EAGER_BYTES

from jobs import run_job
from support.failing import abort_fails_the_waiters, mismatch_fails_every_rank
from support.inproc import issue_each, links_of, run_inproc
from support.numerics import assert_close, redops, reduce_ref
from support.numerics import exact_values as values

SIZES = [1, 2, 3, 4, 5, 6, 7, 8, 9]
HERE = Path(__file__).parent
DTYPES = [np.float32, np.float64, np.int32, np.int8, np.float16, np.bool_, np.uint64, ml_dtypes.bfloat16]
COUNTS = [0, 1, 37, 1001]


@pytest.fixture(autouse=True)
def _no_mailboxes(monkeypatch: pytest.MonkeyPatch) -> None:
    """As between hosts: no mailboxes, so small calls are eager's."""
    monkeypatch.setenv("AHCOMM_MAILBOX_BYTES", "0")


def cases(rng: np.random.Generator, size: int) -> list[tuple[Any, ...]]:
    out: list[tuple[Any, ...]] = []
    for i, dtype in enumerate(DTYPES):
        count = COUNTS[i % len(COUNTS)]
        inplace = i % 2 == 1
        root = (2 * i + 1) % size
        for redop in redops(dtype):
            out.append(("all_reduce", [values(rng, count, dtype, redop) for _ in range(size)], redop, 0, inplace))
        out.append(("reduce", [values(rng, count, dtype, "max") for _ in range(size)], "max", root, False))
        out.append(("reduce_scatter", [values(rng, count * size, dtype) for _ in range(size)], "sum", 0, False))
        out.append(("all_gather", [values(rng, count, dtype) for _ in range(size)], "", 0, False))
        out.append(("gather", [values(rng, count, dtype) for _ in range(size)], "", root, False))
        out.append(("scatter", [values(rng, count * size, dtype) for _ in range(size)], "", root, False))
        out.append(("all_to_all", [values(rng, count * size, dtype) for _ in range(size)], "", 0, False))
        out.append(("broadcast", [values(rng, count, dtype) for _ in range(size)], "", root, inplace))
        out.append(("barrier", [np.empty(0)] * size, "", 0, False))
    return out


async def issue(comm: ahcomm.Comm, case: tuple[Any, ...]) -> Any:
    op, xs, redop, root, inplace = case
    x = xs[comm.rank].copy() if inplace else xs[comm.rank]
    kw = {"algorithm": "eager"}
    if op == "all_reduce":
        got = await comm.all_reduce(x, redop, out=x if inplace else None, **kw)
        assert got is x or not inplace
        return got
    if op == "reduce":
        return await comm.reduce(x, redop, root, **kw)
    if op == "reduce_scatter":
        return await comm.reduce_scatter(x, redop, **kw)
    if op == "all_gather":
        return await comm.all_gather(x, **kw)
    if op == "gather":
        return await comm.gather(x, root, **kw)
    if op == "scatter":
        return await comm.scatter(x, root, **kw)
    if op == "all_to_all":
        return await comm.all_to_all(x, **kw)
    if op == "broadcast":
        return await comm.broadcast(x, root, out=x if inplace else None, **kw)
    return await comm.barrier(**kw)


def want(case: tuple[Any, ...], rank: int, size: int) -> Any:
    op, xs, redop, root, _ = case
    block = xs[0].size // size
    if op == "all_reduce":
        return reduce_ref(xs, redop)
    if op == "reduce":
        return reduce_ref(xs, redop) if rank == root else None
    if op == "reduce_scatter":
        return reduce_ref(xs, redop)[rank * block:(rank + 1) * block]
    if op == "all_gather":
        return np.concatenate(xs)
    if op == "gather":
        return np.concatenate(xs) if rank == root else None
    if op == "scatter":
        return xs[root][rank * block:(rank + 1) * block]
    if op == "all_to_all":
        return np.concatenate([x[rank * block:(rank + 1) * block] for x in xs])
    if op == "broadcast":
        return xs[root]
    return None


async def run_matrix(size: int, rng: np.random.Generator, transport: str = "inproc") -> None:
    todo = cases(rng, size)

    results = await run_inproc(size, lambda comm: issue_each(comm, todo, issue, in_place=lambda case: case[4]),
                               transport=transport)
    for k, case in enumerate(todo):
        for rank in range(size):
            expected = want(case, rank, size)
            if expected is None:  # a rooted op's non-roots, and barrier, get None
                assert results[rank][k] is None, (case[0], rank)
            else:
                assert_close(np.asarray(results[rank][k]).reshape(-1), expected)
        if case[0] == "all_reduce":  # one reduction order everywhere: the same bits on every rank
            assert all(results[0][k].tobytes() == results[r][k].tobytes() for r in range(size))


@pytest.mark.parametrize("size", SIZES)
async def test_matrix(size: int, rng: np.random.Generator) -> None:
    await run_matrix(size, rng)


async def test_matrix_over_rdma_links(rng: np.random.Generator) -> None:
    await run_matrix(3, rng, transport="rdma")


@pytest.mark.parametrize("size", [2, 3, 7])
async def test_rank_order_bit_identical(size: int, rng: np.random.Generator) -> None:
    """Random floats, in place on some ranks: rank 0 + rank 1 + ... in that order, bit for bit."""
    xs = [rng.standard_normal(513).astype(np.float32) for _ in range(size)]

    async def body(comm: ahcomm.Comm) -> np.ndarray:
        x = xs[comm.rank].copy()
        return await comm.all_reduce(x, out=x if comm.rank % 2 == 0 else None, algorithm="eager")

    for got in await run_inproc(size, body):
        np.testing.assert_array_equal(got, reduce_ref(xs, "sum"))


async def test_back_to_back_calls_with_other_algorithms(rng: np.random.Generator) -> None:
    """Forty calls issued before any completes, eager among ring and tree broadcasts (a root runs
    ahead): every message waits for its call, none is lost or mixed up."""
    size = 4
    xs = [[values(rng, 1 + k % 5, np.int64) for _ in range(size)] for k in range(40)]

    async def body(comm: ahcomm.Comm) -> list[Any]:
        futs = []
        for k in range(40):
            if k % 4 == 3:
                futs.append(comm.broadcast(xs[k][comm.rank], k % size, algorithm="eager" if k % 8 == 3 else "tree"))
            else:
                futs.append(comm.all_reduce(xs[k][comm.rank], algorithm="eager" if k % 3 else "ring"))
        got = list(await asyncio.gather(*futs))
        assert not any(link._eager for link in links_of(comm).values())  # every message taken by its call
        return got

    results = await run_inproc(size, body)
    for rank in range(size):
        for k in range(40):
            expected = xs[k][k % size] if k % 4 == 3 else sum(xs[k])
            np.testing.assert_array_equal(results[rank][k], expected)


async def test_selected_for_small_calls_without_mailboxes(monkeypatch: pytest.MonkeyPatch) -> None:
    comms = await ahcomm.init_inprocess(4)
    try:  # in process (mapped links, like sdma): a candidate, chosen by cost
        assert comms[0].topology.eager == EAGER_BYTES
        assert "eager" in comms[0].explain("all_reduce", 2, np.float32)[1]
    finally:
        await asyncio.gather(*(c.close() for c in comms))
    comms = await local_world(4, transport="rdma")
    try:  # rdma links: the pick for every small call it has
        comm = comms[0]
        assert comm.topology.mailbox == 0 and comm.topology.eager == EAGER_BYTES
        for op in ("all_reduce", "broadcast", "all_gather", "reduce_scatter", "reduce", "gather", "all_to_all"):
            assert comm.explain(op, 2, np.float32)[0] == "eager", op
        assert comm.explain("all_reduce", 8192, np.float32)[0] == "eager"  # 32 KiB
        assert comm.explain("barrier", 0, np.uint8)[0] == "dissemination"  # 2 steps of 1 message beat 3 messages
        assert "eager" not in comm.explain("all_reduce", EAGER_BYTES // 4 + 1, np.float32)[1]  # over a message
        with pytest.raises(ahcomm.InvalidArgument, match="eager"):
            comm.all_reduce(np.ones(EAGER_BYTES // 4 + 1, np.float32), algorithm="eager")
    finally:
        await asyncio.gather(*(c.close() for c in comms))
    monkeypatch.setenv("AHCOMM_MAILBOX_BYTES", str(32 << 10))
    comms = await ahcomm.init_inprocess(2)
    try:  # with mailboxes, oneshot is cheaper
        assert comms[0].explain("all_reduce", 2, np.float32)[0] == "oneshot"
    finally:
        await asyncio.gather(*(c.close() for c in comms))


async def test_early_arrivals_are_kept_and_bounded() -> None:
    """A message for a call not asked for yet waits in the link; a second one for the same call,
    or more than EAGER_AHEAD waiting, breaks the protocol."""
    comms = await ahcomm.init_inprocess(2)
    try:
        link = links_of(comms[1])[0]
        link.deliver_eager(100, 0, b"\x01")
        assert (await link.eager(100)) == b"\x01"
        for seq in range(200, 200 + EAGER_AHEAD):
            link.deliver_eager(seq, 0, b"")
        with pytest.raises(ahcomm.TransportError, match="others wait"):
            link.deliver_eager(300, 0, b"")
        with pytest.raises(ahcomm.TransportError, match="second eager message"):
            link.deliver_eager(200, 0, b"")
    finally:
        await asyncio.gather(*(c.close() for c in comms))


@pytest.mark.parametrize("transport", ["inproc", "rdma"])
async def test_mismatch_fails_every_rank(transport: str) -> None:
    """Both ranks run eager at seq 0, one an all_reduce, the other an all_gather: the fingerprints
    carried by the messages differ, and both ranks raise naming the mismatch."""
    await mismatch_fails_every_rank(await local_world(2, transport=transport), "eager")


async def test_abort_while_waiting() -> None:
    await abort_fails_the_waiters(lambda c: c.all_reduce(np.ones(4, np.float32), algorithm="eager"), 1)


@pytest.mark.multiprocess
@pytest.mark.parametrize("n", [2, 4, 8])
def test_real_processes_over_rdma(n: int) -> None:
    proc = run_job(n, str(HERE / "mp_eager.py"), env={"AHCOMM_TRANSPORT": "rdma"}, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    for r in range(n):
        assert f"[{r}] OK rank {r} picks ['eager']" in out, out


@pytest.mark.multiprocess
def test_a_dead_peer_fails_an_eager_call_naming_it() -> None:
    """Rank 1 dies between calls; the others' next eager all_reduce (#6: init's agreement is #0)
    raises PeerFailure within seconds naming the op, its number and rank 1."""
    proc = run_job(3, str(HERE / "mp_eager.py"), env={"AHCOMM_TRANSPORT": "rdma", "KILL_AT": "5",
                                                      "AHCOMM_EXEC_TIMEOUT": "60"}, timeout=120, grace=20)
    out = proc.stdout + proc.stderr
    lines = dict(re.findall(r"^\[\d\] FAILED rank (\d) (.*)$", proc.stdout, re.M))
    assert sorted(lines) == ["0", "2"], out
    for text in lines.values():
        seconds = float(text.split(" ", 2)[1])
        assert seconds < 5, out
        assert "PeerFailure" in text and "rank 1" in text, out
        assert re.search(r"all_reduce.*#6|#6.*all_reduce", text), out

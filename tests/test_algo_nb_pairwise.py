"""NB (Bruck) and pairwise against numpy, in process, world sizes 1..9, 13 and 16.

nb: all_gather, all_gather_v, all_to_all; pairwise: all_to_all, all_to_all_v. The CCL
buffer is 4 KiB (8 KiB for 13 and 16 ranks), so the large blocks cross many slots.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

import ahcomm
from ahcomm.algorithms import names
from ahcomm.algorithms.nb import distances

from support.inproc import run_inproc

SIZES = [1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 16]
DTYPES = [np.float32, np.float64, np.int32, np.int8, np.float16, np.bool_, np.uint64]
TAILS: list[tuple[int, ...]] = [(), (3,)]


def buff_for(size: int) -> int:
    return 8192 if size > 9 else 4096


def big_rows(dtype: Any, tail: tuple[int, ...], buff: int) -> int:
    """Rows whose block is larger than the whole CCL buffer."""
    return int(buff // (np.dtype(dtype).itemsize * int(np.prod(tail, dtype=np.int64)))) + 3


def data(rng: np.random.Generator, rows: int, tail: tuple[int, ...], dtype: Any) -> np.ndarray:
    dt = np.dtype(dtype)
    shape = (rows, *tail)
    if dt == np.bool_:
        return rng.integers(0, 2, shape).astype(bool)
    lo = 0 if dt.kind == "u" else -100
    return rng.integers(lo, 100, shape).astype(dt)  # exact in every dtype tested


def uneven(rng: np.random.Generator, size: int, top: int) -> list[int]:
    """Counts in 0..top with a zero somewhere (when there is more than one rank)."""
    counts = [int(c) for c in rng.integers(0, top + 1, size)]
    if size > 1:
        counts[int(rng.integers(size))] = 0
    return counts


def send_matrix(rng: np.random.Generator, size: int, top: int, variant: int) -> list[list[int]]:
    """send[p][q] rows from p to q: variant 1 has a rank that sends nothing, 2 one that receives nothing."""
    send = [uneven(rng, size, top) for _ in range(size)]
    if variant == 1:
        send[size // 2] = [0] * size
    elif variant == 2:
        for row in send:
            row[size - 1] = 0
    return send


def check(got: Any, want: np.ndarray) -> None:
    assert isinstance(got, np.ndarray) and got.dtype == want.dtype and got.shape == want.shape, (got, want.shape)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("size", SIZES)
async def test_all_to_all(size: int, rng: np.random.Generator) -> None:
    buff = buff_for(size)
    cases: list[tuple[str, list[np.ndarray], bool]] = []  # (algorithm, inputs, out= given)
    for algo in ("nb", "pairwise"):
        for i, dtype in enumerate(DTYPES):
            tail = TAILS[i % 2]
            rows = [0, 1, 5, big_rows(dtype, tail, buff)][i % 4]
            cases.append((algo, [data(rng, rows * size, tail, dtype) for _ in range(size)], i % 3 == 0))
        for rows in (1, 3, big_rows(np.float32, (3,), buff)):
            cases.append((algo, [data(rng, rows * size, (3,), np.float32) for _ in range(size)], rows == 3))

    async def body(comm: ahcomm.Comm) -> list[np.ndarray]:
        results = []
        for algo, xs, give_out in cases:
            x = xs[comm.rank].copy()
            out = np.empty_like(x) if give_out else None
            got = await comm.all_to_all(x, out=out, algorithm=algo)
            assert out is None or got is out
            assert np.array_equal(x, xs[comm.rank])  # input untouched
            results.append(got)
        return results

    results = await run_inproc(size, body, buffsize=buff)
    for k, (_algo, xs, _) in enumerate(cases):
        for r in range(size):
            check(results[r][k], np.concatenate([np.split(x, size)[r] for x in xs]))


@pytest.mark.parametrize("size", SIZES)
async def test_all_to_all_v_pairwise(size: int, rng: np.random.Generator) -> None:
    buff = buff_for(size)
    cases: list[tuple[list[list[int]], list[np.ndarray], bool, bool]] = []  # (send, inputs, pass recv, out=)
    for i, dtype in enumerate(DTYPES):
        tail = TAILS[i % 2]
        top = [1, 4, big_rows(dtype, tail, buff)][i % 3]
        send = send_matrix(rng, size, top, i % 3)
        cases.append((send, [data(rng, sum(row), tail, dtype) for row in send], i % 2 == 0, i % 3 == 1))
    zero = [[0] * size for _ in range(size)]  # nothing anywhere
    cases.append((zero, [data(rng, 0, (3,), np.float32) for _ in range(size)], False, False))

    async def body(comm: ahcomm.Comm) -> list[Any]:
        r, results = comm.rank, []
        for send, xs, pass_recv, give_out in cases:
            recv = [send[p][r] for p in range(size)]
            out = np.empty((sum(recv), *xs[r].shape[1:]), xs[r].dtype) if give_out else None
            x = xs[r].copy()
            got = await comm.all_to_all_v(x, send[r], recv_counts=recv if pass_recv else None, out=out,
                                          algorithm="pairwise")
            assert out is None or got.data is out
            assert np.array_equal(x, xs[r]) and got.counts == tuple(recv)
            results.append(got.data)
        return results

    results = await run_inproc(size, body, buffsize=buff)
    for k, (send, xs, _, _) in enumerate(cases):
        for r in range(size):
            want = [np.split(xs[p], np.cumsum(send[p])[:-1])[r] for p in range(size)]
            check(results[r][k], np.concatenate(want))


@pytest.mark.parametrize("size", SIZES)
async def test_all_gather_nb(size: int, rng: np.random.Generator) -> None:
    buff = buff_for(size)
    even: list[tuple[list[np.ndarray], bool]] = []
    for i, dtype in enumerate(DTYPES):
        tail = TAILS[i % 2]
        rows = [0, 1, 5, big_rows(dtype, tail, buff)][i % 4]
        even.append(([data(rng, rows, tail, dtype) for _ in range(size)], i % 3 == 0))
    even.append(([data(rng, 1, (), np.float64)[0] for _ in range(size)], False))  # 0-d inputs
    ragged: list[tuple[list[np.ndarray], bool, bool]] = []  # (inputs, pass counts, out=)
    for i, dtype in enumerate(DTYPES):
        tail = TAILS[i % 2]
        counts = uneven(rng, size, [1, 4, big_rows(dtype, tail, buff)][i % 3])
        ragged.append(([data(rng, c, tail, dtype) for c in counts], i % 2 == 0, i % 3 == 1))
    ragged.append(([data(rng, 0, (3,), np.int32) for _ in range(size)], True, False))

    async def body(comm: ahcomm.Comm) -> list[Any]:
        r, results = comm.rank, []
        for xs, give_out in even:
            x = np.copy(xs[r])
            out = np.empty((size * x.shape[0], *x.shape[1:]) if x.ndim else (size,), x.dtype) if give_out else None
            got = await comm.all_gather(x, out=out, algorithm="nb")
            assert out is None or got is out
            assert np.array_equal(x, xs[r])
            results.append(got)
        for xs, pass_counts, give_out in ragged:
            counts = [x.shape[0] for x in xs]
            out = np.empty((sum(counts), *xs[r].shape[1:]), xs[r].dtype) if give_out else None
            x = xs[r].copy()
            gathered = await comm.all_gather_v(x, counts=counts if pass_counts else None, out=out, algorithm="nb")
            assert out is None or gathered.data is out
            assert gathered.counts == tuple(counts) and np.array_equal(x, xs[r])
            results.append(gathered.data)
        return results

    results = await run_inproc(size, body, buffsize=buff)
    wants = [np.stack(xs) if xs[0].ndim == 0 else np.concatenate(xs) for xs, _ in even]
    wants += [np.concatenate(xs) for xs, _, _ in ragged]
    for k, want in enumerate(wants):
        for r in range(size):
            check(results[r][k], want)


@pytest.mark.parametrize("size", [3, 5, 8, 13])
async def test_volume_and_peers(size: int, rng: np.random.Generator) -> None:
    # Bruck's signature: ceil(log2 n) peers; all_gather moves no byte beyond the n - 1 blocks
    # every rank must get, all_to_all moves sum(popcount(i)) blocks; pairwise n - 1 blocks to n - 1 peers.
    block = 50 * 8
    xs = [data(rng, 50 * size, (), np.float64) for _ in range(size)]
    popcount = sum(bin(i).count("1") for i in range(size))
    expect = {("nb", "all_gather"): ((size - 1) * block, len(distances(size))),
              ("nb", "all_to_all"): (popcount * block, len(distances(size))),
              ("pairwise", "all_to_all"): ((size - 1) * block, size - 1)}

    async def body(comm: ahcomm.Comm) -> dict[tuple[str, str], tuple[int, int]]:
        seen = {}
        for algo, op in expect:
            before = {p: s["bytes_sent"] for p, s in comm.stats()["links"].items()}
            x = xs[comm.rank]
            if op == "all_gather":
                await comm.all_gather(x[:50], algorithm=algo)
            else:
                await comm.all_to_all(x, algorithm=algo)
            sent = {p: s["bytes_sent"] - before[p] for p, s in comm.stats()["links"].items()}
            seen[algo, op] = (sum(sent.values()), sum(1 for v in sent.values() if v))
        return seen

    for seen in await run_inproc(size, body, buffsize=1 << 16):
        assert seen == expect


async def test_registered_ops() -> None:
    for op in ("all_gather", "all_gather_v", "all_to_all"):
        assert "nb" in names(op)
    for op in ("all_to_all", "all_to_all_v"):
        assert "pairwise" in names(op)
    assert "nb" not in names("all_to_all_v")  # uneven Bruck would need every rank's counts
    comms = await ahcomm.init_inprocess(2)
    try:
        with pytest.raises(ahcomm.InvalidArgument, match="pairwise"):
            await comms[0].all_gather(np.ones(3), algorithm="pairwise")
    finally:
        await asyncio.gather(*(c.close() for c in comms))

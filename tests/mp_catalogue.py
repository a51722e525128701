"""A rank program for the multi-process tests: every op of the catalogue x every algorithm
that can run it on this job's links, against numpy; point-to-point and object collectives.
Exits non-zero on the first mismatch."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Callable, Coroutine
from typing import Any

import numpy as np

import ahcomm
from ahcomm import P2POp

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "gather", "scatter", "all_to_all",
       "all_gather_v", "reduce_scatter_v", "gather_v", "scatter_v", "all_to_all_v")


def rows_of(seed: int, n: int, big: bool) -> list[int]:
    """Per-rank row counts: some zero, one big enough to exceed the test's 64 KiB CCL buffer."""
    rng = np.random.default_rng(seed)
    counts = [int(c) for c in rng.integers(0, 9, n)]
    counts[seed % n] = 0
    if big:
        counts[(seed + 1) % n] = 12_000  # x 2 columns x 8 bytes = 192 KB
    return counts


def data(rank: int, rows: int, dtype: str, salt: int) -> np.ndarray:
    return np.random.default_rng(1000 * salt + rank).integers(-4, 5, (rows, 2)).astype(dtype)


async def check(comm: ahcomm.Comm, op: str, algo: str, salt: int, big: bool) -> None:
    r, n = comm.rank, comm.size
    dtype = "float64" if salt % 2 else "int32"
    rows = rows_of(salt, n, big)
    root = salt % n
    xs = [data(p, rows[p], dtype, salt) for p in range(n)]
    even = max(rows)
    ev = [data(p, even * n, dtype, salt) for p in range(n)]  # n equal blocks of `even` rows
    if op == "all_reduce":
        np.testing.assert_array_equal(await comm.all_reduce(ev[r], algorithm=algo), sum(ev))
    elif op == "reduce":
        got = await comm.reduce(ev[r], "max", root, algorithm=algo)
        assert (got is None) == (r != root)
        if got is not None:
            np.testing.assert_array_equal(got, np.max(ev, axis=0))
    elif op == "broadcast":
        np.testing.assert_array_equal(await comm.broadcast(ev[r], root, algorithm=algo), ev[root])
    elif op == "all_gather":
        np.testing.assert_array_equal(await comm.all_gather(ev[r][:even], algorithm=algo),
                                      np.concatenate([e[:even] for e in ev]))
    elif op == "reduce_scatter":
        np.testing.assert_array_equal(await comm.reduce_scatter(ev[r], algorithm=algo),
                                      sum(ev)[r * even:(r + 1) * even])
    elif op == "gather":
        got = await comm.gather(ev[r][:even], root, algorithm=algo)
        if r == root:
            np.testing.assert_array_equal(got, np.concatenate([e[:even] for e in ev]))
        else:
            assert got is None
    elif op == "scatter":
        got = await comm.scatter(ev[root] if r == root else ev[r], root, algorithm=algo)
        np.testing.assert_array_equal(got, ev[root][r * even:(r + 1) * even])
    elif op == "all_to_all":
        got = await comm.all_to_all(ev[r], algorithm=algo)
        np.testing.assert_array_equal(got, np.concatenate([ev[p][r * even:(r + 1) * even] for p in range(n)]))
    elif op == "all_gather_v":
        got = await comm.all_gather_v(xs[r], algorithm=algo)
        assert got.counts == tuple(rows)
        np.testing.assert_array_equal(got.data, np.concatenate(xs))
    elif op == "reduce_scatter_v":
        full = [data(p, sum(rows), dtype, salt) for p in range(n)]
        got = await comm.reduce_scatter_v(full[r], rows, algorithm=algo)
        start = sum(rows[:r])
        np.testing.assert_array_equal(got, sum(full)[start:start + rows[r]])
    elif op == "gather_v":
        got = await comm.gather_v(xs[r], root, algorithm=algo)
        if r == root:
            assert got is not None and got.counts == tuple(rows)
            np.testing.assert_array_equal(got.data, np.concatenate(xs))
        else:
            assert got is None
    elif op == "scatter_v":
        whole = np.concatenate(xs)
        got = await comm.scatter_v(whole if r == root else whole[:0], rows, root, algorithm=algo)
        np.testing.assert_array_equal(got, xs[r])
    elif op == "all_to_all_v":
        send = rows_of(salt + r, n, big and r == 0)  # rank r sends send[j] rows to rank j
        recv = [rows_of(salt + p, n, big and p == 0)[r] for p in range(n)]
        x = data(r, sum(send), dtype, salt)
        got = await comm.all_to_all_v(x, send, algorithm=algo)
        assert got.counts == tuple(recv), (got.counts, recv)
        want = []
        for p in range(n):
            sp = rows_of(salt + p, n, big and p == 0)
            xp = data(p, sum(sp), dtype, salt)
            want.append(xp[sum(sp[:r]):sum(sp[:r]) + sp[r]])
        np.testing.assert_array_equal(got.data, np.concatenate(want))


SMALL_ONLY = frozenset({"eager"})  # runs only calls whose every message fits one (the big ones: 192 KB)


async def run_catalogue(comm: ahcomm.Comm) -> int:
    """Every op x every algorithm that can run it here, small and big; returns the case count."""
    salt = 0
    for op in OPS:
        for algo in sorted(comm.explain(op, 1)[1]):
            for big in (False, True):
                if big and algo in SMALL_ONLY:
                    continue
                salt += 1
                try:
                    await check(comm, op, algo, salt, big)
                except AssertionError as exc:
                    raise AssertionError(f"{op} algorithm={algo} salt={salt} big={big}: {exc}") from None
    return salt


async def main() -> None:
    comm = await ahcomm.init()
    r, n = comm.rank, comm.size
    kinds = {link["kind"] for link in comm.stats()["links"].values()}
    assert kinds == {os.environ["EXPECT_LINK"]}, kinds
    ran = await run_catalogue(comm)
    # point-to-point around the ring, a big message included, and the object collectives
    x = np.arange(300_000, dtype=np.float32) + r
    got, _ = await comm.batch_send_recv([P2POp("recv", np.empty_like(x), (r - 1) % n), P2POp("send", x, (r + 1) % n)])
    np.testing.assert_array_equal(got, np.arange(300_000, dtype=np.float32) + (r - 1) % n)
    objs: Any = await comm.all_gather_object({"rank": r, "tag": "x" * r})
    assert objs == [{"rank": p, "tag": "x" * p} for p in range(n)]
    assert await comm.broadcast_object({"cfg": [1, 2]} if r == n - 1 else None, root=n - 1) == {"cfg": [1, 2]}
    await comm.close()
    print(f"OK rank {r}/{n} ran {ran} op x algorithm cases", flush=True)


def run_rank(main: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """Run a rank's ``main``; a failure is printed with the rank before it propagates."""
    try:
        asyncio.run(main())
    except Exception as exc:
        print(f"FAIL rank {os.environ.get('AHCOMM_RANK')}: {exc!r}", file=sys.stderr, flush=True)
        raise


if __name__ == "__main__":
    run_rank(main)

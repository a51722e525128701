"""A rank program for the multi-process tests: every collective vs numpy, on the real
transports, through the module API and a Comm. Exits non-zero on the first mismatch."""

from __future__ import annotations

import asyncio
import os
import sys

import numpy as np

import ahcomm


def data(rank: int, count: int, dtype: str, salt: int) -> np.ndarray:
    rng = np.random.default_rng(1000 * salt + rank)
    return rng.integers(-4, 5, count).astype(dtype)


async def main() -> None:
    comm = await ahcomm.init()
    r, n = ahcomm.get_rank(), ahcomm.get_world_size()
    assert (r, n) == (comm.rank, comm.size)
    kinds = {link["kind"] for link in comm.stats()["links"].values()}
    want_kind = os.environ["EXPECT_LINK"]
    assert kinds == {want_kind}, (kinds, want_kind)
    if os.environ.get("EXPECT_SINGLE_COPY"):
        assert comm.topology.single_copy == (os.environ["EXPECT_SINGLE_COPY"] == "1"), comm.topology
    salt = 0
    for algo in (None, "ring", "mesh" if want_kind == "sdma" else None):
        for count in (0, 1, 37, 50_000):  # 50k float64 = 400 KB > the 64 KiB CCL buffer of the test
            for dtype in ("float64", "int32", "float16"):
                salt += 1
                xs = [data(p, count, dtype, salt) for p in range(n)]
                x = xs[r]
                got = await ahcomm.all_reduce(x, "sum", algorithm=algo)
                np.testing.assert_allclose(got, np.sum(xs, axis=0, dtype=np.float64).astype(dtype), rtol=1e-2)
                got = await comm.all_reduce(x, "max", algorithm=algo)
                np.testing.assert_array_equal(got, np.max(xs, axis=0))
                got = await ahcomm.all_gather(x, algorithm=algo)
                np.testing.assert_array_equal(got, np.concatenate(xs))
                big = [np.tile(v, n) for v in xs]
                got = await ahcomm.reduce_scatter(big[r], algorithm=algo)
                want = np.sum(big, axis=0, dtype=np.float64).astype(dtype)[r * count:(r + 1) * count]
                np.testing.assert_allclose(got, want, rtol=1e-2)
                root = salt % n
                got = await ahcomm.broadcast(x, root=root, algorithm=algo)
                np.testing.assert_array_equal(got, xs[root])
    big = data(0, 600_000, "float64", 99)  # 4.8 MB: broadcast takes its single-copy path where agreed
    got = await comm.broadcast(big if r == 1 else np.zeros_like(big), root=1)
    np.testing.assert_array_equal(got, big)
    # several in flight at once, mixed ops
    futs = [comm.all_reduce(np.full(1000, r + 1.0)), comm.all_gather(np.full(2, r)),
            comm.broadcast(np.full(3, float(r)), root=n - 1), comm.barrier(), comm.all_reduce(np.ones(70_000))]
    a, g, b, _, big_sum = await asyncio.gather(*futs)
    assert np.all(a == n * (n + 1) / 2) and np.all(b == n - 1) and np.all(big_sum == n)
    np.testing.assert_array_equal(g, np.repeat(np.arange(n), 2))
    stats = comm.stats()
    moved = sum(link["bytes_sent"] for link in stats["links"].values())
    assert moved > 0
    await ahcomm.finalize()
    print(f"OK rank {r}/{n} {want_kind} single_copy={comm.topology.single_copy} sent={moved}", flush=True)


if __name__ == "__main__":
    try:
        asyncio.run(main())
    except Exception as exc:  # make the failure visible in the launcher's output
        print(f"FAIL rank {os.environ.get('AHCOMM_RANK')}: {exc!r}", file=sys.stderr, flush=True)
        raise

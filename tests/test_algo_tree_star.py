"""Tree and star against numpy, in process, world sizes 1..9, 13 and 16.

tree: broadcast (binomial, and van de Geijn scatter + ring all_gather for large messages),
reduce, gather(_v), scatter(_v). star: the same plus all_reduce, all_gather(_v). The CCL
buffer is 2 KiB (8 KiB for 13 and 16 ranks): the 1500-element blocks cross many Channels
pieces (tree) and many rounds or slices of a CCL half (star).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import ahcomm
from ahcomm import InvalidArgument
from ahcomm.algorithms import names, tree
from ahcomm.algorithms.tree import children

from support.inproc import run_inproc
from support.numerics import assert_close, reduce_ref

SIZES = [1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 16]
DTYPES = [np.float32, np.float64, np.int32, np.int8, np.float16, np.bool_, np.uint64]
COUNTS = [0, 1, 37, 1500]  # 1500 float32 = 6000 B > the whole CCL buffer
ROOTED = ["broadcast", "reduce", "gather", "gather_v", "scatter", "scatter_v"]
STAR_ONLY = ["all_reduce", "all_gather", "all_gather_v"]


def buff_for(size: int) -> int:
    return 8192 if size > 9 else 2048


def values(rng: np.random.Generator, count: int, dtype: Any, op: str = "sum") -> np.ndarray:
    dt = np.dtype(dtype)
    if dt == np.bool_:
        return rng.integers(0, 2, count).astype(bool)
    lo, hi = (1, 3) if op == "prod" else ((-8, 9) if dt.kind == "f" else (0 if dt.kind == "u" else -3, 4))
    return rng.integers(lo, hi, count).astype(dt)  # exact in every dtype, any reduction order


def ops_for(dtype: Any) -> list[str]:
    return ["sum", "prod", "max", "min"] + (["avg"] if np.dtype(dtype).kind == "f" else [])


def uneven(size: int, k: int) -> list[int]:
    """Counts with zeros (more than one rank) and blocks larger than the CCL buffer."""
    return [[0, 1500, 3, 0, 37, 1][(p + k) % 6] for p in range(size)]


@dataclasses.dataclass
class Case:
    op: str
    xs: list[np.ndarray]  # every rank's input
    root: int = 0
    redop: str = ""
    counts: list[int] | None = None
    inplace: bool = False  # reduce/broadcast at the root into x itself (out=x); v ops: counts given

    def want(self, rank: int) -> Any:
        xs, root = self.xs, self.root
        if self.op == "broadcast":
            return xs[root]
        if self.op in ("reduce", "all_reduce"):
            return reduce_ref(xs, self.redop) if self.op == "all_reduce" or rank == root else None
        if self.op in ("gather", "gather_v"):
            return np.concatenate(xs) if rank == root else None
        if self.op in ("all_gather", "all_gather_v"):
            return np.concatenate(xs)
        counts = self.counts or [xs[root].size // len(xs)] * len(xs)
        at = np.cumsum([0, *counts])
        return xs[root][at[rank]:at[rank + 1]]


async def issue(comm: ahcomm.Comm, case: Case, algo: str) -> Any:
    r, x = comm.rank, case.xs[comm.rank]
    op, root = case.op, case.root
    if op == "broadcast":
        if case.inplace and r == root:
            y = x.copy()
            assert await comm.broadcast(y, root, out=y, algorithm=algo) is y
            return y
        return await comm.broadcast(x, root, algorithm=algo)
    if op == "reduce":
        if case.inplace and r == root:
            y = x.copy()
            assert await comm.reduce(y, case.redop, root, out=y, algorithm=algo) is y
            return y
        return await comm.reduce(x, case.redop, root, algorithm=algo)
    if op == "all_reduce":
        return await comm.all_reduce(x, case.redop, algorithm=algo)
    if op == "gather":
        return await comm.gather(x, root, algorithm=algo)
    if op == "all_gather":
        return await comm.all_gather(x, algorithm=algo)
    if op in ("gather_v", "all_gather_v"):
        counts = case.counts if case.inplace else None  # else the library exchanges them
        got = await (comm.gather_v(x, root, counts=counts, algorithm=algo) if op == "gather_v"
                     else comm.all_gather_v(x, counts=counts, algorithm=algo))
        if got is not None:
            assert got.counts == tuple(case.counts or ())
            return got.data
        return None
    template = x if r == root else np.zeros_like(case.xs[root])
    if op == "scatter":
        return await comm.scatter(template, root, algorithm=algo)
    return await comm.scatter_v(template, case.counts or [], root, algorithm=algo)


def build(rng: np.random.Generator, size: int, ops: list[str]) -> list[Case]:
    cases: list[Case] = []

    def add(op: str, dtype: Any, count: int, root: int, redop: str = "sum", k: int = 0) -> None:
        inplace = k % 2 == 1
        if op in ("reduce", "all_reduce"):
            cases.append(Case(op, [values(rng, count, dtype, redop) for _ in range(size)], root, redop,
                              inplace=inplace))
        elif op in ("gather_v", "all_gather_v"):
            counts = uneven(size, k)
            cases.append(Case(op, [values(rng, c, dtype) for c in counts], root, counts=counts, inplace=inplace))
        elif op == "scatter_v":
            counts = uneven(size, k)
            xs = [values(rng, sum(counts), dtype) for _ in range(size)]
            cases.append(Case(op, xs, root, counts=counts))
        elif op == "scatter":
            cases.append(Case(op, [values(rng, count * size, dtype) for _ in range(size)], root))
        else:
            cases.append(Case(op, [values(rng, count, dtype) for _ in range(size)], root, inplace=inplace))

    for i, dtype in enumerate(DTYPES):
        count, root = COUNTS[i % len(COUNTS)], (2 * i + 1) % size
        for op in ops:
            if op in ("reduce", "all_reduce"):
                for j, redop in enumerate(ops_for(dtype)):
                    add(op, dtype, count, (root + j) % size, redop, k=i + j)
            else:
                add(op, dtype, count, root, k=i)
    for k, count in enumerate(COUNTS):  # every count with one dtype, the last rank as root
        for op in ops:
            add(op, np.float32, count, size - 1, k=k + 1)
    return cases


async def run_cases(size: int, algo: str, cases: list[Case]) -> list[list[Any]]:
    async def body(comm: ahcomm.Comm) -> list[Any]:
        out = []
        for case in cases:
            x = case.xs[comm.rank]
            before = x.copy()
            out.append(await issue(comm, case, algo))
            assert np.array_equal(x, before)  # inputs are never modified
        return out

    return await run_inproc(size, body, buffsize=buff_for(size))


@pytest.mark.parametrize("algo", ["tree", "star"])
@pytest.mark.parametrize("size", SIZES)
async def test_matrix(size: int, algo: str, rng: np.random.Generator) -> None:
    cases = build(rng, size, ROOTED + (STAR_ONLY if algo == "star" else []))
    check(cases, await run_cases(size, algo, cases))


def check(cases: list[Case], results: list[list[Any]]) -> None:
    size = len(results)
    for k, case in enumerate(cases):
        for rank in range(size):
            want, got = case.want(rank), results[rank][k]
            if want is None:
                assert got is None, (case.op, rank)
            else:
                assert_close(got.reshape(-1), want)
        if case.op == "all_reduce":  # one reduction, copied everywhere: the same bits
            assert all(np.array_equal(results[0][k], results[r][k]) for r in range(size))


@pytest.mark.parametrize("size", [3, 4, 5, 7, 9, 13, 16])
async def test_tree_large_broadcast(size: int, monkeypatch: pytest.MonkeyPatch, rng: np.random.Generator) -> None:
    """Scatter + ring all_gather forced for every size: counts below, at and above the world size."""
    monkeypatch.setattr(tree, "LARGE_BYTES", 1)
    cases = [Case("broadcast", [values(rng, count, dtype) for _ in range(size)], root, inplace=k % 2 == 0)
             for k, (count, dtype, root) in enumerate([
                 (1, np.float32, 1), (size - 1, np.int8, size - 1), (size, np.float64, 2), (37, np.bool_, 0),
                 (1500, np.float32, size // 2), (1501, np.uint64, 1)])]
    results = await run_cases(size, "tree", cases)
    for k, case in enumerate(cases):
        for rank in range(size):
            assert_close(results[rank][k], case.want(rank))


def root_bytes(comm: ahcomm.Comm) -> int:
    return sum(link["bytes_sent"] for link in comm.stats()["links"].values())


@pytest.mark.parametrize("above", [False, True])
async def test_tree_broadcast_switches_at_threshold(above: bool) -> None:
    """At LARGE_BYTES the root sends each chunk about twice (scatter + ring), not the whole
    vector to each of its children."""
    size, root = 5, 2  # the root has 3 children
    count = tree.LARGE_BYTES // 4 - (0 if above else 1)
    x = np.arange(count, dtype=np.float32)

    async def body(comm: ahcomm.Comm) -> tuple[np.ndarray, int]:
        before = root_bytes(comm)
        got = await comm.broadcast(x if comm.rank == root else np.empty_like(x), root, algorithm="tree")
        return got, root_bytes(comm) - before

    results = await run_inproc(size, body, buffsize=1 << 18)
    for got, _ in results:
        np.testing.assert_array_equal(got, x)
    sent = results[root][1] / x.nbytes
    assert (sent < 2.0) if above else sent == 3.0, sent


def tree_order(xs: list[np.ndarray], root: int, ufunc: Callable[..., Any]) -> np.ndarray:
    """The binomial tree's reduction: each rank folds its children's partials in, smallest subtree first."""
    n = len(xs)

    def partial(v: int) -> np.ndarray:
        acc = xs[(v + root) % n].copy()
        for c in children(v, n):
            acc = ufunc(acc, partial(c))
        return acc

    return partial(0)


@pytest.mark.parametrize("size", [3, 6, 16])
async def test_reduction_order_is_fixed(size: int, rng: np.random.Generator) -> None:
    """Random floats: tree reduces in binomial order, star's reduce takes the root's input first
    then rank order, star's all_reduce rank order, bit for bit (rounding shows any other order)."""
    root = size - 2
    xs = [rng.standard_normal(3000).astype(np.float32) for _ in range(size)]

    async def body(comm: ahcomm.Comm) -> list[Any]:
        x = xs[comm.rank]
        return [await comm.reduce(x, "sum", root, algorithm="tree"),
                await comm.reduce(x, "prod", root, algorithm="tree"),
                await comm.reduce(x, "sum", root, algorithm="star"),
                await comm.all_reduce(x, algorithm="star")]

    results = await run_inproc(size, body, buffsize=4096)
    tree_sum, tree_prod, star_sum, _ = results[root]
    np.testing.assert_array_equal(tree_sum, tree_order(xs, root, np.add))
    np.testing.assert_array_equal(tree_prod, tree_order(xs, root, np.multiply))
    star_want = xs[root].copy()
    for p in range(size):
        if p != root:
            star_want += xs[p]
    np.testing.assert_array_equal(star_sum, star_want)
    rank_order = reduce_ref(xs, "sum")
    assert not np.array_equal(rank_order, star_want) or not np.array_equal(rank_order, tree_sum)  # orders do differ
    for rank in range(size):
        np.testing.assert_array_equal(results[rank][3], rank_order)


async def test_back_to_back_calls_reuse_buffers(rng: np.random.Generator) -> None:
    """Every call issued before any completes, star and tree alternating: each buffer half is
    reused two calls later, while slower ranks may still be reading the other one."""
    size = 5
    stars = [("star", case) for case in build(rng, size, ROOTED + STAR_ONLY)]
    trees = [("tree", case) for case in build(rng, size, ROOTED)]
    plan = [pair for pairs in itertools.zip_longest(stars, trees) for pair in pairs if pair is not None]

    async def body(comm: ahcomm.Comm) -> list[Any]:
        return list(await asyncio.gather(*(issue(comm, case, algo) for algo, case in plan)))

    check([case for _, case in plan], await run_inproc(size, body, buffsize=2048))


async def test_star_needs_mapped_links_and_tree_does_not(rng: np.random.Generator) -> None:
    for op in ROOTED:
        assert {"tree", "star"} <= set(names(op))
    for op in STAR_ONLY:
        assert "star" in names(op)
    size = 4
    xs = [values(rng, 700, np.float64) for _ in range(size)]

    async def body(comm: ahcomm.Comm) -> tuple[Any, ...]:
        comm._set_topology(dataclasses.replace(comm.topology, all_mapped=False))  # as across hosts
        with pytest.raises(InvalidArgument, match="star"):
            comm.gather(xs[comm.rank], 1, algorithm="star")
        x = xs[comm.rank]
        return (await comm.broadcast(x, 3, algorithm="tree"), await comm.reduce(x, "sum", 1, algorithm="tree"),
                await comm.gather(x, 1, algorithm="tree"), await comm.scatter(xs[2], 2, algorithm="tree"))

    results = await run_inproc(size, body, buffsize=2048)
    for rank, (bc, red, g, sc) in enumerate(results):
        assert_close(bc, xs[3])
        assert_close(sc, xs[2][rank * 175:(rank + 1) * 175])
        if rank == 1:
            assert_close(red, reduce_ref(xs, "sum"))
            assert_close(g, np.concatenate(xs))
        else:
            assert red is None and g is None


def test_tree_shape() -> None:
    """Every virtual rank but 0 is the child of exactly one parent, and subtrees are contiguous."""
    for n in range(1, 40):
        seen = [c for v in range(n) for c in children(v, n)]
        assert sorted(seen) == list(range(1, n))
        for v in range(n):
            assert all(c - (c & -c) == v for c in children(v, n))

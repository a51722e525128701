"""ring and mesh on the ops run whole: every op each claims vs numpy, in process.

ring: all_gather_v, reduce_scatter_v, reduce. mesh: those and gather(_v), scatter(_v),
all_to_all(_v). World sizes 1..9, 13, 16 with a 2 KiB CCL buffer (a 1 KiB half), so the
larger blocks stream through many pieces and slots; every call of a job is issued at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

import ahcomm
from ahcomm.algorithms import REGISTRY, Call, Topology, _push
from ahcomm.algorithms.mesh import PUSH_BYTES

from support.inproc import busy_flags
from support.numerics import assert_close, reduce_ref

SIZES = [1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 16]
RING_OPS = ["all_gather_v", "reduce_scatter_v", "reduce"]
MESH_OPS = [*RING_OPS, "gather", "gather_v", "scatter", "scatter_v", "all_to_all", "all_to_all_v"]
DTYPES = [np.float32, np.float64, np.int32, np.int8, np.float16, np.bool_, np.uint64, np.int64]
COUNTS = [0, 1, 37, 1500]  # 1500 elements > the 1 KiB CCL half for every dtype
SMALL_BUFF = 2048


def data(rng: np.random.Generator, rows: int, dtype: Any, op: str = "sum", width: int = 0) -> np.ndarray:
    """Integer-valued data (exact in every dtype and any reduction order); ``width`` adds a row axis."""
    dt = np.dtype(dtype)
    shape = (rows, width) if width else (rows,)
    if dt == np.bool_:
        return rng.integers(0, 2, shape).astype(bool)
    lo, hi = (1, 3) if op == "prod" else (0 if dt.kind == "u" else -8, 9)
    return rng.integers(lo, hi, shape).astype(dt)


def ops_for(dtype: Any) -> list[str]:
    return ["sum", "prod", "max", "min"] + (["avg"] if np.dtype(dtype).kind == "f" else [])


def vcounts(rng: np.random.Generator, n: int, i: int) -> list[int]:
    """Uneven counts with zeros anywhere: all zero, one big block, or a random mix."""
    kind = i % 4
    if kind == 0:
        return [0] * n
    if kind == 1:
        return [1500 if p == (i * 5) % n else 0 for p in range(n)]
    counts = [int(c) for c in rng.choice([0, 1, 37, 700], n)]
    counts[(i * 3) % n] = 0
    return counts


@dataclass
class Case:
    name: str
    issue: Callable[[ahcomm.Comm], Awaitable[Any]]  # the call as rank comm.rank makes it
    want: Callable[[int], Any]  # the expected result on a rank (None: the call returns None)
    inputs: list[np.ndarray]  # every rank's input, checked untouched afterwards


def make_case(op: str, i: int, n: int, algo: str, rng: np.random.Generator) -> Case:
    dtype = DTYPES[i % len(DTYPES)]
    red = ops_for(dtype)[i % len(ops_for(dtype))]
    count = COUNTS[(3 * i + i // 4) % len(COUNTS)]  # every count, not tied to one dtype
    root = (3 * i + 1) % n
    width = 2 if i % 5 == 4 else 0  # some calls move rows of two elements
    name = f"{op}#{i} {np.dtype(dtype).name} {red} n={n} root={root}"
    if op == "reduce":
        xs = [data(rng, count, dtype, red) for _ in range(n)]
        inplace = i % 2 == 1

        async def issue(c: ahcomm.Comm) -> Any:
            if inplace and c.rank == root:
                y = xs[c.rank].copy()
                got = await c.reduce(y, red, root, out=y, algorithm=algo)
                assert got is y
                return got
            return await c.reduce(xs[c.rank], red, root, algorithm=algo)
        return Case(name + f" inplace={inplace}", issue, lambda r: reduce_ref(xs, red) if r == root else None, xs)
    if op in ("gather", "scatter", "all_to_all"):
        per = count // 2 if op == "gather" else count // 2 // n  # rows per block
        xs = [data(rng, per * (1 if op == "gather" else n), dtype, width=width) for _ in range(n)]
        if op == "gather":
            return Case(name, lambda c: c.gather(xs[c.rank], root, algorithm=algo),
                        lambda r: np.concatenate(xs) if r == root else None, xs)
        if op == "scatter":
            return Case(name, lambda c: c.scatter(xs[c.rank], root, algorithm=algo),
                        lambda r: xs[root][r * per:(r + 1) * per], xs)
        return Case(name, lambda c: c.all_to_all(xs[c.rank], algorithm=algo),
                    lambda r: np.concatenate([x[r * per:(r + 1) * per] for x in xs]), xs)
    counts = vcounts(rng, n, i)
    d = Call.displs(counts)
    known = i % 3 != 0  # pass counts we could exchange
    if op in ("gather_v", "all_gather_v"):
        xs = [data(rng, counts[p], dtype, width=width) for p in range(n)]
        kw: dict[str, Any] = {"counts": counts} if known else {}
        if op == "gather_v":
            return Case(name, lambda c: _data(c.gather_v(xs[c.rank], root, algorithm=algo, **kw)),
                        lambda r: np.concatenate(xs) if r == root else None, xs)
        return Case(name, lambda c: _data(c.all_gather_v(xs[c.rank], algorithm=algo, **kw)),
                    lambda r: np.concatenate(xs), xs)
    if op == "scatter_v":
        xs = [data(rng, d[n] if p == root else 0, dtype, width=width) for p in range(n)]
        return Case(name, lambda c: c.scatter_v(xs[c.rank], counts, root, algorithm=algo),
                    lambda r: xs[root][d[r]:d[r + 1]], xs)
    if op == "reduce_scatter_v":
        xs = [data(rng, d[n], dtype, red, width=width) for _ in range(n)]
        return Case(name, lambda c: c.reduce_scatter_v(xs[c.rank], counts, red, algorithm=algo),
                    lambda r: reduce_ref(xs, red)[d[r]:d[r + 1]], xs)
    # all_to_all_v: S[p][q] rows go from p to q
    table = np.array([vcounts(rng, n, i + p) for p in range(n)])
    xs = [data(rng, int(table[p].sum()), dtype, width=width) for p in range(n)]
    offs = [Call.displs(table[p]) for p in range(n)]

    def a2av(c: ahcomm.Comm) -> Awaitable[Any]:
        recv = {"recv_counts": list(table[:, c.rank])} if known else {}
        return _data(c.all_to_all_v(xs[c.rank], list(table[c.rank]), algorithm=algo, **recv))
    return Case(name, a2av, lambda r: np.concatenate([xs[p][offs[p][r]:offs[p][r + 1]] for p in range(n)]), xs)


async def _data(fut: Awaitable[Any]) -> Any:
    got = await fut
    return None if got is None else got.data


async def run_job(size: int, body: Callable[[ahcomm.Comm], Awaitable[Any]], *, buffsize: int,
                  single_copy: bool = True) -> list[Any]:
    comms = await ahcomm.init_inprocess(size, buffsize=buffsize, single_copy=single_copy)
    try:
        results = list(await asyncio.wait_for(asyncio.gather(*(body(c) for c in comms)), timeout=60))
        for comm in comms:  # protocol: every notify posted was waited, none posted twice
            assert not busy_flags(comm), (comm.rank, busy_flags(comm))
        return results
    finally:
        await asyncio.gather(*(c.close() for c in comms))


def check(cases: list[Case], results: list[list[Any]], copies: list[list[np.ndarray]]) -> None:
    for k, case in enumerate(cases):
        for rank, got in enumerate(results):
            want = case.want(rank)
            if want is None:
                assert got[k] is None, case.name
            else:
                assert got[k] is not None, case.name
                assert_close(got[k], want)
        for x, orig in zip(case.inputs, copies[k]):
            np.testing.assert_array_equal(x, orig, err_msg=f"{case.name}: input modified")


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("algo", ["ring", "mesh"])
async def test_matrix(algo: str, size: int) -> None:
    rng = np.random.default_rng(size)
    ops = RING_OPS if algo == "ring" else MESH_OPS
    reps = 8 if size <= 9 else 4
    cases = [make_case(op, i + j, size, algo, rng) for i in range(reps) for j, op in enumerate(ops)]
    copies = [[x.copy() for x in case.inputs] for case in cases]

    async def body(comm: ahcomm.Comm) -> list[Any]:
        futs = [case.issue(comm) for case in cases]  # all in flight: buffer halves alternate
        return list(await asyncio.gather(*futs))

    check(cases, await run_job(size, body, buffsize=SMALL_BUFF), copies)


@pytest.mark.parametrize("size", [2, 3, 5])
async def test_mesh_single_copy_matches_staged(size: int) -> None:
    # Pair blocks of 70k float32 (280 KB) take the single-copy reads (reduce and reduce_scatter_v
    # always stage); the 1 MiB buffer (512 KiB half) makes the staged ones stream in pieces.
    # Mixed pairs: big, small and empty.
    rng = np.random.default_rng(7)
    big = 70_000
    counts = [big if p % 2 == 0 else 5 * p for p in range(size)]
    d = Call.displs(counts)
    xs = [data(rng, big, np.float32) for _ in range(size)]
    ws = [data(rng, 2 * big * size, np.float32) for _ in range(size)]  # reduce shares above SC_BYTES too
    vs = [data(rng, d[size], np.float32) for _ in range(size)]
    table = np.array([[big if (p + q) % 2 else q for q in range(size)] for p in range(size)])
    ts = [data(rng, int(table[p].sum()), np.float32) for p in range(size)]
    offs = [Call.displs(table[p]) for p in range(size)]
    root = size - 1
    cases = [
        Case("gather", lambda c: c.gather(xs[c.rank], root, algorithm="mesh"),
             lambda r: np.concatenate(xs) if r == root else None, xs),
        Case("gather_v", lambda c: _data(c.gather_v(vs[c.rank][:counts[c.rank]], 1, counts=counts, algorithm="mesh")),
             lambda r: np.concatenate([v[:counts[p]] for p, v in enumerate(vs)]) if r == 1 else None, vs),
        Case("scatter_v", lambda c: c.scatter_v(vs[c.rank] if c.rank == root else vs[c.rank][:0], counts, root,
                                                algorithm="mesh"), lambda r: vs[root][d[r]:d[r + 1]], vs),
        Case("all_gather_v", lambda c: _data(c.all_gather_v(vs[c.rank][:counts[c.rank]], algorithm="mesh")),
             lambda r: np.concatenate([v[:counts[p]] for p, v in enumerate(vs)]), vs),
        Case("all_to_all_v", lambda c: _data(c.all_to_all_v(ts[c.rank], list(table[c.rank]), algorithm="mesh")),
             lambda r: np.concatenate([ts[p][offs[p][r]:offs[p][r + 1]] for p in range(size)]), ts),
        Case("reduce_scatter_v", lambda c: c.reduce_scatter_v(vs[c.rank], counts, "max", algorithm="mesh"),
             lambda r: reduce_ref(vs, "max")[d[r]:d[r + 1]], vs),
        Case("reduce", lambda c: c.reduce(ws[c.rank], "sum", 0, algorithm="mesh"),
             lambda r: reduce_ref(ws, "sum") if r == 0 else None, ws),
    ]
    copies = [[x.copy() for x in case.inputs] for case in cases]

    async def body(comm: ahcomm.Comm) -> tuple[list[Any], int]:
        assert comm.topology.single_copy is single
        got = [await case.issue(comm) for case in cases]
        return got, sum(link["bytes_received"] for link in comm.stats()["links"].values())

    for single in (True, False):
        out = await run_job(size, body, buffsize=1 << 20, single_copy=single)
        check(cases, [got for got, _ in out], copies)
        read = [n for _, n in out]
        # who read peers' memory: single copy reads whole 280 KB blocks; staged runs receive at most
        # the small eager messages of the _v ops' count exchanges over the links
        assert all(n >= 4 * big for n in read) if single else all(n < 4096 for n in read), read


async def test_ring_reduce_chain_and_scratch_reuse() -> None:
    # Large reduce and reduce_scatter_v through ring on many pieces, then again (scratch reused).
    size, count = 4, 20_000
    rng = np.random.default_rng(3)
    xs = [data(rng, count, np.float64) for _ in range(size)]
    counts = [0, count // 2, 1, count - count // 2 - 1]
    d = Call.displs(counts)

    async def body(comm: ahcomm.Comm) -> list[Any]:
        x = xs[comm.rank]
        return [await comm.reduce(x, "sum", 2, algorithm="ring"),
                await comm.reduce_scatter_v(x, counts, "min", algorithm="ring"),
                await comm.reduce(x, "max", 0, algorithm="ring")]

    results = await run_job(size, body, buffsize=4096)
    for r, (s, rs, mx) in enumerate(results):
        assert (s is None) == (r != 2) and (mx is None) == (r != 0)
        if r == 2:
            assert_close(s, reduce_ref(xs, "sum"))
        if r == 0:
            assert_close(mx, reduce_ref(xs, "max"))
        assert_close(rs, reduce_ref(xs, "min")[d[r]:d[r + 1]])


def test_registry_and_mesh_needs_mapped_links() -> None:
    for op in MESH_OPS:
        assert "mesh" in REGISTRY.names(op)
        assert ("ring" in REGISTRY.names(op)) == (op in RING_OPS)
    mesh = REGISTRY.algorithms["mesh"]
    call = Call(op="gather_v", seq=0, dtype=np.dtype(np.float32), count=4, counts=(4, 4))
    topo = Topology(rank=0, size=2, hosts=("a", "a"), link_kinds=("self", "rdma"), all_mapped=False)
    assert not mesh.select(call, topo)
    assert mesh.select(call, Topology(rank=0, size=2, hosts=("a", "a"), link_kinds=("self", "sdma"),
                                      all_mapped=True))


@pytest.mark.parametrize("cores", [2, 8])
@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("dtype, op", [(np.float32, "sum"), (np.float64, "max"), (np.int32, "prod")])
async def test_mesh_single_copy_all_reduce_writes_a_large_output_directly(size: int, dtype: Any, op: str, cores: int,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Out of place into an output the cache should not keep (``Context.stream_output``, here for
    every size), each rank reduces every piece of its share straight into the output and pushes
    it from there, whether or not each rank has a core: no second pass through the scratch and
    no non-temporal copy (with the push loop that pass cost more than it saved). Pieces of
    ``PUSH_BYTES`` and an odd tail; in place the same; the inputs stay as they were."""
    monkeypatch.setattr("ahcomm.algorithms.base.streams", lambda nbytes: True)
    monkeypatch.setattr("ahcomm.algorithms.base.usable_cores", lambda: cores)
    pieces = [0]
    check = _push.check

    def counted(*args: Any) -> None:
        pieces[0] += 1
        check(*args)
    monkeypatch.setattr(_push, "check", counted)
    rng = np.random.default_rng(size)
    count = size * (PUSH_BYTES // np.dtype(dtype).itemsize) + 7
    xs = [(rng.integers(1, 3, count) if np.dtype(dtype).kind == "i" else rng.standard_normal(count)).astype(dtype)
          for _ in range(size)]
    copies = [x.copy() for x in xs]
    want = reduce_ref(xs, op)

    async def body(comm: ahcomm.Comm) -> tuple[np.ndarray, np.ndarray, dict[str, int]]:
        out = await comm.all_reduce(xs[comm.rank], op, algorithm="mesh")
        inplace = xs[comm.rank].copy()
        await comm.all_reduce(inplace, op, out=inplace, algorithm="mesh")
        return out, inplace, comm.stats()["paths"]

    for out, inplace, paths in await run_job(size, body, buffsize=4 << 20):
        assert_close(out, want)
        assert_close(inplace, want)
        assert "copy.non_temporal" not in paths, paths
    assert pieces[0] >= 2 * 2 * size, pieces  # the push loop ran: two pieces (one and a tail) a rank, two calls
    for x, orig in zip(xs, copies):
        np.testing.assert_array_equal(x, orig)

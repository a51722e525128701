"""Hier (two-level: inside servers, then across them) against numpy, in process, with the
servers faked through ``Topology.hosts``: layouts 2x2, 3+1, 1+3, 2+2+2+2, 1+1+1, 5+2, 3x3
and 4+4+1.

Every op it runs (all_reduce, reduce_scatter, all_gather, broadcast, reduce) for every dtype,
reduce op, counts 0 / 1 / odd / larger than the 4 KiB CCL buffer, roots on every server;
all_reduce bitwise identical on every rank, in place too; level 1 forced to ring and to RHD,
and the pipelined all_reduce (segments made small); the bytes that cross servers (each block
or chunk crosses to each other server once); the cost estimate (the same on every rank).
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import numpy as np
import pytest

import ahcomm
from ahcomm.algorithms import REGISTRY, Call, Topology, hierarchical
from ahcomm.algorithms._hier import Layout, tree
from ahcomm.algorithms.cost import CostModel

from support.numerics import assert_close, reduce_ref

LAYOUTS = {"2x2": [2, 2], "3+1": [3, 1], "1+3": [1, 3], "4x2": [2, 2, 2, 2], "1+1+1": [1, 1, 1],
           "5+2": [5, 2], "3x3": [3, 3, 3], "4+4+1": [4, 4, 1]}
DTYPES = [np.float32, np.float64, np.int32, np.int8, np.float16, np.bool_, np.uint64]
COUNTS = [0, 1, 37, 700]  # 700 float32 = 2800 B > the CCL half of 2 KiB
BUFF = 4096


def hosts_of(layout: list[int]) -> tuple[str, ...]:
    return tuple(f"host{h}" for h, count in enumerate(layout) for _ in range(count))


def fake_servers(comms: list[ahcomm.Comm], layout: list[int]) -> None:
    for c in comms:
        c._set_topology(dataclasses.replace(c.topology, hosts=hosts_of(layout)))


def inputs(rng: np.random.Generator, size: int, count: int, dtype: Any, op: str = "sum") -> list[np.ndarray]:
    dt = np.dtype(dtype)
    if dt == np.bool_:
        return [rng.integers(0, 2, count).astype(bool) for _ in range(size)]
    if op == "prod":
        return [rng.integers(1, 3, count).astype(dt) for _ in range(size)]
    lo = 0 if dt.kind == "u" else -3
    return [rng.integers(lo, 4, count).astype(dt) for _ in range(size)]


def ops_for(dtype: Any) -> list[str]:
    return ["sum", "prod", "max", "min"] + (["avg"] if np.dtype(dtype).kind == "f" else [])


Case = tuple[str, list[np.ndarray], str, int]  # (op, per-rank inputs, reduce op, root)


def cases(rng: np.random.Generator, layout: list[int]) -> list[Case]:
    n = sum(layout)
    roots = sorted({sum(layout[:h]) + (h % count) for h, count in enumerate(layout)})  # one per server
    out: list[Case] = []
    for i, dtype in enumerate(DTYPES):
        count = COUNTS[i % len(COUNTS)]
        for op in ops_for(dtype):
            out.append(("all_reduce", inputs(rng, n, count, dtype, op), op, 0))
        red = ops_for(dtype)[i % 4]
        root = roots[i % len(roots)]
        out += [("reduce_scatter", inputs(rng, n, count * n, dtype, red), red, 0),
                ("all_gather", inputs(rng, n, count, dtype), "", 0),
                ("broadcast", inputs(rng, n, count, dtype), "", root),
                ("reduce", inputs(rng, n, count, dtype, red), red, root)]
    for count in COUNTS[1:]:
        out += [("all_reduce", inputs(rng, n, count, np.float32), "sum", 0),
                ("reduce_scatter", inputs(rng, n, count * n, np.float32), "sum", 0),
                ("all_gather", inputs(rng, n, count, np.float32), "", 0)]
        for root in roots:
            out += [("broadcast", inputs(rng, n, count, np.int32), "", root),
                    ("reduce", inputs(rng, n, count, np.int32, "max"), "max", root)]
    return out


def expected(case: Case, rank: int, n: int) -> np.ndarray | None:
    op, xs, red, root = case
    if op == "all_reduce":
        return reduce_ref(xs, red)
    if op == "reduce":
        return reduce_ref(xs, red) if rank == root else None
    if op == "reduce_scatter":
        return np.split(reduce_ref(xs, red), n)[rank]
    if op == "all_gather":
        return np.concatenate(xs)
    return xs[root]


async def call(comm: ahcomm.Comm, case: Case) -> Any:
    op, xs, red, root = case
    x = xs[comm.rank]
    if op == "all_reduce":
        return await comm.all_reduce(x, red, algorithm="hier")
    if op == "reduce":
        return await comm.reduce(x, red, root, algorithm="hier")
    if op == "reduce_scatter":
        return await comm.reduce_scatter(x, red, algorithm="hier")
    if op == "all_gather":
        return await comm.all_gather(x, algorithm="hier")
    return await comm.broadcast(x, root, algorithm="hier")


async def run_layout(layout: list[int], body: Any) -> list[Any]:
    """conftest.run_inproc, with every comm's hosts faked before its first call."""
    comms = await ahcomm.init_inprocess(sum(layout), buffsize=BUFF)
    fake_servers(comms, layout)
    try:
        return list(await asyncio.wait_for(asyncio.gather(*(body(c) for c in comms)), timeout=60))
    finally:
        await asyncio.gather(*(c.close() for c in comms))


def check_identical_sum(results: list[np.ndarray], floats: list[np.ndarray]) -> None:
    for got in results:  # one rank reduces each element: every rank gets the same bits
        assert got.tobytes() == results[0].tobytes()
        np.testing.assert_allclose(got, sum(floats), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", list(LAYOUTS))
async def test_matrix(name: str, rng: np.random.Generator) -> None:
    layout = LAYOUTS[name]
    n = sum(layout)
    data = cases(rng, layout)
    floats = [rng.standard_normal(1001).astype(np.float32) for _ in range(n)]

    async def body(comm: ahcomm.Comm) -> tuple[list[Any], np.ndarray, np.ndarray]:
        assert comm.explain("all_reduce", 1)[1].get("hier") is not None  # a candidate with an estimate
        out = [await call(comm, case) for case in data]
        y = floats[comm.rank].copy()
        assert await comm.all_reduce(y, "sum", out=y, algorithm="hier") is y
        b = np.arange(50, dtype=np.int64) if comm.rank == n - 1 else np.zeros(50, np.int64)
        assert await comm.broadcast(b, n - 1, out=b, algorithm="hier") is b
        return out, y, b

    originals = [[x.copy() for x in case[1]] for case in data]
    results = await run_layout(layout, body)
    for k, case in enumerate(data):
        for x, orig in zip(case[1], originals[k]):
            np.testing.assert_array_equal(x, orig)  # inputs are never modified
        for rank in range(n):
            want, got = expected(case, rank, n), results[rank][0][k]
            if want is None:
                assert got is None, (case[0], rank)
            else:
                assert_close(got, want)
    check_identical_sum([r[1] for r in results], floats)
    for rank in range(n):
        np.testing.assert_array_equal(results[rank][2], np.arange(50))


@pytest.mark.parametrize("level1", ["ring", "rhd"])
@pytest.mark.parametrize("name", ["3+1", "4x2", "3x3", "4+4+1", "1+1+1"])
async def test_level1_and_pipelining(name: str, level1: str, rng: np.random.Generator,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Level 1 forced (as AHCOMM_ALGO's level1 would), segments of 256 B: a 700-element
    float32 all_reduce runs as 4 pipelined segments (the most), the int64 one of 3001 too."""
    monkeypatch.setattr(REGISTRY.algorithms["hier"], "level1", level1)
    monkeypatch.setattr(hierarchical, "SEGMENT_BYTES", 256)
    layout = LAYOUTS[name]
    n = sum(layout)
    vecs = {count: [rng.standard_normal(count).astype(np.float32) for _ in range(n)] for count in (5, 100, 700)}
    ints = [rng.integers(-9, 9, 3001).astype(np.int64) for _ in range(n)]

    async def body(comm: ahcomm.Comm) -> list[np.ndarray]:
        r = comm.rank
        out = [await comm.all_reduce(v[r], algorithm="hier") for v in vecs.values()]
        out.append(await comm.all_reduce(ints[r], "max", algorithm="hier"))
        for root in range(0, n, 2):
            out.append(await comm.broadcast(ints[r], root, algorithm="hier"))
        return out

    results = await run_layout(layout, body)
    for i, v in enumerate(vecs.values()):
        check_identical_sum([r[i] for r in results], v)
    for rank in range(n):
        np.testing.assert_array_equal(results[rank][3], np.maximum.reduce(ints))
        for j, root in enumerate(range(0, n, 2)):
            np.testing.assert_array_equal(results[rank][4 + j], ints[root])


@pytest.mark.parametrize("name", ["3+1", "5+2", "4+4+1"])
async def test_cross_server_bytes(name: str) -> None:
    """Each block (all_gather, reduce_scatter) or vector element (broadcast, reduce) crosses to
    each other server exactly once; a ring level 1 moves 2 (S - 1) times the vector in all."""
    layout = LAYOUTS[name]
    n, S = sum(layout), len(layout)
    server = [h for h, count in enumerate(layout) for _ in range(count)]
    count = 300

    def crossing(comm: ahcomm.Comm) -> int:
        return sum(link["bytes_sent"] for peer, link in comm.stats()["links"].items()
                   if server[peer] != server[comm.rank])

    async def body(comm: ahcomm.Comm) -> list[int]:
        x = np.ones(count * n, np.float64)
        steps = [crossing(comm)]
        for run in (lambda: comm.all_gather(x[:count], algorithm="hier"),
                    lambda: comm.reduce_scatter(x, algorithm="hier"),
                    lambda: comm.broadcast(x, n - 1, algorithm="hier"),
                    lambda: comm.reduce(x, root=1, algorithm="hier"),
                    lambda: comm.all_reduce(x, algorithm="hier")):
            await run()
            steps.append(crossing(comm))
        return list(np.diff(steps))

    per_rank = await run_layout(layout, body)
    totals = np.sum(per_rank, axis=0)
    block, vector = count * 8, count * n * 8
    assert list(totals) == [n * (S - 1) * block, n * (S - 1) * block, (S - 1) * vector, (S - 1) * vector,
                            2 * (S - 1) * vector]


def topo(layout: list[int], rank: int, inner: str = "sdma", outer: str = "rdma") -> Topology:
    hosts = hosts_of(layout)
    kinds = tuple("self" if p == rank else inner if hosts[p] == hosts[rank] else outer for p in range(len(hosts)))
    return Topology(rank=rank, size=len(hosts), hosts=hosts, link_kinds=kinds)


def test_layout_groups_and_trees() -> None:
    for layout in LAYOUTS.values():
        lay = Layout(topo(layout, 0))
        assert lay.G == max(layout)
        for c in range(lay.G):  # a chunk's group: one owner per server
            assert [lay.server[r] for r in lay.group(c)] == list(range(len(layout)))
        for s in range(lay.S):  # every rank's block has one holder per server, on that server
            assert all(lay.server[lay.holder(s, b)] == s for b in range(sum(layout)))
            assert [lay.holder(s, b) for b in lay.ranks[s]] == lay.ranks[s]
    for n in range(1, 12):
        for chain in (True, False):
            reached = {0}
            for v in range(n):  # parents come first; every position is reached once
                parent, kids = tree(v, n, chain)
                assert (parent is None) == (v == 0) and (parent is None or parent in reached)
                assert not reached & set(kids)
                reached |= set(kids)
            assert reached == set(range(n))


def test_select_and_cost() -> None:
    hier = REGISTRY.algorithms["hier"]
    model = CostModel()
    one = Topology(rank=0, size=4, hosts=("a",) * 4, link_kinds=("self",) + ("sdma",) * 3)
    call = Call(op="all_reduce", seq=0, dtype=np.dtype(np.float32), count=1 << 20)
    assert not hier.select(call, one)
    for layout in ([4, 4], [3, 1], [4, 4, 1]):
        for op in sorted(hier.ops):
            c = Call(op=op, seq=0, dtype=np.dtype(np.float32), count=1 << 18)
            costs = {hier.cost(c, topo(layout, r), model) for r in range(sum(layout))}
            assert len(costs) == 1, (layout, op, costs)  # every rank estimates the same
            cost = costs.pop()
            assert cost is not None and 0 < cost < 1, (layout, op, cost)
    big = Call(op="all_reduce", seq=0, dtype=np.dtype(np.float32), count=1 << 22)
    ring = REGISTRY.algorithms["ring"].cost(big, topo([4, 4], 0), model)
    mine = hier.cost(big, topo([4, 4], 0), model)
    assert ring is not None and mine is not None and mine < ring  # fewer bytes over the slow links


async def test_ahcomm_algo_level1_runs_hier_with_that_algorithm_between_servers() -> None:
    comms = await ahcomm.init_inprocess(4, algo="level0:NA;level1:rhd")
    try:
        for c in comms:
            c._set_topology(dataclasses.replace(c.topology, hosts=("a", "a", "b", "b")))
        chosen = comms[0]._selector.choose(Call("all_reduce", 0, np.dtype(np.float32), 8), comms[0].topology)
        assert chosen.name == "hier" and chosen is hierarchical.with_level1("rhd")
        flat = comms[0]._selector.choose(Call("all_to_all", 0, np.dtype(np.float32), 2, counts=(2,) * 4,
                                              recv_counts=(2,) * 4), comms[0].topology)
        assert flat.name != "hier"  # hier has no all_to_all: the default rule
        got = await asyncio.gather(*(c.all_reduce(np.full(8, c.rank + 1.0)) for c in comms))
        assert all(np.all(g == 10.0) for g in got)
    finally:
        await asyncio.gather(*(c.close() for c in comms))


def test_layout_scales_and_keeps_its_holders() -> None:
    """A rank's layout costs O(n), not O(servers x n) (4,096 ranks in the simulator: the old
    one built 512 lists of 4,096 per rank), with the same block holders as before."""
    import random
    import time

    from ahcomm.algorithms._hier import Layout
    from ahcomm.algorithms.call import Topology

    def topo(rank: int, hosts: tuple[str, ...]) -> Topology:
        n = len(hosts)
        return Topology(rank=rank, size=n, hosts=hosts, link_kinds=("rdma",) * n, all_mapped=False,
                        single_copy=False)

    rng = random.Random(1)
    for _ in range(100):  # uneven servers, interleaved: holders as the former full tables had them
        n = rng.randint(1, 30)
        hosts = tuple(f"h{rng.randint(0, 4)}" for _ in range(n))
        lay = Layout(topo(rng.randrange(n), hosts))
        for s in range(lay.S):
            others = [b for b in range(n) if lay.server[b] != s]
            want = list(range(n))
            for i, b in enumerate(others):
                want[b] = lay.ranks[s][i % len(lay.ranks[s])]
            assert [lay.holder(s, b) for b in range(n)] == want
    hosts = tuple(f"s{r // 8}" for r in range(4096))
    started = time.perf_counter()
    for r in range(0, 4096, 64):
        Layout(topo(r, hosts))
    assert time.perf_counter() - started < 5.0  # the old layout: about half a second per rank

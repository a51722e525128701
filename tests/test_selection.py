"""The selector and the cost model (issue 3): pure and in-process, no ranks are started.

Topologies are built by hand: one host with SDMA links (mapped, single copy) or RDMA links
(as AHCOMM_TRANSPORT=rdma gives), and the default ``CostModel`` (``cores=0``: no
oversubscription) unless a test says otherwise.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest

from ahcomm.algorithms import REGISTRY, Algorithm, Call, Context, Registry, Topology
from ahcomm.algorithms._selection import Selector
from ahcomm.algorithms.base import WHOLE
from ahcomm.algorithms.cost import HALF_BYTES, MODEL_VERSION, CostModel, LinkCost, Work, engine_tasks, load, npieces
from ahcomm.algorithms.direct import Direct
from ahcomm.algorithms.mesh import Mesh
from ahcomm.algorithms.nb import NB
from ahcomm.algorithms.nhr import NHR
from ahcomm.algorithms.pairwise import Pairwise
from ahcomm.algorithms.rhd import RHD
from ahcomm.algorithms.ring import Ring
from ahcomm.algorithms.star import Star
from ahcomm.algorithms.tree import Tree

F32 = np.dtype(np.float32)
OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "gather", "scatter", "all_to_all")
V_OPS = ("all_gather_v", "reduce_scatter_v", "gather_v", "scatter_v", "all_to_all_v")
SIZES = (0, 8, 4 << 10, 256 << 10, 2 << 20, 64 << 20)


def catalogue() -> Registry:
    """The catalogue's algorithms alone (other engineers may register more in REGISTRY)."""
    registry = Registry()
    for algorithm in (Ring(), Mesh(), NB(), Pairwise(), RHD(), NHR(), Tree(), Star()):
        registry.register(algorithm)
    return registry


def topo(kind: str, n: int, rank: int = 0) -> Topology:
    mapped = kind != "rdma"
    return Topology(rank=rank, size=n, hosts=("h",) * n,
                    link_kinds=tuple("self" if p == rank else kind for p in range(n)),
                    all_mapped=mapped, single_copy=mapped)


def call(op: str, n: int, nbytes: int, dtype: np.dtype = F32) -> Call:
    """A call as ``ahcomm-bench`` makes it: ``nbytes`` is the whole buffer (n blocks for the
    blocked ops), like ``Comm.explain``'s calls for the ops with per-rank counts."""
    elems = nbytes // dtype.itemsize
    blocked = op in ("all_gather", "reduce_scatter", "gather", "scatter", "all_to_all")
    count = elems // n if blocked else elems
    counts = (count,) * n if op in WHOLE and op != "reduce" else None
    return Call(op=op, seq=0, dtype=dtype, count=count, counts=counts,
                recv_counts=counts if op.startswith("all_to_all") else None)


def pick(op: str, kind: str, n: int, nbytes: int, model: CostModel | None = None) -> str:
    return Selector(catalogue(), "", model or CostModel()).choose(call(op, n, nbytes), topo(kind, n)).name


# -- clear-cut picks ----------------------------------------------------------------------------
@pytest.mark.parametrize(("op", "kind", "n", "nbytes", "expected"), [
    ("all_reduce", "sdma", 2, 8, "mesh"),  # one step: every rank reduces the staged inputs
    ("all_reduce", "sdma", 2, 64 << 20, "mesh"),  # single copy: each rank reduces its share
    ("all_to_all", "sdma", 4, 64 << 20, "mesh"),  # every block read once out of the sender's memory
    ("reduce", "sdma", 4, 8, "star"),  # the root reduces the staged inputs: one step
    ("reduce", "sdma", 4, 64 << 20, "star"),
    ("all_reduce", "rdma", 4, 8, "rhd"),  # 2 log2 n steps
    ("all_reduce", "rdma", 8, 64 << 20, "ring"),  # bandwidth-optimal, fewer pieces than the halving
    ("all_to_all", "rdma", 8, 8, "nb"),  # log2 n steps
    ("all_to_all", "rdma", 8, 16 << 20, "pairwise"),  # every block crosses one link once
    ("broadcast", "rdma", 8, 8, "tree"),  # log2 n deep
    ("broadcast", "rdma", 8, 64 << 20, "ring"),  # a pipelined chain: the root sends once
    ("gather", "rdma", 4, 4 << 10, "tree"),  # the only candidate
])
def test_clear_cut_picks(op: str, kind: str, n: int, nbytes: int, expected: str) -> None:
    assert pick(op, kind, n, nbytes) == expected


def test_oversubscribed_host_prefers_star_for_small_all_reduce() -> None:
    """With 4 ranks on 2 cores, mesh's all-to-all notifies cost more than star's extra step."""
    assert pick("all_reduce", "sdma", 4, 8) == "mesh"
    assert pick("all_reduce", "sdma", 4, 8, CostModel(cores=2)) == "star"


def test_star_prices_its_crowded_copies_in_phases() -> None:
    """star's all_reduce: all but the centre stage at once and every rank copies the result out
    at once; where ranks outnumber cores those copies wait for a core. With a core per rank the
    estimate is the single-phase sum (two copies, the centre's reduction). The old estimate
    counted two busy ranks for the whole call and picked star at 16-64 MiB on 2 cores, where
    mesh measured 25-55% faster (np=4 32 MiB 16757-17227 us against 22904-23043; np=6 64 MiB
    53553 against 119412: results/2026-11-26-star-phases.md)."""
    m, n = 32 << 20, 4
    roomy, crowded = CostModel(cores=8), CostModel(cores=2)
    c = call("all_reduce", n, m)
    star = Star()
    s = npieces(m, HALF_BYTES)
    one_phase = Work(rounds=3 * s - 1, copied=2 * m, reduced=(n - 1) * m, tasks=s * n + (s - 1) * (n - 1),
                     engines=(n + 1) * s * engine_tasks(m / s), busy=2)
    assert star.cost(c, topo("sdma", n), roomy) == pytest.approx(one_phase.seconds(roomy, topo("sdma", n)))
    # 4 ranks on 2 cores: the staging copy (3 ranks) takes 1.5 times as long, the copy-out (4) twice
    extra = star.cost(c, topo("sdma", n), crowded) - one_phase.seconds(crowded, topo("sdma", n))
    assert extra == pytest.approx(1.5 * m * crowded.copy)
    for n, nbytes in ((4, 16 << 20), (4, 32 << 20), (6, 32 << 20), (6, 64 << 20), (8, 64 << 20)):
        assert pick("all_reduce", "sdma", n, nbytes, crowded) == "mesh", (n, nbytes)
    assert pick("all_reduce", "sdma", 4, 8, crowded) == "star"  # small calls: unchanged


def test_no_engine_hand_offs_where_ranks_fill_the_cores() -> None:
    """The streams copy inline where a host has as many ranks as cores (``engine_bytes_for``):
    the model charges a hand-off per big memory task only where there are cores to spare."""
    assert CostModel(engine=1e-3, cores=8).engine_cost(topo("sdma", 4)) == 1e-3
    assert CostModel(engine=1e-3, cores=4).engine_cost(topo("sdma", 4)) == 0.0
    assert CostModel(engine=1e-3).engine_cost(topo("sdma", 4)) == 1e-3  # cores unknown
    work = Work(engines=3)
    assert work.seconds(CostModel(engine=1e-3, cores=2), topo("sdma", 2)) == 0.0


def test_direct_hands_off_to_its_own_threads_on_a_full_host() -> None:
    """Where the streams copy inline (2 ranks on 2 cores) their memory tasks pay no hand-off, but
    direct's copy threads are its own (not ``AHCOMM_COPY_ENGINE``'s): a copy of INLINE_BYTES or
    more still goes to a thread there, and its hand-off is charged."""
    full = CostModel(copy=0.0, engine=1e-3, cores=2)
    assert Work(engines=1).seconds(full, topo("sdma", 2)) == 0.0  # the streams' engines: gone
    assert Work(engines=1, threads=True).seconds(full, topo("sdma", 2)) == pytest.approx(1e-3)
    direct = Direct().work(call("broadcast", 2, 64 << 20), topo("sdma", 2), full, 64 << 20, 64 << 20)
    assert direct.threads and direct.engines == 1
    free = dataclasses.replace(full, engine=0.0)
    assert direct.seconds(full, topo("sdma", 2)) - direct.seconds(free, topo("sdma", 2)) == pytest.approx(0.5e-3)


def test_rdma_small_all_reduce_order_and_large_all_to_all() -> None:
    sel = Selector(catalogue(), "", CostModel(cores=2))
    costs = sel.costs(call("all_reduce", 4, 8), topo("rdma", 4))
    assert costs["rhd"] < costs["nhr"] < costs["ring"]  # type: ignore[operator]
    big = sel.costs(call("all_to_all", 4, 64 << 20), topo("rdma", 4))
    assert big["pairwise"] < big["nb"]  # type: ignore[operator]


# -- determinism and refusals -------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["sdma", "rdma"])
@pytest.mark.parametrize("n", [2, 3, 4, 5, 8])
def test_every_rank_picks_the_same_and_never_a_refusing_algorithm(kind: str, n: int) -> None:
    for registry in (catalogue(), REGISTRY):
        sel = Selector(registry, "", CostModel(cores=2))
        for op in OPS:
            for nbytes in SIZES:
                c = call(op, n, nbytes)
                names = {sel.choose(c, topo(kind, n, r)).name for r in range(n)}
                assert len(names) == 1, (op, nbytes, names)
                chosen = registry.algorithms[names.pop()]
                assert chosen.select(c, topo(kind, n)), (op, nbytes, chosen.name)
                assert chosen.name == sel.choose(c, topo(kind, n)).name  # repeatable
                if kind == "rdma":
                    assert chosen.name not in ("mesh", "star")


class _Refuses(Algorithm):
    """Free, but never able to run anything."""

    name = "refuses"
    ops = frozenset(OPS)

    def select(self, call: Call, topo: Topology) -> bool:
        return False

    def cost(self, call: Call, topo: Topology, model: CostModel) -> float | None:
        return 0.0

    async def orchestrate(self, ctx: Context) -> None:  # pragma: no cover - never selected
        raise AssertionError("a refusing algorithm ran")


class _NoCost(Algorithm):
    """Can run all_reduce, gives no estimate."""

    name = "nocost"
    ops = frozenset({"all_reduce"})

    async def orchestrate(self, ctx: Context) -> None:  # pragma: no cover - never run here
        raise AssertionError("not run")


def test_a_refusing_algorithm_is_never_picked_however_cheap() -> None:
    registry = Registry()
    registry.register(_Refuses())
    for algorithm in catalogue().algorithms.values():
        registry.register(algorithm)
    sel = Selector(registry, "", CostModel())
    for op in OPS:
        assert sel.choose(call(op, 4, 4096), topo("rdma", 4)).name != "refuses"
        assert "refuses" not in sel.costs(call(op, 4, 4096), topo("rdma", 4))


def test_an_algorithm_without_cost_loses_to_one_with_a_cost() -> None:
    registry = Registry()
    registry.register(_NoCost())  # first in preference order, and no estimate
    registry.register(RHD())
    sel = Selector(registry, "", CostModel())
    assert sel.choose(call("all_reduce", 4, 8), topo("rdma", 4)).name == "rhd"
    assert sel.costs(call("all_reduce", 4, 8), topo("rdma", 4))["nocost"] is None
    alone = Registry()
    alone.register(_NoCost())
    assert Selector(alone, "", CostModel()).choose(call("all_reduce", 4, 8), topo("rdma", 4)).name == "nocost"


# -- v-ops and zero counts ----------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["sdma", "rdma"])
@pytest.mark.parametrize("op", V_OPS)
@pytest.mark.parametrize("counts", [(0, 0, 0, 0), (0, 5, 0, 3), (1000, 0, 1 << 20, 7), (1 << 22,) * 4])
def test_v_ops_and_zero_counts_get_a_finite_cost_and_a_runnable_pick(kind: str, op: str,
                                                                     counts: tuple[int, ...]) -> None:
    n = len(counts)
    sel = Selector(REGISTRY, "", CostModel(cores=2))
    picks = set()
    for r in range(n):
        # all_to_all_v: every rank sends its own row (a rotation here), so the calls differ per rank
        row = counts[r:] + counts[:r] if op == "all_to_all_v" else counts
        recv = counts[-r:] + counts[:-r] if op == "all_to_all_v" and r else counts
        c = Call(op=op, seq=3, dtype=F32, count=row[r], counts=row,
                 recv_counts=recv if op == "all_to_all_v" else None)
        t = topo(kind, n, r)
        for name, cost in sel.costs(c, t).items():
            assert cost is None or (math.isfinite(cost) and cost >= 0), (name, cost)
        chosen = sel.choose(c, t)
        assert chosen.select(c, t)
        picks.add(chosen.name)
    assert len(picks) == 1, picks  # every rank runs the same algorithm, even with its own counts


@pytest.mark.parametrize("kind", ["sdma", "rdma"])
def test_costs_are_finite_and_non_negative_everywhere(kind: str) -> None:
    models = (CostModel(), CostModel(cores=2), CostModel(cores=64))
    for n in (1, 2, 3, 5, 7, 13, 16):
        t = topo(kind, n)
        for op in OPS:
            for nbytes in SIZES:
                c = call(op, n, nbytes)
                for algorithm in catalogue().algorithms.values():
                    if not algorithm.select(c, t):
                        continue
                    for model in models:
                        cost = algorithm.cost(c, t, model)
                        assert cost is not None and math.isfinite(cost) and cost >= 0, (algorithm.name, op, n)


def test_costs_grow_with_size() -> None:
    for kind, n in (("sdma", 4), ("rdma", 4), ("rdma", 8)):
        t = topo(kind, n)
        for op in OPS:
            for algorithm in catalogue().algorithms.values():
                if not algorithm.select(call(op, n, 8), t):
                    continue
                small = algorithm.cost(call(op, n, 4 << 10), t, CostModel())
                large = algorithm.cost(call(op, n, 64 << 20), t, CostModel())
                assert small is not None and large is not None and large > small, (algorithm.name, op)


# -- the model -----------------------------------------------------------------------------------
def test_oversubscription_factors() -> None:
    t4 = topo("sdma", 4)
    assert CostModel().hop(t4) == 1.0 and CostModel().slowdown(t4) == 1.0  # cores unknown
    model = CostModel(cores=2)
    assert model.hop(t4) == 2.0 and model.slowdown(t4) == 2.0  # 4 ranks on 2 cores
    assert model.hop(t4, busy=2) == 1.0 and model.slowdown(t4, busy=2) == 1.0  # only two work
    assert model.slowdown(t4, busy=1, streams=3) == 0.5  # one rank alone spreads over both cores
    assert CostModel(cores=8).slowdown(t4) == 1.0
    work = Work(rounds=2, handoffs=1, tasks=1)
    link = model.links["sdma"]
    assert work.seconds(model, t4) == pytest.approx((2 * 2 + 1) * link.alpha + 2 * model.task)
    assert work.seconds(CostModel(cores=4), t4) == pytest.approx(2 * link.alpha + model.task)


def test_uncalibrated_model_counts_the_usable_cores(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a calibration the model takes the cores this process may run on (its affinity),
    not the host's ``cpu_count``: in a 2-core cpuset of a 64-core host the streams of 4 ranks copy
    inline (``engine_bytes_for``), so the model must not charge them engine hand-offs (nor leave
    the host's oversubscription out)."""
    from ahcomm.algorithms import cost

    monkeypatch.setenv("AHCOMM_TUNING_FILE", str(tmp_path / "none.json"))
    monkeypatch.setattr(cost, "usable_cores", lambda: 2, raising=False)
    monkeypatch.setattr(cost.os, "cpu_count", lambda: 64)
    model = load()
    assert model.cores == 2
    assert model.engine_cost(topo("sdma", 4)) == 0.0


def test_model_round_trip_and_old_calibrations(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = dataclasses.replace(CostModel(), links={**CostModel().links, "rdma": LinkCost(1e-4, 2e-9)},
                                task=5e-5, engine=6e-5, cores=3, source="test")
    assert CostModel.from_dict(json.loads(json.dumps(model.to_dict()))) == model
    old = {"links": {"rdma": {"alpha": 9e-4, "beta": 1e-9}}, "gamma": 1e-10, "copy": 1e-10}  # version 1
    assert CostModel.from_dict(old) == CostModel()
    path = tmp_path / "calibration.json"
    monkeypatch.setenv("AHCOMM_TUNING_FILE", str(path))
    assert load().cores >= 1  # no file: the defaults, with this host's cores
    path.write_text(json.dumps({**model.to_dict(), "version": MODEL_VERSION}))
    assert load() == model


def test_a_name_that_is_no_algorithm_is_called_so() -> None:
    """A typo in AHCOMM_ALGO or algorithm= says the name is not an algorithm, in words a newcomer
    reads (it used to run the variable and the name together: ``AHCOMM_ALGO'nosuch' cannot run``)."""
    from ahcomm import InvalidArgument

    c, t = call("all_gather", 2, 1 << 20), topo("sdma", 2)
    with pytest.raises(InvalidArgument, match="^AHCOMM_ALGO's 'nosuch' is not an algorithm and cannot run all_gather"):
        Selector(catalogue(), "allgather=level0:nosuch").choose(c, t)
    with pytest.raises(InvalidArgument, match="^per-call algorithm='nosuch' is not an algorithm and cannot run"):
        Selector(catalogue()).choose(c, t, override="nosuch")
    with pytest.raises(InvalidArgument, match="^AHCOMM_ALGO's 'pairwise' cannot run all_gather .*can: ring"):
        Selector(catalogue(), "allgather=level0:pairwise").choose(c, t)

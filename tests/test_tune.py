"""Measured picks (``ahcomm-bench tune``): the table, where the selector consults it, how it
travels in the calibration file, and the command that measures it."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import ahcomm
from ahcomm._tune import fastest
from ahcomm.algorithms import REGISTRY, Call, Topology
from ahcomm.algorithms._selection import Selector
from ahcomm.algorithms._tuned import MeasuredPick, nearest, parse
from ahcomm.algorithms.cost import MODEL_VERSION, CostModel, load, save

F32 = np.dtype(np.float32)
ROOT = Path(__file__).resolve().parent.parent


def pick(op: str = "all_gather", ranks: int = 2, nbytes: int = 4 << 20, algorithm: str = "ring",
         link: str = "sdma", single_copy: bool = True) -> MeasuredPick:
    return MeasuredPick(op=op, ranks=ranks, link=link, single_copy=single_copy, nbytes=nbytes, algorithm=algorithm)


def topo(n: int, kind: str = "sdma", hosts: tuple[str, ...] | None = None, single_copy: bool = True) -> Topology:
    return Topology(rank=0, size=n, hosts=hosts or ("h",) * n,
                    link_kinds=tuple("self" if p == 0 else kind for p in range(n)), all_mapped=kind != "rdma",
                    single_copy=single_copy)


def gather_call(n: int, nbytes: int) -> Call:
    count = nbytes // F32.itemsize // n
    return Call(op="all_gather", seq=0, dtype=F32, count=count, counts=(count,) * n)


# -- the table -----------------------------------------------------------------------------
def test_nearest_takes_the_closest_size_within_a_factor_of_two() -> None:
    picks = (pick(nbytes=1 << 20, algorithm="oneshot"), pick(nbytes=4 << 20, algorithm="direct"))
    find = lambda nbytes: nearest(picks, "all_gather", 2, "sdma", True, nbytes)
    assert find(1 << 20).algorithm == "oneshot"
    assert find(3 << 20).algorithm == "direct"  # log-nearer 4 MiB than 1 MiB
    assert find(2 << 20).algorithm == "direct"  # a tie: the larger size
    assert find(512 << 10).algorithm == "oneshot" and find(8 << 20).algorithm == "direct"  # the span's ends
    assert find(511 << 10) is None and find((8 << 20) + 4) is None  # beyond: the cost model's
    assert find(0) is None


def test_nearest_matches_op_ranks_link_and_single_copy() -> None:
    picks = (pick(),)
    assert nearest(picks, "all_gather", 2, "sdma", True, 4 << 20) is not None
    assert nearest(picks, "broadcast", 2, "sdma", True, 4 << 20) is None
    assert nearest(picks, "all_gather", 3, "sdma", True, 4 << 20) is None
    assert nearest(picks, "all_gather", 2, "rdma", True, 4 << 20) is None
    assert nearest(picks, "all_gather", 2, "sdma", False, 4 << 20) is None


def test_parse_leaves_out_malformed_entries() -> None:
    good = pick().to_dict()
    bad = [{"op": "all_gather"}, "junk", {**good, "ranks": "x"}, {**good, "nbytes": float("inf")},
           {**good, "single_copy": "false"}]  # int(inf) overflows; bool("false") would be True
    assert parse([good, *bad]) == (pick(),)
    assert parse(None) == () and parse({"op": 1}) == ()


def test_a_damaged_pick_does_not_stop_init(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "calibration.json"
    monkeypatch.setenv("AHCOMM_TUNING_FILE", str(path))
    path.write_text(json.dumps({"version": MODEL_VERSION, "source": "defaults",
                                "picks": [pick().to_dict(), {**pick().to_dict(), "nbytes": 1e400}]}))
    assert load().picks == (pick(),)


def test_the_fastest_replaces_the_models_pick_only_by_a_margin() -> None:
    point = {"model": "oneshot", "times": {"oneshot": 104.0, "direct": 100.0, "ring": 300.0}}
    assert fastest(point) == "oneshot"  # 4% apart: run-to-run noise on a shared host
    point["times"]["oneshot"] = 106.0
    assert fastest(point) == "direct"
    assert fastest({"model": "star", "times": {"ring": 2.0, "mesh": 1.0}}) == "mesh"  # the model's was not timed


# -- in the model and the selector -----------------------------------------------------------
def test_picks_travel_with_the_model_and_survive_another_model_version() -> None:
    model = dataclasses.replace(CostModel(), cores=2, picks=(pick(), pick(op="broadcast", algorithm="direct")))
    data = json.loads(json.dumps(model.to_dict()))
    assert CostModel.from_dict(data) == model
    older = CostModel.from_dict({**data, "version": MODEL_VERSION - 1})  # the numbers are void, not the timings
    assert older.picks == model.picks and older.copy == CostModel().copy


def test_saving_picks_on_the_defaults_keeps_only_the_picks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "calibration.json"
    monkeypatch.setenv("AHCOMM_TUNING_FILE", str(path))
    save(dataclasses.replace(CostModel(), cores=7, picks=(pick(),)))
    assert set(json.loads(path.read_text())) == {"version", "source", "picks"}  # later defaults still apply
    model = load()
    assert model.picks == (pick(),) and model.cores != 7 and model.source == "defaults"


def test_selector_takes_the_measured_pick_over_the_cost_model() -> None:
    model = CostModel(cores=2)
    n, nbytes = 2, 4 << 20
    plain = Selector(REGISTRY, "", model).choose(gather_call(n, nbytes), topo(n)).name
    other = "ring" if plain != "ring" else "mesh"
    tuned = Selector(REGISTRY, "", dataclasses.replace(model, picks=(pick(algorithm=other),)))
    assert tuned.choose(gather_call(n, nbytes), topo(n)).name == other
    assert tuned.basis(gather_call(n, nbytes), topo(n)) == "measured"
    # too far from the measured size, another host layout, no single copy: the cost model's
    far = gather_call(n, 64 << 20)
    assert tuned.choose(far, topo(n)) is Selector(REGISTRY, "", model).choose(far, topo(n))
    assert tuned.basis(far, topo(n)) == "cost model"
    two_servers = topo(n, "rdma", hosts=("a", "b"))
    assert tuned.basis(gather_call(n, nbytes), two_servers) == "cost model"
    assert tuned.basis(gather_call(n, nbytes), topo(n, single_copy=False)) == "cost model"


def test_picks_are_keyed_by_the_slowest_link_and_never_by_one_ranks_bytes() -> None:
    """Every rank must pick alike. Links of mixed kinds are keyed by the slowest, as the model prices
    them; all_to_all_v's bytes are this rank's own, so no pick applies to it."""
    model = CostModel(cores=2, picks=(pick(op="all_gather", ranks=3, link="rdma", nbytes=3 << 20),
                                      pick(op="all_to_all_v", ranks=2, nbytes=1 << 20, algorithm="mesh")))
    mixed = Topology(rank=0, size=3, hosts=("h",) * 3, link_kinds=("self", "sdma", "rdma"), single_copy=True)
    assert model.link_kind(mixed) == "rdma" and model.link(mixed) == model.links["rdma"]
    assert model.measured(gather_call(3, 3 << 20), mixed) is not None
    counts = ((1 << 18, 1 << 18), (1 << 17, 1 << 17))  # 1 MiB sent and received here, not on every rank
    a2av = Call(op="all_to_all_v", seq=0, dtype=F32, count=0, counts=counts[0], recv_counts=counts[1])
    assert model.measured(a2av, topo(2)) is None


def test_a_measured_pick_that_cannot_run_the_call_is_passed_over() -> None:
    model = CostModel(cores=2, picks=(pick(algorithm="pairwise"), pick(algorithm="no-such-algorithm", op="broadcast")))
    selector = Selector(REGISTRY, "", model)
    assert selector.choose(gather_call(2, 4 << 20), topo(2)).name != "pairwise"  # pairwise is all_to_all's
    assert selector.basis(gather_call(2, 4 << 20), topo(2)) == "cost model"
    bcast = Call(op="broadcast", seq=0, dtype=F32, count=1 << 20)
    assert selector.choose(bcast, topo(2)).name in REGISTRY.algorithms


def test_ahcomm_algo_and_a_per_call_algorithm_outrank_the_measured_pick() -> None:
    model = CostModel(cores=2, picks=(pick(algorithm="ring"),))
    selector = Selector(REGISTRY, "allgather=level0:mesh", model)
    assert selector.choose(gather_call(2, 4 << 20), topo(2)).name == "mesh"
    assert selector.basis(gather_call(2, 4 << 20), topo(2)) == "AHCOMM_ALGO"
    assert Selector(REGISTRY, "", model).choose(gather_call(2, 4 << 20), topo(2), override="star").name == "star"


async def test_a_world_runs_the_measured_pick_and_explain_says_so(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Through ``init_inprocess``: the tuning file's pick for in-process links runs (the flight
    record names it) and gives numpy's answer; ``explain`` reports it and why."""
    n, count = 4, 1 << 16  # 256 KiB float32 all_reduce
    path = tmp_path / "calibration.json"
    monkeypatch.setenv("AHCOMM_TUNING_FILE", str(path))
    monkeypatch.setenv("AHCOMM_CORES", "2")
    plain = await ahcomm.init_inprocess(n)
    default = plain[0].explain("all_reduce", count)[0]
    await close(plain)
    other = "ring" if default != "ring" else "rhd"
    save(CostModel(picks=(pick(op="all_reduce", ranks=n, nbytes=count * 4, algorithm=other, link="inproc"),)))
    comms = await ahcomm.init_inprocess(n)
    explained = comms[0].explain("all_reduce", count)
    assert explained[0] == other and explained.basis == "measured" and default in explained[1]
    data = [np.arange(count, dtype=F32) * (r + 1) for r in range(n)]
    results = await asyncio.gather(*(c.all_reduce(x) for c, x in zip(comms, data)))
    for got in results:
        np.testing.assert_array_equal(got, sum(data))
    assert comms[0].flight_record()[-1]["algorithm"] == other
    await close(comms)


async def close(comms: list[ahcomm.Comm]) -> None:
    await asyncio.gather(*(c.close() for c in comms))


# -- ahcomm-bench tune ----------------------------------------------------------------------
def bench(*args: str, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ahcomm.bench", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_tune_measures_picks_that_the_next_job_runs(tmp_path: Path) -> None:
    """A real 2-rank tuning job over the host's links saves a pick per size, keeps the earlier
    picks it did not measure again, and a later bench job runs what it saved."""
    path = tmp_path / "calibration.json"
    earlier = pick(op="broadcast", ranks=3, algorithm="direct")
    save_env = {**os.environ, "AHCOMM_TUNING_FILE": str(path)}
    path.write_text(json.dumps({"version": MODEL_VERSION, "source": "defaults", "picks": [earlier.to_dict()]}))
    out = tmp_path / "tune.json"
    # the job's own picks, not AHCOMM_ALGO's: an inherited override would be saved as measured
    done = bench("tune", "--ranks", "2", "--ops", "all_gather", "-b", "64K", "-e", "128K", "-f", "2", "--rounds", "2",
                 "-w", "1", "-i", "3", "--max-seconds", "0.05", "--json", str(out),
                 env={**save_env, "AHCOMM_ALGO": "allgather=level0:ring"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "saved 2 measured picks (1 earlier ones kept)" in done.stdout, done.stdout
    model = CostModel.from_dict(json.loads(path.read_text()))
    measured = [p for p in model.picks if p.op == "all_gather"]
    assert earlier in model.picks and sorted(p.nbytes for p in measured) == [64 << 10, 128 << 10]
    result = json.loads(out.read_text())["results"][0]
    assert result["ranks"] == 2 and len(result["links"]) == 1
    for point, saved in zip(result["points"], sorted(measured, key=lambda p: p.nbytes)):
        assert saved.algorithm == fastest(point) and point["model"] in point["times"] and point["model"] != "ring"
        assert saved.link == result["links"][0] and not point["wrong"]
    # a later job runs what the file says (here a pick the model would not make: ring's two steps)
    data = json.loads(path.read_text())
    for entry in data["picks"]:
        if entry["op"] == "all_gather" and entry["nbytes"] == 128 << 10:
            entry["algorithm"] = "ring"
    path.write_text(json.dumps(data))
    rows = tmp_path / "rows.json"
    ran = bench("-n", "2", "all_gather", "-b", "128K", "-e", "128K", "-i", "3", "--json", str(rows), env=save_env)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert json.loads(rows.read_text())["rows"][0]["algorithm"] == "ring"


@pytest.mark.parametrize(("args", "message"), [
    (["--ranks", "1"], "each rank count must be 2 or more"),
    (["--ranks", "two"], "expected rank counts such as 2,4"),
    (["--ops", "all_reduce,allgather"], "--ops 'all_reduce,allgather': choose from all, all_reduce"),
    (["--rounds", "0"], "--rounds must be 1 or more"),
])
def test_tune_refuses_bad_arguments_before_any_rank_starts(args: list[str], message: str, tmp_path: Path) -> None:
    done = bench("tune", *args, env={**os.environ, "AHCOMM_TUNING_FILE": str(tmp_path / "c.json")}, timeout=60)
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert not (tmp_path / "c.json").exists()


def test_ops_all_is_every_op_the_benchmark_times() -> None:
    from ahcomm._bench_case import OPS as BENCH_OPS
    from ahcomm._tune import op_list

    assert op_list("all") == list(BENCH_OPS) and op_list("broadcast, all_reduce") == ["broadcast", "all_reduce"]

"""Calls whose data stays in cache are priced at the in-cache rates (CostModel.hot), in the
selector and in the simulator alike; calibrate measures those rates and the cache's size."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest

from ahcomm._config import last_level_cache
from ahcomm.algorithms import REGISTRY, Call, Topology
from ahcomm.algorithms._selection import Selector
from ahcomm.algorithms.cost import CACHE_USABLE, FOOTPRINT, STAGED, CostModel
from ahcomm.sim import simulate

MIB = 1 << 20
CACHE = 48 * MIB  # its usable third holds 2 ranks' 2 MiB calls (3 copies of the data each)
HOT = CostModel(copy=1 / 12e9, gamma=1 / 11e9, copy_shared=1.3 / 12e9, cores=2, cache=CACHE,
                copy_hot=1 / 36e9, gamma_hot=1 / 25e9, source="test")


def test_the_last_level_cache_is_read_from_sysfs(tmp_path: Path) -> None:
    for index, (level, size) in enumerate([(1, "48K"), (1, "32K"), (2, "1024K"), (3, "32768K")]):
        entry = tmp_path / f"index{index}"
        entry.mkdir()
        (entry / "level").write_text(f"{level}\n")
        (entry / "size").write_text(f"{size}\n")
    (tmp_path / "uevent").write_text("")
    assert last_level_cache(str(tmp_path)) == 32 * MIB
    (tmp_path / "index3" / "size").write_text("2M\n")
    assert last_level_cache(str(tmp_path)) == 2 * MIB
    assert last_level_cache(str(tmp_path / "missing")) == 0


def test_a_call_is_hot_where_each_rank_has_a_core_and_the_data_fits_the_usable_cache() -> None:
    fits = CACHE * CACHE_USABLE / (2 * FOOTPRINT)  # the largest call of 2 ranks that is in cache
    assert HOT.hot(2, fits) and not HOT.hot(2, fits * 1.01)
    assert not HOT.hot(3, 64 << 10)  # 3 ranks on 2 cores: they evict each other's caches
    assert not dataclasses.replace(HOT, cache=0).hot(2, 1024)  # cache size unknown
    assert not dataclasses.replace(HOT, copy_hot=0.0, gamma_hot=0.0).hot(2, 1024)  # rates not measured
    assert not dataclasses.replace(HOT, cores=0).hot(2, 1024)
    warm = HOT.for_call(2, 2 * MIB)
    assert (warm.copy, warm.gamma, warm.crowd) == (HOT.copy_hot, HOT.gamma_hot, 1.0)
    assert HOT.for_call(4, 2 * MIB) is HOT and HOT.for_call(3, 64 << 10) is HOT


def test_a_call_beyond_the_cache_runs_in_it_for_the_share_the_cache_holds() -> None:
    """Past the usable cache (``CACHE_USABLE`` of it) the share in cache falls as that part over
    the ranks' data: a call twice the largest hot one runs half at the in-cache rates, per byte
    (the binary rule priced it at memory's rates: 2-rank 64 MiB calls on a host reporting 480
    MiB, 1.18-1.34x measured)."""
    fits = CACHE * CACHE_USABLE / (2 * FOOTPRINT)
    assert HOT.cache_share(2, fits) == 1.0 and HOT.cache_share(2, 2 * fits) == 0.5
    assert HOT.cache_share(2, 64 * fits) == 1 / 64 and HOT.cache_share(3, 1024) == 0.0
    half = HOT.for_call(2, 2 * fits)
    assert math.isclose(half.copy, (HOT.copy_hot + HOT.copy) / 2)
    assert math.isclose(half.gamma, (HOT.gamma_hot + HOT.gamma) / 2)
    assert math.isclose(half.copy_shared, (HOT.copy_hot + HOT.copy_shared) / 2)  # no crowding in cache
    assert 1.0 < half.crowd < HOT.crowd
    assert math.isclose(half.staged * half.copy, (HOT.copy_hot + STAGED * HOT.copy) / 2)  # a full copy in cache
    nearly = HOT.for_call(2, fits * 1.01)
    assert HOT.copy_hot < nearly.copy < 1.02 * HOT.copy_hot
    far = HOT.for_call(2, 1024 * fits)
    assert far.copy > 0.99 * HOT.copy and far.crowd > 0.99 * HOT.crowd


def test_the_rates_travel_with_the_model() -> None:
    assert CostModel.from_dict(json.loads(json.dumps(HOT.to_dict()))) == HOT
    old = {k: v for k, v in HOT.to_dict().items() if k not in ("cache", "copy_hot", "gamma_hot")}
    older = CostModel.from_dict(old)
    assert (older.cache, older.copy_hot, older.gamma_hot) == (0, 0.0, 0.0) and older.for_call(2, 1024) is older


def _topo(n: int) -> Topology:
    return Topology(rank=0, size=n, hosts=("h",) * n, link_kinds=("self",) + ("sdma",) * (n - 1),
                    all_mapped=True, single_copy=True, mailbox=1 << 20)


def test_the_selector_prices_a_hot_call_at_the_in_cache_rates() -> None:
    """reduce at 2 ranks, 2 MiB: in cache, star's reductions are cheap and it beats ring (measured:
    star 270-282 us, ring 452-482; results/2026-11-26-cache-rates.md); without the rates, ring."""
    call = Call(op="reduce", seq=0, dtype=np.dtype(np.float32), count=(2 * MIB) // 4, root=0)
    cold = dataclasses.replace(HOT, cache=0)
    star = REGISTRY.algorithms["star"]
    assert star.cost(call, _topo(2), HOT) < star.cost(call, _topo(2), cold)  # type: ignore[operator]
    assert Selector(REGISTRY, "", HOT).choose(call, _topo(2)).name == "star"
    big = Call(op="reduce", seq=0, dtype=np.dtype(np.float32), count=(64 * MIB) // 4, root=0)
    # 64 MiB: 1/24 of 2 ranks' data in a 48 MiB cache's usable third, priced nearly as from memory
    assert 0.95 * star.cost(big, _topo(2), cold) < star.cost(big, _topo(2), HOT) < star.cost(big, _topo(2), cold)  # type: ignore[operator]


def test_the_simulator_runs_a_hot_call_at_the_in_cache_rates() -> None:
    """np=2 2 MiB ring all_reduce is predicted faster with the in-cache rates; np=4 on 2 cores is
    not hot and predicts as before, 64 MiB (1/24 of its data in cache) nearly so."""
    cold = dataclasses.replace(HOT, cache=0)
    for n, nbytes, faster in ((2, 2 * MIB, True), (4, 2 * MIB, False), (2, 64 * MIB, False)):
        hot = simulate("all_reduce", n, n, nbytes, "ring", model=HOT, cpu=True).time_us
        plain = simulate("all_reduce", n, n, nbytes, "ring", model=cold, cpu=True).time_us
        if faster:
            assert hot < 0.9 * plain, (n, nbytes, hot, plain)
        elif n > 2:  # ranks share the cores: nothing in cache
            assert hot == plain, (n, nbytes, hot, plain)
        else:
            assert plain * 0.95 < hot < plain, (n, nbytes, hot, plain)


def test_calibrate_measures_the_in_cache_rates() -> None:
    from ahcomm._calibrate import hot_rates

    copy, reduce = hot_rates(2, rounds=20, passes=2)
    for rate in (copy, reduce):
        assert math.isfinite(rate) and 1 / 2000e9 < rate < 1 / 0.1e9


def test_an_in_cache_rate_slower_than_from_memory_keeps_the_memory_rate() -> None:
    disturbed = dataclasses.replace(HOT, copy_hot=1 / 3.1e9)  # a calibration's stolen pass
    warm = disturbed.for_call(2, 2 * MIB)
    assert warm.copy == HOT.copy and warm.gamma == HOT.gamma_hot


def test_the_in_cache_rates_come_from_the_fastest_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two of three passes slowed throughout (a stolen stretch) leave the third's rate."""
    import itertools
    import threading

    from ahcomm import _calibrate as calibration

    calls, clock, lock = itertools.count(), [0.0], threading.Lock()
    slow, fast, rounds = 1e-3, 1e-5, 10

    def thread_time() -> float:  # each operation reads the clock twice; two passes of three are slow
        with lock:
            i = next(calls)
            if i % 2:
                clock[0] += slow if (i // (2 * rounds)) % 3 < 2 else fast  # copies' and reductions' alike
            return clock[0]

    monkeypatch.setattr(calibration.time, "thread_time", thread_time)
    copy, reduce = calibration.hot_rates(1, rounds=rounds, passes=3)
    assert math.isclose(copy * calibration.HOT_PIECE, fast) and math.isclose(reduce * calibration.HOT_PIECE, fast)


def test_staged_copies_cost_half_a_copy_and_single_copy_reads_a_pin_more() -> None:
    """A copy into or out of a mailbox slot (which the cache keeps) sends half its traffic through
    memory: ``STAGED`` of a copy, a full (in-cache) copy where the call is hot. A read through the
    kernel costs ``PIN`` a byte on top of its copy."""
    from ahcomm.algorithms.cost import PIN, Work

    two = _topo(2)
    work = Work(staged=MIB)
    assert math.isclose(work.seconds(HOT, two), STAGED * MIB * HOT.copy)
    assert math.isclose(work.seconds(HOT.for_call(2, 2 * MIB), two), MIB * HOT.copy_hot)
    read = Work(copied=MIB, pinned=MIB)
    assert math.isclose(read.seconds(HOT, two), MIB * (HOT.copy + PIN))
    inproc = Topology(rank=0, size=2, hosts=("h",) * 2, link_kinds=("self", "inproc"), all_mapped=True,
                      single_copy=True, mailbox=MIB)
    assert math.isclose(read.seconds(HOT, inproc), MIB * HOT.copy)  # in one process a read is a memmove


def test_a_staged_copy_in_cache_costs_no_more_than_out_of_it() -> None:
    """In cache a staged copy costs an in-cache copy; where the in-cache rate is not faster than
    memory's (a disturbed calibration, clamped), no more than a staged copy out of cache."""
    from ahcomm.algorithms.cost import Work

    two, work = _topo(2), Work(staged=MIB)
    disturbed = dataclasses.replace(HOT, copy_hot=1 / 3.1e9)
    assert math.isclose(work.seconds(disturbed.for_call(2, 2 * MIB), two), STAGED * MIB * HOT.copy)
    assert math.isclose(work.seconds(HOT.for_call(2, 2 * MIB), two), MIB * HOT.copy_hot)
    assert CostModel.from_dict(json.loads(json.dumps(dataclasses.replace(HOT, staged=0.7).to_dict()))).staged == 0.7


def test_all_gather_goes_through_the_slots_and_broadcast_keeps_direct() -> None:
    """all_gather through oneshot's slots at every size (np=2 4-8 MiB level with direct's reads,
    beyond 1.2-1.8x faster); broadcast keeps direct from 4 MiB: out of place (the API's default)
    oneshot's root copies twice per byte, and a call does not say which it is
    (results/2026-11-26-staged-copies.md)."""
    model = CostModel(cores=2)

    def pick(op: str, n: int, total: int) -> str:
        call = Call(op=op, seq=0, dtype=np.dtype(np.float32), count=(total // n if op == "all_gather" else total) // 4)
        return Selector(REGISTRY, "", model).choose(call, _topo(n)).name

    sizes = [mib * MIB for mib in (2, 4, 8, 16, 32, 64)]
    assert {pick("all_gather", n, size) for n in (2, 4, 8) for size in sizes} == {"oneshot"}
    for n in (2, 4, 8):
        assert [pick("broadcast", n, size) for size in sizes] == ["oneshot"] + ["direct"] * 5


def test_the_memory_bound_probes_outgrow_the_cache() -> None:
    """calibrate's copy and reduce rates come from arrays a quarter of the last-level cache each
    (three of them), from 32 MiB up to 128 MiB (below glibc's non-temporal threshold)."""
    from ahcomm import _calibrate as calibration

    assert calibration.probe_bytes(0) == 32 * MIB  # unknown
    assert calibration.probe_bytes(32 * MIB) == 32 * MIB  # the EPYC host: as before
    assert calibration.probe_bytes(480 * MIB) == 120 * MIB  # the Intel VM: 32 MiB arrays stayed in its cache
    assert calibration.probe_bytes(4096 * MIB) == 128 * MIB

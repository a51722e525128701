"""The CPU the simulator charges (``ahcomm-sim --cpu``): a notify's CPU share of its cost and a
call's own CPU, both from ``ahcomm-bench calibrate``'s CPU timings (``fit_cpu``)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ahcomm._calibrate import fit_cpu
from ahcomm.algorithms import REGISTRY, Call, Topology
from ahcomm.algorithms.cost import CostModel, LinkCost
from ahcomm.sim import simulate
from ahcomm.transports.sim import ASLEEP, SimNetwork, VirtualLoop

TWO = Topology(rank=0, size=2, hosts=("h",) * 2, link_kinds=("self", "sdma"), all_mapped=True, single_copy=True)
CASES = (("ring", "all_reduce"), ("ring", "all_gather"), ("rhd", "all_reduce"), ("mesh", "all_reduce"),
         ("mesh", "all_gather"))
HOST = CostModel(links={"inproc": LinkCost(25e-6, 0.2e-9), "sdma": LinkCost(25e-6, 0.07e-9),
                        "rdma": LinkCost(70e-6, 0.5e-9)}, cores=2, task=50e-6, source="test")  # as calibrated here


def _notifies(algorithm: str, op: str) -> int:
    call = Call(op=op, seq=0, dtype=np.dtype(np.float32), count=2)
    work = REGISTRY.algorithms[algorithm].work(call, TWO, CostModel(), 8.0, 4.0)
    return int(work.tasks)  # type: ignore[union-attr]


def _points(per_call: float, per_notify: float) -> list[dict[str, object]]:
    points: list[dict[str, object]] = [
        {"algorithm": a, "op": op, "count": 2, "seconds": 1e-4,
         "cpu": per_call + per_notify * _notifies(a, op)} for a, op in CASES]
    points.append({"algorithm": "ring", "op": "all_gather", "count": 1 << 20, "seconds": 1e-3})  # no CPU timed
    return points


def test_the_cpu_fit_finds_the_cost_per_notify_and_per_call() -> None:
    assert len({_notifies(a, op) for a, op in CASES}) > 1  # the cases tell the two apart
    notify, call = fit_cpu(_points(44e-6, 31e-6), True)
    assert math.isclose(notify, 31e-6, rel_tol=1e-6) and math.isclose(call, 44e-6, rel_tol=1e-6)
    notify, call = fit_cpu(_points(-20e-6, 31e-6), True)  # no negative call cost: through the origin
    assert call == 0.0 and 0 < notify < 31e-6
    assert fit_cpu(_points(44e-6, 31e-6)[:1], True) == (0.0, 0.0)  # one case: not measured
    same = [p for p in _points(44e-6, 31e-6) if p.get("algorithm") == "mesh"]  # 1 notify each
    assert fit_cpu(same, True) == (0.0, 0.0)  # per call and per notify cannot be told apart
    assert fit_cpu(_points(44e-6, -1e-6), True) == (0.0, 0.0)  # no positive cost per notify


def test_a_notify_s_cpu_share_shares_cores_and_the_rest_is_latency() -> None:
    """Half of each notify's cost as CPU: at 2 ranks on 2 cores (no core shared) the call takes
    about as long; at 4 ranks on 2 cores, where the CPU work queues for the cores, less."""
    half = dataclasses.replace(HOST, task_cpu=HOST.task / 2)
    assert half.notify_cpu == HOST.task / 2 and HOST.notify_cpu == HOST.task
    assert dataclasses.replace(HOST, task_cpu=2 * HOST.task).notify_cpu == HOST.task  # at most all of it
    for n, alike in ((2, True), (4, False)):
        full = simulate("all_reduce", n, n, 8, "ring", model=HOST, cpu=True).time_us
        part = simulate("all_reduce", n, n, 8, "ring", model=half, cpu=True).time_us
        assert math.isclose(full, part, rel_tol=0.1) if alike else part < 0.85 * full, (n, full, part)
    # without --cpu neither counts
    assert (simulate("all_reduce", 4, 4, 8, "ring", model=half).time_us
            == simulate("all_reduce", 4, 4, 8, "ring", model=HOST).time_us)


def test_a_call_s_own_cpu_comes_before_its_first_task() -> None:
    base = simulate("broadcast", 2, 2, 8, "ring", model=HOST, cpu=True).time_us
    launched = dataclasses.replace(HOST, launch=40e-6)
    assert math.isclose(simulate("broadcast", 2, 2, 8, "ring", model=launched, cpu=True).time_us, base + 40,
                        abs_tol=1.0)
    assert simulate("broadcast", 2, 2, 8, "ring", model=launched).time_us == simulate(
        "broadcast", 2, 2, 8, "ring", model=HOST).time_us
    four = simulate("broadcast", 4, 4, 8, "ring", model=launched, cpu=True).time_us  # 4 launches on 2 cores
    assert four >= simulate("broadcast", 4, 4, 8, "ring", model=HOST, cpu=True).time_us + 80 - 1.0


def test_the_cpu_costs_travel_with_the_model() -> None:
    model = dataclasses.replace(HOST, task_cpu=31e-6, launch=44e-6, cold_notify=75e-6, gamma_staged=0.09e-9)
    back = CostModel.from_dict(json.loads(json.dumps(model.to_dict())))
    assert (back.task_cpu, back.launch, back.cold_notify, back.gamma_staged) == (31e-6, 44e-6, 75e-6, 0.09e-9)
    old = {k: v for k, v in model.to_dict().items() if k not in ("task_cpu", "launch", "cold_notify", "gamma_staged")}
    assert (CostModel.from_dict(old).task_cpu, CostModel.from_dict(old).launch,
            CostModel.from_dict(old).cold_notify, CostModel.from_dict(old).gamma_staged) == (0.0, 0.0, 0.0, 0.0)


def test_a_reduction_in_place_out_of_a_slot_costs_gamma_staged() -> None:
    """A ring all_reduce reduces each piece in place out of the slot its peer's put just wrote
    (``dst += slot``): ``gamma_staged`` a byte where measured and below ``gamma`` (4 ranks on 2
    cores: the 4-rank all_reduce's excess, docs/sim.md). An all_gather reduces nothing; a
    ``gamma_staged`` above ``gamma`` changes nothing."""
    base = dataclasses.replace(HOST, gamma=0.2e-9, task_cpu=HOST.task / 2)

    def us(op: str, model: CostModel, n: int = 4) -> float:
        return simulate(op, n, n, 16 << 20, "ring", model=model, cpu=True).time_us

    staged = dataclasses.replace(base, gamma_staged=0.1e-9)
    assert us("all_reduce", staged) < 0.95 * us("all_reduce", base)
    assert us("all_reduce", staged, 2) < us("all_reduce", base, 2)
    assert us("all_gather", staged) == us("all_gather", base)
    assert us("all_reduce", dataclasses.replace(base, gamma_staged=0.4e-9)) == us("all_reduce", base)


def test_a_notify_after_a_cache_s_worth_of_copies_costs_more_where_it_wakes_a_sleeping_peer() -> None:
    """``cold_notify``: a rank's first post after it moved ``COLD_BYTES`` costs that much more CPU,
    pro rata below, where it wakes a peer idle for ``ASLEEP`` or longer. A 2-rank ring broadcast
    of 2 MiB posts twice so (the root's DataSignal after its put wakes the waiting receiver, the
    receiver's Ack after its copy out of the slot the waiting root): 2 x 80 us; of 1 MiB, half
    that; of 8 bytes, nothing; of 4 MiB (two pieces) the same two, as the posts between them find
    their peer at work. A ring all_reduce's ranks work at once: nothing. Not where ranks
    outnumber cores, nor between servers, nor after a copy engine's copies, nor without --cpu."""
    base = dataclasses.replace(HOST, task_cpu=HOST.task / 2)
    cold = dataclasses.replace(base, cold_notify=80e-6)

    def extra(op: str, size: int) -> float:
        return (simulate(op, 2, 2, size, "ring", model=cold, cpu=True).time_us
                - simulate(op, 2, 2, size, "ring", model=base, cpu=True).time_us)

    for size, us in ((8, 0.0), (1 << 20, 80.0), (2 << 20, 160.0), (4 << 20, 160.0)):
        assert math.isclose(extra("broadcast", size), us, abs_tol=0.5), (size, extra("broadcast", size))
    assert math.isclose(extra("all_reduce", 2 << 20), 0.0, abs_tol=0.5)
    assert (simulate("broadcast", 4, 4, 2 << 20, "ring", model=cold, cpu=True).time_us
            == simulate("broadcast", 4, 4, 2 << 20, "ring", model=base, cpu=True).time_us)
    assert (simulate("broadcast", 2, 2, 2 << 20, "ring", model=cold).time_us
            == simulate("broadcast", 2, 2, 2 << 20, "ring", model=base).time_us)
    # nor between servers (the probe wakes a peer of its host), nor for copies a copy engine makes
    # (2 ranks on 4 cores: the probe copies on the event loop's thread)
    assert (simulate("broadcast", 2, 1, 2 << 20, "ring", model=cold, cpu=True).time_us
            == simulate("broadcast", 2, 1, 2 << 20, "ring", model=base, cpu=True).time_us)
    four = dataclasses.replace(base, cores=4)
    assert (simulate("broadcast", 2, 2, 2 << 20, "ring", model=dataclasses.replace(four, cold_notify=80e-6),
                     cpu=True).time_us == simulate("broadcast", 2, 2, 2 << 20, "ring", model=four, cpu=True).time_us)


def test_a_post_pays_for_the_bytes_its_rank_moved_since_its_last_post_once() -> None:
    loop = VirtualLoop()  # type: ignore[abstract]
    net = SimNetwork(loop, 2, {}, cores=2, task=20e-6, cold=80e-6, cold_bytes=2 << 20)
    loop.at(ASLEEP, lambda: None)
    loop.run_until_complete(asyncio.sleep(ASLEEP))  # both ranks idle since 0: asleep now
    assert net.post_cpu(0, 1) == 10e-6
    net.moved[0], net.moved[1] = 1 << 20, 4 << 20
    assert math.isclose(net.post_cpu(0, 1), 50e-6) and net.post_cpu(0, 1) == 10e-6  # half of cold, then warm
    net.threads[0] = loop.now - ASLEEP / 2  # rank 0 worked until just now: not asleep
    assert net.post_cpu(1, 0) == 10e-6 and not net.moved  # the bytes count once, woken or not
    net.memory(0, 4 << 20, 1e-4)
    assert net.moved == {0: 4 << 20}
    plain = SimNetwork(loop, 2, {}, cores=2, task=20e-6)
    plain.memory(0, 4 << 20, 1e-4)
    assert plain.post_cpu(0, 1) == 10e-6 and not plain.moved


def test_hierarchical_pricing_takes_a_notify_s_cpu_share_too() -> None:
    """Two servers of 4 ranks on 2 cores: hier's estimate drops with ``task_cpu`` as the flat
    algorithms' do (the selector would lean against it otherwise)."""
    half = dataclasses.replace(HOST, task_cpu=HOST.task / 2)
    topo = Topology(rank=0, size=8, hosts=("a",) * 4 + ("b",) * 4,
                    link_kinds=("self",) + ("sdma",) * 3 + ("rdma",) * 4, all_mapped=False, single_copy=False)
    call = Call(op="all_reduce", seq=0, dtype=np.dtype(np.float32), count=2)
    for name in ("hier", "ring"):
        algo = REGISTRY.algorithms[name]
        full, part = algo.cost(call, topo, HOST), algo.cost(call, topo, half)
        assert full is not None and part is not None and part < 0.95 * full, (name, full, part)


def test_the_selector_prices_a_notify_s_cpu_share_by_the_cores() -> None:
    """With ``task_cpu`` the estimate at 2 ranks on 2 cores is the same (a notify costs ``task``),
    and at 4 ranks on 2 cores lower: only the CPU share waits for a core."""
    half = dataclasses.replace(HOST, task_cpu=HOST.task / 2)
    ring = REGISTRY.algorithms["ring"]
    call = Call(op="all_reduce", seq=0, dtype=np.dtype(np.float32), count=2)
    for n, alike in ((2, True), (4, False)):
        topo = Topology(rank=0, size=n, hosts=("h",) * n, link_kinds=("self",) + ("sdma",) * (n - 1),
                        all_mapped=True, single_copy=True)
        full, part = ring.cost(call, topo, HOST), ring.cost(call, topo, half)
        assert full is not None and part is not None
        assert math.isclose(full, part) if alike else part < 0.9 * full, (n, full, part)


def test_a_calibration_that_cannot_be_read_is_named_not_ignored(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """An AHCOMM_TUNING_FILE that is not a calibration falls back to the defaults with a warning
    naming it (it was silent); a missing one (not calibrated here) stays silent."""
    import logging

    from ahcomm.algorithms import cost

    monkeypatch.setenv("AHCOMM_TUNING_FILE", str(tmp_path / "none.json"))
    with caplog.at_level(logging.WARNING, logger="ahcomm.cost"):
        assert cost.load().source == "defaults"
    assert not caplog.records
    bad = tmp_path / "calibration.json"
    bad.write_text('{"version": 2, "copy": "fast"}')
    monkeypatch.setenv("AHCOMM_TUNING_FILE", str(bad))
    with caplog.at_level(logging.WARNING, logger="ahcomm.cost"):
        assert cost.load().source == "defaults"
    assert str(bad) in caplog.text and "cannot be read" in caplog.text and "fast" in caplog.text


def test_only_an_in_place_reduction_with_an_operand_in_the_ccl_buffers_is_staged(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """What ``gamma_staged`` prices: the output is one of the operands, and an operand lies in the
    rank's CCL buffers (a slot). In place over user memory, or out of place out of a slot: ``gamma``."""
    from ahcomm import sim

    model = dataclasses.replace(HOST, gamma=0.2e-9, gamma_staged=0.1e-9)
    world = sim.World(2, 2, model, check=False, contention=True, cpu=True)
    spans: list[float] = []
    monkeypatch.setattr(world.net, "memory", lambda rank, nbytes, span: spans.append(span / nbytes) or 0.0)

    class Stream:
        memory: Any = None

    stream = Stream()
    sim._simulate_memory(stream, world, 0)  # type: ignore[arg-type]
    slot = world.buffers[0][0][:4096].view(np.float32)
    user, other = np.zeros(1024, np.float32), np.zeros(1024, np.float32)
    stream.memory(np.add, user, slot, out=user)  # a ring's dst += slot
    stream.memory(np.add, user, other, out=user)  # in place over user memory
    stream.memory(np.add, other, slot, out=user)  # out of place, out of a slot
    assert spans == [0.1e-9, 0.2e-9, 0.2e-9]

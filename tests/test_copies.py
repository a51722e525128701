"""comm.explain() says how many copies per byte the chosen algorithm makes."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import ahcomm
from ahcomm.algorithms.base import Call, Topology
from ahcomm.algorithms.copies import copies
from ahcomm.algorithms.mesh import SINGLE_COPY_BYTES


def _topo(single: bool) -> Topology:
    return Topology(rank=0, size=2, hosts=("h", "h"), link_kinds=("self", "sdma"), all_mapped=True,
                    single_copy=single)


@pytest.mark.parametrize("op", ["all_gather", "broadcast"])
def test_mesh_single_copy_is_one_copy(op: str) -> None:
    big = Call(op=op, seq=0, dtype=np.dtype(np.float32), count=SINGLE_COPY_BYTES[op] // 4)
    one = copies("mesh", big, _topo(True))
    two = copies("mesh", big, _topo(False))
    assert one is not None and two is not None
    assert (one["total"], one["single_copy"]) == (1, True)
    assert (two["total"], two["single_copy"]) == (2, False)
    small = Call(op=op, seq=0, dtype=np.dtype(np.float32), count=1)
    entry = copies("mesh", small, _topo(True))
    assert entry is not None and entry["total"] == 2  # below the threshold mesh stages


def test_unknown_is_none() -> None:
    call = Call(op="all_to_all", seq=0, dtype=np.dtype(np.float32), count=4)
    assert copies("pairwise", call, _topo(False)) is None


async def test_explain_shows_copies() -> None:
    comms = await ahcomm.init_inprocess(2)
    try:
        algorithm, costs = comms[0].explain("broadcast", 1 << 24, np.float32)  # still a pair
        shown = comms[0].explain("broadcast", 1 << 24, np.float32)
        assert algorithm in costs
        assert shown.copies == copies(algorithm, Call(op="broadcast", seq=0, dtype=np.dtype(np.float32),
                                                      count=1 << 24), comms[0].topology)
        if algorithm == "mesh":
            assert shown.copies is not None and shown.copies["total"] == 1
    finally:
        await asyncio.gather(*(c.close() for c in comms))


@pytest.mark.parametrize("single", [True, False])
async def test_stats_say_which_path(single: bool) -> None:
    comms = await ahcomm.init_inprocess(2, single_copy=single)
    try:
        assert comms[0].stats()["single_copy"] is single
        entry = comms[0].explain("all_gather", 1 << 20, np.float32).copies
        if comms[0].explain("all_gather", 1 << 20, np.float32)[0] == "mesh":
            assert entry is not None and entry["single_copy"] is single
    finally:
        await asyncio.gather(*(c.close() for c in comms))

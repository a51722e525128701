"""The public algorithm kit: ``ahcomm.testing.check_algorithm`` on every registered algorithm, over
in-process links and over real sdma and rdma links made inside this process (the algorithm
matrix per transport, as Gloo runs each test once per transport), and its failure reports."""

from __future__ import annotations

import numpy as np
import pytest

import ahcomm
from ahcomm.algorithms import REGISTRY, Channels, Context, Ring, Signal, channel_run
from ahcomm.testing import check_algorithm

from support.sizes import KIT_COUNTS


def two_servers(n: int) -> list[str]:
    return [f"host{r % 2}" for r in range(n)]


@pytest.mark.parametrize("name", sorted(REGISTRY.algorithms))
def test_every_algorithm_matches_numpy_inproc(name: str) -> None:
    hosts = two_servers if name == "hier" else None
    assert check_algorithm(name, world_sizes=(2, 3, 4), counts=KIT_COUNTS, hosts=hosts) > 0


@pytest.mark.parametrize("transport", ["sdma", "rdma"])
@pytest.mark.parametrize("name", sorted(REGISTRY.algorithms))
def test_every_algorithm_over_real_links(name: str, transport: str) -> None:
    """Every algorithm x its ops on 3 ranks over real links; mesh and star need mapped peer
    buffers and oneshot, twoshot and direct the host's mailboxes, so over rdma they are checked as refusing
    (select) rather than run."""
    algorithm = REGISTRY.algorithms[name]
    hosts = two_servers if name == "hier" else None
    if transport == "rdma" and name in ("mesh", "oneshot", "twoshot", "star", "direct"):
        with pytest.raises(AssertionError, match="selected none"):
            check_algorithm(name, world_sizes=(3,), counts=(5,), transports=(transport,))
        return
    ops = sorted(algorithm.ops)
    assert check_algorithm(name, ops=ops, world_sizes=(3,), dtypes=("float32",), counts=(0, 5, 3000),
                           transports=(transport,), hosts=hosts) > 0


class OffByOne(Ring):
    """A ring whose all_gather corrupts one element on rank 1: check_algorithm must say so."""

    name = "off_by_one"

    async def _all_gather(self, ctx: Context) -> None:  # type: ignore[override]
        await Ring._all_gather(self, ctx)
        if ctx.rank == 1 and ctx.dst.size:
            ctx.dst.reshape(-1)[-1] += 1

    runs = {"all_gather": _all_gather}


def test_check_algorithm_reports_a_wrong_result() -> None:
    with pytest.raises(AssertionError, match=r"off_by_one all_gather of 7 int32 on 2 ranks \(inproc\): rank 1 "
                                             r"differs from numpy at 1 of 14 elements, first at \[13\]"):
        check_algorithm(OffByOne(), world_sizes=(2,), dtypes=("int32",), counts=(7,))
    assert "off_by_one" not in REGISTRY.algorithms  # registered for the check only


class Hangs(ahcomm.algorithms.Algorithm):
    """Waits for a signal nobody posts."""

    name = "hangs"

    async def _wait_forever(self, ctx: Context) -> None:
        ctx.wait(ctx.main, (ctx.rank + 1) % ctx.size, Signal.DATA, 3)
        await ctx.synchronize()

    runs = {"all_gather": _wait_forever}


def test_check_algorithm_reports_a_hang() -> None:
    with pytest.raises(AssertionError, match=r"hangs all_gather of 1 float32 on 2 ranks \(inproc\): no result"):
        check_algorithm(Hangs(), world_sizes=(2,), dtypes=("float32",), counts=(1,), timeout=1.0)


def test_check_algorithm_refuses_unknown_names_and_ops() -> None:
    with pytest.raises(ValueError, match="no algorithm named 'nope'"):
        check_algorithm("nope")
    with pytest.raises(ValueError, match="ring does not run scatter"):
        check_algorithm("ring", ops=["scatter"])


def test_a_channels_algorithm_from_the_public_kit() -> None:
    """An all_to_all written only with ahcomm.algorithms' public names (Channels, channel_run)."""

    def plan(ctx: Context, ch: Channels) -> None:
        n, r, m = ctx.size, ctx.rank, ctx.src.size // ctx.size
        src, dst = ctx.src.reshape(n, m), ctx.dst.reshape(n, m)
        ctx.subs[0].copy(dst[r], src[r])
        for k in range(1, n):
            ch.send(ctx.main, (r + k) % n, src[(r + k) % n])
            ch.recv(ctx.subs[0], (r - k) % n, dst[(r - k) % n])

    class Direct(ahcomm.algorithms.Algorithm):
        name = "direct_a2a"
        runs = {"all_to_all": channel_run(plan)}

        def resources(self, call: ahcomm.algorithms.Call, topo: ahcomm.algorithms.Topology,
                      half_bytes: int) -> ahcomm.algorithms.Resources:
            return ahcomm.algorithms.Resources(substreams=1)

    assert Direct.ops == frozenset({"all_to_all"})
    assert check_algorithm(Direct(), world_sizes=(2, 3, 5), dtypes=("float64", np.int8), counts=(0, 1, 9000)) == 18

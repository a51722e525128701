"""Sub-communicators (Comm.split, Comm.new_group): in process across world sizes 1..9, and on
real processes over sdma and rdma links (every op x algorithm on a group while the parent
runs its own collectives; no new connections; a member's death reaches the group)."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from mp_catalogue import OPS, SMALL_ONLY, check
from test_multiprocess import launch, left_behind, shm_names

import ahcomm

from jobs import run_job
from support.inproc import links_of

HERE = Path(__file__).parent


async def world(n: int, buffsize: int = 64 * 1024) -> list[ahcomm.Comm]:
    return await ahcomm.init_inprocess(n, buffsize=buffsize)


async def close_all(comms: list[ahcomm.Comm]) -> None:
    await asyncio.gather(*(c.close() for c in comms))


async def parent_traffic(comm: ahcomm.Comm, rounds: int) -> None:
    for i in range(rounds):
        got = await comm.all_reduce(np.full(7, comm.rank + i, np.int64))
        assert np.all(got == sum(range(comm.size)) + comm.size * i)


@pytest.mark.parametrize("n", range(1, 10))
async def test_split_runs_every_op_against_numpy(n: int) -> None:
    """Groups of r % 3 (key reversed): every op with its default algorithm, small and larger
    than the CCL buffer, on every group at once, while the parent runs its own collectives."""
    comms = await world(n)
    groups = await asyncio.gather(*(c.split(c.rank % 3, key=-c.rank) for c in comms))
    for c, g in zip(comms, groups):
        assert g is not None
        members = [p for p in range(n) if p % 3 == c.rank % 3][::-1]
        assert g.world_ranks == tuple(members) and g.rank == members.index(c.rank) and g.size == len(members)

    async def member(c: ahcomm.Comm, g: ahcomm.Comm) -> None:
        salt = 0
        for op in OPS:
            for big in (False, True):
                salt += 1
                # the default for the call's size (a big call is over one eager message)
                await check(g, op, g.explain(op, 1 << 15 if big else 1)[0], salt, big)

    await asyncio.gather(*(member(c, g) for c, g in zip(comms, groups if n > 0 else [])),
                         *(parent_traffic(c, 5) for c in comms))
    await close_all(comms)
    assert all(g is not None and g.closed for g in groups)


async def test_every_algorithm_on_an_uneven_group() -> None:
    """Every op x every algorithm that can run it, on a group of 5 out of 7 ranks whose CCL
    buffers (buffsize=) are smaller than the parent's."""
    comms = await world(7)
    groups = await asyncio.gather(*(c.new_group([6, 0, 3, 2, 5], buffsize=8192) for c in comms))
    members = [g for g in groups if g is not None]
    assert [g.world_ranks for g in members] == [(6, 0, 3, 2, 5)] * 5
    assert all(g._executor.buffers.nbytes == 8192 for g in members)
    assert [groups[p] is None for p in range(7)] == [False, True, False, False, True, False, False]

    async def member(g: ahcomm.Comm) -> None:
        salt = 0
        for op in OPS:
            for algo in sorted(g.explain(op, 1)[1]):
                salt += 1
                await check(g, op, algo, salt, salt % 2 == 0 and algo not in SMALL_ONLY)

    await asyncio.gather(*(member(g) for g in members))
    await close_all(comms)


async def test_group_and_parent_collectives_in_any_order() -> None:
    """A group's collectives are independent of the parent's: ranks may issue them in different
    orders (and nested groups too) without deadlock."""
    comms = await world(6)
    groups = await asyncio.gather(*(c.split(c.rank % 2) for c in comms))
    nested = await asyncio.gather(*(g.split(g.rank // 2) for g in groups if g is not None))
    x = [np.full(3000, r, np.float64) for r in range(6)]

    async def rank(r: int) -> tuple[Any, ...]:
        c, g, s = comms[r], groups[r], nested[r]
        assert g is not None and s is not None
        calls = [lambda: c.all_reduce(x[r]), lambda: g.all_reduce(x[r]), lambda: s.all_gather(x[r][:2])]
        if r % 3 == 1:
            calls.reverse()
        futures = [call() for call in calls]
        return tuple(await asyncio.gather(*futures))

    results = await asyncio.wait_for(asyncio.gather(*(rank(r) for r in range(6))), 30)
    for r, res in enumerate(results):
        world_sum, group_sum, nested_gather = (res if r % 3 != 1 else res[::-1])
        assert world_sum[0] == 15
        assert group_sum[0] == sum(p for p in range(6) if p % 2 == r % 2)
        s = nested[r]
        assert s is not None and list(nested_gather[::2]) == list(s.world_ranks)
    await close_all(comms)


async def test_mismatch_in_a_group_names_world_ranks_and_spares_the_parent() -> None:
    comms = await world(4)
    groups = await asyncio.gather(*(c.split(c.rank // 2) for c in comms))
    g0, g1 = groups[0], groups[1]
    assert g0 is not None and g1 is not None
    results = await asyncio.gather(g0.all_reduce(np.ones(4)), g1.broadcast(np.ones(4)), return_exceptions=True)
    for err in results:
        assert isinstance(err, ahcomm.CollectiveMismatchError), err
        assert "world rank 1" in str(err) and "world rank 0" in str(err), err
    other = await asyncio.gather(*(g.all_reduce(np.ones(2)) for g in groups[2:] if g is not None))
    assert all(np.all(o == 2) for o in other)
    world_sum = await asyncio.gather(*(c.all_reduce(np.ones(2)) for c in comms))  # the parent is unaffected
    assert all(np.all(w == 4) for w in world_sum)
    await close_all(comms)


async def test_abort_of_a_group_reaches_its_members_only() -> None:
    comms = await world(4)
    groups = await asyncio.gather(*(c.split(c.rank % 2) for c in comms))
    assert groups[0] is not None and groups[2] is not None
    pending = groups[2].all_reduce(np.ones(4))
    groups[0].abort("test abort")
    with pytest.raises(ahcomm.PeerFailure, match=r"rank 0 \(world rank 0\) aborted"):
        await asyncio.wait_for(pending, 10)
    got = await asyncio.gather(*(c.all_reduce(np.ones(3)) for c in comms))
    assert all(np.all(g == 4) for g in got)
    await close_all(comms)


@pytest.mark.parametrize("bad", ["color", "key", "ranks_range", "ranks_twice", "ranks_differ", "buffsize",
                                 "buffsize_differ"])
async def test_bad_arguments_raise_on_every_rank(bad: str) -> None:
    comms = await world(4)

    def call(c: ahcomm.Comm) -> Any:
        r = c.rank
        if bad == "color":
            return c.split(-1 if r == 2 else 0)
        if bad == "key":
            return c.split(0, key="x" if r == 1 else r)  # type: ignore[arg-type]
        if bad == "ranks_range":
            return c.new_group([0, 4] if r == 3 else [0, 1])
        if bad == "ranks_twice":
            return c.new_group([0, 1, 1])
        if bad == "buffsize":
            return c.split(0, buffsize=100 if r == 0 else None)
        if bad == "buffsize_differ":
            return c.split(r % 2, buffsize=8192 if r == 1 else 4096)  # one group of two disagrees
        return c.new_group([0, 1] if r != 2 else [1, 0])

    results = await asyncio.wait_for(asyncio.gather(*(call(c) for c in comms), return_exceptions=True), 10)
    words = {"color": "color -1", "key": "key 'x'", "ranks_range": "rank 4 is out of range",
             "ranks_twice": "twice", "ranks_differ": "differ", "buffsize": "buffsize 100",
             "buffsize_differ": "different buffsize"}[bad]
    for err in results:
        assert isinstance(err, ahcomm.InvalidArgument), err
        assert words in str(err), err
    got = await asyncio.gather(*(c.all_reduce(np.ones(1)) for c in comms))  # still usable
    assert all(g[0] == 4 for g in got)
    await close_all(comms)


async def test_groups_of_one_and_of_everyone() -> None:
    comms = await world(3)
    singles = await asyncio.gather(*(c.split(c.rank) for c in comms))
    everyone = await asyncio.gather(*(c.split(0) for c in comms))
    for r, (s, e) in enumerate(zip(singles, everyone)):
        assert s is not None and s.size == 1 and s.world_ranks == (r,)
        assert e is not None and e.size == 3 and e.world_ranks == (0, 1, 2)
    assert [float((await s.all_reduce(np.array([5.0 + i])))[0]) for i, s in enumerate(singles) if s] == [5, 6, 7]
    got = await asyncio.gather(*(e.reduce_scatter(np.arange(6.0)) for e in everyone if e))
    assert [list(g) for g in got] == [[0, 3], [6, 9], [12, 15]]
    assert await asyncio.gather(*(c.split(None) for c in comms)) == [None, None, None]
    await close_all(comms)


@pytest.mark.multiprocess
@pytest.mark.parametrize("transport", ["sdma", "rdma"])
def test_groups_on_real_transports(transport: str) -> None:
    before = shm_names()
    proc = launch(5, str(HERE / "mp_groups.py"), env={"AHCOMM_TRANSPORT": transport, "EXPECT_LINK": transport,
                                                        "PYTHONPATH": str(HERE)}, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert not left_behind(before), "shared-memory names were left behind"
    for r in range(5):
        assert re.search(rf"\[{r}\] OK rank {r}/5 group \d/\d ran \d+ cases", out), out


@pytest.mark.multiprocess
@pytest.mark.parametrize("transport", ["sdma", "rdma"])
def test_a_dead_member_fails_its_groups_within_seconds(transport: str) -> None:
    proc = run_job(5, str(HERE / "mp_groups.py"), grace=20, env={
        "AHCOMM_TRANSPORT": transport, "EXPECT_LINK": transport, "GROUP_FAULT": "1", "AHCOMM_BUFFSIZE": "0.0625",
        "PYTHONPATH": str(HERE)})
    out = proc.stdout + proc.stderr
    raised = {rank: (seconds, message) for rank, seconds, message in
              re.findall(r"RAISED rank (\d) after ([\d.]+) s: (.*)", out)}
    assert sorted(raised) == ["0", "1", "2", "3"], out
    for rank, (seconds, message) in raised.items():
        assert float(seconds) < 5, out
        if int(rank) % 2 == 0:  # rank 4's group: [4, 2, 0] names it by its world rank
            assert "rank 0 (world rank 4) was lost" in message, message
        else:
            assert "rank 4 was lost" in message, message


async def test_groups_made_concurrently_get_distinct_domains() -> None:
    """Creations in flight together: two from one parent, and nested ones from overlapping
    groups issued in opposite orders on the ranks they share (their domains meet on a
    connection and one creation retries with a fresh domain)."""
    comms = await world(4)
    pairs = await asyncio.gather(*(asyncio.gather(c.split(0, buffsize=4096), c.split(c.rank % 2, buffsize=4096))
                                   for c in comms))
    got = await asyncio.gather(*(asyncio.gather(a.all_reduce(np.ones(3)), b.all_reduce(np.ones(3)))
                                 for a, b in pairs if a and b))
    assert [(float(x[0]), float(y[0])) for x, y in got] == [(4.0, 2.0)] * 4
    left = await asyncio.gather(*(c.new_group([0, 1, 2]) for c in comms))
    right = await asyncio.gather(*(c.new_group([1, 2, 3]) for c in comms))

    async def nested(r: int) -> list[ahcomm.Comm | None]:
        mine = [g for g in ((left[r], right[r]) if r != 2 else (right[r], left[r])) if g is not None]
        return list(await asyncio.gather(*(g.split(0, buffsize=4096) for g in mine)))

    subs = await asyncio.wait_for(asyncio.gather(*(nested(r) for r in range(4))), 30)
    flat = [s for row in subs for s in row if s is not None]
    domains = {}
    for s in flat:
        for link in links_of(s).values():
            domains.setdefault(s.world_ranks, set()).add(link.domain_key[0])  # type: ignore[attr-defined]
    assert len(set().union(*domains.values())) == len(domains) == 2, domains
    sums = await asyncio.wait_for(asyncio.gather(*(s.all_reduce(np.array([float(s.world_ranks[s.rank])]))
                                                   for s in flat)), 30)
    assert sorted(float(x[0]) for x in sums) == [3.0] * 3 + [6.0] * 3
    await close_all(comms)


async def test_a_rank_that_cannot_open_its_links_fails_every_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    from ahcomm.transports.inproc import InprocLink

    child = InprocLink.child

    def failing(self: InprocLink, *args: Any, **kw: Any) -> InprocLink:
        if self.ends[0] == 2:
            raise OSError("no memory for the mapping")
        return child(self, *args, **kw)

    monkeypatch.setattr(InprocLink, "child", failing)
    comms = await world(4)
    results = await asyncio.wait_for(asyncio.gather(*(c.split(c.rank % 2) for c in comms),
                                                    return_exceptions=True), 10)
    for err in results:
        assert isinstance(err, ahcomm.TransportError) and "rank 2 could not open" in str(err), err
    monkeypatch.setattr(InprocLink, "child", child)
    groups = await asyncio.gather(*(c.split(c.rank % 2) for c in comms))  # the parent is still fine
    assert all(g is not None and g.size == 2 for g in groups)
    await close_all(comms)


async def test_traces_of_groups_are_named_after_their_domain(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AHCOMM_TRACE", str(tmp_path))
    comms = await world(4)
    groups = await asyncio.gather(*(c.split(c.rank % 2) for c in comms))
    await asyncio.gather(*(g.all_reduce(np.ones(8)) for g in groups if g))
    await close_all(comms)
    names = sorted(p.name.split(".")[0] + "." + p.name.split(".")[1] for p in tmp_path.glob("*.g*.json"))
    assert names == ["rank0of2.g1"] * 2 + ["rank1of2.g1"] * 2, names
    assert len(list(tmp_path.glob("rank*of4.*.json"))) == 4


async def test_a_rank_that_cannot_make_its_buffers_fails_every_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 1's /dev/shm is full when the group's buffers are made: it raises its ConfigError and
    every other rank a TransportError naming it (before: they waited in the next round)."""
    from ahcomm import _groups

    make = _groups._make_buffers

    def failing(parent: ahcomm.Comm, group: tuple[int, ...], nbytes: int) -> Any:
        if parent.rank == 1:
            raise ahcomm.ConfigError("not enough shared memory for the CCL buffers: /dev/shm is 64 MiB")
        return make(parent, group, nbytes)

    monkeypatch.setattr(_groups, "_make_buffers", failing)
    comms = await world(4)
    results = await asyncio.wait_for(asyncio.gather(*(c.split(c.rank % 2) for c in comms),
                                                    return_exceptions=True), 10)
    assert isinstance(results[1], ahcomm.ConfigError) and "/dev/shm is 64 MiB" in str(results[1]), results
    for r in (0, 2, 3):
        err = results[r]
        assert isinstance(err, ahcomm.TransportError), results
        assert ("split: rank 1 could not create its CCL buffers for the new sub-communicator: ConfigError: not "
                "enough shared memory" in str(err)), err
    monkeypatch.setattr(_groups, "_make_buffers", make)
    groups = await asyncio.gather(*(c.split(c.rank % 2) for c in comms))  # the parent is still fine
    assert all(g is not None and g.size == 2 for g in groups)
    await close_all(comms)


NO_ROOM = """
import asyncio, errno, os, numpy as np, ahcomm

async def main():
    comm = await ahcomm.init()
    async with comm:
        if comm.rank == 1:  # /dev/shm is full when rank 1 makes the group's buffers (real SharedRegion)
            def enospc(fd: int, offset: int, length: int) -> None:
                raise OSError(errno.ENOSPC, "No space left on device")
            os.posix_fallocate = enospc
        try:
            await comm.split(0, buffsize=1 << 20)
        except ahcomm.AhcommError as exc:
            print(f"rank {comm.rank} raised {type(exc).__name__}: {exc}", flush=True)
        y = await comm.all_reduce(np.ones(4))  # the parent is still fine
        print(f"rank {comm.rank} sum={y[0]:.0f}", flush=True)

asyncio.run(main())
"""


@pytest.mark.multiprocess
def test_a_member_without_room_for_the_group_buffers_fails_every_rank(tmp_path: Path) -> None:
    """Over real sdma links: rank 1's /dev/shm has no room for the group's CCL buffers; every rank
    raises (before: ranks 0 and 2 waited in the next round until the collective timed out)."""
    script = tmp_path / "no_room.py"
    script.write_text(NO_ROOM)
    proc = run_job(3, str(script), grace=20, timeout=60, env={"AHCOMM_TRANSPORT": "sdma", "AHCOMM_BUFFSIZE": "1"})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    raised = sorted(line.split("] ", 1)[-1] for line in out.splitlines() if " raised " in line)
    assert [line[:26] for line in raised] == ["rank 0 raised TransportErr", "rank 1 raised ConfigError:",
                                              "rank 2 raised TransportErr"], out
    assert "not enough shared memory for the CCL buffers" in raised[1], out
    for line in (raised[0], raised[2]):
        assert ("split: rank 1 could not create its CCL buffers for the new sub-communicator: ConfigError: not "
                "enough shared memory for the CCL buffers" in line), out
    assert sorted(line.split("] ", 1)[-1] for line in out.splitlines() if "sum=" in line) == [
        f"rank {r} sum=3" for r in range(3)], out

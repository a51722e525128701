"""ahcomm.alloc: memory this host's peers map, and the collectives that read it where it lies.

The owner's table and segments, a reader's mappings (stale ids, a table being edited), the
in-process and sdma links' ``view``, mesh's all_reduce reducing a mapped share, direct and
mesh reading mapped buffers, buffers from alloc on some ranks only, and real processes.
"""

from __future__ import annotations

import contextlib
import gc
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ahcomm
from ahcomm import _peer_memory
from ahcomm._peer_memory import PeerMemory, alloc, table_name
from ahcomm._rendezvous import check_entry
from ahcomm.transports.inproc import InprocLink
from ahcomm.transports.sdma import SdmaLink

from jobs import run_job
from support.inproc import links_of, run_inproc

HERE = Path(__file__).parent
SHM = Path("/dev/shm")


@contextlib.contextmanager
def _reader() -> Iterator[PeerMemory]:
    """A reader of this process's own alloc memory, as a peer would map it."""
    reader = PeerMemory(table_name())
    try:
        yield reader
    finally:
        reader.close()


def _segment(array: np.ndarray) -> Path:
    """The /dev/shm file behind an array from alloc."""
    owner = _peer_memory._owner()
    for ident, (base, size, *_) in owner.segments.items():
        if base <= array.ctypes.data < base + max(size, 1):
            return SHM / f"{owner.name}-{ident}"
    raise AssertionError("not an array from alloc")


def test_alloc_gives_zeroed_arrays_of_the_shape_and_dtype() -> None:
    a = alloc((3, 5), np.int16)
    assert a.shape == (3, 5) and a.dtype == np.int16 and not a.any() and a.flags.c_contiguous
    a[:] = 7
    assert int(a.sum()) == 7 * 15
    assert alloc(0).shape == (0,) and alloc(4).dtype == np.float32


def test_a_subarray_dtype_adds_its_dimensions_as_numpy_does() -> None:
    a = alloc(4, np.dtype((np.float32, 3)))
    assert a.shape == (4, 3) and a.dtype == np.float32 and a.shape == np.empty(4, np.dtype((np.float32, 3))).shape


@pytest.mark.parametrize("shape", [(2, -1), 2.0, None, True, "10", (3, 1.5)])
def test_alloc_refuses_a_shape_that_is_not_whole_numbers(shape: Any) -> None:
    with pytest.raises(ahcomm.InvalidArgument, match="shape must be a non-negative integer"):
        alloc(shape)


@pytest.mark.parametrize("dtype,why", [(object, "Python objects"), (None, "pass one"), ("V0", "no size"),
                                       ("not-a-type", "not a dtype")])
def test_alloc_refuses_a_dtype_it_cannot_share(dtype: Any, why: str) -> None:
    with pytest.raises(ahcomm.InvalidDtype, match=why):
        alloc(3, dtype)


def test_alloc_beyond_the_hosts_memory_is_refused_before_any_page(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_peer_memory, "_available", lambda: 1 << 20)
    with pytest.raises(ahcomm.ConfigError, match=r"alloc of 2.0 MiB: only 1.0 MiB of memory is available"):
        alloc(1 << 19)


def test_alloc_without_a_descriptor_left_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    def no_fd(self: Any, nbytes: int) -> Any:
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(_peer_memory._Owner, "add", no_fd)
    with pytest.raises(ahcomm.UsageError, match="no file descriptor left.*ulimit -n"):
        alloc(16)


def test_a_reader_keeps_a_bounded_number_of_mappings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_peer_memory, "PEER_MAPS", 2)
    arrays = [alloc(4096, np.uint8) for _ in range(4)]
    for i, a in enumerate(arrays):
        a[:] = i + 1
    with _reader() as reader:
        for _ in range(2):
            for i, a in enumerate(arrays):
                got = reader.view(a.ctypes.data, 4096)
                assert got is not None and int(got[0]) == i + 1
                assert len(reader._maps) <= 2


def test_an_array_is_freed_when_nothing_refers_to_it() -> None:
    a = alloc(1 << 16, np.uint8)
    path = _segment(a)
    view = a[10:20]
    del a
    gc.collect()
    assert path.exists()  # a view keeps it
    del view
    gc.collect()
    assert not path.exists()


def test_a_reader_maps_the_owners_memory() -> None:
    with _reader() as reader:
        a = alloc(1000, np.int64)
        a[:] = np.arange(1000)
        got = reader.view(a.ctypes.data + 80, 160)
        assert got is not None and np.array_equal(got.view(np.int64), np.arange(10, 30))
        a[10] = -1  # the same pages, not a copy
        assert got.view(np.int64)[0] == -1
        assert reader.view(a.ctypes.data + 8 * 990, 8 * 11) is None  # runs past the end
        private = np.ones(1000)
        assert reader.view(private.ctypes.data, 8) is None


def test_a_reader_never_takes_freed_memory_for_new_memory_at_its_address() -> None:
    with _reader() as reader:
        a = alloc(1 << 16, np.uint8)
        a[:] = 1
        old = a.ctypes.data
        assert reader.view(old, a.nbytes) is not None
        del a
        gc.collect()
        b = alloc(1 << 16, np.uint8)
        b[:] = 2
        got = reader.view(b.ctypes.data, b.nbytes)
        assert got is not None and int(got[0]) == 2
        if b.ctypes.data != old:
            assert reader.view(old, 1 << 16) is None


def _list(row: tuple[int, int, int]) -> None:
    """Write ``row`` into a free slot of this process's table, as the owner would."""
    rows = _peer_memory._owner()._rows
    assert rows is not None
    slot = 1 + int(np.flatnonzero(rows[1::3] == 0)[0]) * 3
    rows[0] += 1
    rows[slot + 1], rows[slot + 2], rows[slot] = row[1], row[2], row[0]
    rows[0] += 1


def test_a_reader_takes_the_newest_row_over_an_address() -> None:
    a = alloc(4096, np.uint8)
    a[:] = 5
    _list((-1, a.ctypes.data, a.nbytes))  # an older segment at the same address, not yet unlisted
    reader = PeerMemory(table_name())
    try:
        got = reader.view(a.ctypes.data, 4096)
        assert got is not None and int(got[0]) == 5
    finally:
        reader.close()
        owner = _peer_memory._owner()
        rows = owner._rows
        assert rows is not None
        owner._unlist(rows, np.flatnonzero(rows[1::3] == -1))


def test_a_new_segment_unlists_older_rows_over_its_addresses() -> None:
    a = alloc(1 << 16, np.uint8)
    address, nbytes = a.ctypes.data, a.nbytes
    del a
    gc.collect()
    _list((-2, address, nbytes))  # as if the old segment's free had not run when the new one came
    owner = _peer_memory._owner()
    rows = owner._rows
    assert rows is not None
    b = alloc(1 << 16, np.uint8)
    if b.ctypes.data != address:
        owner._unlist(rows, np.flatnonzero(rows[1::3] == -2))
        pytest.skip("the kernel placed the new segment elsewhere: nothing overlapped")
    assert not (rows[1::3] == -2).any()


def test_a_free_during_an_edit_waits_for_the_next_alloc() -> None:
    owner = _peer_memory._owner()
    a = alloc(4096, np.uint8)
    path = _segment(a)
    with owner.lock:  # a garbage collection inside add() frees an array on add's own thread
        del a
        gc.collect()
        assert path.exists()
    alloc(16)
    assert not path.exists()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here")
def test_a_forked_child_leaves_its_parents_segments_alone() -> None:
    a = alloc(4096, np.uint8)
    path = _segment(a)
    pid = os.fork()
    if pid == 0:  # the child drops its inherited array, collects, and exits through atexit-free _exit
        try:
            del a
            gc.collect()
            _peer_memory._owners[os.getppid()].close()
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    assert path.exists()
    with _reader() as reader:
        assert reader.view(a.ctypes.data, 4096) is not None


def test_a_reader_gives_up_on_a_table_that_keeps_changing() -> None:
    a = alloc(64, np.uint8)
    rows = _peer_memory._owner()._rows
    assert rows is not None
    reader = PeerMemory(table_name())
    rows[0] += 1  # the owner is "editing" for good: the reader must not spin forever
    try:
        assert reader.view(a.ctypes.data, 64) is None
    finally:
        rows[0] += 1
        reader.close()
    with _reader() as reader:
        assert reader.view(a.ctypes.data, 64) is not None


def test_a_peer_that_never_allocated_has_nothing_mapped() -> None:
    reader = PeerMemory(f"{table_name()}-none")  # a table that was never made
    assert reader.view(1 << 20, 8) is None
    reader.close()


def test_the_rendezvous_checks_the_table_name() -> None:
    entry = {"rank": 0, "size": 2, "buffsize": 1, "pid": 1, "probe": 0, "host": "h",
             "endpoints": {"ipc": "ipc:///tmp/x"}, "memory": "ahcomm-1-mem-ab"}
    assert check_entry(dict(entry))["memory"] == "ahcomm-1-mem-ab"
    for bad in ("/etc/passwd", "ahcomm-1/../x", "ahcomm-1-mem\0", 5):
        with pytest.raises(ValueError, match="memory"):
            check_entry({**entry, "memory": bad})


# -- collectives in one process ------------------------------------------------------------------

def _count_views(monkeypatch: pytest.MonkeyPatch, cls: Any) -> list[int]:
    """Record the bytes of every view a link of ``cls`` handed out."""
    given: list[int] = []
    real = cls.view

    def view(self: Any, addr: int, nbytes: int) -> Any:
        got = real(self, addr, nbytes)
        if got is not None:
            given.append(nbytes)
        return got

    monkeypatch.setattr(cls, "view", view)
    return given


def _data(rank: int, count: int, dtype: Any, salt: int = 0) -> np.ndarray:
    return ((np.arange(count) * 7 + rank * 13 + salt) % 101).astype(dtype)


def _buffer(rank: int, count: int, dtype: Any, registered: bool, salt: int = 0) -> np.ndarray:
    x = alloc(count, dtype) if registered else np.empty(count, dtype)
    x[:] = _data(rank, count, dtype, salt)
    return x


@pytest.mark.parametrize("transport,cls", [("inproc", InprocLink), ("sdma", SdmaLink)])
@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("who", ["all", "some"])
async def test_mesh_all_reduce_reduces_mapped_shares_where_they_lie(transport: str, cls: Any, size: int, who: str,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    given = _count_views(monkeypatch, cls)
    count = 300_001  # above mesh's single-copy threshold, odd, several scratch pieces per share

    async def body(comm: ahcomm.Comm) -> None:
        registered = who == "all" or comm.rank % 2 == 0
        for k, dtype in enumerate([np.float32, np.int32, np.float64]):
            want = sum(_data(p, count, dtype, k) for p in range(size)).astype(dtype)
            x = _buffer(comm.rank, count, dtype, registered, k)
            out = alloc(count, dtype) if registered else None
            got = await comm.all_reduce(x, out=out, algorithm="mesh")
            assert np.array_equal(got, want), (dtype, "out of place")
            assert np.array_equal(x, _data(comm.rank, count, dtype, k))
            got = await comm.all_reduce(x, out=x, algorithm="mesh")
            assert np.array_equal(x, want), (dtype, "in place")

    await run_inproc(size, body, transport=transport)
    assert given, "no share was reduced where it lies"


@pytest.mark.parametrize("algorithm", ["mesh", "direct"])
@pytest.mark.parametrize("size", [2, 3])
async def test_readers_copy_from_mapped_buffers(algorithm: str, size: int) -> None:
    """sdma links made in this process: a read of a peer's alloc buffer is counted as mapped, one
    of an ordinary array (the odd ranks' all_gather inputs) as through the kernel."""
    count = (1 << 20) + 3  # above both algorithms' single-copy thresholds

    async def body(comm: ahcomm.Comm) -> dict[str, int]:
        r = comm.rank
        for root in range(size):
            x = _buffer(r, count, np.float32, True, root)
            got = await comm.broadcast(x, root, out=x, algorithm=algorithm)
            assert np.array_equal(got, _data(root, count, np.float32, root))
        got = await comm.all_gather(_buffer(r, count, np.float32, r % 2 == 0), algorithm=algorithm)
        assert np.array_equal(got.reshape(-1), np.concatenate([_data(p, count, np.float32) for p in range(size)]))
        reads = {"mapped": 0, "kernel": 0}
        for stats in comm.stats()["links"].values():
            for key, value in stats.get("read_bytes", {}).items():
                reads[key] += value
        return reads

    reads = await run_inproc(size, body, transport="sdma")
    assert all(r["mapped"] > 0 for r in reads), reads
    assert any(r["kernel"] > 0 for r in reads), reads  # the all_gather's blocks from odd ranks


async def test_a_view_over_sdma_sees_the_peers_memory_not_a_copy() -> None:
    async def body(comm: ahcomm.Comm) -> None:
        x = alloc(4096, np.uint8)
        x[:] = comm.rank + 1
        addrs = await comm.all_gather(np.array([x.ctypes.data], np.uint64))
        await comm.barrier()
        for peer, link in links_of(comm).items():
            got = link.view(int(addrs.reshape(-1)[peer]), 4096)
            assert got is not None and int(got[0]) == peer + 1 and int(got[-1]) == peer + 1
        await comm.barrier()
        del x

    await run_inproc(3, body, transport="sdma")


# -- real processes ----------------------------------------------------------------------------

@pytest.mark.multiprocess
@pytest.mark.parametrize("n,who", [(2, "all"), (3, "some"), (4, "all")])
def test_real_processes(n: int, who: str) -> None:
    before = {p.name for p in SHM.glob("ahcomm-*")}
    proc = run_job(n, str(HERE / "mp_peer_memory.py"), timeout=240, env={
        "PYTHONPATH": f"{HERE}{os.pathsep}{HERE.parent}", "AHCOMM_TRANSPORT": "sdma", "AHCOMM_BUFFSIZE": "1",
        "WHO": who})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    kernels = []
    for r in range(n):
        match = re.search(rf"\[{r}\] OK mapped (\d+) kernel (\d+)", out)
        assert match is not None, out
        mapped, kernel = int(match.group(1)), int(match.group(2))
        assert mapped > 0, out
        kernels.append(kernel)
    if who == "all":
        assert not any(kernels), out  # every read of a peer came out of its mapped memory
    else:
        assert any(kernels), out  # the odd ranks' ordinary arrays went through the kernel
    left = {p.name for p in SHM.glob("ahcomm-*-mem-*")} - before
    assert not [name for name in left if not Path(f"/proc/{name.split('-')[1]}").exists()], left


def test_alloc_without_room_says_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    from ahcomm._buffers import SharedRegion

    def full(self: Any, fd: int, nbytes: int, local_ranks: int) -> None:
        raise ahcomm.ConfigError("no room")

    monkeypatch.setattr(SharedRegion, "_reserve", full)
    with pytest.raises(ahcomm.ConfigError, match=r"ahcomm.alloc of 4.0 MiB: /dev/shm .*shm-size.*ordinary array"):
        alloc(1 << 20)


async def test_a_sub_communicator_reads_mapped_buffers_through_its_parents_connections(
        monkeypatch: pytest.MonkeyPatch) -> None:
    given = _count_views(monkeypatch, SdmaLink)
    count = 300_001

    async def body(comm: ahcomm.Comm) -> None:
        sub = await comm.split(comm.rank % 2)
        assert sub is not None
        members = [p for p in range(comm.size) if p % 2 == comm.rank % 2]
        x = _buffer(comm.rank, count, np.float32, True)
        await sub.all_reduce(x, out=x, algorithm="mesh")
        assert np.array_equal(x, sum(_data(p, count, np.float32) for p in members).astype(np.float32))
        await sub.close()

    await run_inproc(4, body, transport="sdma")
    assert given, "the sub-communicator's links mapped nothing"


@pytest.mark.multiprocess
def test_the_launcher_removes_a_killed_ranks_segments() -> None:
    """A rank killed outright cannot unlink its alloc segments (they live by name); ahcomm-run does."""
    program = ("import asyncio, os, signal, numpy as np, ahcomm\n"
               "async def main():\n"
               "    comm = await ahcomm.init()\n"
               "    x = ahcomm.alloc(1 << 18, np.float32)\n"
               "    await comm.all_reduce(x, out=x, algorithm='mesh')\n"
               "    print('PID', os.getpid(), flush=True)\n"
               "    if comm.rank == 1:\n"
               "        os.kill(os.getpid(), signal.SIGKILL)\n"
               "    await comm.all_reduce(x, out=x, algorithm='mesh')\n"
               "asyncio.run(main())\n")
    proc = run_job(2, sys.executable, "-c", program, timeout=120, grace=5, env={
        "AHCOMM_TRANSPORT": "sdma", "AHCOMM_EXEC_TIMEOUT": "20", "AHCOMM_BUFFSIZE": "1"})
    out = proc.stdout + proc.stderr
    pids = re.findall(r"\[(\d)\] PID (\d+)", out)
    assert len(pids) == 2, out
    left = [p.name for p in SHM.glob("ahcomm-*") if any(p.name.startswith(f"ahcomm-{pid}-") for _, pid in pids)]
    assert not left, (left, out)


def _tree(tmp_path: Path, files: dict[str, str], cgroup: str) -> tuple[str, str]:
    for name, text in files.items():
        path = tmp_path / "cg" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    (tmp_path / "self").write_text(cgroup)
    return str(tmp_path / "cg"), str(tmp_path / "self")


@pytest.mark.parametrize("files,cgroup,room", [
    ({"job/memory.max": "1073741824\n", "job/memory.current": "268435456\n"}, "0::/job\n", 768 << 20),  # v2
    ({"job/memory.max": "max\n", "job/memory.current": "1\n"}, "0::/job\n", None),  # v2 without a limit
    ({"memory/job/memory.limit_in_bytes": "536870912\n", "memory/job/memory.usage_in_bytes": "0\n"},
     "4:memory:/job\n", 512 << 20),  # v1
    ({"memory/memory.limit_in_bytes": "9223372036854771712\n", "memory/memory.usage_in_bytes": "5\n"},
     "4:memory:/elsewhere\n", None),  # v1 at the mount's root (a container), no limit
    ({"memory.max": "2147483648\n", "memory.current": "3221225472\n"}, "0::/\n", 0),  # over: none left
    ({}, "", None),  # no cgroup files at all
])
def test_a_containers_memory_limit_bounds_what_alloc_takes(files: dict[str, str], cgroup: str, room: int | None,
                                                          tmp_path: Path) -> None:
    """Shared-memory pages count against a container's memory cgroup: alloc refuses beyond it, not
    only beyond the host's MemAvailable."""
    root, self_file = _tree(tmp_path, files, cgroup)
    assert _peer_memory._cgroup_room(root, self_file) == room

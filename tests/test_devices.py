"""The device layer (ahcomm._devices): host views of numpy, torch, DLPack and __array__ inputs,
results back as the caller's type, the staging pool, chunked readiness."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import ahcomm
from ahcomm import _devices
from ahcomm._devices import POOL, host_out, stage, staged_chunks, to_host

try:
    import torch
except ImportError:  # torch is optional: the numpy paths must work without it
    torch = None

needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed (pip install 'ahcomm[torch]')")
needs_cuda = pytest.mark.skipif(torch is None or not torch.cuda.is_available(),
                                reason="no CUDA device here: the accelerator staging path is not exercised")

TORCH_DTYPES = ["float32", "int64", "bfloat16", "bool"]


def _tensor(dtype: str, strided: bool) -> Any:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6) - 5
    t = base.to(getattr(torch, dtype))
    return t[:, ::2] if strided else t  # strided: a (4, 3) view with stride 2


def _bits(t: Any) -> np.ndarray:
    """The tensor's memory as numpy, for shares_memory checks (bfloat16 through int16)."""
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()


# -- numpy, DLPack, __array__ -----------------------------------------------------------------
def test_numpy_round_trip_is_identity() -> None:
    x = np.arange(10, dtype=np.float32)
    host, restore = to_host(x)
    assert host is x
    result = host * 2
    assert restore(result) is result
    st = stage(x, out=x)
    assert st.array is x and st.out_for(x.shape) is x and not st.on_device
    assert st.finish(x) is x


class DLPackOnly:
    """A CPU DLPack producer that is not a numpy array and has no __array__."""

    def __init__(self, a: np.ndarray) -> None:
        self.a = a

    def __dlpack__(self, **kw: Any) -> Any:
        return self.a.__dlpack__(**kw)

    def __dlpack_device__(self) -> Any:
        return self.a.__dlpack_device__()


class ArrayLike:
    def __init__(self, a: np.ndarray) -> None:
        self.a = a

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        return self.a if dtype is None else self.a.astype(dtype)


def test_dlpack_input_is_zero_copy() -> None:
    a = np.arange(12, dtype=np.int32).reshape(3, 4)
    host, restore = to_host(DLPackOnly(a))
    assert np.shares_memory(host, a) and host.shape == (3, 4) and host.dtype == np.int32
    out = restore(host + 1)
    assert isinstance(out, np.ndarray) and out[0, 0] == 1


def test_dlpack_out_is_written_in_place() -> None:
    a = np.zeros(4, dtype=np.float64)
    view, writeback = host_out(DLPackOnly(a))
    view[:] = 7
    assert isinstance(writeback(), DLPackOnly) and np.all(a == 7)


def test_array_like_input() -> None:
    a = np.linspace(0, 1, 5)
    host, restore = to_host(ArrayLike(a))
    np.testing.assert_array_equal(host, a)
    assert isinstance(restore(host), np.ndarray)


def test_unsupported_inputs_raise_type_error() -> None:
    with pytest.raises(TypeError, match="numpy array"):
        to_host([1, 2, 3])
    with pytest.raises(TypeError, match="out must be"):
        host_out(ArrayLike(np.zeros(3)))  # a copy could never reach the caller


def test_numpy_copy_stages_a_private_copy() -> None:
    x = np.arange(4.0)
    st = stage(x, copy=True)
    assert not np.shares_memory(st.array, x) and np.array_equal(st.array, x)


async def test_host_chunks_are_views() -> None:
    x = np.arange(100, dtype=np.float32)
    seen = [(lo, chunk) async for lo, chunk in staged_chunks(x, chunk_bytes=40 * 4)]
    assert [lo for lo, _ in seen] == [0, 40, 80] and all(np.shares_memory(c, x) for _, c in seen)
    np.testing.assert_array_equal(np.concatenate([c for _, c in seen]), x)


def test_import_does_not_import_torch() -> None:
    code = ("import sys, numpy as np\n"
            "sys.modules['torch'] = None  # as if torch were not installed\n"
            "import ahcomm\nfrom ahcomm._devices import to_host, stage\n"
            "x = np.ones(3)\nh, r = to_host(x)\nassert h is x and r(h) is h\n"
            "assert stage(x).array is x\nprint('ok')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr
    code2 = "import sys, ahcomm, ahcomm._devices; print('torch' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code2], capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == "False", proc.stdout + proc.stderr


# -- torch on the CPU: zero copy both ways -----------------------------------------------------
@needs_torch
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
@pytest.mark.parametrize("dtype", TORCH_DTYPES)
def test_torch_cpu_round_trip(dtype: str, strided: bool) -> None:
    t = _tensor(dtype, strided)
    host, restore = to_host(t)
    assert np.shares_memory(host, _bits(t)), "a CPU tensor must be viewed, not copied"
    assert host.shape == tuple(t.shape)
    want = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype.replace("bool", "bool_"))
    assert host.dtype == want
    np.testing.assert_array_equal(host.astype(np.float32), t.to(torch.float32).numpy())
    result = np.ascontiguousarray(host)  # what a collective hands back: a new host array
    back = restore(result)
    assert isinstance(back, torch.Tensor) and back.dtype == t.dtype and back.device == t.device
    assert tuple(back.shape) == tuple(t.shape) and torch.equal(back, t)
    assert np.shares_memory(_bits(back), result), "the result must be wrapped, not copied"


@needs_torch
def test_torch_float8_maps_to_ml_dtypes() -> None:
    t = torch.tensor([0.5, -2.0, 448.0]).to(torch.float8_e4m3fn)
    host, restore = to_host(t)
    assert host.dtype == np.dtype(ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(host.astype(np.float32), [0.5, -2.0, 448.0])
    assert restore(host.copy()).dtype == torch.float8_e4m3fn


@needs_torch
def test_torch_requires_grad_is_detached() -> None:
    t = torch.ones(3, requires_grad=True)
    host, restore = to_host(t)
    assert np.shares_memory(host, t.detach().numpy()) and not restore(host).requires_grad


@needs_torch
def test_torch_out_on_cpu_is_written_in_place() -> None:
    out = torch.zeros(6, dtype=torch.bfloat16)[::2]
    view, writeback = host_out(out)
    assert np.shares_memory(view, _bits(out))
    view[:] = np.array([1, 2, 3], dtype=ml_dtypes.bfloat16)
    assert writeback() is out and out.tolist() == [1.0, 2.0, 3.0]


@needs_torch
def test_in_place_shares_one_host_array() -> None:
    t = torch.arange(6.0)
    st = stage(t, out=t)
    assert st.out_for((6,)) is st.array  # the collective sees result is input: runs in place
    assert st.finish(st.array) is t


# -- the staging pool (CPU tensors forced through it, as device tensors always are) --------------
@needs_torch
def test_staging_buffer_is_reused() -> None:
    POOL.clear()
    t = torch.arange(1000, dtype=torch.float32)
    st = stage(t, copy=True)
    (buf,) = st.buffers
    assert not np.shares_memory(st.array, t.numpy()) and np.array_equal(st.array, t.numpy())
    back = st.finish(st.array.copy())
    assert torch.equal(back, t) and back.dtype == t.dtype
    allocations = POOL.allocations
    for k in range(3):  # a warm loop of calls allocates no staging
        st2 = stage(t + k, copy=True)
        assert st2.buffers[0] is buf
        assert torch.equal(st2.finish(st2.array), t + k)
    assert POOL.allocations == allocations


@needs_torch
def test_concurrent_stagings_get_distinct_buffers() -> None:
    POOL.clear()
    a, b = torch.ones(64), torch.full((64,), 2.0)
    sa, sb = stage(a, copy=True), stage(b, copy=True)
    held = sa.buffers + sb.buffers
    assert held[0] is not held[1] and not np.shares_memory(sa.array, sb.array)
    sa.release()
    sb.release()
    assert POOL.idle() == 2
    sa.release()  # idempotent
    assert POOL.idle() == 2
    other_dtype = stage(torch.ones(64, dtype=torch.int32), copy=True)  # another key: a new buffer
    assert all(other_dtype.buffers[0] is not b for b in held) and POOL.idle() == 2
    other_dtype.release()


@needs_torch
def test_staged_in_place_writes_back() -> None:
    POOL.clear()
    t = torch.arange(8, dtype=torch.int64)
    st = stage(t, out=t, copy=True)
    host = st.out_for((8,))
    assert host is st.array and not np.shares_memory(host, t.numpy())
    host *= 10  # what a collective does to its out
    assert st.finish(host) is t and t.tolist() == [10 * i for i in range(8)]
    assert POOL.idle() == 1


@needs_torch
async def test_staged_chunks_of_a_tensor() -> None:
    t = torch.arange(50, dtype=torch.float64)
    chunks = [(lo, c.copy()) async for lo, c in staged_chunks(t, chunk_bytes=16 * 8)]
    assert [lo for lo, _ in chunks] == [0, 16, 32, 48]
    np.testing.assert_array_equal(np.concatenate([c for _, c in chunks]), t.numpy())


@needs_torch
async def test_collectives_through_the_device_layer() -> None:
    """The integration proposed for Comm, done by hand: stage, run, finish."""
    comms = await ahcomm.init_inprocess(2)
    try:
        async def body(comm: ahcomm.Comm) -> tuple[Any, Any, Any]:
            x = torch.full((4, 3), float(comm.rank + 1), dtype=torch.bfloat16)
            st = stage(x)
            await st.ready()
            y = st.finish(await comm.all_reduce(st.array, out=st.out_for((4, 3))))
            z = torch.arange(6, dtype=torch.float32) * (comm.rank + 1)
            st2 = stage(z, out=z, copy=True)  # in place, through a staging buffer
            z2 = st2.finish(await comm.all_reduce(st2.array, op="max", out=st2.out_for((6,))))
            g = torch.full((2,), comm.rank, dtype=torch.int64)
            st3 = stage(g)
            gathered = st3.finish(await comm.all_gather(st3.array, out=st3.out_for((4,))))
            return y, (z2 is z, z), gathered

        results = await asyncio.wait_for(asyncio.gather(*(body(c) for c in comms)), 30)
    finally:
        await asyncio.gather(*(c.close() for c in comms))
    for y, (same, z), gathered in results:
        assert isinstance(y, torch.Tensor) and y.dtype == torch.bfloat16 and torch.all(y == 3)
        assert same and torch.equal(z, torch.arange(6, dtype=torch.float32) * 2)
        assert gathered.tolist() == [0, 0, 1, 1]


# -- accelerators: only where one is present -----------------------------------------------------
@needs_cuda
async def test_cuda_staging_round_trip() -> None:
    POOL.clear()
    t = torch.arange(1 << 16, dtype=torch.float32, device="cuda")[::2]
    st = stage(t, chunk_bytes=1 << 14)
    assert st.on_device and st.pending
    await st.ready(0, 100)
    await st.ready()
    np.testing.assert_array_equal(st.array, t.cpu().numpy())
    buf = st.buffers[0]
    assert buf.is_pinned()
    host_result = st.out_for(tuple(t.shape))
    assert host_result is not None
    np.multiply(st.array, 2, out=host_result)
    back = st.finish(host_result)
    assert back.device == t.device and back.dtype == t.dtype and torch.equal(back, t * 2)
    st2 = stage(t)
    await st2.ready()
    assert st2.buffers[0] is buf or any(b is buf for b in st2.buffers)
    out = torch.empty_like(t)
    st3 = stage(t, out=out)
    await st3.ready()
    assert st3.finish(st3.out_for(tuple(t.shape))) is out
    st2.release()
    h, restore = to_host(torch.ones(3, dtype=torch.bfloat16, device="cuda"))
    assert h.dtype == np.dtype(ml_dtypes.bfloat16) and restore(h).device.type == "cuda"
    assert _devices.is_device_tensor(t)


# -- the accelerator code path with a stand-in stream API (torch.cuda's shape; copies are the CPU's) --------
class FakeEvent:
    def __init__(self) -> None:
        self.done = False
        self.stream: Any = None

    def record(self, stream: Any) -> None:
        self.stream = stream
        stream.events.append(self)

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True


class FakeStream:
    def __init__(self, device: Any = None) -> None:
        self.events: list[FakeEvent] = []
        self.waited: list[Any] = []

    def wait_stream(self, other: Any) -> None:
        self.waited.append(other)


@pytest.fixture
def fake_accelerator(monkeypatch: pytest.MonkeyPatch) -> Any:
    """CPU tensors take the device path: copy stream, chunked non-blocking copies, events."""
    import contextlib
    from types import SimpleNamespace
    current = FakeStream()
    mod = SimpleNamespace(Stream=FakeStream, Event=FakeEvent, current_stream=lambda device=None: current,
                          stream=lambda s: contextlib.nullcontext(), device=lambda d: contextlib.nullcontext(),
                          current=current)
    recorded: list[Any] = []
    monkeypatch.setattr(_devices, "_accelerator", lambda device: mod)
    monkeypatch.setattr(_devices, "_on_host", lambda t: False)
    monkeypatch.setattr(_devices, "_record_stream", lambda t, s: recorded.append((t, s)))
    monkeypatch.setattr(_devices, "_copy_streams", {})
    mod.recorded = recorded
    POOL.clear()
    yield mod
    POOL.clear()


@needs_torch
async def test_device_path_chunks_and_events(fake_accelerator: Any) -> None:
    t = torch.arange(100, dtype=torch.float32)[::2]  # strided: made contiguous first
    st = stage(t, chunk_bytes=16 * 4)  # 50 elements in chunks of 16: 4 copies, 4 events
    assert st.on_device and st.pending
    copy_stream = _devices._copy_streams["cpu"]
    assert copy_stream.waited == [fake_accelerator.current], "the copy must follow the producing stream"
    assert fake_accelerator.current.waited == [copy_stream], "later work on the caller's stream follows the copy"
    events = copy_stream.events
    assert len(events) == 4 and not any(e.done for e in events)
    assert len(fake_accelerator.recorded) == 1 and fake_accelerator.recorded[0][1] is copy_stream
    await st.ready(16, 20)  # only the chunk that covers [16, 20)
    assert [e.done for e in events] == [False, True, False, False]
    await st.ready()
    assert all(e.done for e in events) and not st.pending
    np.testing.assert_array_equal(st.array, t.numpy())
    host = st.out_for((50,))
    assert host is not None and not np.shares_memory(host, st.array)
    np.multiply(st.array, 3, out=host)
    back = st.finish(host)
    assert torch.equal(back, t * 3) and back.dtype == t.dtype
    # the result's copy to the device is asynchronous: its buffer went back with the event
    writeback = fake_accelerator.current.events[-1]
    assert not writeback.done and POOL.idle() == 2
    again = stage(torch.zeros(50), read=False)
    assert again.out_for((50,)) is not None
    assert writeback.done, "a buffer whose copy may be in flight is waited for before reuse"
    again.release()


@needs_torch
async def test_device_path_chunk_iterator(fake_accelerator: Any) -> None:
    t = torch.arange(40, dtype=torch.int64)
    got = [(lo, c.copy()) async for lo, c in staged_chunks(t, chunk_bytes=10 * 8)]
    assert [lo for lo, _ in got] == [0, 10, 20, 30]
    np.testing.assert_array_equal(np.concatenate([c for _, c in got]), t.numpy())
    assert all(e.done for e in _devices._copy_streams["cpu"].events) and POOL.idle() == 1


@needs_torch
def test_device_out_written_back(fake_accelerator: Any) -> None:
    out = torch.zeros(6, dtype=torch.bfloat16)
    st = stage(np.ones(6, np.float32), out=out)  # a host input, a device out
    host = st.out_for((6,))
    assert host is not None and host.dtype == np.dtype(ml_dtypes.bfloat16) and not np.shares_memory(host, _bits(out))
    host[:] = 2
    assert st.finish(host) is out and out.tolist() == [2.0] * 6


def test_pool_keeps_at_most_max_bytes() -> None:
    if torch is None:
        pytest.skip("torch is not installed (pip install 'ahcomm[torch]')")
    pool = _devices.StagingPool(max_bytes=3 * 400)
    bufs = [pool.acquire(torch.device("cpu"), torch.float32, 100) for _ in range(5)]  # 400 bytes each
    for b in bufs:
        pool.release(torch.device("cpu"), b)
    assert pool.idle() == 3 and pool.allocations == 5
    pool.release(torch.device("cpu"), bufs[-1])  # twice: still one entry
    assert pool.idle() == 3
    assert pool.acquire(torch.device("cpu"), torch.float32, 100) is bufs[-1]  # the most recent first


@needs_torch
@pytest.mark.parametrize("op", ["all_reduce", "reduce_scatter", "all_gather", "broadcast"])
async def test_collective_waits_for_the_device_copy_slice_by_slice(fake_accelerator: Any,
                                                                    monkeypatch: pytest.MonkeyPatch, op: str) -> None:
    """A device tensor bigger than the CCL buffer: the collective is issued before its input has
    landed on the host, and the executor waits for each chunk of the device-to-host copy only
    when a slice reads it, so slice k is communicated while chunk k+1 is still pending."""
    from ahcomm.algorithms._executor import Executor

    log: list[str] = []
    sync = FakeEvent.synchronize
    views = Executor._views
    monkeypatch.setattr(FakeEvent, "synchronize", lambda self: (log.append("copy"), sync(self))[1])
    monkeypatch.setattr(Executor, "_views", lambda self, *a: (log.append("slice"), views(self, *a))[1])
    # 24 MiB of float32: 3 copy chunks of 8 MiB; star (ring for reduce_scatter) runs it in slices
    # through 4 MiB CCL buffers (ring, rhd and nhr all_reduce pipeline inside one run instead,
    # which waits for the whole input)
    n = 6 * (1 << 20)
    comms = await ahcomm.init_inprocess(2, buffsize=4 << 20)
    try:
        xs = [torch.arange(n, dtype=torch.float32) * (r + 1) for r in range(2)]
        algorithm = "ring" if op == "reduce_scatter" else "star"  # both slice the call
        results = await asyncio.wait_for(asyncio.gather(*(getattr(c, op)(xs[c.rank], algorithm=algorithm)
                                                          for c in comms)), 60)
    finally:
        await asyncio.gather(*(c.close() for c in comms))
    base = torch.arange(n, dtype=torch.float32)
    want = {"all_reduce": [base * 3] * 2, "reduce_scatter": [(base * 3)[:n // 2], (base * 3)[n // 2:]],
            "all_gather": [torch.cat([base, base * 2])] * 2, "broadcast": [base] * 2}[op]
    for y, w in zip(results, want):
        assert isinstance(y, torch.Tensor) and torch.equal(y, w)
    assert log.count("copy") == 6, log  # 3 chunks on each of 2 ranks, each waited for once
    assert log.index("slice") < len(log) - 1 - log[::-1].index("copy"), \
        f"every copy was waited for before the first slice: {log}"


@needs_torch
async def test_a_device_input_is_not_kept_alive_by_the_communicator(fake_accelerator: Any) -> None:
    """The staging handed to the executor does not outlive the call (no task's context keeps it)."""
    import gc
    import weakref

    comms = await ahcomm.init_inprocess(2)
    try:
        xs = [torch.ones(1000) * (r + 1) for r in range(2)]
        refs = [weakref.ref(x) for x in xs]
        got = await asyncio.gather(*(c.all_reduce(xs[c.rank]) for c in comms))
        assert all(torch.all(g == 3) for g in got)
        del xs, got
        gc.collect()
        assert [r() for r in refs] == [None, None], "the communicator keeps a device input alive"
    finally:
        await asyncio.gather(*(c.close() for c in comms))

"""Device tensors: host arrays for the collectives, and results back as the caller's type.

The collectives work on numpy arrays in host memory. This leaf module (numpy and ml_dtypes
only; torch is never imported here - a torch tensor can exist only once its caller has
imported torch, so ``sys.modules`` tells) turns what a caller passes into such arrays and
turns the host result back:

=========================================  ===================================================
caller passes                              host array (``Staged.array``)
=========================================  ===================================================
``numpy.ndarray``                          itself
torch tensor on the CPU                    ``tensor.numpy()``: zero copy (a strided tensor
                                           gives a strided view; the collectives handle it)
torch tensor on an accelerator             a copy in a *staging buffer*: pinned host memory
(``cuda``, ``npu``, any non-CPU device)    from a pool keyed by (device, dtype, bytes), reused
                                           across calls, so a loop of calls allocates nothing
                                           once warm; the device-to-host copy is issued
                                           ``non_blocking`` on a per-device copy stream, in
                                           chunks, each followed by an event; the
                                           caller's stream then waits for the copy stream,
                                           so later device work may overwrite the tensor
a DLPack producer on the CPU               ``np.from_dlpack(x)`` (zero copy)
an object with ``__array__``               ``np.asarray(x)``
=========================================  ===================================================

torch ``bfloat16``, ``float8_e4m3fn`` and ``float8_e5m2`` map to ml_dtypes' types through an
integer view of the same bits (``tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)``),
so they too are zero copy on the CPU.

Results: ``Staged.finish(host_result)`` gives the result as the caller's type on the
caller's device (a torch tensor of the same device and dtype for torch callers; numpy stays
numpy; generic array-likes and DLPack producers get numpy). With ``out=``, the host result
is written into the caller's ``out`` (for a device tensor: a ``non_blocking`` host-to-device
copy on the device's current stream, so later work on that stream sees it) and ``out``
itself is returned.

Overlap: ``Staged.ready(lo, hi)`` awaits only the chunks of the device-to-host copy that
cover elements ``[lo, hi)`` of the flat input, so a collective that runs slice by slice can
start communicating slice k while slice k+1 is still being copied. all_reduce, all_gather,
reduce_scatter and broadcast do (``device_aware(sliced=True)``: the executor awaits each
slice's range); the other collectives wait for the whole copy before they are issued.
``staged_chunks`` is the same as an async iterator. For host inputs everything is ready at once.

Scope of what was run here: numpy, torch CPU tensors, DLPack and ``__array__`` inputs, and
the staging pool (CPU tensors forced through it with ``copy=True``) are tested on CPU; so is
the accelerator path's logic (chunked copies on a copy stream that waits for the current
stream, one event per chunk, ``ready`` ranges, ``record_stream``, writebacks whose buffer
returns to the pool with an event) with a stand-in for the stream API and CPU tensors
posing as device tensors (tests/test_devices.py). The real accelerator calls (pinned
memory, ``torch.cuda``'s streams and events, ``non_blocking`` copies) follow torch.cuda's
documented API and, for Ascend NPUs, torch_npu's documented mirror of it
(``torch.npu.Stream``/``Event``/``current_stream``/``stream``/``device``,
``Tensor.pin_memory``, ``Tensor.record_stream``); they run only where
``torch.cuda.is_available()`` (the CUDA test skips otherwise) and have never run on an
Ascend device.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator, Callable
from typing import Any

import ml_dtypes
import numpy as np

from ._staging_pool import POOL, StagingPool

__all__ = [
    "POOL",
    "Staged",
    "StagingPool",
    "host_out",
    "is_device_tensor",
    "stage",
    "staged_chunks",
    "to_host",
]

#: chunk of the device-to-host copy when ``stage`` is given no ``chunk_bytes`` (8 MiB: a
#: few hundred microseconds at PCIe speeds, small against the collectives' slices)
DEFAULT_CHUNK_BYTES = 8 << 20

# torch dtypes numpy cannot hold directly: (torch dtype name, same-size integer torch dtype
# name, the ml_dtypes numpy dtype)
_ML_VIEWS: tuple[tuple[str, str, np.dtype], ...] = (
    ("bfloat16", "int16", np.dtype(ml_dtypes.bfloat16)),
    ("float8_e4m3fn", "uint8", np.dtype(ml_dtypes.float8_e4m3fn)),
    ("float8_e5m2", "uint8", np.dtype(ml_dtypes.float8_e5m2)),
)
_ML_BY_NUMPY = {np_dtype: (name, int_name) for name, int_name, np_dtype in _ML_VIEWS}


def _torch() -> Any:
    """torch if the program has imported it (else no torch tensor can exist), or None."""
    return sys.modules.get("torch")


def _on_host(t: Any) -> bool:
    """A torch tensor whose memory numpy can view (the CPU's)."""
    return bool(t.device.type == "cpu")


def is_device_tensor(x: Any) -> bool:
    """True for a torch tensor on an accelerator (anything but the CPU)."""
    torch = _torch()
    return torch is not None and isinstance(x, torch.Tensor) and not _on_host(x)


# -- dtype views ------------------------------------------------------------------------------
def _tensor_numpy(t: Any) -> np.ndarray:
    """A CPU tensor's memory as a numpy array (zero copy; ml_dtypes through an integer view)."""
    torch = _torch()
    t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    name = str(t.dtype).removeprefix("torch.")
    for tname, int_name, np_dtype in _ML_VIEWS:
        if name == tname:
            return np.asarray(t.view(getattr(torch, int_name)).numpy()).view(np_dtype)
    try:
        return np.asarray(t.numpy())
    except TypeError as exc:
        raise TypeError(f"torch dtype {t.dtype} has no numpy equivalent: {exc}") from None


def _numpy_tensor(a: np.ndarray) -> Any:
    """A numpy array as a CPU torch tensor sharing its memory (ml_dtypes through an integer view)."""
    torch = _torch()
    ml = _ML_BY_NUMPY.get(a.dtype)
    if ml is not None:
        name, int_name = ml
        return torch.from_numpy(a.view(np.dtype(int_name))).view(getattr(torch, name))
    return torch.from_numpy(a)


_copy_streams: dict[str, Any] = {}


def _device_module(device: Any) -> Any:
    """torch.cuda for ``cuda``, torch.npu (torch_npu) for ``npu``: the same documented API."""
    torch = _torch()
    mod = getattr(torch, device.type, None)
    if mod is None or not hasattr(mod, "Stream") or not hasattr(mod, "Event"):
        return None
    return mod


def _accelerator(device: Any) -> Any:
    """The stream API for ``device``'s tensors, or None for the CPU (copies there are synchronous)."""
    return None if device.type == "cpu" else _device_module(device)


def _record_stream(tensor: Any, stream: Any) -> None:
    """Tell the caching allocator that ``stream`` reads ``tensor`` (its memory is not reused before)."""
    tensor.record_stream(stream)


def _copy_stream(device: Any) -> Any:
    key = str(device)
    stream = _copy_streams.get(key)
    if stream is None:
        stream = _copy_streams[key] = _accelerator(device).Stream(device=device)
    return stream


# -- one call's staging ---------------------------------------------------------------------
class _Side:
    """One tensor argument (input or out) and its host view."""

    __slots__ = ("buf", "device", "host", "kind", "obj")

    def __init__(self, obj: Any, kind: str, host: np.ndarray, device: Any = None, buf: Any = None) -> None:
        self.obj = obj  # what the caller passed
        self.kind = kind  # "numpy", "torch" (CPU, zero copy), "staged" (a pool buffer), "host" (other)
        self.host = host
        self.device = device
        self.buf = buf  # the pool buffer (flat torch tensor) when kind == "staged"


class Staged:
    """One call's host arrays and the way back to the caller's types.

    ``array``: the input as a host numpy array (for a device tensor: the staging buffer,
    whose content is valid once ``ready()`` is done). ``out_for(shape)``: the host ``out=``
    to give the collective. ``finish(host_result)``: the result as the caller expects it;
    it also gives the staging buffers back. ``release()``: give them back without a result
    (the call failed).
    """

    __slots__ = ("_done", "_events", "_out", "_result_buf", "_x")

    def __init__(self, x: _Side, out: _Side | None) -> None:
        self._x = x
        self._out = out
        self._events: list[tuple[int, int, Any]] = []  # (lo, hi, event) of the in-flight copy
        self._result_buf: Any = None  # pool buffer staging a fresh device result
        self._done = False

    @property
    def array(self) -> np.ndarray:
        return self._x.host

    @property
    def on_device(self) -> bool:
        """True when a device tensor is involved (input or out): results need a copy back."""
        return self._x.kind == "staged" or (self._out is not None and self._out.kind == "staged")

    @property
    def pending(self) -> bool:
        """True while some of the device-to-host copy may still be in flight."""
        return bool(self._events)

    @property
    def buffers(self) -> tuple[Any, ...]:
        """The pool buffers this call holds (for inspection)."""
        sides = (self._x, self._out)
        return tuple(s.buf for s in sides if s is not None and s.buf is not None) + (
            (self._result_buf,) if self._result_buf is not None else ())

    def out_for(self, shape: tuple[int, ...]) -> np.ndarray | None:
        """The host ``out=`` for a collective whose result has ``shape``.

        The caller's ``out`` (its host view: itself, ``.numpy()``, or its staging buffer;
        when ``out`` is the input, the input's host array itself, so the collective runs in
        place); None for host callers without ``out`` (the collective allocates); for a
        device caller without ``out``, a pooled pinned buffer of ``shape`` (so the result's
        copy to the device is asynchronous and nothing is allocated on the host).
        """
        if self._out is not None:
            return self._out.host
        if self._x.kind != "staged":
            return None
        if self._result_buf is None:
            numel = int(np.prod(shape, dtype=np.int64))
            self._result_buf = POOL.acquire(self._x.device, self._x.obj.dtype, numel)
        return _tensor_numpy(self._result_buf).reshape(shape)

    # -- readiness (device-to-host) ------------------------------------------------------
    async def ready(self, lo: int = 0, hi: int | None = None) -> None:
        """Wait (without blocking the loop) until elements ``[lo, hi)`` of the flat input landed."""
        if not self._events:
            return
        hi = self.array.size if hi is None else hi
        loop = asyncio.get_running_loop()
        for a, b, event in self._events:
            if b > lo and a < hi and not event.query():
                await loop.run_in_executor(None, event.synchronize)
        if hi >= self.array.size and lo <= 0:
            self._events = []

    def wait(self) -> None:
        """Block until the whole input landed (``to_host``'s synchronous form)."""
        for _, _, event in self._events:
            event.synchronize()
        self._events = []

    # -- results (host-to-device) ----------------------------------------------------------
    def finish(self, result: Any) -> Any:
        """``result`` (the collective's host array, or None) as the caller expects it."""
        try:
            if result is None:
                return None
            if not isinstance(result, np.ndarray):
                raise TypeError(f"finish: expected the collective's numpy result, got {type(result).__name__}")
            out = self._out
            if out is not None:
                if out.kind == "staged":
                    self._writeback(out.obj, out.buf, result)
                    out.buf = None  # _writeback gave it back
                return out.obj
            x = self._x
            if x.kind == "numpy" or x.kind == "host":
                return result
            if x.kind == "torch":
                return _numpy_tensor(result)
            # a device caller: the result goes to a new tensor on its device
            torch = _torch()
            dst = torch.empty(result.shape, dtype=x.obj.dtype, device=x.device)
            if self._result_buf is not None and np.shares_memory(result, _tensor_numpy(self._result_buf)):
                self._writeback(dst, self._result_buf, result)
                self._result_buf = None
            else:
                dst.copy_(_numpy_tensor(np.ascontiguousarray(result)))
            return dst
        finally:
            self.release()

    def _writeback(self, dst: Any, buf: Any, host: np.ndarray) -> None:
        """Copy the staged ``host`` (which lies in ``buf``) into device tensor ``dst``, asynchronously
        on the device's current stream (later work on that stream sees it); ``buf`` goes back to
        the pool with the copy's event, so it is not reused before the copy has read it."""
        device = dst.device
        src = buf[: dst.numel()].view(dst.shape)
        mod = _accelerator(device)
        if mod is None:
            dst.copy_(src)
            POOL.release(device, buf)
            return
        with mod.device(device):
            dst.copy_(src, non_blocking=True)
            event = mod.Event()
            event.record(mod.current_stream(device))
        POOL.release(device, buf, event)

    def release(self) -> None:
        """Give the staging buffers back (idempotent)."""
        if self._done:
            return
        self._done = True
        event = self._events[-1][2] if self._events else None  # a device-to-host copy may be in flight
        for side in (self._x, self._out):
            if side is not None and side.buf is not None:
                POOL.release(side.device, side.buf, event)
                side.buf = None
        if self._result_buf is not None:
            POOL.release(self._x.device, self._result_buf)
            self._result_buf = None
        self._events = []


def _host_side(x: Any, what: str, *, copy: bool, read: bool, chunk_bytes: int, events: list[Any],
               writable: bool = False) -> _Side:
    if isinstance(x, np.ndarray):
        if copy and read:
            return _Side(x, "numpy", x.copy())
        return _Side(x, "numpy", x)
    torch = _torch()
    if torch is not None and isinstance(x, torch.Tensor):
        if _on_host(x) and not copy:
            return _Side(x, "torch", _tensor_numpy(x))
        return _stage_tensor(x, read=read, chunk_bytes=chunk_bytes, events=events)
    if hasattr(x, "__dlpack__"):
        try:
            arr = np.from_dlpack(x)
        except (BufferError, TypeError, ValueError, RuntimeError, AttributeError):
            arr = None
            if torch is not None:  # a device DLPack producer (CuPy, JAX...): through torch, zero copy
                t = torch.from_dlpack(x)
                return _stage_tensor(t, read=read, chunk_bytes=chunk_bytes, events=events)
        if arr is not None:
            if writable and not arr.flags.writeable:
                raise TypeError(f"{what}: the DLPack producer's memory is read-only")
            return _Side(x, "host", arr.copy() if copy and read else arr)
    if writable:
        raise TypeError(f"{what} must be a numpy array, a torch tensor or a writable CPU DLPack producer, "
                        f"got {type(x).__name__}")
    if hasattr(x, "__array__"):
        return _Side(x, "host", np.asarray(x))
    raise TypeError(f"{what} must be a numpy array, a torch tensor, a DLPack producer or expose __array__, "
                    f"got {type(x).__name__}")


def _stage_tensor(t: Any, *, read: bool, chunk_bytes: int, events: list[Any]) -> _Side:
    """``t`` (any device) staged in a pool buffer; the copy in flight is recorded in ``events``."""
    device = t.device
    buf = POOL.acquire(device, t.dtype, t.numel())
    host = _tensor_numpy(buf).reshape(tuple(t.shape))
    side = _Side(t, "staged", host, device, buf)
    if not read or t.numel() == 0:
        return side
    mod = _accelerator(device)
    if mod is None:  # a CPU tensor (copy=True), or a device without a stream API: synchronous
        buf.view(t.shape).copy_(t.detach())
        return side
    src = t.detach()
    current = mod.current_stream(device)
    if not src.is_contiguous():
        src = src.contiguous()  # on the device, in stream order; chunks are then flat ranges
    flat = src.reshape(-1)
    step = max(1, chunk_bytes // max(1, src.element_size()))
    stream = _copy_stream(device)
    stream.wait_stream(current)  # the copy reads t only after the work that produces it
    with mod.stream(stream):
        for lo in range(0, flat.numel(), step):
            hi = min(lo + step, flat.numel())
            buf[lo:hi].copy_(flat[lo:hi], non_blocking=True)
            event = mod.Event()
            event.record(stream)
            events.append((lo, hi, event))
    _record_stream(src, stream)  # the allocator keeps src's memory until the copy stream is past it
    current.wait_stream(stream)  # later work on the caller's stream (which may write t) follows the copy
    return side


def stage(x: Any, out: Any = None, *, copy: bool = False, read: bool = True,
          chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Staged:
    """Host arrays for a collective's input ``x`` and ``out=``; see the module docstring.

    ``copy``: stage a CPU tensor (or copy a host array) instead of viewing it, so the caller
    may change ``x`` while the collective runs. ``read=False``: only ``x``'s shape and dtype
    matter (a non-root's broadcast or scatter input): no device-to-host copy. ``chunk_bytes``:
    granularity of the device-to-host copy (``ready(lo, hi)`` waits for the chunks covering a
    range). Raises ``TypeError`` for what it cannot take (the API turns it into InvalidArgument).
    """
    events: list[Any] = []
    xs = _host_side(x, "input", copy=copy, read=read, chunk_bytes=chunk_bytes, events=events)
    outs: _Side | None = None
    if out is not None:
        if out is x:  # in place: one host array for both, so the collective sees result is input
            outs = _Side(out, xs.kind, xs.host, xs.device, None)
        else:
            outs = _host_side(out, "out", copy=False, read=False, chunk_bytes=chunk_bytes, events=[],
                              writable=True)
    st = Staged(xs, outs)
    st._events = events
    if out is x and xs.kind == "staged":  # the result goes back into x: x's buffer is out's too
        assert outs is not None
        outs.buf, xs.buf = xs.buf, None
    return st


# -- the convenience forms the brief names ----------------------------------------------------
def to_host(x: Any) -> tuple[np.ndarray, Callable[[Any], Any]]:
    """``(host_array, restore)``: ``x`` as a host numpy array (copied and waited for, if on a device),
    and ``restore(result)``, which gives a host result back as ``x``'s type on ``x``'s device
    (and returns the staging buffer to the pool)."""
    st = stage(x)
    st.wait()
    return st.array, st.finish


def host_out(out: Any) -> tuple[np.ndarray, Callable[[], Any]]:
    """``(host_view, writeback)`` for an ``out=`` argument: the collective writes ``host_view``;
    ``writeback()`` puts it into ``out`` (a copy only for device tensors) and returns ``out``."""
    st = stage(np.empty(0, np.uint8), out)
    host = st.out_for(())
    assert host is not None
    return host, lambda: st.finish(host)


async def staged_chunks(x: Any, chunk_bytes: int = DEFAULT_CHUNK_BYTES, *,
                        staged: Staged | None = None) -> AsyncIterator[tuple[int, np.ndarray]]:
    """Yield ``(start, flat_host_chunk)`` over ``x``'s elements, each chunk once its device-to-host
    copy has landed, while later chunks are still being copied (all copies are issued at once on
    the copy stream, in order). For host inputs the chunks are views, at once. The chunks stay
    valid until the staging is finished or released (pass ``staged`` to keep control of that;
    otherwise it is released when the iteration ends)."""
    own = staged is None
    st = stage(x, chunk_bytes=chunk_bytes) if staged is None else staged
    try:
        flat = st.array.reshape(-1) if st.array.flags.c_contiguous else np.ascontiguousarray(st.array).reshape(-1)
        step = max(1, chunk_bytes // max(1, flat.itemsize))
        for lo in range(0, flat.size, step):
            hi = min(lo + step, flat.size)
            await st.ready(lo, hi)
            yield lo, flat[lo:hi]
    finally:
        if own:
            st.release()

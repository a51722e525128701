"""Large outputs written past the cache (``_memcopy.copy(..., stream=True)``, the optional C
extension ``ahcomm._ntcopy``): which copies take that path, that every byte arrives at any
alignment, the switch ``AHCOMM_NT_STORES``, and oneshot's and direct's use of it."""

from __future__ import annotations

import ctypes
from collections.abc import Iterator

import numpy as np
import pytest

import ahcomm
from ahcomm import _memcopy
from ahcomm._memcopy import STREAM_BYTES, STREAM_PIECE, copy, streams
from tests.support.inproc import run_inproc

BUILT = _memcopy._ntcopy is not None and bool(_memcopy._ntcopy.NON_TEMPORAL)
needs_extension = pytest.mark.skipif(not BUILT, reason="ahcomm._ntcopy is not built with non-temporal stores here "
                                     "(no C compiler at install, or not x86-64): such copies are plain numpy ones")


class Recorder:
    """Stands in for the extension: records each copy's size and makes it with memmove."""

    NON_TEMPORAL = 1

    def __init__(self) -> None:
        self.calls: list[int] = []

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        self.calls.append(nbytes)
        ctypes.memmove(dst, src, nbytes)


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> Iterator[Recorder]:
    rec = Recorder()
    monkeypatch.setattr(_memcopy, "_ntcopy", rec)
    monkeypatch.delenv("AHCOMM_NT_STORES", raising=False)
    _memcopy.non_temporal.cache_clear()
    yield rec
    _memcopy.non_temporal.cache_clear()


def test_only_an_asked_large_separate_contiguous_copy_streams(recorder: Recorder) -> None:
    src = np.arange(STREAM_PIECE // 4, dtype=np.float32)
    dst = np.zeros_like(src)
    copy(dst, src)
    assert recorder.calls == []  # not asked
    copy(dst, src, stream=True)
    assert recorder.calls == [src.nbytes] and np.array_equal(dst, src)
    copy(dst[1:], src[1:], stream=True)  # below STREAM_PIECE
    buf = np.arange(STREAM_PIECE, dtype=np.float32)
    copy(buf[8:], buf[:-8].copy(), stream=True)  # separate: streams
    assert recorder.calls == [src.nbytes, (buf.size - 8) * 4]
    over = np.arange(STREAM_PIECE, dtype=np.float32)
    copy(over[8:], over[:-8], stream=True)  # overlapping: numpy's copy, as memmove
    np.testing.assert_array_equal(over[8:], np.arange(STREAM_PIECE - 8, dtype=np.float32))
    strided = np.zeros(2 * src.size, np.float32)
    copy(strided[::2], src, stream=True)
    objects = np.empty(STREAM_PIECE, object)
    copy(objects, np.full(STREAM_PIECE, "x", object), stream=True)  # references are counted, not copied as bytes
    assert recorder.calls == [src.nbytes, (buf.size - 8) * 4]
    np.testing.assert_array_equal(strided[::2], src)
    frozen = np.zeros_like(src)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):  # as np.copyto: never a write through a frozen array
        copy(frozen, src, stream=True)
    assert recorder.calls == [src.nbytes, (buf.size - 8) * 4] and not frozen.any()


def test_streams_from_stream_bytes_unless_turned_off(recorder: Recorder, monkeypatch: pytest.MonkeyPatch) -> None:
    assert streams(STREAM_BYTES) and not streams(STREAM_BYTES - 1)
    monkeypatch.setenv("AHCOMM_NT_STORES", "0")
    _memcopy.non_temporal.cache_clear()
    assert not streams(STREAM_BYTES)
    src = np.ones(STREAM_PIECE, np.uint8)
    copy(np.zeros_like(src), src, stream=True)
    assert recorder.calls == []


def test_a_bad_switch_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AHCOMM_NT_STORES", "maybe")
    _memcopy.non_temporal.cache_clear()
    try:
        with pytest.raises(ahcomm.ConfigError, match="AHCOMM_NT_STORES='maybe'"):
            streams(STREAM_BYTES)
    finally:
        _memcopy.non_temporal.cache_clear()


@needs_extension
@pytest.mark.parametrize("nbytes", [0, 1, 15, 63, 64, 65, 4099, STREAM_PIECE + 13, (1 << 20) + 7])
@pytest.mark.parametrize(("dst_at", "src_at"), [(0, 0), (1, 0), (0, 1), (15, 3), (16, 16), (33, 7), (8, 40)])
def test_the_extension_copies_every_byte_and_no_other(nbytes: int, dst_at: int, src_at: int) -> None:
    rng = np.random.default_rng(nbytes + dst_at)
    src_buf = rng.integers(0, 256, nbytes + 128, dtype=np.uint8)
    dst_buf = np.full(nbytes + 128, 0xAA, np.uint8)
    base = (-dst_buf.ctypes.data) % 64  # offsets from a cache line
    sbase = (-src_buf.ctypes.data) % 64
    assert _memcopy._ntcopy is not None
    _memcopy._ntcopy.copy(dst_buf.ctypes.data + base + dst_at, src_buf.ctypes.data + sbase + src_at, nbytes)
    lo = base + dst_at
    np.testing.assert_array_equal(dst_buf[lo:lo + nbytes], src_buf[sbase + src_at:sbase + src_at + nbytes])
    assert (dst_buf[:lo] == 0xAA).all() and (dst_buf[lo + nbytes:] == 0xAA).all()


@needs_extension
def test_the_extension_names_its_arguments() -> None:
    assert _memcopy._ntcopy is not None
    with pytest.raises(TypeError, match="3 arguments"):
        _memcopy._ntcopy.copy(1, 2)
    with pytest.raises(ValueError, match="null"):
        _memcopy._ntcopy.copy(0, 0, 5)
    _memcopy._ntcopy.copy(0, 0, 0)


@pytest.mark.parametrize("algorithm", ["oneshot", "direct"])
@pytest.mark.parametrize("op", ["all_gather", "broadcast"])
async def test_large_outputs_stream_and_small_ones_do_not(recorder: Recorder, algorithm: str, op: str) -> None:
    """all_gather's output and a broadcast's vector of ``STREAM_BYTES``: the copies into it stream
    (``copy.non_temporal`` in ``stats()["paths"]``) and the results are the same; half that: plain."""
    size = 2
    big = STREAM_BYTES // 4 // (size if op == "all_gather" else 1)  # float32 elements per rank

    async def body(comm: ahcomm.Comm) -> tuple[list[np.ndarray], dict[str, int], dict[str, int]]:
        out = []
        for count in (big // 2, big):
            x = np.arange(count, dtype=np.float32) + comm.rank * count
            if op == "all_gather":
                out.append(await comm.all_gather(x, algorithm=algorithm))
            else:  # out of place: a direct root copies its input (its readers read, not copy)
                out.append(await comm.broadcast(x, 0, algorithm=algorithm))
            if count == big // 2:
                small = dict(comm.stats()["paths"])
        return out, small, comm.stats()["paths"]

    results = await run_inproc(size, body)
    for rank, (out, small, paths) in enumerate(results):
        for k, count in enumerate((big // 2, big)):
            xs = [np.arange(count, dtype=np.float32) + r * count for r in range(size)]
            np.testing.assert_array_equal(out[k], np.concatenate(xs) if op == "all_gather" else xs[0])
        assert "copy.non_temporal" not in small
        copies = algorithm == "oneshot" or op == "all_gather" or rank == 0  # who copies into its output
        assert ("copy.non_temporal" in paths) == copies, paths
    assert recorder.calls and all(n >= STREAM_PIECE for n in recorder.calls)


def test_a_bad_switch_fails_init_not_a_large_call_later() -> None:
    from ahcomm._config import Config

    with pytest.raises(ahcomm.ConfigError, match="AHCOMM_NT_STORES"):
        Config.from_env({"AHCOMM_NT_STORES": "maybe"})
    Config.from_env({"AHCOMM_NT_STORES": "off"})

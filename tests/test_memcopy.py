"""Copies that keep off rep movsb's slow case (ahcomm._memcopy) and the reads built on them."""

from __future__ import annotations

import ctypes
import errno
import os

import numpy as np
import pytest

from ahcomm import _memcopy
from ahcomm._memcopy import BOUNCE_BYTES, LINE, PAGE, copy, misaligned, read_bounced, write_bounced
from ahcomm.transports import _cma
from ahcomm.transports.inproc import _memmove

SIZES = [0, 1, 2047, 2048, 4099, (1 << 20) + 7]


def _pair(nbytes: int, distance: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(src, dst) of ``nbytes`` each in one buffer, ``dst`` exactly ``distance`` bytes past a
    multiple of a page from ``src`` (random bytes in ``src``, zeros in ``dst``)."""
    span = -(-nbytes // PAGE) * PAGE + PAGE
    buf = np.zeros(2 * span + 2 * PAGE, np.uint8)
    start = (-buf.ctypes.data) % LINE
    src = buf[start:start + nbytes]
    src[:] = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
    at = start + span + distance
    return src, buf[at:at + nbytes]


def _at(buf: np.ndarray, offset: int, nbytes: int) -> np.ndarray:
    """``nbytes`` of ``buf`` starting ``offset`` bytes past a multiple of 64."""
    start = (-buf.ctypes.data) % LINE + offset
    return buf[start:start + nbytes]


def test_the_slow_case_is_a_destination_1_to_31_bytes_past_the_source_within_a_page() -> None:
    assert [d for d in range(64) if misaligned(1000 * 64 + d, 1000 * 64, 4096)] == list(range(1, 32))
    assert not misaligned(16, 0, _memcopy.MIN_BYTES - 1)  # small copies: glibc's vector moves
    assert misaligned(PAGE + 8, 0, 4096) and misaligned(3 * PAGE + 24, 5, 4096)
    # 72-4048 bytes apart (8 or 16 modulo 64) rep movsb ran at 13.5-15.9 GB/s against 15.6
    # aligned, process_vm_readv at 10.2-12.2 against 12.5, but 6.7-8.1 bounced (review, then
    # results/2026-11-26-aligned-copies.md): those are not the slow case
    assert not any(misaligned(d, 0, 4096) for d in (72, 80, 136, 264, 528, 2056, 4040, 4048, 4080, 4088))


@pytest.mark.parametrize("nbytes", SIZES)
def test_copy_equals_copyto_at_every_offset(nbytes: int) -> None:
    rng = np.random.default_rng(nbytes)
    src_buf = rng.integers(0, 256, nbytes + 2 * LINE, dtype=np.uint8)
    dst_buf = np.zeros(nbytes + 2 * LINE, np.uint8)
    src = _at(src_buf, 0, nbytes)
    for offset in range(0, LINE, 1 if nbytes < 1 << 20 else 8):
        dst = _at(dst_buf, offset, nbytes)
        dst[:] = 0
        copy(dst, src)
        assert np.array_equal(dst, src), offset


def test_copy_keeps_copytos_meaning_for_other_arrays() -> None:
    a = np.arange(10_000, dtype=np.float64)
    want = a.copy()
    want[1:] = want[:-1].copy()
    copy(a[1:], a[:-1])  # overlapping, 8 bytes apart: memmove's semantics
    assert np.array_equal(a, want)
    out = np.zeros((100, 100), np.float32)
    copy(out, np.arange(100, dtype=np.float32))  # broadcast
    assert np.array_equal(out[7], np.arange(100))
    col = np.zeros((1000, 3), np.float32)
    copy(col[:, 1], np.ones(1000, np.float32))  # strided destination
    assert col[:, 1].all() and not col[:, 0].any()
    f16 = np.zeros(5000, np.float16)
    copy(f16, np.full(5000, 2.5, np.float64))  # a cast
    assert (f16 == 2.5).all()


def test_a_misaligned_copy_takes_the_vector_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = np.copyto
    monkeypatch.setattr(np, "copyto", lambda dst, src, **kw: (calls.append(dst.nbytes), real(dst, src, **kw)))
    src, dst = _pair(8192, 16)
    copy(dst, src)
    assert calls == [] and np.array_equal(dst, src)
    for distance in (48, 80):  # rep movsb is fast there
        src, dst = _pair(8192, distance)
        copy(dst, src)
        assert np.array_equal(dst, src)
    assert calls == [8192, 8192]


def _fake_kernel(calls: list[tuple[int, int, int]]):  # type: ignore[no-untyped-def]
    def read(dst: np.ndarray, addr: int) -> None:
        calls.append((dst.ctypes.data, addr, dst.nbytes))
        ctypes.memmove(dst.ctypes.data, addr, dst.nbytes)
    return read


@pytest.mark.parametrize("nbytes", [100, 2048, 5000, 3 * BOUNCE_BYTES + 11])
@pytest.mark.parametrize("offset", [0, 8, 16, 31, 32, 48, 72, 4040])
@pytest.mark.parametrize("way", ["read", "write"])
def test_bounced_transfers_give_the_kernel_aligned_pairs(nbytes: int, offset: int, way: str) -> None:
    """read_bounced fills ``dst`` from ``src``'s address, write_bounced writes ``src`` to ``dst``'s:
    either way the kernel (here a memmove) gets only pairs it copies fast."""
    src, dst = _pair(nbytes, offset, seed=offset)
    calls: list[tuple[int, int, int]] = []  # (destination, source, bytes) of each kernel call
    if way == "read":
        read_bounced(dst, src.ctypes.data, _fake_kernel(calls))
    else:
        def kernel(piece: np.ndarray, addr: int) -> None:  # a process_vm_writev of ``piece`` to ``addr``
            calls.append((addr, piece.ctypes.data, piece.nbytes))
            ctypes.memmove(addr, piece.ctypes.data, piece.nbytes)
        write_bounced(src, dst.ctypes.data, kernel)
    assert np.array_equal(dst, src)
    if misaligned(dst.ctypes.data, src.ctypes.data, nbytes):
        assert len(calls) == -(-nbytes // BOUNCE_BYTES)
        assert all(not misaligned(to, frm, size) and size <= BOUNCE_BYTES for to, frm, size in calls)
    else:
        assert calls == [(dst.ctypes.data, src.ctypes.data, nbytes)]


@pytest.mark.parametrize("way", ["read", "write"])
def test_cma_hands_the_kernel_aligned_pairs(monkeypatch: pytest.MonkeyPatch, way: str) -> None:
    """process_vm_readv / writev copy each page with rep movsb: a misaligned transfer goes through
    the bounce buffer (the old read handed the kernel the 16-byte misaligned pair)."""
    seen: list[tuple[int, int]] = []
    name = "_readv" if way == "read" else "_writev"
    real = getattr(_cma, name)
    if real is None:
        pytest.skip(f"no process_vm_{way}v")

    def spy(pid, local, nlocal, remote, nremote, flags):  # type: ignore[no-untyped-def]
        seen.append((local._obj.base, remote._obj.base))  # ctypes.byref(_IoVec)
        return real(pid, local, nlocal, remote, nremote, flags)
    monkeypatch.setattr(_cma, name, spy)
    src, dst = _pair(200_000, 16)
    try:
        if way == "read":
            _cma.read(os.getpid(), dst, src.ctypes.data)
        else:
            _cma.write(os.getpid(), src, dst.ctypes.data)
    except OSError as exc:
        pytest.skip(f"process_vm_{way}v on this process is not permitted here: {exc}")
    assert np.array_equal(dst, src)
    assert seen and all((local - remote) % LINE == 0 for local, remote in seen)


@pytest.mark.parametrize("refused", ["none", "_readv", "_writev"])
def test_cma_probe_needs_reads_and_writes_and_changes_nothing(monkeypatch: pytest.MonkeyPatch, refused: str) -> None:
    """Single copy moves bytes both ways (reads, and mesh's push writes): a system-call filter
    that refuses either call turns it off (the probe used to try reads only); the probed bytes
    are left as they were."""
    target = np.arange(64, dtype=np.uint8)
    if not _cma.probe(os.getpid(), target.ctypes.data):
        pytest.skip("process_vm_readv / writev on this process are not permitted here")
    np.testing.assert_array_equal(target, np.arange(64, dtype=np.uint8))

    def eperm(*args: object) -> int:
        ctypes.set_errno(errno.EPERM)
        return -1
    if refused != "none":
        monkeypatch.setattr(_cma, refused, eperm)
    assert _cma.probe(os.getpid(), target.ctypes.data) is (refused == "none")
    np.testing.assert_array_equal(target, np.arange(64, dtype=np.uint8))


@pytest.mark.parametrize("offset", [0, 8, 24, 40])
def test_inproc_read_at_any_offset(offset: int) -> None:
    src = _at(np.random.default_rng(1).integers(0, 256, 70_000, dtype=np.uint8), 0, 66_000)
    dst = _at(np.zeros(70_000, np.uint8), offset, 66_000)
    _memmove(dst, src.ctypes.data)
    assert np.array_equal(dst, src)


def test_copy_of_references_and_array_likes_is_copytos() -> None:
    """Object arrays (or fields) have no uint8 view and hold counted references: the old code
    took the vector loop for them where the addresses were 8, 16 or 56 bytes apart and raised
    TypeError; and a list or scalar source (np.copyto takes any array_like) raised AttributeError."""
    src = np.array([str(i) for i in range(1000)], dtype=object)
    buf = np.empty(1100, object)
    for k in range(8):  # the destination 8 k bytes further each time: every offset mod 64
        dst = buf[k:k + 1000]
        copy(dst, src)
        assert list(dst) == list(src), k
    rows = np.dtype([("a", object), ("b", np.float64)])  # 16-byte items
    src_rows = np.zeros(500, rows)
    src_rows["a"] = "x"
    for k in range(4):
        dst_rows = np.zeros(600, rows)[k:k + 500]
        copy(dst_rows, src_rows)
        assert all(v == "x" for v in dst_rows["a"]), k
    dst8 = _at(np.zeros(10_000, np.uint8), 8, 4096)
    copy(dst8, 7)
    assert (dst8 == 7).all()
    floats = dst8.view(np.float32)
    copy(floats, [2.5] * floats.size)
    assert (floats == 2.5).all()


class _Counted(np.ndarray):
    """An array that counts how often its address (``.ctypes``) is asked for."""

    asked = 0

    @property
    def ctypes(self):  # type: ignore[no-untyped-def, override]
        _Counted.asked += 1
        return super().ctypes


@pytest.mark.parametrize("nbytes", [8, 64, 1024, _memcopy.MIN_BYTES - 1])
def test_small_copies_ask_for_no_address(nbytes: int) -> None:
    """An address costs about 1 us (``ndarray.ctypes``), ten times a small np.copyto: the old
    code asked for both before it looked at the size, on every copy of every hot path."""
    src = np.arange(nbytes, dtype=np.uint8).view(_Counted)
    dst = np.zeros(nbytes + 16, np.uint8)[8:8 + nbytes].view(_Counted)
    _Counted.asked = 0
    copy(dst, src)
    assert np.array_equal(dst, src) and _Counted.asked == 0


@pytest.mark.parametrize("dtype", [*__import__("ahcomm._dtypes", fromlist=["x"]).SUPPORTED_DTYPES,
                                   np.dtype(">f4"), np.dtype("M8[s]"), np.dtype([("a", "i4"), ("b", "f8")]),
                                   np.dtype(np.complex64)])
def test_address_is_the_arrays_data_pointer(dtype: np.dtype) -> None:
    base = np.zeros(1000, dtype)
    for a in (base, base[3:], base[3:].reshape(-1)[:-1]):
        assert _memcopy._address(a) == a.ctypes.data
        a.flags.writeable = False
        assert _memcopy._address(a) == a.ctypes.data


def test_a_2_kib_copy_is_copytos(monkeypatch: pytest.MonkeyPatch) -> None:
    """glibc's memmove takes rep movsb from x86_rep_movsb_threshold (0x840 = 2112 bytes on this
    host) up: a copy of 2048-2111 bytes is vector moves at any offset (2048 B at +8: 0.44 us
    against 0.39 aligned), and the old threshold of 2048 sent it through the addresses and the
    ufunc (3.4 us)."""
    calls = []
    real = np.copyto
    monkeypatch.setattr(np, "copyto", lambda dst, src, **kw: (calls.append(dst.nbytes), real(dst, src, **kw)))
    src_buf, dst_buf = np.ones(4096, np.uint8), np.zeros(4096, np.uint8)
    for nbytes in (2048, 2111):
        copy(_at(dst_buf, 8, nbytes), _at(src_buf, 0, nbytes))
    assert calls == [2048, 2111]


def test_read_bounced_refuses_a_strided_destination() -> None:
    """A reshape of a strided array copies it: the read would land in the copy and leave ``dst``
    as it was (review)."""
    src = np.arange(20_000, dtype=np.uint8)
    dst = np.zeros((100, 400), np.uint8)[:, :200]
    with pytest.raises(ValueError, match="contiguous"):
        read_bounced(dst, src.ctypes.data, _fake_kernel([]))

"""Results of calls without ``out=``: memory a caller dropped is handed out again, never memory it holds."""

from __future__ import annotations

import asyncio
import gc
import types
import weakref
from typing import Any

import numpy as np
import pytest

from ahcomm import ConfigError
from ahcomm._config import Config
from ahcomm._outputs import MIN_BYTES, Results
from ahcomm.testing import local_world

F32 = np.dtype(np.float32)


def _at(a: np.ndarray) -> int:
    """The address of ``a``'s data (``a.ctypes`` would make an object that refers to ``a``)."""
    return int(a.__array_interface__["data"][0])


COUNT = MIN_BYTES // 4  # a result big enough to be kept


def test_a_dropped_result_is_handed_out_again_and_a_held_one_never() -> None:
    results = Results(limit=16 * MIN_BYTES)
    a = results.take((COUNT,), F32)
    first = _at(a)
    b = results.take((COUNT,), F32)
    assert _at(b) != first  # a is held
    del a
    c = results.take((2, COUNT // 2), F32)  # same bytes, another shape
    assert _at(c) == first and c.shape == (2, COUNT // 2) and results.reused == 1
    view = c[1, :10]
    del c
    assert _at(results.take((COUNT,), F32)) not in (first, _at(b))  # a view keeps its base
    del view
    assert _at(results.take((COUNT,), np.dtype(np.int32))) == first  # any dtype of the same bytes


def test_a_tracer_at_import_does_not_make_held_results_look_free() -> None:
    """A trace function that reads frames' locals (snoop, pysnooper, a debugger) adds a reference
    to the array ``take`` looks at: a baseline measured once, at an import under such a tracer,
    made a held result look free, and it was handed out twice (CPython 3.11-3.12)."""
    import importlib
    import sys

    from ahcomm import _outputs

    def tracer(frame: types.FrameType, event: str, arg: object) -> object:
        seen.append(frame.f_locals)  # what such tools do on every line
        return tracer

    seen: list[object] = []
    sys.settrace(tracer)  # type: ignore[arg-type]
    try:
        module = importlib.reload(_outputs)  # the same module object, re-run under the tracer
    finally:
        sys.settrace(None)
    try:
        results = module.Results(limit=16 * MIN_BYTES)
        a = results.take((COUNT,), F32)
        b = results.take((COUNT,), F32)
        assert _at(a) != _at(b)
        del a
        assert _at(results.take((COUNT,), F32)) != _at(b)  # a dropped one is still handed out again
        assert results.reused == 1 and seen
    finally:
        importlib.reload(_outputs)  # as every other test imports it


def test_clear_frees_what_nobody_holds() -> None:
    results = Results(limit=16 * MIN_BYTES)
    held = results.take((COUNT,), F32)
    results.take((COUNT,), F32)
    assert results.kept_bytes == 2 * MIN_BYTES
    assert results.clear() == MIN_BYTES and results.kept_bytes == 0 and held.nbytes == MIN_BYTES


def test_small_and_object_results_are_not_kept_and_the_limit_drops_the_oldest() -> None:
    results = Results(limit=2 * MIN_BYTES)
    small = results.take((8,), F32)
    assert small.nbytes == 32 and not results._kept
    assert results.take((COUNT,), np.dtype(object)).dtype == object and not results._kept
    held = [results.take((COUNT,), F32) for _ in range(3)]  # three of MIN_BYTES, all held: the oldest goes
    assert len(results._kept) == 2 and results._bytes == 2 * MIN_BYTES
    assert [_at(k) for k in results._kept] == [_at(h) for h in held[1:]]
    off = Results(limit=0)
    off.take((COUNT,), F32)
    assert not off._kept


def test_the_cache_size_is_checked_at_init(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="AHCOMM_RESULT_CACHE_MB"):
        Config.from_env({"AHCOMM_RESULT_CACHE_MB": "lots"})
    with pytest.raises(ConfigError, match="AHCOMM_RESULT_CACHE_MB"):
        Config.from_env({"AHCOMM_RESULT_CACHE_MB": "-1"})
    with pytest.raises(ConfigError, match="AHCOMM_RESULT_CACHE_MB"):
        Config.from_env({"AHCOMM_RESULT_CACHE_MB": "nan"})
    Config.from_env({"AHCOMM_RESULT_CACHE_MB": "0"})
    monkeypatch.setenv("AHCOMM_RESULT_CACHE_MB", "3")
    assert Results().limit == 3 << 20


async def _all_reduce(comms: list[Any], xs: list[np.ndarray]) -> list[np.ndarray]:
    return list(await asyncio.gather(*(c.all_reduce(x) for c, x in zip(comms, xs))))


@pytest.mark.asyncio
async def test_a_result_the_caller_holds_keeps_its_values_across_later_calls() -> None:
    comms = await local_world(3, buffsize=1 << 18)
    try:
        xs = [np.full(COUNT, r + 1, np.float32) for r in range(3)]
        held = await _all_reduce(comms, xs)
        for step in range(3):
            await asyncio.sleep(0)
            later = await _all_reduce(comms, [x * (step + 2) for x in xs])
            kept = all(bool(np.all(h == 6)) for h in held)  # plain names: the assert keeps no array alive
            right = all(bool(np.all(v == 6 * (step + 2))) for v in later)
            apart = not any(np.may_share_memory(h, v) for h, v in zip(held, later))
            del later
            assert kept and right and apart, step
        assert all(c.stats()["results_reused"] >= 1 for c in comms)  # the dropped ones came back
    finally:
        await asyncio.gather(*(c.close() for c in comms))


@pytest.mark.asyncio
async def test_a_finished_run_keeps_no_reference_to_the_caller_s_arrays(monkeypatch: pytest.MonkeyPatch) -> None:
    """The streams' error hook was the last run's context, whose views kept the result (and
    input) alive until the next call: a dropped result could not be handed out again."""
    monkeypatch.setenv("AHCOMM_RESULT_CACHE_MB", "0")
    comms = await local_world(2, buffsize=1 << 18)
    try:
        results = await _all_reduce(comms, [np.ones(COUNT, np.float32) for _ in comms])
        gone = [weakref.ref(r if r.base is None else r.base) for r in results]
        gc.disable()  # refcounts alone: a cycle would be the defect
        try:
            del results
            await asyncio.sleep(0)
            assert [ref() for ref in gone] == [None, None]
        finally:
            gc.enable()
    finally:
        await asyncio.gather(*(c.close() for c in comms))


@pytest.mark.asyncio
async def test_suspend_frees_the_kept_results_and_close_forgets_them() -> None:
    comms = await local_world(2, buffsize=1 << 18)
    try:
        dropped = await _all_reduce(comms, [np.ones(COUNT, np.float32) for _ in comms])
        del dropped
        await asyncio.sleep(0)
        assert all(c.stats()["results_kept_bytes"] == MIN_BYTES for c in comms)
        await asyncio.gather(*(c.suspend() for c in comms))
        for comm in comms:
            stats = comm.stats()
            assert stats["results_kept_bytes"] == 0 and stats["released_bytes"] >= MIN_BYTES, stats
        await asyncio.gather(*(c.resume() for c in comms))
        group = await asyncio.gather(*(c.split(0) for c in comms))  # shares its parent's results
        kept = await _all_reduce(group, [np.ones(COUNT, np.float32) for _ in group])
        assert all(c.stats()["results_kept_bytes"] == MIN_BYTES for c in comms)
        await asyncio.gather(*(g.close() for g in group))
        assert all(c.stats()["results_kept_bytes"] == 0 for c in comms) and np.all(kept[0] == 2)
    finally:
        await asyncio.gather(*(c.close() for c in comms))


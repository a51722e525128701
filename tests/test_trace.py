"""AHCOMM_TRACE timelines: per-rank files, ahcomm-trace merge (strictly valid trace JSON on rank 0's
clock), tracing off costs no objects, and the PNGs of ahcomm-bench --plot and ahcomm-trace plot."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ahcomm
from ahcomm import _clock, _trace
from ahcomm.algorithms import names
from ahcomm.trace import merge, rank_files, summary

ROOT = Path(__file__).resolve().parent.parent
PNG = b"\x89PNG\r\n\x1a\n"
PROGRAM = """
import asyncio, numpy as np, ahcomm
async def main():
    async with await ahcomm.init() as comm:
        for n in (2, 4096, 65536):
            await comm.all_reduce(np.ones(n, np.float32))
        await comm.all_reduce(np.ones(8192, np.float32), algorithm="ring")
asyncio.run(main())
"""


def run(*argv: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if k != "AHCOMM_TRACE"}
    full.update({"AHCOMM_BUFFSIZE": "1", "AHCOMM_EXEC_TIMEOUT": "60", **(env or {})})
    return subprocess.run([sys.executable, *argv], env=full, capture_output=True, text=True, timeout=timeout,
                          check=False, cwd=ROOT)


def check_trace(doc: Any) -> list[dict[str, Any]]:
    """Strict Trace Event Format checks; returns the X events."""
    assert isinstance(doc, dict) and isinstance(doc["traceEvents"], list) and doc["traceEvents"]
    spans = []
    for e in doc["traceEvents"]:
        assert isinstance(e, dict) and e["ph"] in ("X", "M", "s", "f"), e
        assert isinstance(e["name"], str) and e["name"], e
        assert type(e["pid"]) is int and type(e["tid"]) is int, e
        if e["ph"] == "M":
            assert e["name"] in ("process_name", "process_sort_index", "thread_name", "thread_sort_index"), e
            assert isinstance(e["args"], dict) and e["args"], e
            continue
        assert isinstance(e["ts"], (int, float)) and e["ts"] >= 0 and isinstance(e["cat"], str), e
        if e["ph"] == "X":
            assert isinstance(e["dur"], (int, float)) and e["dur"] >= 0 and isinstance(e["args"], dict), e
            spans.append(e)
        else:
            assert type(e["id"]) is int, e
    assert [s["ts"] for s in spans] == sorted(s["ts"] for s in spans), "spans are not sorted"
    return spans


@pytest.mark.multiprocess
def test_four_real_ranks_merge_onto_one_clock(tmp_path: Path) -> None:
    tdir, merged = tmp_path / "trace", tmp_path / "trace.json"
    proc = run("-m", "ahcomm.run", "-n", "4", "python", "-c", PROGRAM, env={"AHCOMM_TRACE": str(tdir)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    files = sorted(tdir.glob("rank*of4.*.json"))
    assert len(files) == 4, files
    proc = run("-m", "ahcomm.trace", "merge", str(tdir), "-o", str(merged))
    assert proc.returncode == 0 and "merged 4 rank files" in proc.stdout, proc.stdout + proc.stderr
    doc = json.loads(merged.read_text())
    spans = check_trace(doc)
    meta = {(e["pid"], e["tid"]): e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name"}
    procs = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "process_name"}
    assert procs == {r: f"rank {r}" for r in range(4)}
    for r in range(4):
        assert {"collectives", "main"} <= {name for (pid, _), name in meta.items() if pid == r}
    ranks = doc["otherData"]["ahcomm_merged"]["ranks"]
    assert all(r["offset_ns"] == 0 for r in ranks), ranks  # one host: one clock
    assert all(abs(r["estimated_offset_ns"]) <= r["rtt_ns"] for r in ranks[1:]), ranks  # NTP's bound
    # one collective span per rank per all_reduce, algorithm named; they overlap once merged
    colls = [s for s in spans if s["cat"] == "collective" and s["args"]["op"] == "all_reduce"]
    by_seq: dict[int, list[dict[str, Any]]] = {}
    for s in colls:
        assert s["args"]["algorithm"] in names("all_reduce") and s["name"] == f"all_reduce #{s['args']['seq']}"
        assert meta[(s["pid"], s["tid"])] == "collectives"
        by_seq.setdefault(s["args"]["seq"], []).append(s)
    assert len(by_seq) == 5 and all(sorted(s["pid"] for s in v) == [0, 1, 2, 3] for v in by_seq.values())
    assert {s["args"]["algorithm"] for s in by_seq[4]} == {"ring"}
    for seq, group in by_seq.items():  # no rank can finish an all_reduce before every rank began it
        assert max(s["ts"] for s in group) <= min(s["ts"] + s["dur"] for s in group) + 200, (seq, group)
    tasks = [s for s in spans if s["cat"] != "collective"]
    assert {"post", "wait", "copy"} <= {s["args"]["kind"] for s in tasks}
    assert any(s["args"].get("bytes", 0) > 0 for s in tasks) and any("peer" in s["args"] for s in tasks)
    assert all(meta[(s["pid"], s["tid"])] != "collectives" for s in tasks)
    assert any(e["ph"] == "s" for e in doc["traceEvents"]), "no post -> wait flows"
    assert "all_reduce [ring]" in summary(doc)


async def test_in_process_one_file_per_communicator(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AHCOMM_TRACE", str(tmp_path))
    comms = await ahcomm.init_inprocess(4, buffsize=1 << 16)
    assert all(_clock.tracer_of(c) is not None for c in comms)
    await asyncio.gather(*(_clock.estimate_offsets(c) for c in comms))  # the init-time protocol, in process
    assert [_clock.tracer_of(c).offset for c in comms] == [0, 0, 0, 0]  # type: ignore[union-attr]
    x = np.arange(5000, dtype=np.float32)
    await asyncio.gather(*(c.all_reduce(x) for c in comms))
    await asyncio.gather(*(c.all_gather(x[:10]) for c in comms))
    await asyncio.gather(*(c.close() for c in comms))
    docs = rank_files([tmp_path])
    assert [d["otherData"]["ahcomm"]["rank"] for d in docs] == [0, 1, 2, 3]
    for d in docs:
        spans = check_trace(d)
        ops = [s["args"]["op"] for s in spans if s["cat"] == "collective"]
        assert ops == ["all_reduce", "all_gather", "barrier"], ops
    check_trace(merge(docs))


async def test_abort_flushes_the_trace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AHCOMM_TRACE", str(tmp_path))
    comms = await ahcomm.init_inprocess(2, buffsize=1 << 16)
    await asyncio.gather(*(c.all_reduce(np.ones(4, np.float32)) for c in comms))
    comms[0].abort("test")
    files = list(tmp_path.glob("rank0of2.*.json"))
    assert len(files) == 1
    spans = [e for e in json.loads(files[0].read_text())["traceEvents"] if e["ph"] == "X"]
    assert any(e["name"].startswith("all_reduce") for e in spans), spans  # what ran before the abort
    await asyncio.gather(*(c.close() for c in comms), return_exceptions=True)


async def test_tracing_off_makes_no_tracer_and_no_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AHCOMM_TRACE", raising=False)
    monkeypatch.chdir(tmp_path)

    def forbidden(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a tracer object was made with tracing off")

    monkeypatch.setattr(_trace.Tracer, "__init__", forbidden)
    monkeypatch.setattr(_trace._Task, "__init__", forbidden)
    comms = await ahcomm.init_inprocess(3, buffsize=1 << 16)
    for c in comms:
        assert _clock.tracer_of(c) is None and "run" not in vars(c._executor)
        assert c._executor.main.tracer is None and "submit" not in vars(c._executor.main)
    x = np.ones(20000, np.float32)
    for algo in ("ring", "mesh", "star"):
        await asyncio.gather(*(c.all_reduce(x, algorithm=algo) for c in comms))
    assert all(s.tracer is None for c in comms for s in c._executor.subs)
    await asyncio.gather(*(c.close() for c in comms))
    assert list(tmp_path.iterdir()) == []


def test_merge_applies_each_rank_offset() -> None:
    """Rank 1's clock runs 5 ms ahead of rank 0's: its spans move back by 5 ms."""
    def doc(rank: int, origin: int, offset: int, ts: float) -> dict[str, Any]:
        span = {"name": "all_reduce #0", "cat": "collective", "ph": "X", "ts": ts, "dur": 10.0, "pid": rank, "tid": 0,
                "args": {"op": "all_reduce", "seq": 0}}
        info = {"rank": rank, "size": 2, "group": "", "pid": 100 + rank, "origin_ns": origin, "offset_ns": offset}
        return {"traceEvents": [span], "otherData": {"ahcomm": info}}

    merged = merge([doc(0, 1_000_000, 0, 100.0), doc(1, 6_000_000, 5_000_000, 100.0)], flows=False)
    spans = check_trace(merged)
    assert [(s["pid"], s["ts"]) for s in spans] == [(0, 0.0), (1, 0.0)]
    merged = merge([doc(0, 1_000_000, 0, 100.0), doc(1, 6_000_000, 4_000_000, 100.0)], flows=False)
    assert [(s["pid"], s["ts"]) for s in check_trace(merged)] == [(0, 0.0), (1, 1000.0)]


def test_bench_plot_writes_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "busbw.png"
    proc = run("-m", "ahcomm.bench", "-n", "2", "all_reduce", "-b", "8", "-e", "1K", "-f", "32", "-w", "1", "-i", "2",
               "--max-seconds", "0.02", "--algorithm", "all", "--plot", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = out.read_bytes()
    assert data.startswith(PNG) and len(data) > 1000


async def test_trace_plot_writes_a_png(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("matplotlib")
    from ahcomm.trace import main

    monkeypatch.setenv("AHCOMM_TRACE", str(tmp_path / "t"))
    comms = await ahcomm.init_inprocess(2, buffsize=1 << 16)
    await asyncio.gather(*(c.all_reduce(np.ones(64, np.float32)) for c in comms))
    await asyncio.gather(*(c.close() for c in comms))
    main(["merge", str(tmp_path / "t"), "-o", str(tmp_path / "m.json")])
    main(["plot", str(tmp_path / "m.json"), "-o", str(tmp_path / "timeline.png")])
    assert (tmp_path / "timeline.png").read_bytes().startswith(PNG)


def test_plot_without_matplotlib_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    from ahcomm import _plot

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(SystemExit, match=r"ahcomm\[plot\]"):
        _plot.require()


def test_tracing_on_some_ranks_only_does_not_stall_init(tmp_path: Path) -> None:
    """Only rank 0 traces: init agrees that not every rank does, skips the clock ping-pongs
    (which the others would never answer) and says so; the job runs as usual."""
    script = tmp_path / "some.py"
    script.write_text(
        "import asyncio, os, time, numpy as np, ahcomm\n"
        "async def main():\n"
        f"    if os.environ['AHCOMM_RANK'] == '0': os.environ['AHCOMM_TRACE'] = {str(tmp_path / 't')!r}\n"
        "    start = time.monotonic()\n"
        "    comm = await ahcomm.init()\n"
        "    took = time.monotonic() - start\n"
        "    got = await comm.all_reduce(np.ones(4))\n"
        "    await comm.close()\n"
        "    print(f'INIT {comm.rank} {took:.2f} {got[0]:g}', flush=True)\n"
        "asyncio.run(main())\n")
    proc = run("-m", "ahcomm.run", "-n", "3", str(script))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    inits = re.findall(r"INIT (\d) ([\d.]+) (\d+)", proc.stdout)  # ranks' lines may interleave
    assert len(inits) == 3 and all(float(took) < 5 and total == "3" for _, took, total in inits), out
    assert "not on every rank" in out, out
    assert len(list((tmp_path / "t").glob("rank0of3.*.json"))) == 1

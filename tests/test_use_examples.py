"""The three 'real use' examples, as real ranks through ahcomm-run, at small sizes."""

from __future__ import annotations

import http.client
import importlib.util
import json
import os
import re
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from jobs import job_argv, run_job

ROOT = Path(__file__).parent.parent
EXAMPLES = ROOT / "examples"
ENV = {**os.environ, "AHCOMM_BUFFSIZE": "1", "PYTHONUNBUFFERED": "1"}

pytestmark = pytest.mark.multiprocess


def launch(n: int, script: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run an example on ``n`` ranks; --tag-output keeps the ranks' lines whole ("[rank] line")."""
    return run_job(n, "python", str(EXAMPLES / script), *args, env=ENV, timeout=timeout)


def rank_lines(text: str, rank: int | None = None) -> list[str]:
    """The lines of ``rank`` (any rank when None), without the "[rank] " prefix."""
    return [m.group(2) for m in re.finditer(r"^\[(\d+)\] (.*)$", text, re.M)
            if rank is None or int(m.group(1)) == rank]


def test_sharded_inference_three_ranks() -> None:
    proc = launch(3, "sharded_inference.py")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    line = rank_lines(proc.stdout, 0)[-1]
    m = re.search(r"tensor-parallel=(\S+) sequence-parallel=(\S+) pipeline\(1 pair\(s\), 4 micro-batches\)=(\S+) "
                  r"decode\(8 layers\)=(\S+) OK$", line)
    assert m and line.startswith("sharded_inference: np=3"), line
    assert all(float(v) < 1e-4 for v in m.groups()), line
    decode = [x for x in rank_lines(proc.stdout, 0) if x.startswith("decode:")]
    assert len(decode) == 1 and "ahcomm " in decode[0] and "gloo" not in decode[0], proc.stdout
    assert float(re.search(r"ahcomm (\S+) ms/token \((\d+) tokens/s", decode[0])[1]) > 0, decode  # type: ignore[index]


DECODE = ("--compare-gloo", "--layers", "3", "--decode-tokens", "8", "--rounds", "1")


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch (the test extra) is not installed")
def test_sharded_inference_decode_against_gloo() -> None:
    proc = launch(2, "sharded_inference.py", *DECODE)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = rank_lines(proc.stdout, 0)
    assert lines[-1].startswith("sharded_inference: np=2") and lines[-1].endswith("OK"), proc.stdout
    decode = [x for x in lines if x.startswith("decode:")]
    m = re.search(r"ahcomm (\S+) ms/token .*; gloo (\S+) ms/token .*; ahcomm/gloo speed (\S+)x$", decode[0])
    assert m and float(m[1]) > 0 and float(m[2]) > 0, decode
    assert abs(float(m[3]) - float(m[2]) / float(m[1])) <= 0.01 * float(m[3]) + 0.01, decode


def test_sharded_inference_without_torch_skips_the_gloo_comparison(tmp_path: Path) -> None:
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text("raise ImportError('no torch here (test)')\n")
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH", "")) if p)
    proc = run_job(2, "python", str(EXAMPLES / "sharded_inference.py"), *DECODE,
                   env={**ENV, "PYTHONPATH": path}, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = rank_lines(proc.stdout, 0)
    assert lines[-1].endswith("OK"), proc.stdout
    decode = [x for x in lines if x.startswith("decode:")]
    assert decode and decode[0].endswith("gloo comparison skipped (torch is not installed on every rank)"), lines


def test_data_parallel_training_matches_single_process() -> None:
    proc = launch(2, "data_parallel_training.py", "--steps", "100", "--bucket-elems", "100")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    line = rank_lines(proc.stdout, 0)[-1]
    m = re.search(r"loss (\S+) -> dp=(\S+) single=(\S+) .* replicas in sync OK$", line)
    assert m and line.startswith("data_parallel_training: np=2") and "buckets=6" in line, line
    initial, dp, single = map(float, m.groups())
    assert abs(dp - single) <= 1e-3 and dp < 0.5 * initial, line


def test_async_service_demo() -> None:
    proc = launch(2, "async_service.py", "--demo", "--port", "0")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert rank_lines(proc.stdout, 0)[-1] == "async_service: 2 replicas stopped OK", proc.stdout
    assert any(line.startswith("demo: totals") and "while the /total requests were pending" in line
               for line in rank_lines(proc.stdout, 0)), proc.stdout


# -- the service, driven from outside ----------------------------------------------------------------
def request(port: int, method: str, path: str, body: Any = None, timeout: float = 15) -> tuple[int, Any, float]:
    start = time.monotonic()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        data = json.dumps(body) if body is not None else None
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        payload = json.loads(resp.read())
        return resp.status, payload, time.monotonic() - start
    finally:
        conn.close()


def test_async_service_three_replicas() -> None:
    """Replicas take free ports (--port 0) and print them; the test reads them from the output."""
    n, window = 3, 0.8  # rank 0's coalescing window: a /total takes at least this long
    proc = subprocess.Popen(job_argv(n, "python", str(EXAMPLES / "async_service.py"), "--port", "0",
                                     "--batch-ms", str(window * 1e3), "--counters", "hits,items",
                                     "--heartbeat", "0.2"),
                            cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    output: list[str] = []
    reader = threading.Thread(target=lambda: output.extend(proc.stdout or []), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 30
        ports: dict[int, int] = {}
        while len(ports) < n:  # "replica R/N listening on http://127.0.0.1:PORT"
            assert time.monotonic() < deadline and proc.poll() is None, "".join(output)
            time.sleep(0.05)
            ports = {int(r): int(p) for r, p in re.findall(r"^\[\d+\] replica (\d+)/\d+ listening on "
                                                           r"http://127.0.0.1:(\d+)$", "".join(output), re.M)}
        port = [ports[r] for r in range(n)]
        for r in range(n):
            assert request(port[r], "GET", "/health")[1] == {"ok": True, "rank": r}
        time.sleep(0.6)  # idle: rank 0 sends keep-alive ticks (every 0.2 s), the replicas answer them

        expected = {"hits": 0, "items": 0}
        jobs = []
        for i in range(30):
            name, by = ("hits", "items")[i % 2], i % 4 + 1
            expected[name] += by
            jobs.append((port[i % n], name, by))
        with ThreadPoolExecutor(max_workers=6) as pool:
            results = list(pool.map(lambda j: request(j[0], "POST", "/incr", {"counter": j[1], "by": j[2]}), jobs))
        assert all(status == 200 for status, _, _ in results), results

        # /total on every replica at once; meanwhile every replica keeps answering /health quickly
        with ThreadPoolExecutor(max_workers=2 * n) as pool:
            started = time.monotonic()
            totals = [pool.submit(request, port[r], "GET", "/total") for r in range(n)]
            time.sleep(0.05)
            health = list(pool.map(lambda p: request(p, "GET", "/health"), port))
            health_done = time.monotonic()
            answers = [f.result() for f in totals]
        assert all(status == 200 and a["totals"] == expected and a["replicas"] == n for status, a, _ in answers), \
            answers
        assert len({a["round"] for _, a, _ in answers}) == 1, "concurrent /total requests share one round"
        assert all(status == 200 for status, _, _ in health)
        assert max(t for _, _, t in health) < 0.25, f"/health latencies {[t for _, _, t in health]}"
        first_total = started + min(t for _, _, t in answers)
        assert health_done < first_total, "the health checks ran while the /total requests were pending"

        # an increment acknowledged on one replica is in the next /total asked of another
        assert request(port[2], "POST", "/incr", {"counter": "hits", "by": 1000})[0] == 200
        expected["hits"] += 1000
        status, answer, _ = request(port[0], "GET", "/total")
        assert status == 200 and answer["totals"] == expected, answer
        assert request(port[0], "POST", "/incr", {"counter": "nope"})[0] == 404
        assert request(port[0], "GET", "/nowhere")[0] == 404

        assert request(port[1], "POST", "/shutdown")[0] == 200
        assert proc.wait(timeout=20) == 0, "".join(output)
        reader.join(5)
        text = "".join(output)
        finals = re.findall(r"^\[\d+\] replica (\d): served \d+ requests, \d+ sync rounds, final totals (.*)$",
                            text, re.M)
        assert sorted(int(r) for r, _ in finals) == list(range(n)), text
        assert all(json.loads(t) == expected for _, t in finals), text
        assert rank_lines(text, 0)[-1] == f"async_service: {n} replicas stopped OK", text
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)

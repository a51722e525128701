"""examples/async_service.py --survive (issue 13): a replica SIGKILLed while it serves requests;
the others shrink and keep serving, ahcomm-run --on-failure restart starts it again, the
survivors grow, it catches up and serves; the totals are exactly the increments acknowledged by
the replicas alive at the end (the dead one's counters died with it)."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict
from typing import Any

import pytest

from jobs import ROOT, job_env

pytestmark = pytest.mark.multiprocess
EXAMPLE = str(ROOT / "examples" / "async_service.py")
N = 3


def request(port: int, method: str, path: str, body: Any = None, timeout: float = 15) -> tuple[int, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, body=json.dumps(body) if body is not None else None)
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


class Job:
    """The service under ahcomm-run, its output read as it comes."""

    def __init__(self) -> None:
        argv = [sys.executable, "-m", "ahcomm.run", "-n", str(N), "--on-failure", "restart", "--max-restarts", "1",
                "--tag-output", "python", EXAMPLE, "--port", "0", "--survive", "--grow-after", "1.5",
                "--heartbeat", "0.2", "--batch-ms", "5", "--counters", "hits,items"]
        self.proc = subprocess.Popen(argv, cwd=ROOT, env=job_env({"PYTHONUNBUFFERED": "1", "AHCOMM_BUFFSIZE": "1"}),
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        self.lines: list[str] = []
        self.reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout or []), daemon=True)
        self.reader.start()

    @property
    def text(self) -> str:
        return "".join(self.lines)

    def wait_for(self, pattern: str, count: int = 1, timeout: float = 60) -> list[tuple[str, ...]]:
        deadline = time.monotonic() + timeout
        while True:
            found = re.findall(pattern, self.text, re.M)
            if len(found) >= count:
                return found
            assert time.monotonic() < deadline and self.proc.poll() is None, self.text
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)


@pytest.mark.parametrize("victim", [1, 0])  # 0: the deciding replica (and the grow's rendezvous host) dies
def test_a_replica_killed_mid_traffic_the_service_goes_on_and_its_restart_rejoins(victim: int) -> None:
    job = Job()
    acked: dict[int, int] = defaultdict(int)  # port -> sum of the increments it acknowledged (200)
    lock = threading.Lock()
    stop = threading.Event()
    ports: list[int] = []
    totals: list[int] = []  # the statuses of /total requests sent to the survivors all along

    def ask_totals(survivors: list[int]) -> None:
        i = 0
        while not stop.is_set():
            status, _ = request(survivors[i % len(survivors)], "GET", "/total", timeout=20)
            totals.append(status)
            i += 1

    def traffic(worker: int) -> None:
        i = worker
        while not stop.is_set():
            port, by = ports[i % len(ports)], i % 7 + 1
            i += 1
            try:
                status, _ = request(port, "POST", "/incr", {"counter": "hits", "by": by}, timeout=5)
            except (OSError, http.client.HTTPException, ValueError):
                continue  # the victim, dead or dying: not acknowledged, not counted
            if status == 200:
                with lock:
                    acked[port] += by

    try:
        found = job.wait_for(r"^\[\d+\] replica (\d+)/\d+ listening on http://127.0.0.1:(\d+)$", N)
        first = {int(r): int(p) for r, p in found}
        ports.extend(first[r] for r in range(N))
        pid = int(job.wait_for(rf"^\[\d+\] replica {victim} pid (\d+)$")[0])
        threads = [threading.Thread(target=traffic, args=(w,), daemon=True) for w in range(4)]
        threads.append(threading.Thread(target=ask_totals, args=([first[r] for r in range(N) if r != victim],),
                                        daemon=True))
        for t in threads:
            t.start()
        time.sleep(1.0)
        os.kill(pid, signal.SIGKILL)  # while it serves requests
        killed = time.monotonic()
        job.wait_for(r"serving on 2 replicas", N - 1)
        shrunk = time.monotonic()
        # the replacement: a new "listening" line for the victim's rank, once it has rejoined
        again = job.wait_for(rf"^\[\d+\] replica {victim}/\d+ listening on http://127.0.0.1:(\d+)$", 2)
        ports.append(int(again[1]))  # traffic now reaches it too (and still the dead port, refused)
        job.wait_for(r"grown back to 3 replicas", N - 1)
        time.sleep(1.0)
        stop.set()
        for t in threads:
            t.join(10)
        assert totals and set(totals) == {200}, totals  # no /total was lost or refused across the failure
        survivors = [first[r] for r in range(N) if r != victim]
        replacement, dead = int(again[1]), first[victim]
        expected = sum(acked[p] for p in [*survivors, replacement])
        assert acked[dead] > 0 and acked[replacement] > 0, dict(acked)  # both sides of the check matter
        print(f"acknowledged: survivors {[acked[p] for p in survivors]}, killed replica {acked[dead]} (lost with "
              f"it), its replacement {acked[replacement]}; expected total {expected} (naive sum of all: "
              f"{sum(acked.values())}); shrink {shrunk - killed:.2f} s after the kill; {len(totals)} /total "
              "requests on the survivors meanwhile, all answered")
        for port in [*survivors, replacement]:
            status, answer = request(port, "GET", "/total")
            assert status == 200 and answer["replicas"] == N and answer["totals"] == {"hits": expected, "items": 0}, \
                (port, answer, expected, dict(acked))
        assert request(replacement, "POST", "/shutdown")[0] == 200
        status = job.proc.wait(timeout=30)
        job.reader.join(5)
        assert status != 0, job.text  # the exit status still says a replica died
        finals = re.findall(r"^\[\d+\] replica (\d): served \d+ requests, \d+ sync rounds, final totals (.*)$",
                            job.text, re.M)
        assert sorted(int(r) for r, _ in finals) == list(range(N)), job.text
        assert all(json.loads(t) == {"hits": expected, "items": 0} for _, t in finals), job.text
    finally:
        stop.set()
        job.stop()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-s", *sys.argv[1:]]))

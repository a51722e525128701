"""Time from a rank's death to the first collective on the survivors' shrunk communicator.

    python benchmarks/elastic.py [--runs 5] [--ranks 4]

Runs tests/mp_elastic.py's ``kill`` case under ``ahcomm-run --on-failure continue`` (rank 2
SIGKILLs itself mid-loop of all_reduce; the survivors catch the PeerFailure, ``shrink()`` and
all_reduce on the new communicator) on sdma and on rdma, and prints, from the victim's
``time.time()`` just before its SIGKILL: when the last survivor caught the failure (detect),
and when the last survivor's first all_reduce on the new communicator completed (total).
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def one(transport: str, ranks: int) -> tuple[float, float]:
    argv = [sys.executable, "-m", "ahcomm.run", "-n", str(ranks), "--on-failure", "continue",
            str(ROOT / "tests" / "mp_elastic.py")]
    env = {**__import__("os").environ, "CASE": "kill", "AHCOMM_TRANSPORT": transport, "AHCOMM_EXEC_TIMEOUT": "30"}
    res = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    killed = re.search(r"KILL (\S+)", res.stdout)
    oks = [dict(re.findall(r"(\w+)=(\S+)", line)) for line in res.stdout.splitlines() if " OK " in line]
    if killed is None or len(oks) != ranks - 1:
        raise SystemExit(f"the job did not go as planned:\n{res.stdout}\n{res.stderr}")
    t0 = float(killed.group(1))
    return (max(float(o["caught"]) for o in oks) - t0, max(float(o["first"]) for o in oks) - t0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--ranks", type=int, default=4)
    args = parser.parse_args()
    print("| transport | detect (median, min-max) | shrink + first all_reduce | total: death -> first all_reduce |")
    print("|---|---|---|---|")
    for transport in ("sdma", "rdma"):
        rows = [one(transport, args.ranks) for _ in range(args.runs)]
        detect, total = [r[0] for r in rows], [r[1] for r in rows]
        rest = [t - d for d, t in rows]

        def ms(xs: list[float]) -> str:
            return f"{statistics.median(xs) * 1000:.0f} ms ({min(xs) * 1000:.0f}-{max(xs) * 1000:.0f})"

        print(f"| {transport} | {ms(detect)} | {ms(rest)} | {ms(total)} |")


if __name__ == "__main__":
    main()

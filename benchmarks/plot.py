"""Draw busbw vs size from benchmark results: benchmarks/compare.py's (one panel per np x op,
one curve per tool: ahcomm, torch gloo, OpenMPI) or one `ahcomm-bench --json` file (one
curve per algorithm). Needs matplotlib (pip install 'ahcomm[plot]').

    python3 benchmarks/plot.py                                   # benchmarks/results/latest.json
    python3 benchmarks/plot.py results.json -o busbw.png
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from ahcomm import _plot


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("results", nargs="?", type=Path, default=ROOT / "benchmarks" / "results" / "latest.json")
    p.add_argument("-o", "--output", type=Path, default=Path("busbw.png"))
    args = p.parse_args()
    doc = json.loads(args.results.read_text())
    if "results" in doc:  # compare.py
        out = _plot.compare(doc, args.output)
    else:  # ahcomm-bench --json
        out = _plot.busbw(doc.get("rows", []), args.output, nranks=int(doc.get("np", 0)))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

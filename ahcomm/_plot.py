"""Pictures (matplotlib, Agg backend; the optional ``plot`` extra): busbw curves and timelines.

* ``busbw``: busbw vs size (log-log) per algorithm from ``ahcomm-bench`` rows, with the
  selector's pick dashed, and peers' curves (gloo, OpenMPI) from ``benchmarks/compare.py``'s
  ``latest.json`` when given;
* ``compare``: one panel per (np, op) of a ``compare.py`` results file, one curve per tool;
* ``timeline``: a merged ``ahcomm-trace`` timeline, one row per rank x track.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

EXTRA = "pip install 'ahcomm[plot]'  (or: pip install 'matplotlib>=3.8')"
TOOLS = {"ahcomm": "ahcomm", "gloo": "torch gloo", "mpi": "OpenMPI"}
COLORS = {"collective": "#9aa7b8", "copy": "#4c9be8", "reduce": "#e8834c", "put": "#2ca02c", "read": "#17becf",
          "post": "#d62728", "wait": "#f2c14e", "call": "#9467bd", "task": "#8c564b"}


def require() -> Any:
    """matplotlib.pyplot on the Agg backend, or SystemExit naming the extra to install."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit(f"plotting needs matplotlib, which is not installed: {EXTRA}") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _size_axis(ax: Axes) -> None:
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ticks = [t for t in (8, 1 << 10, 32 << 10, 1 << 20, 32 << 20, 1 << 30) if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
    if ticks:
        ax.set_xticks(ticks, [_label(t) for t in ticks])
    ax.set_xlabel("size (bytes)")
    ax.set_ylabel("busbw (GB/s)")
    ax.grid(True, which="both", alpha=0.3)


def _label(nbytes: int) -> str:
    for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
        if nbytes >= 1 << shift:
            return f"{nbytes >> shift}{unit}"
    return str(nbytes)


def _curve(ax: Axes, rows: Sequence[dict[str, Any]], label: str, **style: Any) -> None:
    pts = sorted((r["size"], r["busbw"]) for r in rows if r.get("busbw", 0) > 0 and not r.get("wrong"))
    if pts:
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3, label=label, **style)


def busbw(rows: Sequence[dict[str, Any]], out: Path | str, *, nranks: int, peers: dict[str, Any] | None = None,
          title: str | None = None) -> Path:
    """busbw vs size per algorithm (``rows`` from ``ahcomm-bench``); peers' curves from a compare.py file."""
    plt = require()
    fig, ax = plt.subplots(figsize=(8, 5), dpi=100)
    forced: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        forced[r["algorithm"] if r.get("forced") else ""].append(r)
    for name in sorted(n for n in forced if n):
        _curve(ax, forced[name], name)
    if "" in forced:
        _curve(ax, forced[""], "selector's pick", color="black", linestyle="--", linewidth=1.5)
    op = rows[0]["op"] if rows else "?"
    lo, hi = min((r["size"] for r in rows), default=0), max((r["size"] for r in rows), default=0)
    when = f" ({peers.get('date', 'compare.py')})" if peers else ""
    for tool, tool_rows in _peer_rows(peers, op, nranks).items():  # over the sizes ahcomm ran
        _curve(ax, [r for r in tool_rows if lo <= r["size"] <= hi], TOOLS.get(tool, tool) + when, linestyle=":",
               linewidth=2)
    _size_axis(ax)
    ax.set_title(title or f"ahcomm-bench {op}, np={nranks}")
    ax.legend(fontsize=8)
    return _save(fig, out)


def _peer_rows(doc: dict[str, Any] | None, op: str, nranks: int) -> dict[str, list[dict[str, Any]]]:
    """The gloo / OpenMPI rows for ``op`` at ``nranks`` from a compare.py results document."""
    if not doc:
        return {}
    tools = doc.get("results", {}).get(str(nranks), {})
    return {t: [r for r in tools[t].get("rows", []) if r.get("op") == op]
            for t in ("gloo", "mpi") if t in tools}


def compare(doc: dict[str, Any], out: Path | str) -> Path:
    """One panel per (np, op) of a compare.py results document, one curve per tool."""
    plt = require()
    results = doc.get("results", {})
    panels = [(n, op) for n in sorted(results, key=int)
              for op in sorted({r["op"] for t in results[n].values() for r in t.get("rows", [])})]
    if not panels:
        raise SystemExit("no benchmark rows in that file")
    cols = min(4, len(panels))
    nrows = -(-len(panels) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4 * cols, 3.2 * nrows), dpi=90, squeeze=False)
    for ax, (n, op) in zip(axes.flat, panels):
        for tool, label in TOOLS.items():
            _curve(ax, [r for r in results[n].get(tool, {}).get("rows", []) if r["op"] == op], label)
        _size_axis(ax)
        ax.set_title(f"{op}, np={n}", fontsize=10)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.suptitle(f"busbw, {doc.get('date', '')} (benchmarks/compare.py)")
    return _save(fig, out)


def timeline(doc: dict[str, Any], out: Path | str, *, window: tuple[float, float] | None = None,
             title: str | None = None) -> Path:
    """Rows rank x track (collectives, main, sub0, ...); spans coloured by task kind."""
    plt = require()
    from matplotlib.patches import Patch

    events = doc.get("traceEvents", [])
    procs = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    spans = [e for e in events if e.get("ph") == "X"]
    lo, hi = window or (min((e["ts"] for e in spans), default=0.0), max((e["ts"] + e["dur"] for e in spans),
                                                                        default=1.0))
    spans = [e for e in spans if e["ts"] + e["dur"] >= lo and e["ts"] <= hi]
    used = sorted({(e["pid"], e["tid"]) for e in spans})
    row = {key: i for i, key in enumerate(used)}
    fig, ax = plt.subplots(figsize=(12, 0.32 * len(used) + 1.6), dpi=100)
    bars: dict[tuple[int, str], list[tuple[float, float]]] = defaultdict(list)
    for e in spans:
        kind = "collective" if e.get("cat") == "collective" else e.get("args", {}).get("kind", "task")
        kind = kind if kind in COLORS else "task"
        bars[(row[(e["pid"], e["tid"])], kind)].append((e["ts"], max(e["dur"], (hi - lo) / 4000)))
    for (y, kind), xs in bars.items():
        ax.broken_barh(xs, (y - 0.4, 0.8), facecolors=COLORS[kind], linewidth=0)
    for e in spans:  # name the collectives wide enough to hold a label
        a, b = max(e["ts"], lo), min(e["ts"] + e["dur"], hi)
        if e.get("cat") == "collective" and b - a > (hi - lo) / 12:
            ax.text((a + b) / 2, row[(e["pid"], e["tid"])], f"{e['name']} [{e.get('args', {}).get('algorithm', '')}]",
                    ha="center", va="center", fontsize=7, clip_on=True)
    ax.set_yticks(range(len(used)), [f"{procs.get(p, p)}  {threads.get((p, t), t)}" for p, t in used], fontsize=8)
    ax.set_ylim(len(used) - 0.5, -0.5)
    ax.set_xlim(lo, hi)
    ax.set_xlabel("time (us, rank 0's clock)")
    ax.grid(True, axis="x", alpha=0.3)
    kinds = sorted({k for _, k in bars}, key=list(COLORS).index)
    ax.legend(handles=[Patch(color=COLORS[k], label=k) for k in kinds], loc="upper center", ncol=len(kinds),
              fontsize=8, bbox_to_anchor=(0.5, -0.12 if len(used) > 6 else -0.25), frameon=False)
    ax.set_title(title or "ahcomm timeline (AHCOMM_TRACE, merged by ahcomm-trace)", fontsize=10)
    return _save(fig, out)


def _save(fig: Figure, out: Path | str) -> Path:
    path = Path(out)
    fig.tight_layout()
    fig.savefig(path)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path

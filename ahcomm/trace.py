"""ahcomm-trace: merge the per-rank timelines that ``AHCOMM_TRACE=DIR`` writes, and read them.

    ahcomm-trace merge DIR -o trace.json      (every rank on rank 0's clock; open in ui.perfetto.dev)
    ahcomm-trace summary trace.json           (time per collective op and per task kind)
    ahcomm-trace plot trace.json -o timeline.png [--window START:END]   (needs ahcomm[plot])

``merge`` shifts each rank's spans by its clock offset to rank 0 (measured at init), names
each process after its rank, sorts the events, and links every notify post to the wait it
released on the peer with a flow arrow (``--no-flows`` leaves them out).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from ._trace import metadata

Event = dict[str, Any]


def load(path: Path) -> dict[str, Any] | None:
    """A per-rank trace file's document, or None if ``path`` is not one."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or not isinstance(doc.get("otherData", {}).get("ahcomm"), dict):
        return None
    return doc


def rank_files(paths: Sequence[Path]) -> list[dict[str, Any]]:
    """The per-rank documents in ``paths`` (directories are searched for ``*.json``)."""
    files: list[Path] = []
    for p in paths:
        files += sorted(p.glob("*.json")) if p.is_dir() else [p]
    docs = [d for d in (load(f) for f in files) if d is not None]
    return sorted(docs, key=lambda d: _order(d["otherData"]["ahcomm"]))


def _order(info: dict[str, Any]) -> tuple[Any, ...]:
    return (info.get("group") != "", info.get("group", ""), -int(info.get("size", 0)), int(info.get("rank", 0)),
            int(info.get("pid", 0)))


def merge(docs: Sequence[dict[str, Any]], flows: bool = True) -> dict[str, Any]:
    """One trace: each document a process (its index the pid), on rank 0's clock, sorted."""
    if not docs:
        raise ValueError("no ahcomm trace files found")
    infos = [d["otherData"]["ahcomm"] for d in docs]
    shifts = [int(i["origin_ns"]) - int(i.get("offset_ns") or 0) for i in infos]
    base = min(shifts)
    labels = _labels(infos)
    meta: list[Event] = []
    spans: list[Event] = []
    for pid, (doc, _info, shift) in enumerate(zip(docs, infos, shifts)):
        tracks = {e["args"]["name"]: e["tid"] for e in doc["traceEvents"]
                  if e.get("ph") == "M" and e.get("name") == "thread_name"}
        meta += metadata(pid, labels[pid], tracks)
        delta = (shift - base) / 1e3
        for event in doc["traceEvents"]:
            if event.get("ph") == "X":
                spans.append({**event, "pid": pid, "ts": round(event["ts"] + delta, 3)})
    if spans:
        start = min(e["ts"] for e in spans)
        for e in spans:
            e["ts"] = round(e["ts"] - start, 3)
    spans.sort(key=lambda e: (e["ts"], e["pid"], e["tid"]))
    events = meta + spans + (_flows(spans, infos) if flows else [])
    keys = ("rank", "size", "group", "pid", "host", "offset_ns", "estimated_offset_ns", "rtt_ns", "dropped")
    ranks = [{"label": labels[i], **{k: info.get(k) for k in keys}} for i, info in enumerate(infos)]
    unknown = [labels[i] for i, info in enumerate(infos) if info.get("offset_ns") is None and len(infos) > 1]
    return {"traceEvents": events, "displayTimeUnit": "ns",
            "otherData": {"ahcomm_merged": {"ranks": ranks, "offset_unknown": unknown}}}


def _labels(infos: Sequence[dict[str, Any]]) -> list[str]:
    """'rank 0' for a job's one communicator; 'rank 0/4 GROUP' where there are several."""
    several = len({(i.get("group", ""), i.get("size")) for i in infos}) > 1
    labels = [f"rank {i['rank']}" + (f"/{i['size']}" + (f" {i['group']}" if i.get("group") else "")
                                     if several else "") for i in infos]
    seen: dict[str, int] = defaultdict(int)
    for label in labels:
        seen[label] += 1
    return [f"{label} (pid {i.get('pid')})" if seen[label] > 1 else label for label, i in zip(labels, infos)]


def _flows(spans: Sequence[Event], infos: Sequence[dict[str, Any]]) -> list[Event]:
    """Flow arrows from each link post to the wait it released (k-th post to k-th wait per key)."""
    posts: dict[tuple[Any, ...], list[Event]] = defaultdict(list)
    waits: dict[tuple[Any, ...], list[Event]] = defaultdict(list)
    for e in spans:
        args = e.get("args", {})
        if "signal" not in args or "peer" not in args:
            continue
        info = infos[e["pid"]]
        me, peer = int(info["rank"]), int(args["peer"])
        common = (info.get("group", ""), info.get("size"), args["signal"], args.get("index"), args.get("seq"))
        if args.get("kind") == "post":
            posts[(me, peer, *common)].append(e)
        elif args.get("kind") == "wait":
            waits[(peer, me, *common)].append(e)
    out: list[Event] = []
    for key, sent in posts.items():
        for post, wait in zip(sent, waits.get(key, ())):
            fid = len(out) // 2 + 1
            end = max(wait["ts"], round(wait["ts"] + wait["dur"] - 0.001, 3))
            out.append({"name": "notify", "cat": "notify", "ph": "s", "id": fid, "pid": post["pid"],
                        "tid": post["tid"], "ts": post["ts"]})
            out.append({"name": "notify", "cat": "notify", "ph": "f", "bp": "e", "id": fid, "pid": wait["pid"],
                        "tid": wait["tid"], "ts": end})
    return out


def spans_of(doc: dict[str, Any]) -> list[Event]:
    return [e for e in doc.get("traceEvents", []) if e.get("ph") == "X"]


def summary(doc: dict[str, Any]) -> str:
    """Per collective (op, algorithm) and per task kind: count, total and mean time, bytes."""
    coll: dict[tuple[str, str], list[float]] = defaultdict(list)
    tasks: dict[str, list[float]] = defaultdict(list)
    moved: dict[str, int] = defaultdict(int)
    for e in spans_of(doc):
        args = e.get("args", {})
        if e.get("cat") == "collective":
            coll[(args.get("op", "?"), args.get("algorithm", "?"))].append(e["dur"])
        else:
            kind = args.get("kind", e.get("name", "?"))
            tasks[kind].append(e["dur"])
            moved[kind] += int(args.get("bytes", 0))
    lines = [f"{'collective':<28} {'count':>7} {'total ms':>10} {'mean us':>10} {'max us':>10}"]
    for (op, algo), durs in sorted(coll.items()):
        lines.append(f"{op + ' [' + algo + ']':<28} {len(durs):>7} {sum(durs) / 1e3:>10.2f} "
                     f"{sum(durs) / len(durs):>10.1f} {max(durs):>10.1f}")
    lines += ["", f"{'task':<28} {'count':>7} {'total ms':>10} {'mean us':>10} {'MiB':>10}"]
    for kind, durs in sorted(tasks.items(), key=lambda kv: -sum(kv[1])):
        lines.append(f"{kind:<28} {len(durs):>7} {sum(durs) / 1e3:>10.2f} {sum(durs) / len(durs):>10.1f} "
                     f"{moved[kind] / (1 << 20):>10.2f}")
    lines.append("(times summed over ranks and streams; a wait's time is time spent blocked)")
    return "\n".join(lines)


def _window(text: str | None) -> tuple[float, float] | None:
    if not text:
        return None
    start, _, end = text.partition(":")
    return float(start or 0), float(end) if end else float("inf")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ahcomm-trace", description=__doc__.split("\n\n")[0] if __doc__ else None)
    sub = p.add_subparsers(dest="command", required=True)
    m = sub.add_parser("merge", help="merge the per-rank files of AHCOMM_TRACE=DIR into one trace")
    m.add_argument("inputs", nargs="+", type=Path, help="the trace directory (or per-rank files)")
    m.add_argument("-o", "--output", type=Path, default=Path("trace.json"))
    m.add_argument("--no-flows", action="store_true", help="no post -> wait arrows")
    s = sub.add_parser("summary", help="time per collective op and per task kind")
    s.add_argument("trace", type=Path, help="a merged trace, a per-rank file, or a trace directory")
    g = sub.add_parser("plot", help="draw the timeline as a PNG (needs matplotlib: pip install 'ahcomm[plot]')")
    g.add_argument("trace", type=Path, help="a merged trace (or a trace directory: merged first)")
    g.add_argument("-o", "--output", type=Path, default=Path("timeline.png"))
    g.add_argument("--window", default=None, help="START:END in microseconds of the merged timeline")
    g.add_argument("--title", default=None)
    return p


def _read(path: Path) -> dict[str, Any]:
    if path.is_dir():
        return merge(rank_files([path]))
    doc: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return doc


def main(argv: Iterable[str] | None = None) -> None:
    args = parser().parse_args(None if argv is None else list(argv))
    if args.command == "merge":
        docs = rank_files(args.inputs)
        if not docs:
            sys.exit(f"ahcomm-trace: no ahcomm trace files in {', '.join(map(str, args.inputs))}")
        merged = merge(docs, flows=not args.no_flows)
        args.output.write_text(json.dumps(merged, separators=(",", ":")), encoding="utf-8")
        unknown = merged["otherData"]["ahcomm_merged"]["offset_unknown"]
        note = f"; clock offset unknown for {', '.join(unknown)} (taken as 0)" if unknown else ""
        print(f"merged {len(docs)} rank files, {len(merged['traceEvents'])} events -> {args.output}{note}")
    elif args.command == "summary":
        print(summary(_read(args.trace)))
    else:
        from ._plot import timeline

        timeline(_read(args.trace), args.output, window=_window(args.window), title=args.title)
        print(f"wrote {args.output}")


if __name__ == "__main__":
    main()

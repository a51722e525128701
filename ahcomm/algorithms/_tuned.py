"""Picks measured on this host (``ahcomm-bench tune``), consulted before the cost model.

A cost model fitted on one host can order two close algorithms the wrong way on another (on
an Intel host, direct beat oneshot for a 2-rank all_gather at every size the defaults, fitted
on an AMD host, give to oneshot). OpenMPI answers this with its tuned component's rules file
(op, communicator size, message size -> algorithm), NCCL with a tuner plugin. Here a table of
measured picks rides in the calibration file, so rank 0 hands it to every rank with the rest of
the model and every rank picks alike.

A pick applies to a call of the same op on one server with as many ranks, the same kind of
link and the same single-copy ability as where it was measured, whose bytes (``call_bytes``'s
whole) lie within a factor of two of the nearest measured size. Anything else is left to the
cost model.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

SPAN = 2.0  # a measured size stands for calls up to this factor smaller or larger


@dataclass(frozen=True)
class MeasuredPick:
    """The fastest algorithm measured for ``op`` on ``ranks`` ranks of one server at ``nbytes``."""

    op: str
    ranks: int
    link: str  # the kind of every link ("sdma", "rdma", "inproc")
    single_copy: bool  # whether ranks could read each other's memory where it was measured
    nbytes: int  # the call's whole bytes (``cost.call_bytes``), as ahcomm-bench's size column
    algorithm: str
    time_us: float = 0.0  # its median time there (for the record)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "MeasuredPick":
        """The pick in ``data``; ValueError, TypeError, KeyError or OverflowError where it is not one."""
        if not isinstance(data["single_copy"], bool):  # bool("false") would be True
            raise TypeError(f"single_copy must be true or false, got {data['single_copy']!r}")
        return cls(op=str(data["op"]), ranks=int(data["ranks"]), link=str(data["link"]),
                   single_copy=data["single_copy"], nbytes=int(data["nbytes"]),
                   algorithm=str(data["algorithm"]), time_us=float(data.get("time_us", 0.0)))


def parse(rows: object) -> tuple[MeasuredPick, ...]:
    """The picks in a calibration file's ``picks`` list; a malformed entry is left out."""
    picks = []
    for row in rows if isinstance(rows, list) else []:
        try:
            picks.append(MeasuredPick.from_dict(row))
        except (KeyError, TypeError, ValueError, OverflowError):  # OverflowError: int(float("inf"))
            continue
    return tuple(picks)


def nearest(picks: tuple[MeasuredPick, ...], op: str, ranks: int, link: str, single_copy: bool,
            nbytes: float) -> MeasuredPick | None:
    """The pick measured for this kind of call at the size nearest ``nbytes`` (in ratio), if one
    lies within ``SPAN``; ties go to the larger size."""
    if nbytes <= 0:
        return None
    best: MeasuredPick | None = None
    best_gap = math.inf
    for pick in picks:
        if pick.op != op or pick.ranks != ranks or pick.link != link or pick.single_copy != single_copy:
            continue
        gap = abs(math.log2(max(pick.nbytes, 1) / nbytes))
        if gap < best_gap or (gap == best_gap and best is not None and pick.nbytes > best.nbytes):
            best, best_gap = pick, gap
    return best if best is not None and best_gap <= math.log2(SPAN) + 1e-9 else None

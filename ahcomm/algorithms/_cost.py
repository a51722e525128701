"""The alpha-beta cost model that picks an algorithm per call (HCCL's level-1 choice, NCCL's tuning).

Each algorithm estimates its time for a call from a ``CostModel``:

    steps * alpha + link_bytes * beta + reduced_bytes * gamma + copied_bytes * copy

with ``alpha`` (seconds per dependent step: a notify round trip through the event loops)
and ``beta`` (seconds per byte moved) of the slowest link kind the call crosses, ``gamma``
(seconds per byte of reduction) and ``copy`` (seconds per byte of local copy). The numbers
come from a calibration on the host (``ahcomm-bench --calibrate``, cached in a JSON file)
or, without one, from defaults measured on a 2-core x86 host. Rank 0's model is handed to
every rank at init, so every rank computes the same costs and picks the same algorithm.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .base import Call, Topology


@dataclass(frozen=True)
class LinkCost:
    alpha: float  # seconds per dependent step on this link kind
    beta: float  # seconds per byte moved over it


def _default_links() -> dict[str, LinkCost]:
    return {
        "inproc": LinkCost(alpha=25e-6, beta=1 / 5.0e9),
        "sdma": LinkCost(alpha=90e-6, beta=1 / 4.0e9),
        "rdma": LinkCost(alpha=180e-6, beta=1 / 1.2e9),
    }


@dataclass(frozen=True)
class CostModel:
    links: dict[str, LinkCost] = field(default_factory=_default_links)
    gamma: float = 1 / 3.0e9  # seconds per byte reduced (one ufunc pass over two operands)
    copy: float = 1 / 6.0e9  # seconds per byte copied locally
    source: str = "defaults"

    def link(self, topo: Topology) -> LinkCost:
        """The slowest link kind among ``topo``'s links (what a flat algorithm is bound by)."""
        kinds = [k for k in topo.link_kinds if k != "self"]
        if not kinds:
            return self.links.get("inproc", LinkCost(0.0, 0.0))
        costs = [self.links.get(k, self.links["rdma"]) for k in set(kinds)]
        return max(costs, key=lambda c: (c.beta, c.alpha))

    def to_dict(self) -> dict[str, Any]:
        return {"links": {k: asdict(v) for k, v in self.links.items()}, "gamma": self.gamma, "copy": self.copy,
                "source": self.source}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "CostModel":
        links = _default_links()
        for kind, values in dict(data.get("links", {})).items():
            links[str(kind)] = LinkCost(alpha=float(values["alpha"]), beta=float(values["beta"]))
        default = cls()
        return cls(links=links, gamma=float(data.get("gamma", default.gamma)),
                   copy=float(data.get("copy", default.copy)), source=str(data.get("source", "file")))


def cache_path() -> Path:
    """Where the calibration lives: AHCOMM_TUNING_FILE, else ~/.cache/ahcomm/calibration.json."""
    override = os.environ.get("AHCOMM_TUNING_FILE")
    if override:
        return Path(override)
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "ahcomm" / "calibration.json"


def load() -> CostModel:
    """The cached calibration, or the defaults when there is none (or it cannot be read)."""
    path = cache_path()
    try:
        return CostModel.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return CostModel()


def save(model: CostModel) -> Path:
    path = cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(model.to_dict(), indent=1))
    return path


@dataclass(frozen=True)
class Work:
    """What one rank does in a call, in the model's units."""

    rounds: float = 0.0  # dependent steps (notify round trips on the critical path)
    link: float = 0.0  # bytes this rank sends or receives over links (the larger)
    reduced: float = 0.0  # bytes of reduction
    copied: float = 0.0  # bytes copied in memory (staging, reads out of mapped peer buffers)

    def seconds(self, model: CostModel, topo: Topology) -> float:
        link = model.link(topo)
        return (self.rounds * link.alpha + self.link * link.beta + self.reduced * model.gamma
                + self.copied * model.copy)


def log2up(n: int) -> int:
    """ceil(log2 n) for n >= 1."""
    return max(0, (n - 1).bit_length())


def call_bytes(call: Call, n: int) -> tuple[float, float]:
    """(whole bytes, largest per-rank block bytes) of a call.

    Whole: the vector (all_reduce, broadcast, reduce), all blocks together (all_gather,
    reduce_scatter, gather, scatter and their v variants) or, for all_to_all, the larger of
    what this rank sends and receives. Block: the largest block one rank owns.
    """
    item = call.itemsize
    if call.counts is None:
        if call.op in ("all_gather", "reduce_scatter"):
            return float(call.count * item * n), float(call.count * item)
        return float(call.count * item), float(call.count * item / max(1, n))
    if call.op.startswith("all_to_all"):
        recv = call.recv_counts or call.counts
        blocks = max(max(call.counts), max(recv))
        return float(max(sum(call.counts), sum(recv)) * item), float(blocks * item)
    return float(sum(call.counts) * item), float(max(call.counts) * item)

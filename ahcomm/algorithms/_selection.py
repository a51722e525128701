"""Which algorithm runs a call: per-call override, AHCOMM_ALGO, a pick measured on this host
(``ahcomm-bench tune``, ``_tuned``), then the cost model.

AHCOMM_ALGO follows HCCL_ALGO's grammar: ``"level0:NA;level1:ring"`` for every op, or per
op ``"allreduce=level0:NA;level1:ring/allgather=level1:mesh"``. ``NA`` leaves a level to
the default rule. Level 0 applies inside one server, level 1 when ranks span servers; there,
``level1:ring`` or ``level1:rhd`` runs the two-level ``hier`` algorithm with that algorithm
between servers (for the ops it has; others run the named algorithm flat).
"""

from __future__ import annotations

import math

from .._errors import ConfigError, InvalidArgument
from . import hierarchical
from .base import Algorithm, Call, Registry, Topology
from .cost import CostModel

PICKS = 1024  # kinds of call whose pick is remembered

_OP_ALIASES = {op.replace("_", ""): op for op in (
    "all_reduce", "all_gather", "reduce_scatter", "broadcast", "barrier", "reduce", "gather", "scatter",
    "all_to_all", "all_gather_v", "reduce_scatter_v", "gather_v", "scatter_v", "all_to_all_v",
)}


def parse_algo(spec: str) -> dict[str, dict[int, str]]:
    """AHCOMM_ALGO -> {op or "*": {level: algorithm name}} (names lower-case, NA dropped)."""
    table: dict[str, dict[int, str]] = {}
    spec = spec.strip()
    if not spec:
        return table
    for group in spec.split("/"):
        op = "*"
        if "=" in group:
            op_name, group = group.split("=", 1)
            key = op_name.strip().lower().replace("_", "")
            if key not in _OP_ALIASES:
                raise ConfigError(f"AHCOMM_ALGO: unknown op {op_name!r} in {spec!r}")
            op = _OP_ALIASES[key]
        levels = table.setdefault(op, {})
        for item in group.split(";"):
            if not item.strip():
                continue
            level, _, name = item.partition(":")
            level = level.strip().lower()
            if not level.startswith("level") or not level[5:].isdigit() or not name.strip():
                raise ConfigError(f"AHCOMM_ALGO: expected 'levelN:NAME', got {item!r} in {spec!r}")
            if name.strip().upper() != "NA":
                levels[int(level[5:])] = name.strip().lower()
    return table


class Selector:
    """Chooses an algorithm for each call; deterministic, so every rank picks the same one."""

    def __init__(self, registry: Registry, algo_env: str = "", model: CostModel | None = None) -> None:
        self.registry = registry
        self.env = parse_algo(algo_env)
        self.model = model or CostModel()
        # _default's picks: the cost model is evaluated once per kind of call, not per call
        self._picks: dict[tuple[object, ...], Algorithm] = {}
        self._picks_model = self.model

    def costs(self, call: Call, topo: Topology) -> dict[str, float | None]:
        """Estimated seconds of every algorithm that can run ``call`` (None: no estimate)."""
        return {n: a.cost(call, topo, self.model) for n, a in self.registry.algorithms.items()
                if a.select(call, topo)}

    def candidates(self, call: Call, topo: Topology) -> list[str]:
        return [n for n, a in self.registry.algorithms.items() if a.select(call, topo)]

    def choose(self, call: Call, topo: Topology, override: str | None = None) -> Algorithm:
        return self._decide(call, topo, override)[0]

    def basis(self, call: Call, topo: Topology) -> str:
        """What decides ``call``'s algorithm when no per-call one is given: ``"AHCOMM_ALGO"``,
        ``"measured"`` (a pick ``ahcomm-bench tune`` measured here) or ``"cost model"``."""
        if self._decide(call, topo, None)[1]:
            return "AHCOMM_ALGO"
        return "measured" if self._measured(call, topo) is not None else "cost model"

    def _decide(self, call: Call, topo: Topology, override: str | None) -> tuple[Algorithm, bool]:
        """The algorithm for ``call``, and whether a name (``override``, AHCOMM_ALGO) chose it."""
        name = override.lower() if override else self._from_env(call, topo)
        if name in hierarchical.LEVEL1 and not override and topo.servers > 1:
            # HCCL_ALGO's level1 names the algorithm between servers of a two-level collective.
            hier = hierarchical.with_level1(name)
            if hier.select(call, topo):
                return hier, True
        if name is not None and not override and call.op not in self.env:
            # The all-ops form names an algorithm for what it can serve; the rest keep the rule.
            algorithm = self.registry.algorithms.get(name)
            if algorithm is not None and not algorithm.select(call, topo):
                return self._default(call, topo), False
        if name is not None:
            algorithm = self.registry.algorithms.get(name)
            if algorithm is None or not algorithm.select(call, topo):
                where = f"per-call algorithm={name!r}" if override else f"AHCOMM_ALGO's {name!r}"
                what = "is not an algorithm and" if algorithm is None else ""
                can = ", ".join(self.candidates(call, topo)) or "none"
                raise InvalidArgument(
                    f"{where} {what}{' ' if what else ''}cannot run {call.op} on this topology "
                    f"({topo.size} ranks, {topo.servers} server(s)); algorithms that can: {can}"
                )
            return algorithm, True
        return self._default(call, topo), False

    def _from_env(self, call: Call, topo: Topology) -> str | None:
        if not self.env:
            return None
        level = 0 if topo.servers == 1 else 1
        # "alltoall=" also covers all_to_all_v, as HCCL_ALGO's alltoall covers AlltoAllV.
        for key in (call.op, call.op.removesuffix("_v"), "*"):
            name = self.env.get(key, {}).get(level)
            if name is not None:
                return name
        return None

    def _default(self, call: Call, topo: Topology) -> Algorithm:
        """The algorithm measured fastest here, else the cheapest candidate by the cost model;
        without estimates, mesh, ring, then the first
        (remembered per kind of call: a registry that changed, or another model, starts afresh)."""
        key = (call.op, call.dtype, call.count, call.redop, call.root, call.counts, call.recv_counts, topo,
               self.registry.version)
        if self._picks_model is not self.model:
            self._picks_model = self.model
            self._picks.clear()
        pick = self._picks.get(key)
        if pick is not None and self.registry.algorithms.get(pick.name) is pick:  # (one removed since)
            return pick
        if len(self._picks) >= PICKS:
            self._picks.clear()
        pick = self._picks[key] = self._cheapest(call, topo)
        return pick

    def _measured(self, call: Call, topo: Topology) -> Algorithm | None:
        """The algorithm measured fastest here for calls like ``call``, where it can run it."""
        pick = self.model.measured(call, topo)
        algorithm = self.registry.algorithms.get(pick.algorithm) if pick is not None else None
        return algorithm if algorithm is not None and algorithm.select(call, topo) else None

    def _cheapest(self, call: Call, topo: Topology) -> Algorithm:
        measured = self._measured(call, topo)
        if measured is not None:
            return measured
        best: Algorithm | None = None
        best_cost = math.inf
        for algorithm in self.registry.algorithms.values():
            if not algorithm.select(call, topo):
                continue
            cost = algorithm.cost(call, topo, self.model)
            if cost is not None and cost < best_cost:
                best, best_cost = algorithm, cost
        if best is not None:
            return best
        preferred = ("mesh", "ring") if topo.all_mapped else ("ring",)
        named = [self.registry.algorithms[n] for n in preferred if n in self.registry.algorithms]
        for candidate in (*named, *self.registry.algorithms.values()):
            if candidate.select(call, topo):
                return candidate
        raise InvalidArgument(f"no algorithm can run {call.op} here")

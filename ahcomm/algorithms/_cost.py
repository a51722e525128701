"""Old name of ``ahcomm.algorithms.cost``, kept only for ``ahcomm/bench.py`` until it imports the new one."""

from __future__ import annotations

from .cost import HALF_BYTES, MODEL_VERSION, CostModel, LinkCost, Work, cache_path, load, save

__all__ = ["HALF_BYTES", "MODEL_VERSION", "CostModel", "LinkCost", "Work", "cache_path", "load", "save"]

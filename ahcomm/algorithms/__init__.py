"""Collective algorithms: the framework, the registry, selection and the executor."""

from __future__ import annotations

from .base import ALIGN, Algorithm, Call, Context, Registry, Resources, Topology, aligned, pieces, split
from .dissemination import Dissemination
from .mesh import Mesh
from .ring import Ring

REGISTRY = Registry()
REGISTRY.register(Ring())
REGISTRY.register(Mesh())
REGISTRY.register(Dissemination())


def register(algorithm: Algorithm) -> Algorithm:
    """Add (or replace) an algorithm by its ``name``; it becomes selectable per call."""
    return REGISTRY.register(algorithm)


def names(op: str | None = None) -> list[str]:
    """Registered algorithm names that can run ``op`` (all names if ``op`` is None)."""
    return REGISTRY.names(op)


__all__ = [
    "ALIGN", "Algorithm", "Call", "Context", "Registry", "Resources", "Topology", "REGISTRY",
    "aligned", "names", "pieces", "register", "split",
]

"""Collective algorithms: the framework, the registry, selection and the executor."""

from __future__ import annotations

from .base import ALIGN, Algorithm, Call, Context, Registry, Resources, Topology, aligned, pieces, split
from .dissemination import Dissemination
from .hierarchical import Hierarchical
from .mesh import Mesh
from .nb import NB
from .nhr import NHR
from .oneshot import OneShot
from .pairwise import Pairwise
from .rhd import RHD
from .ring import Ring
from .star import Star
from .tree import Tree

REGISTRY = Registry()
REGISTRY.register(Ring())
REGISTRY.register(Mesh())
REGISTRY.register(Dissemination())
REGISTRY.register(NB())
REGISTRY.register(Pairwise())
REGISTRY.register(RHD())
REGISTRY.register(NHR())
REGISTRY.register(Tree())
REGISTRY.register(Star())
REGISTRY.register(Hierarchical())
REGISTRY.register(OneShot())


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

"""Collective algorithms: the kit to write one, the registry, selection and the executor.

Everything a custom algorithm needs is exported here (see docs/algorithms.md and
``ahcomm.testing.check_algorithm``): the call and topology it sees (``Call``, ``Topology``),
what it asks for (``Resources``), what it orchestrates with (``Context``, ``Stream``,
``Signal``; ``Channels``/``Lane`` for point-to-point steps of any size) and what its estimate
is made of (``CostModel``, ``Work``).
"""

from __future__ import annotations

from .._stream import Stream
from ..transports.base import Signal
from .base import ALIGN, Algorithm, Context, OpRun, Registry, aligned, pieces, split
from .call import WHOLE, Call, Resources, Topology
from .channels import Channels, Lane, Senders, channel_run
from .cost import CostModel, LinkCost, Work, call_bytes, engine_tasks, log2up, npieces
from .direct import Direct
from .dissemination import Dissemination
from .eager import Eager
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
from .twoshot import TwoShot

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
REGISTRY.register(TwoShot())
REGISTRY.register(Eager())
REGISTRY.register(Direct())


def register(algorithm: Algorithm) -> Algorithm:
    """Add (or replace) an algorithm by its ``name``; it becomes selectable per call."""
    return REGISTRY.register(algorithm)


def names(op: str | None = None) -> list[str]:
    """Registered algorithm names that can run ``op`` (all names if ``op`` is None)."""
    return REGISTRY.names(op)


__all__ = [
    "ALIGN", "REGISTRY", "WHOLE", "Algorithm", "Call", "Channels", "Context", "CostModel", "Lane", "LinkCost",
    "OpRun", "Registry", "Resources", "Senders", "Signal", "Stream", "Topology", "Work", "aligned", "call_bytes",
    "channel_run", "engine_tasks", "log2up", "names", "npieces", "pieces", "register", "split",
]

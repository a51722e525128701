"""What a collective is (``Call``), where it runs (``Topology``) and what one run needs (``Resources``).

The vocabulary shared by the algorithms, their cost model and the communicator above them.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass, fields
from functools import cached_property

import numpy as np

from .._dtypes import ReduceOp

# Ops the executor runs whole, never sliced: their algorithms move data of any size through
# ``Channels`` (or read peers' memory). All but reduce carry per-rank ``Call.counts``.
WHOLE = frozenset({"reduce", "gather", "scatter", "all_to_all", "all_gather_v", "reduce_scatter_v",
                     "gather_v", "scatter_v", "all_to_all_v"})


_FINGERPRINTS: dict[tuple[object, ...], int] = {}  # fingerprints of recent kinds of call (the f-string is slow)


@dataclass(slots=True)
class Call:
    """One collective as every rank issued it.

    ``count`` is the per-rank block in elements: the whole vector for all_reduce, broadcast
    and reduce, the input of one rank for all_gather, the output of one rank for
    reduce_scatter, one rank's block for gather, scatter and all_to_all.

    ``counts`` (the ops in ``WHOLE`` but reduce) gives every rank's block in elements, the same on
    every rank: what each rank contributes (all_gather_v, gather, gather_v), receives
    (reduce_scatter_v, scatter, scatter_v), or - for all_to_all(_v) - what *this* rank
    sends to each peer; ``recv_counts`` is then what it receives from each. Blocks lie
    in rank order in the flat ``src``/``dst`` (``displs`` gives their offsets). Treat a
    Call as read-only.
    """

    op: str
    seq: int
    dtype: np.dtype
    count: int
    redop: ReduceOp | None = None
    root: int = 0
    counts: tuple[int, ...] | None = None
    recv_counts: tuple[int, ...] | None = None
    group: str = ""  # unused (always ""): a sub-communicator has links of its own domain, so calls never mix
    algorithm: str = ""  # the algorithm that runs it, set once chosen: ranks must agree on it too
    caller: str = ""  # what made the call where the user did not ("close()" for its barrier): for messages
    _fp: int = 0

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def fingerprint(self) -> int:
        """A nonzero 32-bit summary of what every rank must agree on (not ``seq``: it travels
        beside it), computed once per call."""
        fp = self._fp
        if fp == 0:
            # Sizes every rank agrees on: the per-rank counts where the op has them (a rank's own
            # count differs across ranks there), none for all_to_all_v (each rank has its own row).
            sizes = "" if self.op == "all_to_all_v" else self.counts if self.counts is not None else self.count
            memo = (self.op, self.dtype, sizes, self.redop, self.root, self.group, self.algorithm)
            fp = _FINGERPRINTS.get(memo, 0)
            if not fp:
                key = f"{self.op}|{self.dtype.str}{self.dtype.name}|{sizes}|{self.redop and self.redop.value}|" \
                      f"{self.root}|{self.group}|{self.algorithm}"
                fp = zlib.crc32(key.encode()) or 1
                if len(_FINGERPRINTS) >= 4096:
                    _FINGERPRINTS.clear()
                _FINGERPRINTS[memo] = fp
            self._fp = fp
        return fp

    @property
    def empty(self) -> bool:
        """Nothing to move on any rank (all_to_all: nothing from or to this rank)."""
        if self.counts is None:
            return self.count == 0
        return not any(self.counts) and not any(self.recv_counts or ())

    @staticmethod
    def displs(counts: Sequence[int]) -> list[int]:
        """Offsets of blocks laid out back to back: [0, c0, c0+c1, ...] (one more than counts)."""
        out = [0]
        for c in counts:
            out.append(out[-1] + c)
        return out


@dataclass(frozen=True)
class Topology:
    """Where the ranks are and what joins them, as seen from ``rank``."""

    rank: int
    size: int
    hosts: tuple[str, ...]  # host identity of every rank
    link_kinds: tuple[str, ...]  # kind of the link to every rank ("self" for this rank)
    all_mapped: bool = False  # every link maps its peer's CCL buffers (Link.mapped)
    single_copy: bool = False  # every rank can read every peer's memory (agreed at init)
    mailbox: int = 0  # payload bytes of a mailbox slot (``Context.mailbox``); 0: no mailboxes
    # bytes of one eager message every link carries (``DataLink.send_eager``); 0: not every link.
    # Set by ``Comm.__init__`` from its links, not by the code that builds the rest.
    eager: int = 0

    @cached_property
    def servers(self) -> int:
        return len(set(self.hosts))

    @cached_property
    def _hash(self) -> int:
        return hash(tuple(getattr(self, f.name) for f in fields(self)))

    def __hash__(self) -> int:  # part of the selector's key on every call: hashed once, not per call
        return self._hash


@dataclass(frozen=True)
class Resources:
    """What one run of an algorithm needs."""

    substreams: int = 0
    max_count: int | None = None  # elements of ``Call.count`` one run can take; None: any

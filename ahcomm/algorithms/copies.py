"""Copies per byte: how many times each byte a rank receives is copied, and by whom.

Counted per rank, per byte of the result that rank receives from a peer (its own block
copied into its own output counts as the one local copy it is): ``owner`` copies are made
by the rank the byte comes from (staging it in its CCL buffer or mailbox), ``reader``
copies by the receiving rank (out of a mapped buffer, or through the kernel's single-copy
read, ``process_vm_readv``, which is one copy). One host, mapped (sdma/inproc) links; over
rdma every figure adds the wire. ``comm.explain(...).copies`` shows the entry for the
algorithm a call would run.
"""

from __future__ import annotations

from .base import Call, Topology
from .mesh import single_copy

_READ = "process_vm_readv, or mapped where it is ahcomm.alloc memory"
# (algorithm, op, single-copy path?) -> (owner copies, reader copies, how)
_TABLE: dict[tuple[str, str, bool], tuple[int, int, str]] = {
    ("mesh", "all_gather", False): (1, 1, "owner stages its block in CCL_In, every peer copies it out"),
    ("mesh", "all_gather", True): (0, 1, f"every peer reads the owner's user buffer ({_READ})"),
    ("mesh", "broadcast", False): (1, 1, "root stages in CCL_In, every peer copies it out"),
    ("mesh", "broadcast", True): (0, 1, f"every peer reads the root's user buffer ({_READ})"),
    ("mesh", "all_reduce", False): (1, 1, "owner stages, every peer reduces straight out of its CCL_In"),
    ("mesh", "all_reduce", True): (1, 1, "every rank pulls its peers' pieces of its share into cache-sized "
                                         f"scratch ({_READ}: reduced where it lies) and reduces them, then "
                                         "writes each reduced piece into every peer's output while it is in "
                                         "cache (process_vm_writev)"),
    ("oneshot", "all_gather", False): (1, 1, "owner writes its mailbox slot, every peer copies it out"),
    ("oneshot", "broadcast", False): (1, 1, "root writes its mailbox slot, every peer copies it out"),
    ("oneshot", "all_reduce", False): (1, 1, "owner writes its slot, every rank reduces all slots"),
    ("oneshot", "reduce_scatter", False): (1, 1, "owner writes its peers' blocks to its slot (its own stays "
                                                 "out), every rank reduces its block"),
    ("twoshot", "all_reduce", False): (2, 1, "owner writes its peers' shares to its slot (its own stays out), "
                                            "reduces its share of all slots and its input into its output and "
                                            "writes the share to its slot, every peer copies it out"),
    ("direct", "all_gather", True): (0, 1, f"every peer reads the owner's user buffer ({_READ}); "
                                          "addresses and completion through the mailboxes"),
    ("direct", "broadcast", True): (0, 1, f"every peer reads the root's user buffer ({_READ}); where "
                                          "the readers outnumber the cores unevenly, one per core reads a "
                                          "share and writes it into the others' outputs from its cache "
                                          "(process_vm_writev); addresses and completion through the mailboxes"),
    ("direct", "all_gather", False): (1, 1, "no single copy here: oneshot's mailbox slots, slice by slice"),
    ("direct", "broadcast", False): (1, 1, "no single copy here: oneshot's mailbox slots, slice by slice"),
    ("star", "all_gather", False): (1, 1, "owner stages in CCL_In, every rank copies it out"),
    ("star", "broadcast", False): (1, 1, "root stages in CCL_In, every peer copies it out"),
    ("ring", "all_gather", False): (1, 1, "put into the next rank's CCL_In slot, copied out there; n-1 hops"),
    ("ring", "broadcast", False): (1, 1, "put into the next rank's slot, copied out there; relayed along the ring"),
}


def copies(algorithm: str, call: Call, topo: Topology) -> dict[str, object] | None:
    """The copies ``algorithm`` makes per received byte for ``call`` (None where not written down)."""
    sc = (algorithm == "mesh" and single_copy(call, topo)) or (algorithm == "direct" and topo.single_copy)
    entry = _TABLE.get((algorithm, call.op, sc))
    if entry is None:
        return None
    owner, reader, how = entry
    return {"owner": owner, "reader": reader, "total": owner + reader, "single_copy": sc, "how": how}


class Explanation(tuple[str, dict[str, float | None]]):
    """``(algorithm, {candidate: estimated seconds})`` plus ``copies``: the copies per byte of
    the chosen algorithm (see ``copies``), None where not written down; and ``basis``: what chose
    it ("AHCOMM_ALGO", "measured": a pick ``ahcomm-bench tune`` measured on this host, or
    "cost model": the cheapest estimate)."""

    copies: dict[str, object] | None
    basis: str

    def __new__(cls, algorithm: str, costs: dict[str, float | None],
                copies: dict[str, object] | None, basis: str = "cost model") -> "Explanation":
        self = super().__new__(cls, (algorithm, costs))
        self.copies = copies
        self.basis = basis
        return self

    def __repr__(self) -> str:
        algorithm, costs = self
        estimates = ", ".join(f"{name} {'n/a' if t is None else f'{t * 1e6:.1f} us'}" for name, t in costs.items())
        return f"Explanation({algorithm!r} by {self.basis}; estimates: {estimates}; copies: {self.copies})"

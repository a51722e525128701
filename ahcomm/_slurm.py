"""Slurm: the rendezvous of an ``srun`` step, from the step's own variables.

Rank, world size and local rank come from ``SLURM_PROCID``, ``SLURM_NTASKS`` and
``SLURM_LOCALID`` (``_config`` reads them). What Slurm does not give is where rank 0's
rendezvous listens; ``rendezvous(env)`` derives it, the same on every rank, with no call to
``scontrol``:

* the host: the first node of the step's node list (``SLURM_STEP_NODELIST``, else the job's),
  in Slurm's hostlist syntax (``node[01-04,07]``, ``gpu-a[1-2]-ib,login1``); with Slurm's
  block and cyclic distributions task 0 runs there. The name is resolved to an address
  (rank 0 binds it; every rank connects to it).
* the port: a function of the job id and step id in ``PORT_BASE .. PORT_BASE + PORT_SPAN - 1``
  (below Linux's ephemeral range, so outgoing connections do not take it), so two steps of
  one job, or two jobs sharing a node, get different ports.
"""

from __future__ import annotations

import re
import socket
from collections.abc import Mapping

from ._errors import ConfigError

PORT_BASE = 15000
PORT_SPAN = 15000  # ports 15000..29999
_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def _split_top(spec: str) -> list[str]:
    """``spec`` cut at the commas outside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(spec):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ConfigError(f"Slurm host list {spec!r}: ']' without '['")
        elif ch == "," and depth == 0:
            parts.append(spec[start:i])
            start = i + 1
    if depth:
        raise ConfigError(f"Slurm host list {spec!r}: '[' without ']'")
    parts.append(spec[start:])
    return [p.strip() for p in parts if p.strip()]


def _expand_ranges(body: str, spec: str) -> list[str]:
    """``01-04,07`` -> ['01', '02', '03', '04', '07'] (zero padding as written)."""
    out: list[str] = []
    for item in body.split(","):
        match = _RANGE.match(item.strip())
        if match is None:
            raise ConfigError(f"Slurm host list {spec!r}: {item!r} is not a number or a range a-b")
        lo, hi = match.group(1), match.group(2) or match.group(1)
        if int(hi) < int(lo):
            raise ConfigError(f"Slurm host list {spec!r}: range {item!r} runs backwards")
        if int(hi) - int(lo) > 1 << 16:
            raise ConfigError(f"Slurm host list {spec!r}: range {item!r} is too long")
        width = len(lo) if lo.startswith("0") else 0
        out.extend(str(i).zfill(width) for i in range(int(lo), int(hi) + 1))
    return out


def _expand_one(name: str, spec: str) -> list[str]:
    """One host expression, possibly with several bracket groups (their product, in order)."""
    open_at = name.find("[")
    if open_at < 0:
        return [name]
    close_at = name.index("]", open_at)
    head, body, tail = name[:open_at], name[open_at + 1:close_at], name[close_at + 1:]
    return [head + mid + rest for mid in _expand_ranges(body, spec) for rest in _expand_one(tail, spec)]


def expand_hostlist(spec: str) -> list[str]:
    """Slurm's compressed host list as host names, in order: ``node[01-03],login`` ->
    ['node01', 'node02', 'node03', 'login']."""
    hosts = [h for part in _split_top(spec) for h in _expand_one(part, spec)]
    if not hosts:
        raise ConfigError(f"Slurm host list {spec!r} names no host")
    return hosts


def port_for(job_id: int, step_id: int) -> int:
    """The rendezvous port of step ``step_id`` of job ``job_id``."""
    return PORT_BASE + (job_id * 977 + step_id * 131) % PORT_SPAN


def rendezvous(env: Mapping[str, str]) -> tuple[str, int] | None:
    """(address, port) of rank 0's rendezvous for the srun step ``env`` describes; None when
    ``env`` is not a Slurm step (no ``SLURM_JOB_ID`` or no node list)."""
    job = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not job or not nodes:
        return None
    step = env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID") or "0"
    try:
        job_id, step_id = int(job), int(step)
    except ValueError:
        raise ConfigError(f"SLURM_JOB_ID={job!r} / SLURM_STEP_ID={step!r} are not integers") from None
    host = expand_hostlist(nodes)[0]
    try:
        addr = socket.gethostbyname(host)
    except OSError as exc:
        raise ConfigError(f"the first node of the Slurm step, {host!r} (from {nodes!r}), does not resolve: {exc}; "
                          "set AHCOMM_MASTER_ADDR") from None
    return addr, port_for(job_id, step_id)


def expand_tasks_per_node(spec: str) -> list[int]:
    """Slurm's tasks-per-node list: ``2(x3),1`` -> [2, 2, 2, 1]."""
    out: list[int] = []
    for item in spec.split(","):
        match = re.match(r"^\s*(\d+)(?:\(x(\d+)\))?\s*$", item)
        if match is None:
            raise ConfigError(f"Slurm tasks per node {spec!r}: {item!r} is not N or N(xM)")
        out.extend([int(match.group(1))] * int(match.group(2) or 1))
    return out


def local_world_size(env: Mapping[str, str]) -> int | None:
    """Ranks of this step on this node (``SLURM_STEP_TASKS_PER_NODE`` at ``SLURM_NODEID``), or None."""
    spec = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    node = env.get("SLURM_NODEID")
    if not spec or node is None:
        return None
    counts = expand_tasks_per_node(spec)
    try:
        return counts[int(node)]
    except (ValueError, IndexError):
        raise ConfigError(f"SLURM_NODEID={node!r} does not index the tasks per node {spec!r}") from None

"""Which cores a launched rank runs on (``ahcomm-run --bind-to``, AHCOMM_BIND).

``core`` gives each local rank cores of its own out of the launcher's ``n`` allowed cores: ``n
// ranks`` or one more, in order, where the ranks are at most the cores (a rank's copy threads
keep the spare cores the copy-engine and direct rules count on), else the ``i % n``-th core to
rank ``i`` (mpirun's ``--bind-to core``, round robin); ``none`` leaves the scheduler free;
``auto`` (the default) binds where the ranks outnumber the cores and leaves them free elsewhere
(measured at 2 ranks on 2 cores: all_reduce and all_gather level, but a 32/64 MiB direct
broadcast 20-30% slower bound: the reader's two copy threads shared its one core while the
root's idled). A bound rank is told how many cores the host's ranks share (AHCOMM_CORES): its
own affinity may be one core, and the spin, copy-engine and cost-model rules weigh the host's
ranks against the host's cores (``usable_cores``).

Why bind where ranks share cores: measured at 4 ranks on 2 cores (2 MiB twoshot all_reduce,
windows of 20-100 calls), unbound runs fell into stretches of 1.2-3.5 ms a call (the scheduler
moved ranks so that a rank's yield no longer handed its core to the peer it waited for) around
a steady 0.8 ms; bound runs mostly held 0.8-0.9 ms (results/2026-11-26-binding.md).
"""

from __future__ import annotations

import os

from ._errors import ConfigError

MODES = ("auto", "core", "none")
CORES_VAR = "AHCOMM_CORES"


def bind_mode(value: str | None = None) -> str:
    """The binding asked for: ``value`` (a command line's), else AHCOMM_BIND, else ``auto``."""
    raw = (value if value is not None else os.environ.get("AHCOMM_BIND", "")).strip().lower() or "auto"
    if raw not in MODES:
        raise ConfigError(f"AHCOMM_BIND / --bind-to must be one of {', '.join(MODES)}, got {raw!r}")
    return raw


def checked_mode(value: str | None = None) -> str:
    """``bind_mode(value)``, with AHCOMM_CORES checked too: what a launcher asks before it starts
    anything, so that a bad setting is one line there and not a traceback in every rank."""
    cores_from_env()
    return bind_mode(value)


def allowed_cores() -> list[int]:
    """The cores this process may run on, in order (its affinity: a container's cpuset)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return []


def plan(nprocs: int, mode: str, cores: list[int]) -> list[set[int]] | None:
    """One core set per local rank, or None (leave them free): ``core`` gives rank ``i`` the
    ``i``-th of ``nprocs`` near-equal runs of ``cores`` where there are enough cores, else
    ``cores[i % len(cores)]``; ``auto`` binds only where the ranks outnumber the cores; a single
    rank, or a single core, is left as it is."""
    n = len(cores)
    if mode == "none" or nprocs < 2 or n < 2 or (mode == "auto" and nprocs <= n):
        return None
    if nprocs <= n:
        return [set(cores[i * n // nprocs:(i + 1) * n // nprocs]) for i in range(nprocs)]
    return [{cores[i % n]} for i in range(nprocs)]


def rank_cores(env: dict[str, str], ncores: int | None) -> None:
    """Tell bound ranks how many cores the host's ranks share (AHCOMM_CORES = ``ncores``); free
    ranks (``None``) drop an inherited value (a launcher started by a bound rank): their own
    affinity says it."""
    if ncores is None:
        env.pop(CORES_VAR, None)
    else:
        env[CORES_VAR] = str(ncores)


def own_cores() -> int:
    """The cores this process itself may run on (a bound rank's own, not the host's)."""
    return len(allowed_cores()) or 1


def cores_from_env() -> int | None:
    """AHCOMM_CORES: the cores the ranks of this host share (a launcher that binds sets it)."""
    raw = os.environ.get(CORES_VAR, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ConfigError(f"{CORES_VAR} must be a whole number of cores (1 or more), got {raw!r}")
    return value

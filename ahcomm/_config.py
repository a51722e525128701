"""Settings read from the environment (AHCOMM_* first, then torchrun / OpenMPI / PMI / Slurm)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

from ._errors import ConfigError

MiB = 1 << 20

# Each tuple is tried in order; the first variable that is set wins.
_RANK_VARS = ("AHCOMM_RANK", "RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID")
_SIZE_VARS = ("AHCOMM_WORLD_SIZE", "WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS")
_LOCAL_RANK_VARS = ("AHCOMM_LOCAL_RANK", "LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID")
_LOCAL_SIZE_VARS = ("AHCOMM_LOCAL_WORLD_SIZE", "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS")
_ADDR_VARS = ("AHCOMM_MASTER_ADDR", "MASTER_ADDR")
_PORT_VARS = ("AHCOMM_MASTER_PORT", "MASTER_PORT")


def _first(env: Mapping[str, str], names: tuple[str, ...]) -> tuple[str, str] | None:
    for name in names:
        value = env.get(name)
        if value not in (None, ""):
            return name, value  # type: ignore[return-value]
    return None


def _int(env: Mapping[str, str], names: tuple[str, ...], default: int | None) -> int | None:
    found = _first(env, names)
    if found is None:
        return default
    name, value = found
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{name}={value!r} is not an integer") from None


def _float(env: Mapping[str, str], name: str, default: float) -> float:
    value = env.get(name)
    if value in (None, ""):
        return default
    try:
        out = float(value)  # type: ignore[arg-type]
    except ValueError:
        raise ConfigError(f"{name}={value!r} is not a number") from None
    if out <= 0:
        raise ConfigError(f"{name}={value!r} must be positive")
    return out


@dataclass(frozen=True)
class Config:
    """Everything a communicator needs to know before it starts."""

    rank: int | None = None
    world_size: int | None = None
    local_rank: int | None = None
    local_world_size: int | None = None
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    buffsize: int = 64 * MiB  # bytes of CCL_In and of CCL_Out each (AHCOMM_BUFFSIZE, in MB)
    transport: str = "auto"  # auto | sdma | rdma
    algo: str = ""  # AHCOMM_ALGO override, parsed by the algorithm registry
    connect_timeout: float = 120.0
    exec_timeout: float = 1800.0
    if_ip: str | None = None  # address this rank's tcp endpoint binds to
    server_id: str | None = None  # host identity override
    single_copy: bool = True  # AHCOMM_SINGLE_COPY=0 turns off reads of peers' memory

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "Config":
        env = os.environ if env is None else env
        buff_mb = _float(env, "AHCOMM_BUFFSIZE", 64.0)
        transport = env.get("AHCOMM_TRANSPORT", "auto").strip().lower() or "auto"
        if transport not in ("auto", "sdma", "rdma"):
            raise ConfigError(f"AHCOMM_TRANSPORT={transport!r}: expected auto, sdma or rdma")
        addr = _first(env, _ADDR_VARS)
        return cls(
            rank=_int(env, _RANK_VARS, None),
            world_size=_int(env, _SIZE_VARS, None),
            local_rank=_int(env, _LOCAL_RANK_VARS, None),
            local_world_size=_int(env, _LOCAL_SIZE_VARS, None),
            master_addr=addr[1] if addr else "127.0.0.1",
            master_port=_int(env, _PORT_VARS, None),
            buffsize=max(1024, int(buff_mb * MiB)),
            transport=transport,
            algo=env.get("AHCOMM_ALGO", "").strip(),
            connect_timeout=_float(env, "AHCOMM_CONNECT_TIMEOUT", 120.0),
            exec_timeout=_float(env, "AHCOMM_EXEC_TIMEOUT", 1800.0),
            if_ip=env.get("AHCOMM_IF_IP") or None,
            server_id=env.get("AHCOMM_SERVER_ID") or None,
            single_copy=env.get("AHCOMM_SINGLE_COPY", "1").strip().lower() not in ("0", "false", "no", "off"),
        )

"""Settings read from the environment (AHCOMM_* first, then torchrun / OpenMPI / PMI / Slurm)."""

from __future__ import annotations

import difflib
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from . import _slurm
from ._binding import allowed_cores, cores_from_env
from ._errors import ConfigError
from ._torchrun import agent_store

MiB = 1 << 20
MIN_SECRET = 16  # characters of AHCOMM_JOB_SECRET
# Every AHCOMM_* variable ahcomm reads (tests/test_docs.py checks the list against the code), and
# the two its own test and benchmark tools read. Any other is named in a warning at init: a
# misspelt one was ignored without a word.
KNOWN_VARS = frozenset({
    "AHCOMM_ALGO", "AHCOMM_BIND", "AHCOMM_BUFFSIZE", "AHCOMM_CONNECT_TIMEOUT", "AHCOMM_COPY_ENGINE",
    "AHCOMM_CORES", "AHCOMM_DIRECT_THREADS", "AHCOMM_ENCRYPT", "AHCOMM_EXEC_TIMEOUT", "AHCOMM_FLIGHT_DIR",
    "AHCOMM_FLIGHT_ENTRIES", "AHCOMM_HEARTBEAT", "AHCOMM_IF_IP", "AHCOMM_INSECURE", "AHCOMM_JOB_SECRET",
    "AHCOMM_LOCAL_RANK", "AHCOMM_LOCAL_WORLD_SIZE", "AHCOMM_MAILBOX_BYTES", "AHCOMM_MASTER_ADDR",
    "AHCOMM_MASTER_PORT", "AHCOMM_MAX_MESSAGE", "AHCOMM_NT_STORES", "AHCOMM_RANK", "AHCOMM_RESTART_COUNT",
    "AHCOMM_RESULT_CACHE_MB", "AHCOMM_RSH", "AHCOMM_SERVER_ID", "AHCOMM_SHM_NOTIFY", "AHCOMM_SINGLE_COPY",
    "AHCOMM_SOCKET_IFNAME", "AHCOMM_SPIN_US", "AHCOMM_TRACE", "AHCOMM_TRANSPORT", "AHCOMM_TUNING_FILE",
    "AHCOMM_WORLD_SIZE", "AHCOMM_YIELD_US",
    "AHCOMM_BENCH_LOOP", "AHCOMM_SIM_SCALE",  # benchmarks/latency.py's event loop; tests/test_sim.py's big runs
})
_warned: set[str] = set()
log = logging.getLogger("ahcomm.config")


def warn_unknown(env: Mapping[str, str]) -> list[str]:
    """Name, once per process each, the AHCOMM_* variables in ``env`` that ahcomm does not read
    (with the known one closest to it); the names warned about now."""
    named = []
    for name in sorted(env):
        if name.startswith("AHCOMM_") and name not in KNOWN_VARS and name not in _warned:
            _warned.add(name)
            named.append(name)
            close = difflib.get_close_matches(name, KNOWN_VARS, n=1)
            log.warning("%s is not a variable ahcomm reads%s: it has no effect", name,
                        f" (did you mean {close[0]}?)" if close else "")
    return named


def result_cache_bytes(env: Mapping[str, str] | None = None) -> int:
    """AHCOMM_RESULT_CACHE_MB (default 256; 0 keeps nothing) in bytes: what ``_outputs.Results``
    keeps of dropped results to hand out again."""
    return int(_float(os.environ if env is None else env, "AHCOMM_RESULT_CACHE_MB", 256.0, allow_zero=True,
                      high=1 << 20) * MiB)


def usable_cores() -> int:
    """The cores this host's ranks share: AHCOMM_CORES where a launcher that binds each rank to
    a core says so, else the cores this process may run on (its affinity: a container's cpuset,
    not the host's count)."""
    told = cores_from_env()
    return told if told is not None else len(allowed_cores()) or os.cpu_count() or 1

def last_level_cache(root: str = "/sys/devices/system/cpu/cpu0/cache") -> int:
    """Bytes of the last-level cache of this host's first CPU (sysfs: the highest ``level`` of
    ``index*``, its ``size`` such as ``32768K``); 0 where Linux does not say."""
    best_level, size = 0, 0
    try:
        entries = sorted(os.listdir(root))
    except OSError:
        return 0
    for entry in entries:
        if not entry.startswith("index"):
            continue
        try:
            with open(os.path.join(root, entry, "level")) as f:
                level = int(f.read().strip())
            with open(os.path.join(root, entry, "size")) as f:
                text = f.read().strip().upper()
        except (OSError, ValueError):
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if level >= best_level and digits.isdigit():
            best_level, size = level, int(digits) * scale
    return size


def copy_engine_mode(env: Mapping[str, str] | None = None) -> str:
    """AHCOMM_COPY_ENGINE: ``auto`` (the default), ``on`` or ``off``."""
    env = os.environ if env is None else env
    mode = env.get("AHCOMM_COPY_ENGINE", "auto").strip().lower() or "auto"
    if mode not in ("auto", "on", "off"):
        raise ConfigError(f"AHCOMM_COPY_ENGINE must be auto, on or off, got {mode!r}")
    return mode

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


def _float(env: Mapping[str, str], name: str, default: float, *, low: float = 0.0, high: float | None = None,
           allow_zero: bool = False) -> float:
    """A number from ``env``: positive (or 0 where ``allow_zero``), at most ``high``."""
    value = env.get(name)
    if value in (None, ""):
        return default
    try:
        out = float(value)  # type: ignore[arg-type]
    except ValueError:
        raise ConfigError(f"{name}={value!r} is not a number") from None
    if out != out or out < low or (out == 0 and not allow_zero) or (high is not None and out > high):  # NaN too
        if allow_zero:
            limits = f"between 0 (off) and {high:g}" if high is not None else "0 or more"
        else:
            limits = f"positive, at most {high:g}" if high is not None else "positive"
        raise ConfigError(f"{name}={value!r} must be {limits}")
    return out


def _flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    value = env.get(name, "").strip().lower()
    if not value:
        return default
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{name}={value!r}: expected 1 or 0")


_SUFFIX = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "m": 1 << 20, "mb": 1 << 20, "g": 1 << 30, "gb": 1 << 30}
MAX_MESSAGE_LIMIT = 0xFFFFFFFF  # the link header's byte count field


def _bytes(env: Mapping[str, str], name: str, default: int) -> int:
    """A byte count: 1048576, 64K, 512M, 2G."""
    value = env.get(name, "").strip().lower()
    if not value:
        return default
    number = value.rstrip("kmgb")
    try:
        out = int(float(number) * _SUFFIX[value[len(number):]])
    except (KeyError, ValueError):
        raise ConfigError(f"{name}={value!r} is not a byte count (e.g. 1048576, 64K, 512M, 2G)") from None
    if not 0 < out <= MAX_MESSAGE_LIMIT:
        raise ConfigError(f"{name}={value!r} must be between 1 byte and 4 GiB - 1")
    return out


_WILDCARDS = ("0.0.0.0", "*", "::", "[::]", "")


def _address(env: Mapping[str, str], name: str, value: str | None) -> str | None:
    """An address to bind: one interface's, never a wildcard."""
    if value is not None and value.strip() in _WILDCARDS:
        raise ConfigError(f"{name}={value!r}: ahcomm binds one interface's address only, never a wildcard; "
                          "name the address of the interface the ranks should use")
    return value


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
    socket_ifname: str | None = None  # AHCOMM_SOCKET_IFNAME: interfaces to pick it from (NCCL's grammar)
    server_id: str | None = None  # host identity override
    single_copy: bool = True  # AHCOMM_SINGLE_COPY=0 turns off reads of peers' memory
    job_secret: str | None = field(default=None, repr=False)  # AHCOMM_JOB_SECRET: authenticates every connection
    insecure: bool = False  # AHCOMM_INSECURE=1: a job without a secret runs unauthenticated
    encrypt: bool = False  # AHCOMM_ENCRYPT=1: CURVE (encrypted) instead of PLAIN authentication
    heartbeat: float = 1.0  # AHCOMM_HEARTBEAT: seconds between ZMTP heartbeats (0 = off); lost after 3 silent
    max_message: int = 1 << 30  # AHCOMM_MAX_MESSAGE: bytes of one point-to-point message
    torch_store: bool = False  # under torchrun (no AHCOMM_MASTER_PORT): MASTER_PORT is torchrun's store

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "Config":
        env = os.environ if env is None else env
        warn_unknown(env)
        buff_mb = _float(env, "AHCOMM_BUFFSIZE", 64.0)
        _flag(env, "AHCOMM_NT_STORES", True)  # read by _memcopy at the first large call: named here, at init
        _flag(env, "AHCOMM_SHM_NOTIFY", True)  # read by the link endpoint (transports._notify_ring.usable)
        result_cache_bytes(env)  # read by _outputs.Results
        for waiting in ("AHCOMM_SPIN_US", "AHCOMM_YIELD_US"):  # read by transports.mailbox where it applies
            _float(env, waiting, 0.0, allow_zero=True)
        transport = env.get("AHCOMM_TRANSPORT", "auto").strip().lower() or "auto"
        if transport not in ("auto", "sdma", "rdma"):
            raise ConfigError(f"AHCOMM_TRANSPORT={transport!r}: expected auto, sdma or rdma")
        copy_engine_mode(env)  # read by the streams (_stream.engine_bytes_for); checked here, early
        addr = _first(env, _ADDR_VARS)
        if addr is not None:
            _address(env, addr[0], addr[1])
        port = _int(env, _PORT_VARS, None)
        # Under srun with neither set: rank 0's node and a port derived from the job and step ids.
        slurm = _slurm.rendezvous(env) if addr is None and port is None else None
        local_size = _int(env, _LOCAL_SIZE_VARS, None)
        if local_size is None:
            local_size = _slurm.local_world_size(env)
        return cls(
            rank=_int(env, _RANK_VARS, None),
            world_size=_int(env, _SIZE_VARS, None),
            local_rank=_int(env, _LOCAL_RANK_VARS, None),
            local_world_size=local_size,
            master_addr=addr[1] if addr else slurm[0] if slurm else "127.0.0.1",
            master_port=port if slurm is None else slurm[1],
            buffsize=max(1024, int(buff_mb * MiB)),
            transport=transport,
            algo=env.get("AHCOMM_ALGO", "").strip(),
            connect_timeout=_float(env, "AHCOMM_CONNECT_TIMEOUT", 120.0),
            exec_timeout=_float(env, "AHCOMM_EXEC_TIMEOUT", 1800.0),
            if_ip=_address(env, "AHCOMM_IF_IP", env.get("AHCOMM_IF_IP") or None),
            socket_ifname=env.get("AHCOMM_SOCKET_IFNAME") or None,
            server_id=env.get("AHCOMM_SERVER_ID") or None,
            single_copy=_flag(env, "AHCOMM_SINGLE_COPY", True),
            job_secret=env.get("AHCOMM_JOB_SECRET") or None,
            insecure=_flag(env, "AHCOMM_INSECURE", False),
            encrypt=_flag(env, "AHCOMM_ENCRYPT", False),
            heartbeat=_float(env, "AHCOMM_HEARTBEAT", 1.0, high=3600, allow_zero=True),
            max_message=_bytes(env, "AHCOMM_MAX_MESSAGE", 1 << 30),
            torch_store=agent_store(env) and not env.get("AHCOMM_MASTER_PORT"),
        )

    def check_security(self, size: int) -> None:
        """The rule for a job of ``size`` ranks: a secret (at least MIN_SECRET characters), or an
        explicit AHCOMM_INSECURE=1. Raises ConfigError telling how to fix it."""
        if size <= 1:
            return
        if self.job_secret is None:
            if self.insecure:
                return
            raise ConfigError(
                "no job secret: every connection of a job is authenticated with AHCOMM_JOB_SECRET, which "
                "ahcomm-run sets for its ranks. Under torchrun, mpirun or srun, export the same secret to every "
                "rank, e.g. export AHCOMM_JOB_SECRET=$(python3 -c 'import secrets; print(secrets.token_hex(32))') "
                "before launching (or set AHCOMM_INSECURE=1 to run unauthenticated on a trusted network)")
        if len(self.job_secret) < MIN_SECRET:
            raise ConfigError(f"AHCOMM_JOB_SECRET is {len(self.job_secret)} characters long; use at least "
                              f"{MIN_SECRET} (e.g. python3 -c 'import secrets; print(secrets.token_hex(32))')")

"""Two more ways to describe a job: root info (HcclGetRootInfo) and an HCCL rank table.

Root info: the root calls ``get_root_info()`` and hands the token to every rank by any means
(a file, a key-value store, an RPC); each rank calls ``init(root_info=token, rank=r,
world_size=n)``. The token carries the rendezvous address and port and the job secret, so
treat it as a credential.

Rank table: HCCL's JSON (``server_list`` -> ``device`` -> ``rank_id``), one entry per server
with its address (``host_ip``, else ``server_id``): ``init(rank_table="ranks.json", rank=r)``.
The rendezvous runs on rank 0's server at ``master_port`` (the argument, a ``master_port``
key of the table, or AHCOMM_MASTER_PORT).
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import secrets
import socket
from typing import Any

import msgpack

from ._config import Config
from ._errors import ConfigError

PREFIX = "ahcomm-root-1:"


def _primary_address() -> str:
    """This host's address on its default route (no packet is sent), else loopback."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("10.255.255.255", 9))
            return str(probe.getsockname()[0])
        except OSError:
            return "127.0.0.1"


def get_root_info(addr: str | None = None, port: int | None = None) -> str:
    """A token for ``init(root_info=...)``: where the root's rendezvous will listen, and the secret.

    ``addr`` defaults to AHCOMM_IF_IP, else this host's primary address; ``port`` to a free one;
    the secret to AHCOMM_JOB_SECRET, else a new one.
    """
    addr = addr or os.environ.get("AHCOMM_IF_IP") or _primary_address()
    if port is None:
        port = free_port(addr)
    secret = os.environ.get("AHCOMM_JOB_SECRET") or secrets.token_hex(32)
    packed = msgpack.packb([addr, int(port), secret])
    return PREFIX + base64.urlsafe_b64encode(packed).decode()


def config_from_root_info(token: str, base: Config) -> Config:
    """``base`` with the rendezvous address, port and secret of a root-info token."""
    if not isinstance(token, str) or not token.startswith(PREFIX):
        raise ConfigError(f"root_info is not a token from ahcomm.get_root_info() (expected '{PREFIX}...')")
    try:
        addr, port, secret = msgpack.unpackb(base64.urlsafe_b64decode(token[len(PREFIX):]), max_str_len=4096)
        return dataclasses.replace(base, master_addr=str(addr), master_port=int(port), job_secret=str(secret),
                                   torch_store=False)
    except Exception as exc:  # noqa: BLE001 - any malformed token
        raise ConfigError(f"root_info token is damaged: {exc}") from None


def config_from_rank_table(path: str, rank: int, base: Config, master_port: int | None = None) -> Config:
    """``base`` for ``rank`` of the job an HCCL rank table describes."""
    try:
        with open(path) as f:
            table: Any = json.load(f)
        servers = table["server_list"]
        entries = [(server, int(device["rank_id"]), local)
                   for server in servers for local, device in enumerate(server["device"])]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"rank table {path}: not an HCCL rank table ({exc!r}); expected "
                          "server_list[].device[].rank_id") from None
    ranks = sorted(r for _, r, _ in entries)
    if ranks != list(range(len(ranks))):
        raise ConfigError(f"rank table {path}: rank_ids must be 0..{len(ranks) - 1} once each, got {ranks}")
    by_rank = {r: (server, local) for server, r, local in entries}
    if rank not in by_rank:
        raise ConfigError(f"rank table {path}: rank {rank} is not in the table (ranks 0..{len(ranks) - 1})")
    server, local = by_rank[rank]
    root_server = by_rank[0][0]
    port = master_port or table.get("master_port") or base.master_port
    if port is None:
        raise ConfigError(f"rank table {path}: no rendezvous port: pass master_port=, add a 'master_port' key "
                          f"to the table, or set AHCOMM_MASTER_PORT")

    def address(s: dict[str, Any]) -> str:
        return str(s.get("host_ip") or s["server_id"])

    return dataclasses.replace(
        base, rank=rank, world_size=len(ranks), local_rank=local, local_world_size=len(server["device"]),
        master_addr=address(root_server), master_port=int(port), server_id=str(server["server_id"]),
        if_ip=address(server), torch_store=False)


def free_port(addr: str = "127.0.0.1") -> int:
    """A port nothing is bound to on ``addr``, for a rendezvous that rank 0 binds soon after:
    one below the kernel's ephemeral range where one is free. A port from that range (what
    binding port 0 gives) can be taken before rank 0 binds it, as the source port of any
    outgoing connection on the host; a CI run saw rank 0 fail with "Address already in use"
    after a test's other jobs had connected. Else one the kernel picks."""
    low = _ephemeral_low()
    for port in secrets.SystemRandom().sample(range(max(1024, low - 8192), low), 32) if low > 1024 + 32 else ():
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((addr, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((addr, 0))
        return int(s.getsockname()[1])


def _ephemeral_low(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> int:
    """The lowest port the kernel hands out for outgoing connections (Linux; 32768 elsewhere)."""
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768

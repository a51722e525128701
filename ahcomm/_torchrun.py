"""Under torchrun: the rendezvous port goes through torchrun's own store.

torchrun's agent serves its TCPStore on MASTER_ADDR:MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE=True),
so rank 0 cannot serve ahcomm's rendezvous there. Instead rank 0 binds a free port on MASTER_ADDR
and publishes it in that store under a key of this run, restart and init; the other ranks read it.
torch is imported here only, and only under torchrun; nothing but AHCOMM_JOB_SECRET is needed.
"""

from __future__ import annotations

import asyncio
import datetime
import importlib
import itertools
import os
from collections.abc import Mapping
from typing import Any

from ._errors import ConfigError, ConnectError

_inits = itertools.count()  # every rank calls init() the same number of times: one key per call


def agent_store(env: Mapping[str, str]) -> bool:
    """Whether this process is a torchrun worker whose MASTER_PORT is the agent's store."""
    return bool(env.get("TORCHELASTIC_RUN_ID")) and env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"


class StorePort:
    """The rendezvous port of one init(), published by rank 0 in torchrun's store."""

    def __init__(self, addr: str, port: int, timeout: float, env: Mapping[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        self.addr, self.port, self.timeout = addr, port, timeout
        self.key = (f"ahcomm/{env.get('TORCHELASTIC_RUN_ID', '')}/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
                    f"{next(_inits)}/rendezvous_port")

    def _store(self) -> Any:
        try:
            tcp_store: Any = importlib.import_module("torch.distributed").TCPStore
        except (ImportError, AttributeError) as exc:
            raise ConfigError(f"under torchrun ahcomm finds its rendezvous through torchrun's store, which needs "
                              f"torch.distributed ({exc}); or set AHCOMM_MASTER_PORT to a free port") from None
        return tcp_store(self.addr, self.port, is_master=False, timeout=datetime.timedelta(seconds=self.timeout))

    def _set(self, port: int) -> None:
        self._store().set(self.key, str(port))

    def _get(self) -> int:
        return int(self._store().get(self.key))

    async def publish(self, port: int) -> None:
        """Rank 0: tell the others where its rendezvous listens."""
        await self._call(self._set, port)

    async def fetch(self, rank: int) -> int:
        """Every other rank: where rank 0's rendezvous listens (waits for rank 0 to publish it)."""
        try:
            return int(await self._call(self._get))
        except ConnectError as exc:
            raise ConnectError(f"rank {rank}: {exc} (is rank 0 running? AHCOMM_CONNECT_TIMEOUT)") from None

    async def _call(self, fn: Any, *args: Any) -> Any:
        try:
            return await asyncio.to_thread(fn, *args)
        except ConfigError:
            raise
        except Exception as exc:  # noqa: BLE001 - torch's store errors (DistStoreError, RuntimeError)
            raise ConnectError(f"torchrun's store at {self.addr}:{self.port} gave no rendezvous port "
                               f"({self.key}) within {self.timeout:g} s: {str(exc).splitlines()[0][:200]}") from None

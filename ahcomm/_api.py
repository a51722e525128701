"""The hcomm-style module API on a default communicator."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from ._bootstrap import create
from ._comm import Comm
from ._config import Config
from ._dtypes import ReduceOp
from ._errors import CommClosedError

_default: Comm | None = None


async def init(*, rank: int | None = None, world_size: int | None = None, master_addr: str | None = None,
               master_port: int | None = None, config: Config | None = None) -> Comm:
    """Create a communicator for this process's job and make it the default one.

    Rank, world size and the rendezvous address come from the launcher's environment
    (ahcomm-run, torchrun, OpenMPI, PMI, Slurm); explicit arguments win.
    """
    global _default
    _default = await create(config, rank=rank, world_size=world_size, master_addr=master_addr,
                            master_port=master_port)
    return _default


def default_comm() -> Comm:
    """The communicator made by the last ``init()``."""
    if _default is None or _default.closed:
        raise CommClosedError("no default communicator: call `await ahcomm.init()` first")
    return _default


def get_rank() -> int:
    return default_comm().rank


def get_world_size() -> int:
    return default_comm().size


def all_reduce(x: Any, op: ReduceOp | str = "sum", **kw: Any) -> "asyncio.Future[np.ndarray]":
    return default_comm().all_reduce(x, op, **kw)


def all_gather(x: Any, **kw: Any) -> "asyncio.Future[np.ndarray]":
    return default_comm().all_gather(x, **kw)


def reduce_scatter(x: Any, op: ReduceOp | str = "sum", **kw: Any) -> "asyncio.Future[np.ndarray]":
    return default_comm().reduce_scatter(x, op, **kw)


def broadcast(x: Any, root: int = 0, **kw: Any) -> "asyncio.Future[np.ndarray]":
    return default_comm().broadcast(x, root, **kw)


def barrier() -> "asyncio.Future[None]":
    return default_comm().barrier()


async def finalize() -> None:
    """Close the default communicator."""
    if _default is not None:
        await _default.close()

"""The hcomm-style module API on a default communicator."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import numpy as np

from ._bootstrap import create
from ._collectives import Gathered
from ._comm import Comm
from ._config import Config
from ._dtypes import ReduceOp
from ._errors import CommClosedError, ConfigError
from ._p2p import P2POp
from ._rootinfo import config_from_rank_table, config_from_root_info

_default: Comm | None = None


async def init(*, rank: int | None = None, world_size: int | None = None, master_addr: str | None = None,
               master_port: int | None = None, config: Config | None = None, root_info: str | None = None,
               rank_table: str | None = None) -> Comm:
    """Create a communicator for this process's job and make it the default one.

    Rank, world size and the rendezvous address come from the launcher's environment
    (ahcomm-run, torchrun, OpenMPI, PMI, Slurm), or from a ``root_info`` token
    (``get_root_info()`` on the root, HcclCommInitRootInfo's way) or an HCCL ``rank_table``
    file; explicit arguments win.
    """
    global _default
    if root_info is not None or rank_table is not None:
        base = config or Config.from_env()
        if root_info is not None:
            config = config_from_root_info(root_info, base)
        else:
            if rank is None:
                raise ConfigError("init(rank_table=...) needs rank=: which rank of the table this process is")
            config = config_from_rank_table(str(rank_table), rank, base, master_port)
            world_size = world_size or config.world_size
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


def reduce(x: Any, op: ReduceOp | str = "sum", root: int = 0, **kw: Any) -> "asyncio.Future[np.ndarray | None]":
    return default_comm().reduce(x, op, root, **kw)


def gather(x: Any, root: int = 0, **kw: Any) -> "asyncio.Future[np.ndarray | None]":
    return default_comm().gather(x, root, **kw)


def scatter(x: Any, root: int = 0, **kw: Any) -> "asyncio.Future[np.ndarray]":
    return default_comm().scatter(x, root, **kw)


def all_to_all(x: Any, **kw: Any) -> "asyncio.Future[np.ndarray]":
    return default_comm().all_to_all(x, **kw)


def all_gather_v(x: Any, **kw: Any) -> "asyncio.Future[Gathered]":
    return default_comm().all_gather_v(x, **kw)


def reduce_scatter_v(x: Any, counts: Sequence[int], op: ReduceOp | str = "sum",
                     **kw: Any) -> "asyncio.Future[np.ndarray]":
    return default_comm().reduce_scatter_v(x, counts, op, **kw)


def gather_v(x: Any, root: int = 0, **kw: Any) -> "asyncio.Future[Gathered | None]":
    return default_comm().gather_v(x, root, **kw)


def scatter_v(x: Any, counts: Sequence[int], root: int = 0, **kw: Any) -> "asyncio.Future[np.ndarray]":
    return default_comm().scatter_v(x, counts, root, **kw)


def all_to_all_v(x: Any, send_counts: Sequence[int], **kw: Any) -> "asyncio.Future[Gathered]":
    return default_comm().all_to_all_v(x, send_counts, **kw)


def send(x: Any, dst: int, **kw: Any) -> "asyncio.Future[None]":
    return default_comm().send(x, dst, **kw)


def recv(src: int, **kw: Any) -> "asyncio.Future[np.ndarray]":
    return default_comm().recv(src, **kw)


def batch_send_recv(ops: Sequence[P2POp]) -> "asyncio.Future[list[np.ndarray | None]]":
    return default_comm().batch_send_recv(ops)


def broadcast_object(obj: Any = None, root: int = 0) -> "asyncio.Future[Any]":
    return default_comm().broadcast_object(obj, root)


def all_gather_object(obj: Any) -> "asyncio.Future[list[Any]]":
    return default_comm().all_gather_object(obj)


def gather_object(obj: Any, root: int = 0) -> "asyncio.Future[list[Any] | None]":
    return default_comm().gather_object(obj, root)


async def split(color: int | None, key: int | None = None, **kw: Any) -> Comm | None:
    """``default_comm().split(color, key)``: a sub-communicator (every rank calls it)."""
    return await default_comm().split(color, key, **kw)


async def new_group(ranks: Sequence[int], **kw: Any) -> Comm | None:
    """``default_comm().new_group(ranks)``: a sub-communicator of ``ranks`` (every rank calls it)."""
    return await default_comm().new_group(ranks, **kw)


async def finalize() -> None:
    """Close the default communicator."""
    if _default is not None:
        await _default.close()

"""ahcomm as a ``ray.util.collective`` backend.

    import ahcomm.ray
    ahcomm.ray.register()          # in the driver and in every actor (Ray's rule)
    col.init_collective_group(world_size, rank, backend="ahcomm", group_name="g")
    col.allreduce(array, group_name="g")

``AhcommGroup`` implements Ray's ``BaseGroup`` (allreduce, allgather, reducescatter,
broadcast, reduce, barrier, send, recv) on numpy arrays and CPU torch tensors, in place.
Bootstrap: rank 0 of the group puts a root-info token (``ahcomm.get_root_info()``: address,
free port, job secret - AHCOMM_JOB_SECRET or a fresh one) in Ray's internal key-value store
under the group's name; the other ranks poll for it; rank 0 deletes it once every rank has
joined (the rendezvous needs all of them). The communicator lives on the process's
``LoopThread``; each call blocks the actor until it completes. Inside an async actor, ahcomm's
own async API can be used directly instead (``await ahcomm.init(root_info=...)``; see
examples/ray_async_actors.py).
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import ray.experimental.internal_kv as internal_kv
from ray.util.collective.collective_group.base_collective_group import BaseGroup
from ray.util.collective.types import ReduceOp

from ._bootstrap import create
from ._collectives import Gathered
from ._comm import Comm
from ._config import Config
from ._errors import InvalidArgument
from ._loopthread import LoopThread
from ._rootinfo import config_from_root_info, get_root_info

__all__ = ["BACKEND", "AhcommGroup", "register"]

BACKEND = "ahcomm"
DEFAULT_TIMEOUT = 1800.0
_OPS = {ReduceOp.SUM: "sum", ReduceOp.PRODUCT: "prod", ReduceOp.MIN: "min", ReduceOp.MAX: "max"}


def _key(group_name: str) -> str:
    return f"ahcomm_root_info:{group_name}"


def _host(x: Any) -> np.ndarray:
    """``x`` as a writable host numpy array sharing its memory (numpy, or a CPU torch tensor)."""
    if isinstance(x, np.ndarray):
        return x
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor) and x.device.type == "cpu":
        from ._devices import _tensor_numpy

        return _tensor_numpy(x)
    raise InvalidArgument(f"ahcomm Ray backend: expected a numpy array or a CPU torch tensor, got {type(x).__name__}")


def _timeout(opts: Any) -> float:
    """The call's timeout in seconds: Ray's ``timeout_ms`` (a timedelta, or milliseconds) where set."""
    value: Any = getattr(opts, "timeout_ms", None)
    if isinstance(value, (int, float)):
        seconds = value / 1000
    elif value is not None and hasattr(value, "total_seconds"):
        seconds = float(value.total_seconds())
    else:
        seconds = -1.0
    return seconds if seconds > 0 else DEFAULT_TIMEOUT


def _one(tensors: Any, what: str) -> Any:
    if isinstance(tensors, (list, tuple)):
        if len(tensors) != 1:
            raise InvalidArgument(f"ahcomm Ray backend: {what} takes one tensor per process, got {len(tensors)}")
        return tensors[0]
    return tensors


class AhcommGroup(BaseGroup):  # type: ignore[misc]  # Ray ships no type information
    """A Ray collective group whose calls run on an ahcomm communicator."""

    def __init__(self, world_size: int, rank: int, group_name: str) -> None:
        super().__init__(world_size, rank, group_name)
        self._loop = LoopThread.get()
        base = Config.from_env()
        if world_size == 1:
            config = dataclasses.replace(base, rank=0, world_size=1)
        else:
            config = config_from_root_info(self._rendezvous(group_name, rank, base.connect_timeout), base)
        self.comm: Comm = self._loop.run(create(config, rank=rank, world_size=world_size), base.connect_timeout + 5)
        if rank == 0 and world_size > 1:  # every rank has joined: nobody needs the token any more
            internal_kv._internal_kv_del(_key(group_name))

    @staticmethod
    def _rendezvous(group_name: str, rank: int, timeout: float) -> str:
        if rank == 0:
            internal_kv._internal_kv_put(_key(group_name), get_root_info(), overwrite=True)
        deadline = time.monotonic() + timeout
        while True:
            token = internal_kv._internal_kv_get(_key(group_name))
            if token is not None:
                return bytes(token).decode()
            if time.monotonic() > deadline:
                raise TimeoutError(f"ahcomm Ray backend: rank 0 of group {group_name!r} published no root info "
                                   f"within {timeout:g} s")
            time.sleep(0.05)

    @classmethod
    def backend(cls) -> str:
        return BACKEND.upper()

    @classmethod
    def check_backend_availability(cls) -> bool:
        return True

    def destroy_group(self) -> None:
        if not self.comm.closed:
            try:
                self._loop.run(self.comm.close(), DEFAULT_TIMEOUT)
            except Exception:  # noqa: BLE001 - peers already gone: drop ours
                self.comm.abort("destroy_group")

    def _call(self, start: Callable[[Comm], Any], timeout: float) -> Any:
        comm = self.comm

        async def go() -> Any:
            return await start(comm)
        return self._loop.run(go(), timeout + 30)

    # -- collectives ---------------------------------------------------------------------------
    def allreduce(self, tensors: Any, allreduce_options: Any = None) -> None:
        op = _OPS[getattr(allreduce_options, "reduceOp", ReduceOp.SUM)]
        a, t = _host(_one(tensors, "allreduce")), _timeout(allreduce_options)
        self._call(lambda comm: comm.all_reduce(a, op, out=a, timeout=t), t)

    def barrier(self, barrier_options: Any = None) -> None:
        t = _timeout(barrier_options)
        self._call(lambda comm: comm.barrier(timeout=t), t)

    def reduce(self, tensors: Any, reduce_options: Any = None) -> None:
        op = _OPS[getattr(reduce_options, "reduceOp", ReduceOp.SUM)]
        root = int(getattr(reduce_options, "root_rank", 0))
        a, t = _host(_one(tensors, "reduce")), _timeout(reduce_options)
        out = a if self.rank == root else None
        self._call(lambda comm: comm.reduce(a, op, root, out=out, timeout=t), t)

    def broadcast(self, tensors: Any, broadcast_options: Any = None) -> None:
        root = int(getattr(broadcast_options, "root_rank", 0))
        a, t = _host(_one(tensors, "broadcast")), _timeout(broadcast_options)
        self._call(lambda comm: comm.broadcast(a, root, out=a, timeout=t), t)

    def allgather(self, tensor_lists: Any, tensors: Any, allgather_options: Any = None) -> None:
        x = _host(_one(tensors, "allgather"))
        outs = [_host(o) for o in _one(tensor_lists, "allgather")]
        self._check_count(outs, "allgather output list")
        t = _timeout(allgather_options)
        sizes = [o.size for o in outs]
        flat = np.ascontiguousarray(x).reshape(-1)
        if all(s == x.size for s in sizes):
            result = self._call(lambda comm: comm.all_gather(flat, timeout=t), t)
        else:
            result = self._call(lambda comm: comm.all_gather_v(flat, counts=sizes, timeout=t), t)
        _split_into((result.data if isinstance(result, Gathered) else result).reshape(-1), outs)

    def reducescatter(self, tensors: Any, tensor_lists: Any, reducescatter_options: Any = None) -> None:
        op = _OPS[getattr(reducescatter_options, "reduceOp", ReduceOp.SUM)]
        y = _host(_one(tensors, "reducescatter"))
        ins = [_host(i) for i in _one(tensor_lists, "reducescatter")]
        self._check_count(ins, "reducescatter input list")
        counts = [i.size for i in ins]
        if counts[self.rank] != y.size:
            raise InvalidArgument(f"reducescatter: output has {y.size} elements, this rank's block {counts[self.rank]}")
        source = np.concatenate([np.ascontiguousarray(i).reshape(-1) for i in ins])
        t = _timeout(reducescatter_options)
        if len(set(counts)) == 1:
            result = self._call(lambda comm: comm.reduce_scatter(source, op, timeout=t), t)
        else:
            result = self._call(lambda comm: comm.reduce_scatter_v(source, counts, op, timeout=t), t)
        y[...] = result.reshape(y.shape)

    def send(self, tensors: Any, send_options: Any) -> None:
        a, t = _host(_one(tensors, "send")), _timeout(send_options)
        dst = int(send_options.dst_rank)
        self._call(lambda comm: comm.send(a, dst, timeout=t), t)

    def recv(self, tensors: Any, recv_options: Any) -> None:
        a, t = _host(_one(tensors, "recv")), _timeout(recv_options)
        src = int(recv_options.src_rank)
        got = self._call(lambda comm: comm.recv(src, shape=a.shape, dtype=a.dtype, timeout=t), t)
        a[...] = got

    def _check_count(self, arrays: Sequence[np.ndarray], what: str) -> None:
        if len(arrays) != self.world_size:
            raise InvalidArgument(f"{what} has {len(arrays)} tensors; the group has {self.world_size} ranks")


def _split_into(data: np.ndarray, outs: Sequence[np.ndarray]) -> None:
    start = 0
    for o in outs:
        o[...] = data[start:start + o.size].reshape(o.shape)
        start += o.size


def register() -> None:
    """Register "ahcomm" with ``ray.util.collective`` in this process (idempotent). Ray needs it
    in the driver and in every actor that joins a group."""
    from ray.util.collective.backend_registry import _global_registry, register_collective_backend

    if not _global_registry.is_registered(BACKEND):
        register_collective_backend(BACKEND, AhcommGroup)

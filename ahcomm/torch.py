"""ahcomm as a torch.distributed backend.

    import ahcomm.torch              # registers the backend "ahcomm"
    dist.init_process_group("ahcomm")  # under torchrun or ahcomm-run

``ProcessGroupAhcomm`` is a Python ``torch.distributed.ProcessGroup`` (torch lets Python
subclass ProcessGroup, not Backend): torch's ``dist.*`` functions call its methods, which
turn tensors into numpy views (zero copy for CPU tensors, ``out=`` the tensor itself where
the layout allows) and hand the collective to the backend's event loop thread
(``_torch_work``). Tensors on an accelerator go through host copies (staged before the call,
written back before ``wait()`` returns). Under ahcomm-run or srun, importing this module also gives
torch's ``env://`` rendezvous the job's rank, size and address (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``, where unset: from the AHCOMM_* variables, or from the Slurm
step): the torch store then listens on the port ahcomm-run reserved (or the step's derived
port), and ahcomm's own rendezvous goes through that store.
"""

from __future__ import annotations

import asyncio
import datetime
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

try:
    import torch
    import torch.distributed as dist
except ImportError as exc:  # an optional extra: say how to get it
    raise ImportError("ahcomm.torch needs torch: pip install 'ahcomm[torch]'") from exc

from . import _slurm
from ._collectives import Gathered
from ._comm import Comm
from ._errors import InvalidArgument, UsageError
from ._loopthread import LoopThread
from ._torch_work import AhcommWork, connect
from ._torch_work import Host as _Host
from ._torch_work import out_view as _out_view
from ._torch_work import rows as _rows
from ._torch_work import split_into as _split_into

__all__ = ["BACKEND", "ProcessGroupAhcomm", "create_process_group"]

BACKEND = "ahcomm"
_R: Any = dist.ReduceOp.RedOpType  # torch's stubs lag its bindings (RedOpType's members, ProcessGroup's
_ProcessGroup: Any = dist.ProcessGroup  # constructor and overloads): both are used as torch documents them
_OPS = {_R.SUM: "sum", _R.AVG: "avg", _R.PRODUCT: "prod", _R.MIN: "min", _R.MAX: "max",
        _R.BAND: "band", _R.BOR: "bor", _R.BXOR: "bxor"}


def _redop(op: Any) -> str:
    kind = getattr(op, "op", op)
    name = _OPS.get(kind)
    if name is None:
        raise InvalidArgument(f"ahcomm backend: reduce op {kind} is not supported "
                              f"(sum, avg, product, min, max, band, bor, bxor are)")
    return name


class ProcessGroupAhcomm(_ProcessGroup):  # type: ignore[misc]
    """A torch process group whose collectives run on an ahcomm communicator."""

    def __init__(self, comm: Comm, rank: int, size: int, timeout: float) -> None:
        super().__init__(rank, size)
        self.comm = comm
        self._timeout = timeout
        self._loop = LoopThread.get()

    def getBackendName(self) -> str:
        return BACKEND

    # torch names groups after creating them; a ProcessGroup without C++ backends keeps the name here
    def _set_group_name(self, name: str) -> None:
        self._name = name

    def _set_group_desc(self, desc: str) -> None:
        self._desc = desc

    def getGroupName(self) -> str:
        return getattr(self, "_name", "")

    def getGroupDesc(self) -> str:
        return getattr(self, "_desc", "")

    @property
    def group_name(self) -> str:
        return self.getGroupName()

    @property
    def group_desc(self) -> str:
        return self.getGroupDesc()

    def __repr__(self) -> str:
        return f"ProcessGroupAhcomm(rank={self.rank()}, size={self.size()})"

    # -- plumbing ----------------------------------------------------------------------------
    def _run(self, start: Callable[[Comm], Any], outputs: list[Any],
             then: Callable[[Any], Any] | None = None) -> AhcommWork:
        comm = self.comm
        done = self._loop.submit(lambda: start(comm), then)
        return AhcommWork(done, outputs, self._loop)

    def _check_peer(self, peer: int, what: str) -> None:
        if not 0 <= peer < self.size():
            raise InvalidArgument(f"ahcomm backend: {what} rank {peer} is out of range for group size {self.size()}")

    # -- collectives -------------------------------------------------------------------------
    def allreduce(self, tensors: list[Any], opts: Any = None) -> AhcommWork:
        op = _redop(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        hosts = [_Host(t) for t in tensors]
        timeout = self._timeout

        def start(comm: Comm) -> Any:
            futs = [comm.all_reduce(h.array, op, out=h.array, timeout=timeout) for h in hosts]
            return asyncio.gather(*futs)

        def then(_: Any) -> None:
            for h in hosts:
                h.done()
        return self._run(start, list(tensors), then)

    def allreduce_coalesced(self, tensors: list[Any], opts: Any = None) -> AhcommWork:
        return self.allreduce(tensors, opts)

    def broadcast(self, tensors: list[Any], opts: Any = None) -> AhcommWork:
        root = int(opts.rootRank) if opts is not None else 0
        self._check_peer(root, "broadcast root")
        hosts = [_Host(t, read=self.rank() == root) for t in tensors]
        timeout = self._timeout

        def start(comm: Comm) -> Any:
            return asyncio.gather(*[comm.broadcast(h.array, root, out=h.array, timeout=timeout) for h in hosts])

        def then(_: Any) -> None:
            for h in hosts:
                h.done()
        return self._run(start, list(tensors), then)

    def reduce(self, tensors: list[Any], opts: Any = None) -> AhcommWork:
        root = int(opts.rootRank)
        self._check_peer(root, "reduce root")
        op = _redop(opts.reduceOp)
        (h,) = [_Host(t) for t in tensors]
        timeout = self._timeout
        me = self.rank()

        def then(result: Any) -> None:
            if me == root:
                h.put(result)
        out = h.array if me == root and h.array.flags.c_contiguous else None
        return self._run(lambda comm: comm.reduce(h.array, op, root, out=out, timeout=timeout), list(tensors), then)

    def barrier(self, opts: Any = None) -> AhcommWork:
        timeout = self._timeout
        return self._run(lambda comm: comm.barrier(timeout=timeout), [])

    def allgather(self, output_tensors: list[list[Any]], input_tensors: list[Any], opts: Any = None) -> AhcommWork:
        (x,) = [_Host(t) for t in input_tensors]
        (outs,) = [[_Host(t, read=False) for t in group] for group in output_tensors]
        self._check_count(outs, "all_gather output list")
        sizes = [o.array.size for o in outs]
        timeout = self._timeout

        def start(comm: Comm) -> Any:
            if all(s == x.array.size for s in sizes):
                return comm.all_gather(x.flat(), timeout=timeout)
            return comm.all_gather_v(x.flat(), counts=sizes, timeout=timeout)

        def then(result: Any) -> None:
            data = (result.data if isinstance(result, Gathered) else result).reshape(-1)
            _split_into(data, outs)
        return self._run(start, output_tensors, then)

    def allgather_coalesced(self, output_lists: list[list[Any]], inputs: list[Any], opts: Any = None) -> AhcommWork:
        works = [self.allgather([outs], [x], opts) for outs, x in zip(output_lists, inputs)]
        return _last(works, output_lists)

    def all_gather_single(self, output: Any, input: Any, opts: Any = None) -> AhcommWork:
        x, out = _Host(input), _Host(output, read=False)
        if out.array.size != x.array.size * self.size():
            raise InvalidArgument(f"all_gather_into_tensor: output has {out.array.size} elements, expected "
                                  f"{x.array.size} x {self.size()} ranks")
        view = _out_view(out)
        timeout = self._timeout
        return self._run(lambda comm: comm.all_gather(x.flat(), out=view, timeout=timeout), [output],
                         lambda result: out.put(result))

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs: list[Any], inputs: list[Any], opts: Any = None) -> AhcommWork:
        return _last([self.all_gather_single(o, i, opts) for o, i in zip(outputs, inputs)], outputs)

    def gather(self, output_tensors: list[list[Any]], input_tensors: list[Any], opts: Any = None) -> AhcommWork:
        root = int(opts.rootRank)
        self._check_peer(root, "gather root")
        (x,) = [_Host(t) for t in input_tensors]
        outs = [_Host(t, read=False) for t in output_tensors[0]] if self.rank() == root else []
        if self.rank() == root:
            self._check_count(outs, "gather output list")
        timeout = self._timeout

        def then(result: Any) -> None:
            if result is not None:
                _split_into(result.reshape(-1), outs)
        return self._run(lambda comm: comm.gather(x.flat(), root, timeout=timeout), output_tensors, then)

    def scatter(self, output_tensors: list[Any], input_tensors: list[list[Any]], opts: Any = None) -> AhcommWork:
        root = int(opts.rootRank)
        self._check_peer(root, "scatter root")
        (y,) = [_Host(t, read=False) for t in output_tensors]
        source: np.ndarray | None = None
        if self.rank() == root:
            ins = [_Host(t) for t in input_tensors[0]]
            self._check_count(ins, "scatter input list")
            source = np.concatenate([h.flat() for h in ins])
        else:  # shape and dtype only, no memory (Comm.scatter(None, out=...) cannot be used on non-roots yet)
            source = np.broadcast_to(np.zeros(1, y.array.dtype), (y.array.size * self.size(),))
        view = _out_view(y)
        timeout = self._timeout
        return self._run(lambda comm: comm.scatter(source, root, out=view, timeout=timeout), output_tensors,
                         lambda result: y.put(result))

    def reduce_scatter(self, output_tensors: list[Any], input_tensors: list[list[Any]],
                       opts: Any = None) -> AhcommWork:
        op = _redop(opts.reduceOp)
        (y,) = [_Host(t, read=False) for t in output_tensors]
        ins = [_Host(t) for t in input_tensors[0]]
        self._check_count(ins, "reduce_scatter input list")
        source = np.concatenate([h.flat() for h in ins])
        counts = [h.array.size for h in ins]
        if counts[self.rank()] != y.array.size:
            raise InvalidArgument(f"reduce_scatter: output has {y.array.size} elements, this rank's input block "
                                  f"{counts[self.rank()]}")
        view = _out_view(y)
        timeout = self._timeout

        def start(comm: Comm) -> Any:
            if len(set(counts)) == 1:
                return comm.reduce_scatter(source, op, out=view, timeout=timeout)
            return comm.reduce_scatter_v(source, counts, op, out=view, timeout=timeout)
        return self._run(start, output_tensors, lambda result: y.put(result))

    def reduce_scatter_single(self, output: Any, input: Any, opts: Any = None) -> AhcommWork:
        op = _redop(opts.reduceOp)
        x, y = _Host(input), _Host(output, read=False)
        if x.array.size != y.array.size * self.size():
            raise InvalidArgument(f"reduce_scatter_tensor: input has {x.array.size} elements, expected "
                                  f"{y.array.size} x {self.size()} ranks")
        view = _out_view(y)
        timeout = self._timeout
        return self._run(lambda comm: comm.reduce_scatter(x.flat(), op, out=view, timeout=timeout), [output],
                         lambda result: y.put(result))

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs: list[Any], inputs: list[Any], opts: Any = None) -> AhcommWork:
        return _last([self.reduce_scatter_single(o, i, opts) for o, i in zip(outputs, inputs)], outputs)

    def alltoall(self, output_tensors: list[Any], input_tensors: list[Any], opts: Any = None) -> AhcommWork:
        outs = [_Host(t, read=False) for t in output_tensors]
        ins = [_Host(t) for t in input_tensors]
        self._check_count(outs, "all_to_all output list")
        self._check_count(ins, "all_to_all input list")
        source = np.concatenate([h.flat() for h in ins])
        send = [h.array.size for h in ins]
        recv = [h.array.size for h in outs]
        timeout = self._timeout
        return self._run(lambda comm: comm.all_to_all_v(source, send, recv_counts=recv, timeout=timeout),
                         output_tensors, lambda result: _split_into(result.data.reshape(-1), outs))

    def all_to_all_single(self, output: Any, input: Any, output_split_sizes: Sequence[int] | None,
                          input_split_sizes: Sequence[int] | None, opts: Any = None) -> AhcommWork:
        x, y = _Host(input), _Host(output, read=False)
        n = self.size()
        if not output_split_sizes and not input_split_sizes:
            if x.array.size % n or x.array.size != y.array.size:
                raise InvalidArgument(f"all_to_all_single: input ({x.array.size} elements) and output "
                                      f"({y.array.size}) must be equal and divisible by {n}")
            view = _out_view(y)
            timeout = self._timeout
            return self._run(lambda comm: comm.all_to_all(x.flat(), out=view, timeout=timeout), [output],
                             lambda result: y.put(result))
        rows_in, rows_out = _rows(x.array), _rows(y.array)
        send = list(input_split_sizes or [rows_in[0] // n] * n)
        recv = list(output_split_sizes or [rows_out[0] // n] * n)
        if len(send) != n or len(recv) != n or sum(send) != rows_in[0] or sum(recv) != rows_out[0]:
            raise InvalidArgument(f"all_to_all_single: split sizes {send} / {recv} do not fit {n} ranks and "
                                  f"{rows_in[0]} / {rows_out[0]} rows")
        src = x.flat().reshape(rows_in)
        timeout = self._timeout
        return self._run(lambda comm: comm.all_to_all_v(src, send, recv_counts=recv, timeout=timeout), [output],
                         lambda result: y.put(result.data))

    alltoall_base = all_to_all_single

    # -- point to point ----------------------------------------------------------------------
    def send(self, tensors: list[Any], dst: int, tag: int = 0) -> AhcommWork:
        self._check_peer(dst, "send destination")
        (x,) = [_Host(t) for t in tensors]
        timeout = self._timeout
        return self._run(lambda comm: comm.send(x.array, dst, tag=tag, timeout=timeout), list(tensors))

    def recv(self, tensors: list[Any], src: int, tag: int = 0) -> AhcommWork:
        self._check_peer(src, "recv source")
        (y,) = [_Host(t, read=False) for t in tensors]
        view = y.array if y.array.flags.c_contiguous else None
        timeout = self._timeout
        return self._run(lambda comm: comm.recv(src, out=view, shape=y.array.shape, dtype=y.array.dtype, tag=tag,
                                                timeout=timeout), list(tensors), lambda result: y.put(result))

    def recv_anysource(self, tensors: list[Any], tag: int = 0) -> AhcommWork:
        raise UsageError("ahcomm backend: recv from any source is not supported: name the source rank")

    # -- lifetime ----------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Close the communicator (a meeting of the group's ranks, bounded by the group's timeout)."""
        comm = self.comm
        if comm.closed:
            return
        try:
            self._loop.run(comm.close(), self._timeout + 5)
        except Exception:  # noqa: BLE001 - a peer already gone: drop ours without meeting
            comm.abort("shutdown")

    def abort(self) -> None:
        self._loop.loop.call_soon_threadsafe(self.comm.abort, "aborted by torch")

    def _check_count(self, hosts: list[_Host], what: str) -> None:
        if len(hosts) != self.size():
            raise InvalidArgument(f"{what} has {len(hosts)} tensors; the group has {self.size()} ranks")


def _last(works: list[AhcommWork], outputs: list[Any]) -> AhcommWork:
    """One Work standing for ``works`` (issued in order, so the last completes last - unless one fails)."""
    if not works:
        raise InvalidArgument("ahcomm backend: a coalesced call with no tensors")
    for w in works[:-1]:
        w.wait()
    return works[-1]


def create_process_group(store: Any, rank: int, size: int, timeout: datetime.timedelta) -> ProcessGroupAhcomm:
    """torch's creator function for the backend: a communicator bootstrapped through ``store``."""
    seconds = timeout.total_seconds() if timeout else 1800.0
    world = not dist.is_initialized()
    comm = connect(store, rank, size, seconds, world=world)
    return ProcessGroupAhcomm(comm, rank, size, seconds)


def _torch_env_from_ahcomm_run(env: Any = os.environ) -> None:
    """torch's env:// variables (where RANK is unset) from ahcomm-run's AHCOMM_* ones, or from
    an srun step (rank, size and local rank from Slurm; the master's address and port derived
    from the step's node list and ids, as ``ahcomm._slurm`` does for ahcomm's own rendezvous)."""
    if env.get("RANK"):
        return
    pairs: tuple[tuple[str, str | None], ...] = ()
    if env.get("AHCOMM_RANK"):
        pairs = tuple((theirs, env.get(ours)) for ours, theirs in (
            ("AHCOMM_RANK", "RANK"), ("AHCOMM_WORLD_SIZE", "WORLD_SIZE"), ("AHCOMM_LOCAL_RANK", "LOCAL_RANK"),
            ("AHCOMM_LOCAL_WORLD_SIZE", "LOCAL_WORLD_SIZE"), ("AHCOMM_MASTER_ADDR", "MASTER_ADDR"),
            ("AHCOMM_MASTER_PORT", "MASTER_PORT")))
    elif env.get("SLURM_PROCID") and env.get("SLURM_NTASKS"):
        found = _slurm.rendezvous(env)
        if found is None:
            return
        local_size = _slurm.local_world_size(env)
        pairs = (("RANK", env["SLURM_PROCID"]), ("WORLD_SIZE", env["SLURM_NTASKS"]),
                 ("LOCAL_RANK", env.get("SLURM_LOCALID")),
                 ("LOCAL_WORLD_SIZE", None if local_size is None else str(local_size)),
                 ("MASTER_ADDR", found[0]), ("MASTER_PORT", str(found[1])))
    for name, value in pairs:
        if value and not env.get(name):
            env[name] = value


def _devices() -> list[str]:
    devices = ["cpu"]
    if torch.cuda.is_available():
        devices.append("cuda")
    if hasattr(torch, "npu"):
        devices.append("npu")
    return devices


def register() -> None:
    """Register the backend "ahcomm" with torch.distributed (done on import; idempotent)."""
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, create_process_group, devices=_devices())


_torch_env_from_ahcomm_run()
register()

"""ahcomm: asyncio-native collective communication (HCCL's model over ZeroMQ).

    comm = await ahcomm.init()
    y = await comm.all_reduce(x, op="sum")
"""

from __future__ import annotations

from . import algorithms
from ._api import (
    all_gather,
    all_gather_object,
    all_gather_v,
    all_reduce,
    all_to_all,
    all_to_all_v,
    barrier,
    batch_send_recv,
    broadcast,
    broadcast_object,
    default_comm,
    finalize,
    gather,
    gather_object,
    gather_v,
    get_rank,
    get_world_size,
    init,
    new_group,
    recv,
    reduce,
    reduce_scatter,
    reduce_scatter_v,
    scatter,
    scatter_v,
    send,
    split,
)
from ._bootstrap import create_inprocess as init_inprocess
from ._collectives import Gathered
from ._comm import Comm
from ._config import Config
from ._dtypes import SUPPORTED_DTYPES, ReduceOp
from ._errors import (
    AhcommError,
    CollectiveMismatchError,
    CollectiveTimeout,
    CommClosedError,
    CommSuspendedError,
    CommunicationError,
    ConfigError,
    ConnectError,
    InvalidArgument,
    InvalidDtype,
    PeerFailure,
    TransportError,
    UsageError,
    WrongLoopError,
)
from ._p2p import P2POp
from ._peer_memory import alloc
from ._rootinfo import get_root_info
from ._sync import SyncComm

__version__ = "0.1.0"

__all__ = [
    "SUPPORTED_DTYPES",
    "AhcommError",
    "CollectiveMismatchError",
    "CollectiveTimeout",
    "Comm",
    "CommClosedError",
    "CommSuspendedError",
    "CommunicationError",
    "Config",
    "ConfigError",
    "ConnectError",
    "Gathered",
    "InvalidArgument",
    "InvalidDtype",
    "P2POp",
    "PeerFailure",
    "ReduceOp",
    "SyncComm",
    "TransportError",
    "UsageError",
    "WrongLoopError",
    "__version__",
    "algorithms",
    "all_gather",
    "all_gather_object",
    "all_gather_v",
    "all_reduce",
    "all_to_all",
    "all_to_all_v",
    "alloc",
    "barrier",
    "batch_send_recv",
    "broadcast",
    "broadcast_object",
    "default_comm",
    "finalize",
    "gather",
    "gather_object",
    "gather_v",
    "get_rank",
    "get_root_info",
    "get_world_size",
    "init",
    "init_inprocess",
    "new_group",
    "recv",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_v",
    "scatter",
    "scatter_v",
    "send",
    "split",
]

"""ahcomm: asyncio-native collective communication (HCCL's model over ZeroMQ).

    comm = await ahcomm.init()
    y = await comm.all_reduce(x, op="sum")
"""

from __future__ import annotations

from . import algorithms
from ._api import (
    all_gather,
    all_reduce,
    barrier,
    broadcast,
    default_comm,
    finalize,
    get_rank,
    get_world_size,
    init,
    reduce_scatter,
)
from ._bootstrap import create_inprocess as init_inprocess
from ._comm import Comm
from ._config import Config
from ._dtypes import SUPPORTED_DTYPES, ReduceOp
from ._errors import (
    AhcommError,
    CollectiveMismatchError,
    CollectiveTimeout,
    CommClosedError,
    CommunicationError,
    ConfigError,
    ConnectError,
    InvalidArgument,
    InvalidDtype,
    PeerFailure,
    TransportError,
    UsageError,
)

__version__ = "0.1.0"

__all__ = [
    "AhcommError", "CollectiveMismatchError", "CollectiveTimeout", "Comm", "CommClosedError",
    "CommunicationError", "Config", "ConfigError", "ConnectError", "InvalidArgument", "InvalidDtype",
    "PeerFailure", "ReduceOp", "SUPPORTED_DTYPES", "TransportError", "UsageError", "algorithms",
    "all_gather", "all_reduce", "barrier", "broadcast", "default_comm", "finalize", "get_rank",
    "get_world_size", "init", "init_inprocess", "reduce_scatter", "__version__",
]

"""Exception hierarchy: one root, two families (usage errors and communication failures)."""

from __future__ import annotations

import math
import numbers
from typing import Any


class AhcommError(Exception):
    """Root of every exception ahcomm raises."""

    #: where this rank's flight record (its last collectives, as JSON) was written when the
    #: communicator failed; None when it was not written (see ``AHCOMM_FLIGHT_DIR``)
    flight_record: str | None = None


# --- the caller did something wrong: raised before anything is sent -------------------------


class UsageError(AhcommError):
    """A call that can never succeed as written."""


class InvalidArgument(UsageError, ValueError):
    """A bad value: shape, count, root, op name, rank, group."""


class InvalidDtype(UsageError, TypeError):
    """A dtype that the collective or the reduce op does not support."""


class CommClosedError(UsageError):
    """The communicator was closed (or aborted) before the call."""


class CommSuspendedError(UsageError):
    """The communicator is suspended (``Comm.suspend``): its CCL buffers are released, so no
    collective or point-to-point call runs until ``Comm.resume``. ``op`` names the call refused."""

    def __init__(self, message: str = "", *, op: str | None = None) -> None:
        super().__init__(message)
        self.op = op


class WrongLoopError(UsageError, RuntimeError):
    """A communicator was called from an event loop (or a thread) other than its own.

    A communicator belongs to the loop it was created on; other threads call in through
    ``Comm.call_threadsafe`` or ``Comm.sync``.
    """


class ConfigError(UsageError):
    """An environment variable or init() argument is malformed or missing."""


def check_timeout(timeout: Any, what: str) -> float | None:
    """A call's ``timeout=``: None, or a positive number of seconds (else InvalidArgument)."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or math.isnan(timeout) or timeout <= 0:
        raise InvalidArgument(f"{what}: timeout must be a positive number of seconds (or None), got {timeout!r}")
    return float(timeout)


# --- the job went wrong: peers, links, time ---------------------------------------------------


class CommunicationError(AhcommError):
    """A collective could not complete because of the job, not the call."""


class ConnectError(CommunicationError):
    """Rendezvous or link set-up failed."""


class TransportError(CommunicationError):
    """A link broke or received something it could not accept."""


class CollectiveTimeout(CommunicationError, TimeoutError):
    """A collective did not complete in time.

    ``op`` and ``seq`` name it; ``missing`` lists the ranks that had not reached it (had not
    called it yet, were still in an earlier collective, or did not answer the query).
    """

    def __init__(self, message: str = "", *, op: str | None = None, seq: int | None = None,
                 missing: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.op = op
        self.seq = seq
        self.missing = missing


class PeerFailure(CommunicationError):
    """A peer rank died or aborted; ``rank`` is that peer, ``op`` and ``seq`` the collective this
    rank was running or waiting on when it learnt of it (None while idle)."""

    def __init__(self, message: str, rank: int | None = None, *, op: str | None = None,
                 seq: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.op = op
        self.seq = seq

    def during(self, op: str, seq: int) -> "PeerFailure":
        """This failure naming the collective it ended: itself where it names one already, else a
        copy that does (a link's error, raised by a copy or a wait, names the peer only)."""
        if self.seq is not None:
            return self
        named = PeerFailure(f"{self} during {op} #{seq}", self.rank, op=op, seq=seq)
        named.__cause__, named.__traceback__ = self.__cause__, self.__traceback__
        return named


class CollectiveMismatchError(CommunicationError):
    """Ranks issued different collectives at the same sequence number (or a point-to-point
    message was not what ``recv`` expected). ``seq`` is the collective's sequence number and
    ``ranks`` the two ranks found to differ, where known."""

    def __init__(self, message: str = "", *, seq: int | None = None, ranks: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.seq = seq
        self.ranks = ranks


# Tracebacks name the public path (``ahcomm.PeerFailure``), not this private module.
for _cls in (AhcommError, UsageError, InvalidArgument, InvalidDtype, CommClosedError, CommSuspendedError,
             WrongLoopError, ConfigError,
             CommunicationError, ConnectError, TransportError, CollectiveTimeout, PeerFailure,
             CollectiveMismatchError):
    _cls.__module__ = "ahcomm"
del _cls

"""Exception hierarchy: one root, two families (usage errors and communication failures)."""

from __future__ import annotations


class AhcommError(Exception):
    """Root of every exception ahcomm raises."""


# --- the caller did something wrong: raised before anything is sent -------------------------


class UsageError(AhcommError):
    """A call that can never succeed as written."""


class InvalidArgument(UsageError, ValueError):
    """A bad value: shape, count, root, op name, rank, group."""


class InvalidDtype(UsageError, TypeError):
    """A dtype that the collective or the reduce op does not support."""


class CommClosedError(UsageError):
    """The communicator was closed (or aborted) before the call."""


class ConfigError(UsageError):
    """An environment variable or init() argument is malformed or missing."""


# --- the job went wrong: peers, links, time ---------------------------------------------------


class CommunicationError(AhcommError):
    """A collective could not complete because of the job, not the call."""


class ConnectError(CommunicationError):
    """Rendezvous or link set-up failed."""


class TransportError(CommunicationError):
    """A link broke or received something it could not accept."""


class CollectiveTimeout(CommunicationError, TimeoutError):
    """A collective did not complete in time."""


class PeerFailure(CommunicationError):
    """A peer rank died or aborted."""

    def __init__(self, message: str, rank: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank


class CollectiveMismatchError(CommunicationError):
    """Ranks issued different collectives at the same sequence number."""

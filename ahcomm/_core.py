"""The seams inside a communicator: its queued job, and the two views its parts get of it.

``Comm`` (``_comm``) owns the state: the sequence numbers, the queue, the worker and the
executor. Its parts never reach into one another:

* the front ends (``_collectives``, ``_objects``, ``_p2p``) are mixins typed against one
  Protocol, ``CommCore``: the few methods every collective is built from (``_submit`` and
  the argument checks). ``Comm`` implements it; mypy checks that its ``_submit`` is the one
  they call (no copied stubs to drift).
* the failure handling (``Health``, ``_health``) is a component ``Comm`` owns. It reads the
  communicator through ``CommState``, a read-only view (``Comm`` itself satisfies it at no
  cost), and changes it only through ``_drain_queue()``: a failure takes the queued jobs.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import numpy as np

from ._flight import Entry
from .algorithms.base import Algorithm, Call

if TYPE_CHECKING:
    from ._errors import UsageError
    from .transports.base import Link


async def cancel_and_wait(task: asyncio.Task[Any] | None) -> None:
    """Cancel ``task`` (if still running) and wait until it has ended, whatever it raises."""
    if task is not None and not task.done():
        task.cancel()
        try:
            await task
        except BaseException:  # noqa: BLE001 - it is being stopped: how it ends does not matter
            pass


class Gathered(NamedTuple):
    """An uneven result: the data and how many rows (axis 0) came from each rank."""

    data: np.ndarray
    counts: tuple[int, ...]


@dataclass(slots=True)
class Job:
    """One issued collective, from its call to its result."""

    call: Call
    algorithm: Algorithm | None  # None until ``prepare`` has run (it chooses)
    src: np.ndarray  # flat, contiguous
    dst: np.ndarray  # flat, contiguous (may be src itself)
    result: Any  # what the caller gets back (an array, a Gathered, or None)
    finish: Callable[[], None] | None  # after the run: avg division, copy to a strided out
    future: asyncio.Future[Any]
    prepare: Callable[[Job], None] | None = None  # fills the job in when its turn comes
    override: str | None = None  # the per-call algorithm= (for a job prepared later)
    timeout: float | None = None  # the per-call timeout= (None: AHCOMM_EXEC_TIMEOUT)
    entry: Entry | None = None  # its flight-recorder entry
    probed: bool = False  # its fingerprint was announced to the peers (it ran long)
    ready: Callable[[int, int], Awaitable[None]] | None = None  # src elements [lo, hi) landed on the host


class CommCore(Protocol):
    """What the front ends (collectives, objects, point-to-point) build on."""

    rank: int
    size: int
    _seq: int
    _exec_timeout: float

    def _check_open(self, what: str = "", *, queued: bool = False) -> None: ...
    def _live(self) -> bool: ...  # neither closed nor failed
    def _check_root(self, root: int, what: str) -> None: ...
    def _input(self, x: Any, what: str) -> tuple[np.ndarray, np.dtype]: ...
    def _output(self, op: str, out: np.ndarray | None, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray: ...
    def _submit(self, call: Call, src: np.ndarray, dst: np.ndarray, result: Any,
                finish: Callable[[], None] | None, algorithm: str | None, *,
                prepare: Callable[[Job], None] | None = None, later: bool = False,
                timeout: float | None = None,
                ready: Callable[[int, int], Awaitable[None]] | None = None) -> asyncio.Future[Any]: ...
    def _p2p_links(self) -> dict[int, Link]: ...

    # collectives one front end builds from another's (objects from all_gather_v, gather_v, ...)
    def _reject(self, op: str, exc: UsageError, root: int = 0) -> UsageError: ...
    def broadcast(self, x: Any, root: int = 0, *, out: np.ndarray | None = None, algorithm: str | None = None,
                  timeout: float | None = None) -> asyncio.Future[np.ndarray]: ...
    def all_gather(self, x: Any, *, out: np.ndarray | None = None, algorithm: str | None = None,
                   timeout: float | None = None) -> asyncio.Future[np.ndarray]: ...
    def all_gather_v(self, x: Any, *, counts: Any = None, out: np.ndarray | None = None,
                     algorithm: str | None = None, timeout: float | None = None) -> asyncio.Future[Gathered]: ...
    def _gather(self, arr: np.ndarray, root: int, rows: tuple[int, ...] | None, out: np.ndarray | None,
                algorithm: str | None, op: str, *, uneven: bool,
                later: Callable[[], tuple[int, ...]] | None = None,
                timeout: float | None = None) -> asyncio.Future[Any]: ...


if TYPE_CHECKING:
    FrontEnd = CommCore  # a front end's methods see CommCore's members (mypy only)
else:
    FrontEnd = object


class Members(Protocol):
    """A communicator's place among its members: this rank, their number, each one's world rank."""

    @property
    def rank(self) -> int: ...
    @property
    def size(self) -> int: ...
    @property
    def world_ranks(self) -> tuple[int, ...]: ...


class CommState(Members, Protocol):
    """What ``Health`` reads of its communicator. Read-only: it changes nothing through it but
    the queue, which a failure drains (``_drain_queue``)."""
    @property
    def _parent(self) -> object | None: ...  # a sub-communicator names world ranks too
    @property
    def _seq(self) -> int: ...  # the next call's sequence number
    @property
    def _exec_timeout(self) -> float: ...
    @property
    def _loop(self) -> asyncio.AbstractEventLoop | None: ...
    @property
    def _thread(self) -> int: ...
    @property
    def _closed(self) -> bool: ...
    @property
    def _closing(self) -> bool: ...  # close() passed its barrier: peers going away is expected
    @property
    def _running(self) -> Job | None: ...
    @property
    def _started(self) -> float: ...  # loop time the running job started
    @property
    def _started_seq(self) -> int: ...
    @property
    def _done_seq(self) -> int: ...
    @property
    def _queue(self) -> Sequence[Job]: ...

    def _drain_queue(self) -> list[Job]:
        """Take every queued job (the communicator failed: they will never run)."""
        ...

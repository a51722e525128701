"""The API's entry for device tensors: ``device_aware`` lets a collective take tensors and
array-likes, staging them to host arrays (``_devices.stage``) and giving results back as the
caller's type."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any, TypeVar, cast, overload

import numpy as np

from ._devices import Staged, stage

__all__ = ["device_aware", "take_staging"]

F = TypeVar("F", bound=Callable[..., Any])


def _is_host(x: Any) -> bool:
    return x is None or type(x) is np.ndarray


async def _finished(future: "asyncio.Future[Any]", staged: Staged) -> Any:
    try:
        result = await future
    except BaseException:
        staged.release()
        raise
    counts = getattr(result, "counts", None)
    if counts is not None and hasattr(result, "data"):  # an uneven result: (data, counts)
        return type(result)(staged.finish(result.data), counts)
    return staged.finish(result)


_STAGING: ContextVar["Staged | None"] = ContextVar("ahcomm_staging", default=None)


def take_staging() -> "Staged | None":
    """The device input being issued by a ``device_aware(sliced=True)`` collective, if its
    copy to the host is still in flight (None otherwise). Taking it clears it, so no task
    created afterwards (a worker, a stream) keeps it alive in its copy of the context."""
    staged = _STAGING.get()
    if staged is not None:
        _STAGING.set(None)
    return staged


@overload
def device_aware(method: F) -> F: ...
@overload
def device_aware(*, sliced: bool = False) -> Callable[[F], F]: ...


def device_aware(method: F | None = None, *, sliced: bool = False) -> F | Callable[[F], F]:
    """Let a collective ``method(self, x, ..., out=None, ...)`` take tensors and array-likes.

    Host numpy arrays go straight through. Anything else is staged (``stage``), given to the
    collective as numpy, and the result comes back as the caller's type on the caller's device
    (``Staged.finish``). The input's device-to-host copy is waited for before the call, except
    for a ``sliced`` method (``@device_aware(sliced=True)``): while it runs, ``take_staging()``
    returns the ``Staged``, which the collective hands to the executor to wait slice by slice
    (``Staged.ready``), so the copy of slice k+1 overlaps the communication of slice k.
    """
    if method is None:
        return cast(Callable[[F], F], functools.partial(device_aware, sliced=sliced))

    @functools.wraps(method)
    def wrapper(self: Any, x: Any, *args: Any, out: Any = None, **kwargs: Any) -> Any:
        if _is_host(x) and _is_host(out):
            return method(self, x, *args, out=out, **kwargs)
        from ._errors import InvalidArgument

        try:
            staged = stage(np.empty(0, np.uint8) if x is None else x, out)
        except TypeError as exc:
            raise InvalidArgument(f"{method.__name__}: {exc}") from None
        overlap = sliced and staged.pending
        if not overlap:
            staged.wait()
        host_out = staged.out_for(()) if out is not None else None
        token = _STAGING.set(staged if overlap else None)
        try:
            future = method(self, staged.array if x is not None else None, *args, out=host_out, **kwargs)
        except BaseException:
            staged.release()
            raise
        finally:
            _STAGING.reset(token)
        return asyncio.ensure_future(_finished(future, staged))
    return cast(F, wrapper)

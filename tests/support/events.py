"""Link events for tests: a communicator's own, with some replaced or dropped."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ahcomm.transports.base import LinkEvents


class Events:
    """``LinkEvents`` that go to ``base`` (a link's ``events``, or None) except the ones given:
    ``Events(link.events, on_control=None)`` drops control messages, ``on_lost=f`` sends the
    peer's loss to ``f`` instead."""

    def __init__(self, base: LinkEvents | None = None, **handlers: Callable[..., None] | None) -> None:
        self._base = base
        self._handlers = handlers

    def _call(self, name: str, *args: Any) -> None:
        if name in self._handlers:
            handler = self._handlers[name]
            if handler is not None:
                handler(*args)
        elif self._base is not None:
            getattr(self._base, name)(*args)

    def on_abort(self, peer: int, reason: str) -> None:
        self._call("on_abort", peer, reason)

    def on_fingerprint(self, peer: int, seq: int, fp: int) -> None:
        self._call("on_fingerprint", peer, seq, fp)

    def on_control(self, peer: int, payload: bytes) -> None:
        self._call("on_control", peer, payload)

    def on_lost(self, peer: int, reason: str) -> None:
        self._call("on_lost", peer, reason)

    def on_broken(self, peer: int, reason: str) -> None:
        self._call("on_broken", peer, reason)

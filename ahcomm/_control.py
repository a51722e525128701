"""Control messages between a job's communicators: one-way notices and requests with replies.

A part of ``Health`` (``_health``): a control message is ``CONTROL`` then a msgpack dict whose
``"t"`` names its kind. A request carries an ``"id"``; the peer answers with ``{"t": "re",
"id": ...}``, and ``ask_all`` waits a bounded time for the answers.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import msgpack

from .algorithms._executor import Executor

CONTROL = b"AHc1"  # prefix of this layer's control messages (msgpack follows)


def pack(msg: dict[str, Any]) -> bytes:
    """``msg`` as a control message."""
    packed: bytes = msgpack.packb(msg, use_bin_type=True)
    return CONTROL + packed


def unpack(payload: bytes) -> dict[str, Any] | None:
    """The message a control payload carries (None: not one of this layer's, or not a dict)."""
    if not payload.startswith(CONTROL):
        return None
    msg = msgpack.unpackb(payload[len(CONTROL):], raw=False)
    return msg if isinstance(msg, dict) else None


class Requests:
    """Control messages to the peers over the executor's links, and the replies awaited."""

    def __init__(self, executor: Executor) -> None:
        self._executor = executor
        self._waiting: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._ids = itertools.count(1)

    def send_all(self, msg: dict[str, Any]) -> None:
        """Send ``msg`` to every peer."""
        payload = pack(msg)
        for peer in self._executor.links:
            self._executor.send_control(peer, payload)

    def send_all_acked(self, msg: dict[str, Any]) -> list["asyncio.Future[dict[str, Any]]"]:
        """Send ``msg`` to every peer now, as a request: the futures of their acknowledgements
        (a peer acknowledges a notice on arrival; see ``forget``)."""
        loop = asyncio.get_running_loop()
        acks: list[asyncio.Future[dict[str, Any]]] = []
        for peer in self._executor.links:
            rid = next(self._ids)
            if self._executor.send_control(peer, pack({**msg, "id": rid})):
                fut: asyncio.Future[dict[str, Any]] = loop.create_future()
                self._waiting[rid] = fut
                acks.append(fut)
        return acks

    def forget(self, acks: list["asyncio.Future[dict[str, Any]]"]) -> None:
        """Stop waiting for the acknowledgements ``acks``."""
        for rid, fut in list(self._waiting.items()):
            if fut in acks:
                del self._waiting[rid]
                fut.cancel()

    def reply(self, peer: int, request: dict[str, Any], answer: dict[str, Any]) -> None:
        self._executor.send_control(peer, pack({"t": "re", "id": request.get("id", 0), **answer}))

    def replied(self, msg: dict[str, Any]) -> None:
        """A reply arrived: it answers the request with its id, if still awaited."""
        fut = self._waiting.pop(int(msg.get("id", 0)), None)
        if fut is not None and not fut.done():
            fut.set_result(msg)

    async def ask(self, peer: int, msg: dict[str, Any], wait: float) -> dict[str, Any] | None:
        """Send a request to ``peer``; its reply (None if none came within ``wait`` seconds)."""
        return (await self.ask_all(msg, wait, [peer])).get(peer)

    async def ask_all(self, msg: dict[str, Any], wait: float,
                      peers: list[int] | None = None) -> dict[int, dict[str, Any] | None]:
        """Send ``msg`` to every peer (or ``peers``); their replies within ``wait`` seconds (None: no reply)."""
        loop = asyncio.get_running_loop()
        waiting: dict[int, asyncio.Future[dict[str, Any]]] = {}
        ids = []
        for peer in (peers if peers is not None else list(self._executor.links)):
            rid = next(self._ids)
            fut: asyncio.Future[dict[str, Any]] = loop.create_future()
            self._waiting[rid] = fut
            ids.append(rid)
            if self._executor.send_control(peer, pack({**msg, "id": rid})):
                waiting[peer] = fut
        try:
            if waiting:
                await asyncio.wait(list(waiting.values()), timeout=wait)
        finally:
            for rid in ids:
                self._waiting.pop(rid, None)
        asked = peers if peers is not None else self._executor.links
        out: dict[int, dict[str, Any] | None] = dict.fromkeys(asked)
        for peer, fut in waiting.items():
            if fut.done() and not fut.cancelled():
                out[peer] = fut.result()
            else:
                fut.cancel()
        return out

    def close(self) -> None:
        """Give up on every reply still awaited."""
        for fut in self._waiting.values():
            fut.cancel()
        self._waiting.clear()

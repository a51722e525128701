"""Hosts agree on their ranks before any rank starts (``ahcomm-run --nnodes``, torchrun's style).

Each host may start a different number of ranks (``--nproc-per-node 2`` on one, 1 on another):
host 0's launcher serves ``--master-addr:--master-port`` until every host has said how many ranks
it starts, then tells each its first rank (hosts in ``--node-rank`` order) and the world size, and
closes the port before its own rank 0 binds it for the rendezvous. Every message is one JSON line
with an HMAC-SHA256 of its content under the job secret: a stranger's bytes are dropped.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
from typing import Any

JOIN_TIMEOUT = 300.0  # seconds the hosts have to reach each other
MAX_LINE = 4096


def _mac(secret: str, body: dict[str, Any]) -> str:
    text = json.dumps(body, sort_keys=True).encode()
    return hmac.new(secret.encode(), text, hashlib.sha256).hexdigest()


def _line(secret: str, body: dict[str, Any]) -> bytes:
    return json.dumps({**body, "mac": _mac(secret, body)}).encode() + b"\n"


def _read(secret: str, raw: bytes) -> dict[str, Any] | None:
    """The body of a signed line (None: not one, or signed with another secret)."""
    try:
        msg = json.loads(raw)
        mac = str(msg.pop("mac"))
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    return msg if isinstance(msg, dict) and hmac.compare_digest(mac, _mac(secret, msg)) else None


async def agree(node: int, nnodes: int, nproc: int, addr: str, port: int, secret: str,
                timeout: float = JOIN_TIMEOUT) -> tuple[int, int]:
    """(first rank, world size) of host ``node`` of ``nnodes``, which starts ``nproc`` ranks."""
    if node == 0:
        return await asyncio.wait_for(_serve(nnodes, nproc, addr, port, secret), timeout)
    return await asyncio.wait_for(_join(node, nproc, addr, port, secret), timeout)


async def _serve(nnodes: int, nproc: int, addr: str, port: int, secret: str) -> tuple[int, int]:
    counts: dict[int, int] = {0: nproc}
    writers: dict[int, asyncio.StreamWriter] = {}
    everyone = asyncio.get_running_loop().create_future()

    async def host(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            msg = _read(secret, await reader.readuntil(b"\n"))
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            msg = None
        node, count = (msg or {}).get("node"), (msg or {}).get("nproc")
        if not (isinstance(node, int) and isinstance(count, int) and 0 < node < nnodes and count > 0):
            writer.close()
            return
        counts[node], writers[node] = count, writer
        if len(counts) == nnodes and not everyone.done():
            everyone.set_result(None)

    server = await asyncio.start_server(host, addr, port, limit=MAX_LINE, reuse_address=True)
    try:
        await everyone
    finally:
        server.close()
    size, first = sum(counts.values()), {}
    offset = 0
    for node in sorted(counts):
        first[node], offset = offset, offset + counts[node]
    for node, writer in writers.items():
        writer.write(_line(secret, {"node": node, "first": first[node], "size": size}))
        await writer.drain()
        writer.close()
    await server.wait_closed()
    return 0, size


async def _join(node: int, nproc: int, addr: str, port: int, secret: str) -> tuple[int, int]:
    while True:
        try:
            reader, writer = await asyncio.open_connection(addr, port, limit=MAX_LINE)
        except OSError:  # host 0 not listening yet
            await asyncio.sleep(0.2)
            continue
        writer.write(_line(secret, {"node": node, "nproc": nproc}))
        await writer.drain()
        try:
            raw = await reader.readuntil(b"\n")
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()
            await asyncio.sleep(0.2)  # refused (another job's port?) or closed early: try again
            continue
        writer.close()
        msg = _read(secret, raw)
        if msg is not None and msg.get("node") == node:
            return int(msg["first"]), int(msg["size"])
        await asyncio.sleep(0.2)

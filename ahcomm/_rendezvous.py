"""Rendezvous: rank 0 serves a small ZeroMQ endpoint where every rank registers what peers
need to reach it (host identity, link endpoints, shared-memory names) and gets the table
of all ranks back. Messages are msgpack maps; nothing is unpickled."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from ._errors import ConnectError

MAX_MESSAGE = 1 << 20


def host_identity(override: str | None = None) -> str:
    """This server's identity: AHCOMM_SERVER_ID if set, else hostname + boot id."""
    if override:
        return override
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "noboot"
    return f"{socket.gethostname()}/{boot}"


def local_address(master_addr: str) -> str:
    """The address of the interface this host uses to reach ``master_addr``."""
    try:
        infos = socket.getaddrinfo(master_addr, None, socket.AF_INET)
        ip = str(infos[0][4][0])
    except OSError:
        return "127.0.0.1"
    if ip.startswith("127."):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((ip, 9))
            return str(probe.getsockname()[0])
        except OSError:
            return "127.0.0.1"


def _resolve(addr: str) -> str:
    try:
        return str(socket.getaddrinfo(addr, None, socket.AF_INET)[0][4][0])
    except OSError as exc:
        raise ConnectError(f"cannot resolve master address {addr!r}: {exc}") from exc


def _socket(kind: int) -> zmq.asyncio.Socket:
    sock = zmq.asyncio.Context.instance().socket(kind)
    sock.setsockopt(zmq.LINGER, 2000)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE)
    return sock


async def serve(addr: str, port: int, size: int, timeout: float) -> None:
    """Rank 0: collect ``size`` registrations, check them, send everyone the table."""
    sock = _socket(zmq.ROUTER)
    try:
        sock.bind(f"tcp://{_resolve(addr)}:{port}")
    except zmq.ZMQError as exc:
        sock.close(0)
        raise ConnectError(f"rank 0 cannot serve the rendezvous on {addr}:{port}: {exc}") from exc
    try:
        async with asyncio.timeout(timeout):
            entries: dict[int, dict[str, Any]] = {}
            idents: dict[int, bytes] = {}
            error = ""
            while len(entries) < size:
                ident, raw = await sock.recv_multipart()
                try:
                    info = msgpack.unpackb(raw, raw=False)
                    rank, their_size = int(info["rank"]), int(info["size"])
                except Exception:  # noqa: BLE001 - a stranger's bytes
                    continue
                if their_size != size or not 0 <= rank < size or rank in entries:
                    error = error or (f"rank {rank} registered with world size {their_size}"
                                      f" (rank 0 has {size}), or twice, or out of range")
                entries[rank] = info
                idents[rank] = ident
                if error:
                    break
            sizes = {int(e["buffsize"]) for e in entries.values()}
            if not error and len(sizes) > 1:
                error = f"ranks disagree on AHCOMM_BUFFSIZE: {sorted(sizes)} bytes"
            reply = {"error": error} if error else {"table": [entries[r] for r in range(size)]}
            packed = msgpack.packb(reply)
            for ident in idents.values():
                await sock.send_multipart([ident, packed])
    except TimeoutError:
        missing = sorted(set(range(size)) - set(entries))
        raise ConnectError(f"rendezvous timed out after {timeout:g} s: ranks {missing} never registered "
                           "(AHCOMM_CONNECT_TIMEOUT)") from None
    finally:
        sock.close()


async def register(addr: str, port: int, info: dict[str, Any], timeout: float) -> list[dict[str, Any]]:
    """Every rank: send our entry to rank 0 and get the table of all ranks."""
    sock = _socket(zmq.DEALER)
    sock.connect(f"tcp://{_resolve(addr)}:{port}")
    try:
        await sock.send(msgpack.packb(info))
        async with asyncio.timeout(timeout):
            raw = await sock.recv()
    except TimeoutError:
        raise ConnectError(f"rank {info['rank']}: no answer from the rendezvous at {addr}:{port} within "
                           f"{timeout:g} s (is rank 0 running? AHCOMM_CONNECT_TIMEOUT)") from None
    finally:
        sock.close()
    reply = msgpack.unpackb(raw, raw=False)
    if reply.get("error"):
        raise ConnectError(f"rendezvous refused rank {info['rank']}: {reply['error']}")
    return list(reply["table"])


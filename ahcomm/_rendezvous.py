"""Rendezvous: rank 0 serves a small ZeroMQ endpoint where every rank registers what peers
need to reach it (host identity, link endpoints, shared-memory names) and gets the table
of all ranks back. Messages are msgpack maps; nothing is unpickled.

The endpoint binds the master address only (never a wildcard) and authenticates every
connection with the job secret (``transports._auth``). Decoding is bounded: frames over
``MAX_MESSAGE`` bytes are refused by libzmq before they are allocated, msgpack is read with
limits on every length, and each registration is checked field by field; anything else is
counted in ``RendezvousStats`` and dropped, so a stranger's bytes never end the rendezvous.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from dataclasses import dataclass, field
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from ._buffers import SHM_PREFIX
from ._errors import ConnectError
from .transports._auth import AUTH, HANDSHAKE_FAILED, Credentials, Domain, async_context

MAX_MESSAGE = 1 << 20  # bytes of one rendezvous frame (a registration, or the table)
WIRE_SLACK = 4096  # CURVE's framing overhead
MAX_STR = 4096  # characters of any string in a registration
LINGER = 10.0  # seconds a failed rendezvous still answers ranks that register late
REPLY_SLACK = 5.0  # a rank waits this much longer than rank 0, whose answer names the cause
MAX_DEPTH = 4  # nesting of maps/arrays in the cost model a registration may carry
ENDPOINT_KINDS = ("ipc", "tcp")
_UNPACK_LIMITS = dict(max_str_len=MAX_STR, max_bin_len=0, max_array_len=1 << 16, max_map_len=256, max_ext_len=0)

log = logging.getLogger("ahcomm.security")


@dataclass
class RendezvousStats:
    """What rank 0's rendezvous refused: malformed messages, unauthenticated connections."""

    rejected_messages: int = 0
    rejected_handshakes: int = 0
    last_endpoint: str = ""  # what the server bound (tests check it is not a wildcard)
    reasons: list[str] = field(default_factory=list)  # the first few reasons, for diagnostics

    def reject(self, reason: str) -> None:
        self.rejected_messages += 1
        if len(self.reasons) < 16:
            self.reasons.append(reason)
        if self.rejected_messages <= 3 or self.rejected_messages % 100 == 0:
            log.warning("rendezvous dropped a malformed message (%d so far): %s", self.rejected_messages, reason)


def _unpack(raw: bytes) -> Any:
    if len(raw) > MAX_MESSAGE:
        raise ValueError(f"a message of {len(raw)} bytes (at most {MAX_MESSAGE})")
    return msgpack.unpackb(raw, raw=False, strict_map_key=True, use_list=True, **_UNPACK_LIMITS)


def _plain(value: Any, depth: int = 0) -> bool:
    """msgpack data made of maps with str keys, lists, str, numbers, bools and None, not too deep."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if depth >= MAX_DEPTH:
        return False
    if isinstance(value, list):
        return all(_plain(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v, depth + 1) for k, v in value.items())
    return False


def _int(info: dict[str, Any], key: str, low: int, high: int) -> int:
    value = info.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ValueError(f"{key!r} must be an integer in [{low}, {high}], got {str(value)[:40]!r}")
    return value


def check_entry(info: Any) -> dict[str, Any]:
    """A registration, checked field by field (raises ValueError naming the first bad field)."""
    if not isinstance(info, dict):
        raise ValueError(f"a registration must be a map, got {type(info).__name__}")
    _int(info, "rank", 0, 1 << 30)
    _int(info, "size", 1, 1 << 30)
    if "error" in info:  # a rank that failed before it could register (see failure())
        _int(info, "pid", 0, 1 << 31)
        if not isinstance(info["error"], str) or not info["error"] or not isinstance(info.get("host"), str):
            raise ValueError("an error registration needs a non-empty 'error' string and a 'host'")
        return info
    _int(info, "buffsize", 1, 1 << 50)
    _int(info, "pid", 0, 1 << 31)
    _int(info, "probe", 0, (1 << 64) - 1)
    if not isinstance(info.get("host"), str):
        raise ValueError("'host' must be a string")
    endpoints = info.get("endpoints")
    if (not isinstance(endpoints, dict) or not endpoints or
            not all(k in ENDPOINT_KINDS and isinstance(v, str) and v.startswith(f"{k}://")
                    for k, v in endpoints.items())):
        raise ValueError("'endpoints' must map 'ipc'/'tcp' to addresses of that kind")
    shm = info.get("shm")
    if shm is not None and not (isinstance(shm, list) and len(shm) == 2 and all(isinstance(n, str) for n in shm)):
        raise ValueError("'shm' must be None or two names")
    memory = info.get("memory")
    if memory is not None and not (isinstance(memory, str) and memory.startswith(SHM_PREFIX)
                                   and "/" not in memory and "\0" not in memory and len(memory) < 200):
        raise ValueError(f"'memory' must be None or a shared-memory name, got {str(memory)[:40]!r}")
    tuning = info.get("tuning")
    if tuning is not None and not (isinstance(tuning, dict) and _plain(tuning)):
        raise ValueError("'tuning' must be a small map of numbers and strings")
    return info


def check_reply(reply: Any, size: int) -> dict[str, Any]:
    """Rank 0's answer: an error string, or the table of ``size`` registrations in rank order."""
    if not isinstance(reply, dict):
        raise ValueError("the reply must be a map")
    if reply.get("error"):
        if not isinstance(reply["error"], str):
            raise ValueError("'error' must be a string")
        return reply
    table = reply.get("table")
    if not isinstance(table, list) or len(table) != size:
        raise ValueError(f"'table' must list {size} registrations")
    for rank, entry in enumerate(table):
        if check_entry(entry)["rank"] != rank:
            raise ValueError(f"entry {rank} of the table is rank {entry['rank']}")
    return reply


def host_identity(override: str | None = None) -> str:
    """This server's identity: AHCOMM_SERVER_ID if set, else hostname + boot id + network
    namespace. Ranks with one identity share a kernel *and* a network (ipc endpoints are
    abstract sockets, which a network namespace does not share), so sdma links can reach them."""
    if override:
        return override
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "noboot"
    try:
        netns = f"/net{os.stat('/proc/self/ns/net').st_ino}"
    except OSError:
        netns = ""
    return f"{socket.gethostname()}/{boot}{netns}"


def interface_addresses() -> list[tuple[str, str]]:
    """(interface name, IPv4 address) of this host's interfaces that have one, in index order."""
    import fcntl
    import struct

    out = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(probe.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))  # SIOCGIFADDR
            except OSError:
                continue  # no IPv4 address
            out.append((name, socket.inet_ntoa(raw[20:24])))
    return out


def match_interface(spec: str, interfaces: list[tuple[str, str]]) -> str | None:
    """The address of the first interface ``spec`` selects, in NCCL_SOCKET_IFNAME's grammar:
    ``eth`` (name prefixes, comma-separated), ``^docker,lo`` (all but those prefixes),
    ``=eth0`` (exact names). Interfaces are tried in index order."""
    spec = spec.strip()
    exact, exclude = spec.startswith("="), spec.startswith("^")
    names = [n.strip() for n in spec.lstrip("=^").split(",") if n.strip()]
    for name, addr in interfaces:
        if exact:
            hit = name in names
        elif exclude:
            hit = not any(name.startswith(n) for n in names)
        else:
            hit = any(name.startswith(n) for n in names)
        if hit:
            return addr
    return None


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
    sock = async_context().socket(kind)
    sock.setsockopt(zmq.LINGER, 2000)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE + WIRE_SLACK)
    return sock


def _refusals(domain: Domain) -> str:
    n = domain.rejected_handshakes
    if not n:
        return ""
    return (f"; the rendezvous refused {n} connection{'s' if n > 1 else ''} that did not authenticate (a rank "
            "started with another AHCOMM_JOB_SECRET or AHCOMM_ENCRYPT? see the ahcomm.security warnings)")


def _conflict(info: dict[str, Any], entries: dict[int, dict[str, Any]], size: int) -> str:
    """Why a registration cannot join this job ("" if it can)."""
    rank, their_size = info["rank"], info["size"]
    if their_size != size:
        return f"rank {rank} registered with world size {their_size}, but rank 0 has {size}"
    if not 0 <= rank < size:
        return f"rank {rank} is out of range for world size {size}"
    if rank in entries:
        first = entries[rank]
        return (f"rank {rank} was started twice (pid {first['pid']} on {first['host']}, "
                f"and pid {info['pid']} on {info['host']})")
    return ""


def failure(rank: int, size: int, host: str, error: str) -> dict[str, Any]:
    """The registration of a rank that failed during init before it could register (its
    /dev/shm full, say): rank 0's rendezvous answers every rank with ``error``."""
    limit = (MAX_STR - 64) // 4  # characters: msgpack's limit is in bytes of UTF-8
    text = f"rank {rank} failed during init: {error}"
    return {"rank": rank, "size": size, "host": host[:256], "pid": os.getpid(),
            "error": text if len(text) <= limit else text[:limit] + "..."}


async def serve(addr: str, port: int, size: int, timeout: float, creds: Credentials | None = None,
                stats: RendezvousStats | None = None, bound: "asyncio.Future[int] | None" = None,
                failed: str = "") -> None:
    """Rank 0: collect ``size`` registrations, check them, send everyone the table.

    ``port`` 0 binds a free port, which ``bound`` is given. On a failure (a rank twice, a world
    size that differs, ranks that never came, a rank that registers the error it failed with)
    every rank that registered gets the cause, and for up to ``LINGER`` seconds so does every
    rank that registers after it. ``failed``: rank 0 itself failed during init with this error,
    which is all this server answers (rank 0 does not register)."""
    creds = creds or Credentials("null")
    stats = stats if stats is not None else RendezvousStats()
    domain = AUTH.register("the rendezvous", creds)
    sock = _socket(zmq.ROUTER)
    creds.server(sock, domain)
    monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
    watcher = asyncio.ensure_future(_count_refusals(monitor, domain))
    entries: dict[int, dict[str, Any]] = {}
    waiting: list[tuple[bytes, int]] = []  # (identity, rank) of every registration, duplicates too
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    try:
        try:
            sock.bind(f"tcp://{_resolve(addr)}:{port}")
        except zmq.ZMQError as exc:
            hint = (" (is another rank 0 running, or torchrun's store on this port?)"
                    if exc.errno == zmq.EADDRINUSE else "")
            raise ConnectError(f"rank 0 cannot serve the rendezvous on {addr}:{port}: {exc}{hint}") from exc
        stats.last_endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        if bound is not None and not bound.done():
            bound.set_result(int(stats.last_endpoint.rsplit(":", 1)[1]))
        error = failed
        try:
            async with asyncio.timeout_at(deadline):
                while len(entries) < size and not error:
                    received = await _receive(sock, stats)
                    if received is None:
                        continue
                    ident, info = received
                    waiting.append((ident, info["rank"]))
                    if info.get("error"):
                        error = str(info["error"])
                        continue
                    error = _conflict(info, entries, size)
                    entries.setdefault(info["rank"], info)
        except TimeoutError:
            missing = sorted(set(range(size)) - set(entries))
            error = (f"rendezvous timed out after {timeout:g} s: ranks {missing} never registered "
                     f"(AHCOMM_CONNECT_TIMEOUT){_refusals(domain)}")
            await _answer(sock, waiting, {"error": error})
            raise ConnectError(error) from None
        sizes = {int(e["buffsize"]) for e in entries.values()}
        if not error and len(sizes) > 1:
            error = f"ranks disagree on AHCOMM_BUFFSIZE: {sorted(sizes)} bytes"
        reply: dict[str, Any] = {"error": error} if error else {"table": [entries[r] for r in range(size)]}
        if len(msgpack.packb(reply)) > MAX_MESSAGE:
            reply = {"error": f"the table of {size} ranks is over {MAX_MESSAGE} bytes"}
        await _answer(sock, waiting, reply)
        if reply.get("error"):
            told = {r for _, r in waiting} | ({0} if failed else set())
            await _linger(sock, stats, told, size, reply, min(deadline, loop.time() + LINGER))
    finally:  # sockets closed before any await (see register)
        watcher.cancel()
        sock.disable_monitor()
        monitor.close(0)
        sock.close()
        AUTH.unregister(domain)
        stats.rejected_handshakes = domain.rejected_handshakes
        await asyncio.gather(watcher, return_exceptions=True)


async def _receive(sock: zmq.asyncio.Socket, stats: RendezvousStats) -> tuple[bytes, dict[str, Any]] | None:
    """One registration (None for a malformed message, which is counted and dropped)."""
    frames = await sock.recv_multipart()
    if len(frames) != 2:
        stats.reject(f"a message of {len(frames) - 1} frames (expected 1)")
        return None
    try:
        return frames[0], check_entry(_unpack(frames[1]))
    except Exception as exc:  # noqa: BLE001 - a stranger's bytes
        stats.reject(f"{type(exc).__name__}: {str(exc)[:200]}")
        return None


async def _answer(sock: zmq.asyncio.Socket, waiting: list[tuple[bytes, int]], reply: dict[str, Any]) -> None:
    packed = msgpack.packb(reply)
    for ident, _ in waiting:
        await sock.send_multipart([ident, packed])


async def _linger(sock: zmq.asyncio.Socket, stats: RendezvousStats, told: set[int], size: int,
                  reply: dict[str, Any], until: float) -> None:
    """After a failure: answer ranks that register late with it, until every rank was told."""
    try:
        async with asyncio.timeout_at(until):
            while not set(range(size)) <= told:
                received = await _receive(sock, stats)
                if received is not None:
                    await _answer(sock, [(received[0], received[1]["rank"])], reply)
                    told.add(received[1]["rank"])
    except TimeoutError:
        pass


async def _count_refusals(monitor: zmq.asyncio.Socket, domain: Domain) -> None:
    """Connections libzmq refused before ZAP was asked (no credentials, another mechanism)."""
    while True:
        frames = await monitor.recv_multipart()
        if len(frames[0]) == 6:
            event = int.from_bytes(frames[0][:2], "little")
            domain.refused(None, HANDSHAKE_FAILED.get(event, "the handshake failed"))


async def _watch(monitor: zmq.asyncio.Socket, connected: list[bool]) -> str:
    """Returns why, once the server refused our handshake; notes a handshake that succeeded."""
    while True:
        frames = await monitor.recv_multipart()
        if len(frames[0]) == 6:
            event = int.from_bytes(frames[0][:2], "little")
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                connected.append(True)
            elif event in HANDSHAKE_FAILED:
                return HANDSHAKE_FAILED[event]


async def register(addr: str, port: int, info: dict[str, Any], timeout: float | None,
                   creds: Credentials | None = None) -> list[dict[str, Any]]:
    """Every rank: send our entry to rank 0 and get the table of all ranks (``timeout`` None:
    rank 0's own registration, which its server's diagnosis ends)."""
    creds = creds or Credentials("null")
    sock = _socket(zmq.DEALER)
    creds.client(sock)
    monitor = sock.get_monitor_socket(sum(HANDSHAKE_FAILED) | zmq.EVENT_HANDSHAKE_SUCCEEDED)
    sock.connect(f"tcp://{_resolve(addr)}:{port}")
    connected: list[bool] = []
    refused = asyncio.ensure_future(_watch(monitor, connected))
    answer: asyncio.Future[bytes] | None = None
    try:
        await sock.send(msgpack.packb(info))
        answer = asyncio.ensure_future(sock.recv())
        async with asyncio.timeout(timeout):
            await asyncio.wait({answer, refused}, return_when=asyncio.FIRST_COMPLETED)
        if not answer.done():
            raise ConnectError(f"rank {info['rank']}: the rendezvous at {addr}:{port} refused this rank: "
                               f"{refused.result()}; every rank needs the same AHCOMM_JOB_SECRET and AHCOMM_ENCRYPT")
        raw = answer.result()
    except TimeoutError:
        if connected:
            raise ConnectError(f"rank {info['rank']}: rank 0's rendezvous at {addr}:{port} took this rank's "
                               f"registration but sent no answer within {timeout:g} s (did rank 0 die? "
                               "AHCOMM_CONNECT_TIMEOUT)") from None
        raise ConnectError(f"rank {info['rank']}: no answer from the rendezvous at {addr}:{port} within "
                           f"{timeout:g} s: nothing accepted a connection there (is rank 0 running? is "
                           "AHCOMM_MASTER_ADDR an address of rank 0's host? AHCOMM_CONNECT_TIMEOUT)") from None
    finally:  # sockets closed before any await: a cancel here must not leak them (exit would hang)
        for task in (refused, answer):
            if task is not None and not task.done():
                task.cancel()
        sock.disable_monitor()
        monitor.close(0)
        sock.close()
        await asyncio.gather(*(t for t in (refused, answer) if t is not None), return_exceptions=True)
    try:
        reply = check_reply(_unpack(raw), int(info["size"]))
    except Exception as exc:  # noqa: BLE001
        raise ConnectError(f"rank {info['rank']}: malformed answer from the rendezvous: {exc}") from None
    if reply.get("error"):
        raise ConnectError(f"rank {info['rank']}: rank 0's rendezvous failed: {reply['error']}")
    return list(reply["table"])


async def serve_rounds(addr: str, port: int, size: int, rounds: int, timeout: float,
                       creds: Credentials | None = None) -> None:
    """A rendezvous of ``rounds`` rounds on one socket (``Comm.grow``: the table, then a barrier
    once every rank opened its links): each registration names its round (``"round"``, from 0),
    and a round's table goes to its ``size`` registrants once all came. One socket for every round,
    so a quick rank's next registration never meets a closing server."""
    creds = creds or Credentials("null")
    stats = RendezvousStats()
    domain = AUTH.register("the grow rendezvous", creds)
    sock = _socket(zmq.ROUTER)
    creds.server(sock, domain)
    entries: list[dict[int, dict[str, Any]]] = [{} for _ in range(rounds)]
    waiting: list[list[tuple[bytes, int]]] = [[] for _ in range(rounds)]
    try:
        try:
            sock.bind(f"tcp://{_resolve(addr)}:{port}")
        except zmq.ZMQError as exc:
            raise ConnectError(f"cannot serve the grow rendezvous on {addr}:{port}: {exc}") from exc
        done = 0
        try:
            async with asyncio.timeout(timeout):
                while done < rounds:
                    received = await _receive(sock, stats)
                    if received is None:
                        continue
                    ident, info = received
                    r = info.get("round", 0)
                    if not isinstance(r, int) or not 0 <= r < rounds or info["size"] != size:
                        stats.reject(f"a registration for round {r!r} of size {info['size']}")
                        continue
                    waiting[r].append((ident, info["rank"]))
                    entries[r].setdefault(info["rank"], info)
                    if len(entries[r]) == size and set(entries[r]) == set(range(size)):
                        await _answer(sock, waiting[r], {"table": [entries[r][i] for i in range(size)]})
                        done += 1
        except TimeoutError:
            r = done
            missing = sorted(set(range(size)) - set(entries[r]))
            error = (f"grow: ranks {missing} did not come within {timeout:g} s (round {r + 1} of {rounds})"
                     f"{_refusals(domain)}")
            await _answer(sock, waiting[r], {"error": error})
            raise ConnectError(error) from None
    finally:
        sock.close()
        AUTH.unregister(domain)

"""Job secret, authenticated connections, bounded wire decoding, bind addresses.

Most tests run two real ranks (``_bootstrap.create``: rendezvous, ZeroMQ links, shared
memory) inside this process and attack them with raw ZeroMQ sockets; one runs a fuzzer
against a live rank process started by ``python -m ahcomm.run``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import os
import random
import re
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq

import ahcomm
from ahcomm import ConfigError, ConnectError, TransportError
from ahcomm._buffers import CclBuffers
from ahcomm._config import Config
from ahcomm._rendezvous import MAX_MESSAGE, RendezvousStats, register, serve
from ahcomm.run import free_port
from ahcomm.transports import _wire, _zmq
from ahcomm.transports._auth import Credentials, async_context, context
from ahcomm.transports._wire import HEADER, RANK_ID
from ahcomm.transports._zmq import Channel
from ahcomm.transports.base import Signal
from ahcomm.transports.rdma import RdmaLink

from jobs import run_job
from support.events import Events
from support.inproc import links_of

SECRET = "test-secret-" + "0123456789abcdef" * 2
PAGE = os.sysconf("SC_PAGE_SIZE")
IDLE_CONNECTIONS = 300  # idle TCP connections opened to one rank's endpoint (each end holds a descriptor)


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


async def job(n: int = 2, **overrides: Any) -> list[ahcomm.Comm]:
    from ahcomm._bootstrap import create

    port = free_port()
    settings: dict[str, Any] = {"job_secret": SECRET, "buffsize": 1 << 20, "connect_timeout": 20,
                                "exec_timeout": 30, **overrides}
    cfg = dataclasses.replace(Config.from_env({}), **settings)
    return list(await asyncio.gather(*(create(cfg, rank=r, world_size=n, master_port=port) for r in range(n))))


async def close_all(comms: list[ahcomm.Comm]) -> None:
    await asyncio.wait_for(asyncio.gather(*(c.close() for c in comms)), 30)


async def works(comms: list[ahcomm.Comm]) -> None:
    """A collective and a point-to-point message among the real ranks."""
    outs = await asyncio.wait_for(asyncio.gather(*(c.all_reduce(np.full(1000, c.rank + 1.0)) for c in comms)), 20)
    assert all(np.all(o == sum(range(1, len(comms) + 1))) for o in outs)
    _, got = await asyncio.wait_for(asyncio.gather(comms[0].send(np.arange(5.0), 1), comms[1].recv(0)), 20)
    np.testing.assert_array_equal(got, np.arange(5.0))


def channel_of(comm: ahcomm.Comm) -> Channel:
    link = next(iter(links_of(comm).values()))
    assert isinstance(link, _zmq.ZmqLink)
    return link.channel


async def until(check: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


def dealer(endpoint: str, creds: Credentials | None, identity: bytes | None = None) -> zmq.Socket[Any]:
    sock: zmq.Socket[Any] = context().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    if creds is not None:
        creds.client(sock)
    sock.connect(endpoint)
    return sock


# -- 1. the secret ---------------------------------------------------------------------------------


def test_config_reads_the_security_variables() -> None:
    cfg = Config.from_env({"AHCOMM_JOB_SECRET": SECRET, "AHCOMM_ENCRYPT": "1", "AHCOMM_HEARTBEAT": "0.5",
                           "AHCOMM_MAX_MESSAGE": "64M"})
    assert (cfg.job_secret, cfg.encrypt, cfg.insecure, cfg.heartbeat, cfg.max_message) == (SECRET, True, False, 0.5,
                                                                                            64 << 20)
    assert SECRET not in repr(cfg)  # never in a log line or a traceback
    default = Config.from_env({})
    assert (default.job_secret, default.encrypt, default.heartbeat, default.max_message) == (None, False, 1.0, 1 << 30)
    assert Config.from_env({"AHCOMM_HEARTBEAT": "0"}).heartbeat == 0  # off
    assert Config.from_env({"AHCOMM_INSECURE": "1"}).insecure
    for bad in ({"AHCOMM_ENCRYPT": "maybe"}, {"AHCOMM_HEARTBEAT": "-1"}, {"AHCOMM_MAX_MESSAGE": "5T"},
                {"AHCOMM_MAX_MESSAGE": "8G"}, {"AHCOMM_IF_IP": "0.0.0.0"}, {"AHCOMM_IF_IP": "*"},
                {"AHCOMM_MASTER_ADDR": "0.0.0.0"}):
        with pytest.raises(ConfigError):
            Config.from_env(bad)


async def test_a_job_without_a_secret_is_refused_unless_insecure() -> None:
    from ahcomm._bootstrap import create

    with pytest.raises(ConfigError, match=r"AHCOMM_JOB_SECRET.*export AHCOMM_JOB_SECRET=.*AHCOMM_INSECURE=1"):
        await create(Config.from_env({}), rank=0, world_size=2, master_port=free_port())
    with pytest.raises(ConfigError, match="at least 16"):
        await create(Config.from_env({"AHCOMM_JOB_SECRET": "short"}), rank=0, world_size=2, master_port=free_port())
    with pytest.raises(ConfigError, match="wildcard"):
        await create(Config.from_env({"AHCOMM_JOB_SECRET": SECRET}), rank=0, world_size=2, master_port=free_port(),
                     master_addr="0.0.0.0")
    single = await create(Config.from_env({}), rank=0, world_size=1)  # one rank: nothing to authenticate
    await single.close()
    comms = await job(job_secret=None, insecure=True)  # explicitly unauthenticated: runs (NULL mechanism)
    assert channel_of(comms[0]).creds.mechanism == "null"
    await works(comms)
    await close_all(comms)


def test_the_launcher_passes_a_secret_in_the_environment_only(tmp_path: Path) -> None:
    script = tmp_path / "secret.py"
    script.write_text(
        "import hashlib, os\n"
        "s = os.environ['AHCOMM_JOB_SECRET']\n"
        "cmdlines = [open(f'/proc/{p}/cmdline', 'rb').read() for p in (os.getpid(), os.getppid())]\n"
        "print('SECRET', len(s), hashlib.sha256(s.encode()).hexdigest(), any(s.encode() in c for c in cmdlines),"
        " flush=True)\n")
    def run(extra: dict[str, str]) -> list[tuple[str, ...]]:
        proc = run_job(2, str(script), env=extra, drop=["AHCOMM_JOB_SECRET"], timeout=60)
        assert proc.returncode == 0, proc.stderr
        return re.findall(r"SECRET (\d+) (\w+) (\w+)", proc.stdout)

    first, second = run({}), run({})
    assert len(first) == 2 and len(set(first)) == 1  # both ranks hold the same secret
    assert first[0][0] == "64" and first[0][2] == "False"  # token_hex(32); on no command line
    assert first[0][1] != second[0][1]  # a new one per job
    preset = run({"AHCOMM_JOB_SECRET": SECRET})
    assert preset[0][1] == hashlib.sha256(SECRET.encode()).hexdigest() and preset[0][2] == "False"


def test_credentials_are_derived_from_the_secret() -> None:
    plain, again, other = (Credentials.derive(SECRET), Credentials.derive(SECRET), Credentials.derive(SECRET + "x"))
    assert plain == again and plain.mechanism == "plain" and plain.password != other.password
    assert SECRET.encode() not in plain.password and len(plain.password) == 64  # an HMAC, not the secret
    curve = Credentials.derive(SECRET, encrypt=True)
    assert curve.mechanism == "curve" and zmq.curve_public(curve.secret_key) == curve.public_key
    assert curve.public_key != Credentials.derive(SECRET + "x", encrypt=True).public_key
    assert Credentials.derive(None).mechanism == "null"
    assert "password" not in repr(plain) or plain.password.decode() not in repr(plain)


@pytest.mark.parametrize("encrypt", [False, True], ids=["plain", "curve"])
async def test_peers_without_the_secret_are_refused_in_the_handshake(encrypt: bool,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "ahcomm.security")
    comms = await job(encrypt=encrypt)  # transport auto: rank 0 listens on ipc and tcp
    ch = channel_of(comms[0])
    wrong = Credentials.derive("another-secret-0123456789abcdef", encrypt=encrypt)
    other_mechanism = Credentials.derive(SECRET, encrypt=not encrypt)  # the right secret, the wrong mechanism
    header = HEADER.pack(_wire.MSG_SIGNAL, 0, 0, 0, 0, 0, 0)
    attackers = []

    def knows_the_server_key(sock: zmq.Socket[Any]) -> None:  # CURVE: a client of its own (reaches ZAP)
        public, secret = zmq.curve_keypair()
        sock.setsockopt(zmq.CURVE_SERVERKEY, ch.creds.public_key)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, secret)

    for endpoint in ch.endpoints.values():
        for creds in (None, wrong, other_mechanism, "own key" if encrypt else None):
            for identity in (RANK_ID.pack(1), RANK_ID.pack(7)):
                if creds == "own key":
                    sock = dealer(endpoint, None, identity)
                    sock.disconnect(endpoint)
                    knows_the_server_key(sock)
                    sock.connect(endpoint)
                else:
                    sock = dealer(endpoint, creds if isinstance(creds, Credentials) else None, identity)
                sock.send(header, zmq.NOBLOCK)  # queued; it never gets past the handshake
                attackers.append(sock)
    await until(lambda: ch.rejected_handshakes >= len(attackers))
    await asyncio.sleep(0.2)
    assert ch.rejected == 0, "a message of an unauthenticated peer was decoded"
    refusals = [r.getMessage() for r in caplog.records if r.name == "ahcomm.security"]
    secret_hint = "key is not this job's key" if encrypt else "password is not derived from this job's"
    assert any("from 127.0.0.1" in m and secret_hint in m for m in refusals), refusals  # tcp, via ZAP
    assert any("from localhost:" in m and secret_hint in m for m in refusals), refusals  # ipc (pid:uid:gid), ZAP
    assert any("unknown address" in m for m in refusals), refusals  # no or other mechanism: before ZAP
    stats = comms[0].stats()
    assert stats["endpoint"]["rejected_handshakes"] >= len(attackers) and stats["links"][1]["state"] == "up"
    for sock in attackers:
        sock.close(0)
    await works(comms)
    await close_all(comms)


async def test_endpoint_counters_are_reported_once_not_per_link() -> None:
    """Refused handshakes and strangers' messages belong to the rank's endpoint, not to any link:
    ``stats()`` gives them once (``endpoint``); a link counts only what its own peer sent."""
    comms = await job(3, transport="rdma")
    ch = channel_of(comms[0])
    wrong = Credentials.derive("another-secret-0123456789abcdef")
    attackers = [dealer(ch.endpoints["tcp"], wrong, RANK_ID.pack(1)) for _ in range(3)]
    stranger = dealer(ch.endpoints["tcp"], ch.creds, RANK_ID.pack(9))
    stranger.send(HEADER.pack(_wire.MSG_SIGNAL, 0, 0, 0, 0, 0, 0))
    await until(lambda: ch.rejected_handshakes >= 3 and ch.rejected >= 1)
    stats = comms[0].stats()
    assert stats["endpoint"] == {"rejected_messages": 1, "rejected_handshakes": ch.rejected_handshakes,
                                 "late_messages": 0}, stats
    for peer, link in stats["links"].items():
        assert link["rejected_messages"] == 0, (peer, link)
        assert not any(key.startswith("endpoint") for key in link), link  # nothing endpoint-wide per link
    for sock in (*attackers, stranger):
        sock.close(0)
    await works(comms)
    await close_all(comms)


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def test_idle_connections_are_closed_after_the_handshake_interval() -> None:
    """Connections that never start their handshake are closed by the endpoint after
    HANDSHAKE_TIMEOUT (libzmq's default: 30 s), so a flood of them cannot pile up towards the
    descriptor limit; the rank keeps working and its descriptors return to where they were."""
    comms = await job(2, transport="rdma")
    ch = channel_of(comms[0])
    await works(comms)
    host, port = ch.endpoints["tcp"].removeprefix("tcp://").rsplit(":", 1)
    before_fds, before_refused = open_fds(), ch.rejected_handshakes
    idle = [socket.create_connection((host, int(port))) for _ in range(IDLE_CONNECTIONS)]  # loopback only
    for sock in idle:
        sock.setblocking(False)
    await works(comms)  # the rank works while they hang on

    def closed_by_server(sock: socket.socket) -> bool:
        try:
            return sock.recv(64) == b""
        except BlockingIOError:
            return False
        except ConnectionError:
            return True

    open_ones = list(idle)
    deadline = time.monotonic() + 15  # a hang guard (HANDSHAKE_TIMEOUT is 2 s; libzmq's default, 30 s)
    while open_ones and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
        open_ones = [sock for sock in open_ones if not closed_by_server(sock)]
    assert not open_ones, f"{len(open_ones)} of {len(idle)} idle connections are still open"
    await until(lambda: ch.rejected_handshakes - before_refused >= len(idle))  # counted as failed handshakes
    assert open_fds() == before_fds + len(idle)  # only our ends are left: the endpoint closed its own
    for sock in idle:
        sock.close()
    assert open_fds() == before_fds
    await works(comms)
    assert comms[0].stats()["endpoint"]["rejected_handshakes"] == ch.rejected_handshakes
    await close_all(comms)


@pytest.mark.parametrize("encrypt", [False, True], ids=["plain", "curve"])
async def test_a_rank_with_another_secret_fails_fast(encrypt: bool) -> None:
    """PLAIN: the endpoint refuses the password (at once). CURVE: it cannot read the client's
    handshake and closes it, which the client sees as a failed handshake with no detail (as
    when a busy endpoint's handshake timer runs out): HANDSHAKE_ATTEMPTS of them in a row."""
    from ahcomm._bootstrap import create

    port = free_port()
    base = dataclasses.replace(Config.from_env({}), buffsize=1 << 20, encrypt=encrypt)
    good = dataclasses.replace(base, job_secret=SECRET, connect_timeout=4)
    bad = dataclasses.replace(base, job_secret="another-secret-0123456789abcdef", connect_timeout=60)
    start = time.monotonic()
    results = await asyncio.gather(create(good, rank=0, world_size=2, master_port=port),
                                   create(bad, rank=1, world_size=2, master_port=port), return_exceptions=True)
    assert isinstance(results[1], ConnectError) and "AHCOMM_JOB_SECRET" in str(results[1]), results
    assert time.monotonic() - start < 10  # not the 60 s connect timeout
    assert isinstance(results[0], ConnectError)  # rank 0 waited for a rank that never registered


# -- 2. bounded decoding -----------------------------------------------------------------------------


def _junk(rng: random.Random) -> list[bytes]:
    """One random or mutated link message (frames after the identity)."""
    kind = rng.choice([1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 10, 200, 255])
    header = HEADER.pack(kind, rng.choice([0, 1, 2, 3, 255]), rng.randrange(1 << 16),
                         rng.choice([0, 1, 8, 4096, 1 << 20, (1 << 32) - 1]), rng.randrange(-(1 << 63), 1 << 63),
                         rng.choice([0, 8, 1 << 20, (1 << 64) - 1]), rng.choice([0, 0, 0, 1, 0xFFFF]))
    shape = rng.randrange(8)
    if shape == 0:
        return [header[:rng.randrange(HEADER.size)]]  # truncated header
    if shape == 1:
        return [header + b"x" * rng.randrange(1, 64)]  # overlong header
    if shape == 2:
        return [header]
    if shape == 3:
        return [header] + [rng.randbytes(rng.randrange(0, 512)) for _ in range(rng.randrange(1, 5))]  # extra frames
    if shape == 4:
        return [rng.randbytes(rng.randrange(0, 64)) for _ in range(rng.randrange(1, 4))]  # noise
    if shape == 5:
        return [header, msgpack.packb(["float64", [1 << 40]]), rng.randbytes(rng.randrange(0, 256))]  # p2p-like
    if shape == 6:
        return [header, b"\xdd\xff\xff\xff\xff"]  # msgpack claiming 4G elements
    return [header, rng.randbytes(rng.randrange(4096, 65536))]


async def test_fuzzed_link_messages_never_hurt_a_live_rank() -> None:
    comms = await job()
    ch = channel_of(comms[0])
    creds = ch.creds  # the fuzzer holds the secret: only the decoding stands in its way
    rng = random.Random(20261123)
    socks = {  # identities: a real peer's (already connected: libzmq drops the duplicate), strangers
        name: dealer(ch.endpoints[ep], creds, ident)
        for name, ep, ident in [("real", "tcp", RANK_ID.pack(1)), ("stranger", "tcp", RANK_ID.pack(7)),
                                ("short", "ipc", b"\x01\x02\x03"), ("auto", "ipc", None)]}
    await works(comms)
    before_rss, before_rejected = rss(), ch.rejected
    sent = 0
    start = time.monotonic()
    for i in range(600):
        name = ("real", "stranger", "short", "auto")[i % 4]
        socks[name].send_multipart(_junk(rng), zmq.NOBLOCK)
        sent += name != "real"
        if i % 50 == 0:
            await asyncio.sleep(0)
    socks["stranger"].send_multipart([HEADER.pack(6, 0, 0, 64, 0, 0, 0), b"x" * (_wire.FRAME_LIMIT + 8192)])  # too big
    await until(lambda: ch.rejected - before_rejected >= sent)
    assert time.monotonic() - start < 20
    assert ch.rejected - before_rejected == sent  # every stranger's message counted; none from the duplicate
    for link in links_of(comms[0]).values():
        assert link.stats()["state"] == "up" and link.stats()["rejected_messages"] == 0
    await works(comms)
    grown = rss() - before_rss
    assert grown < 64 << 20, f"RSS grew by {grown >> 20} MiB"
    for sock in socks.values():
        sock.close(0)
    await close_all(comms)


async def _channel_with_peer(max_message: int = 4096) -> tuple[Channel, RdmaLink, RdmaLink, zmq.Socket[Any],
                                                                 zmq.Socket[Any]]:
    """Rank 0's channel with links to peers 1 and 2 (nobody behind them) and raw sockets speaking
    as those peers."""
    creds = Credentials.derive(SECRET)
    ch = Channel(0, CclBuffers.local(1 << 16), ipc=True, creds=creds, max_message=max_message)
    nowhere = f"ipc://@ahcomm-test-nowhere-{os.getpid()}"
    links = [RdmaLink(0, peer, ch, nowhere, None) for peer in (1, 2)]
    ch.start()
    as1, as2 = (dealer(ch.endpoints["ipc"], creds, RANK_ID.pack(p)) for p in (1, 2))
    as1.send(HEADER.pack(_wire.MSG_SIGNAL, Signal.ACK, 9, 0, 0, 0, 0))
    await asyncio.wait_for(links[0].wait(Signal.ACK, 9, 0), 5)  # the path works
    return ch, links[0], links[1], as1, as2


def _h(kind: int, a: int = 0, index: int = 0, nbytes: int = 0, seq: int = 0, offset: int = 0) -> bytes:
    return HEADER.pack(kind, a, index, nbytes, seq, offset, 0)


MALFORMED = {
    "truncated header": [_h(1)[:23]],
    "overlong header": [_h(1) + b"\0"],
    "unknown kind": [_h(200)],
    "unknown signal": [_h(_wire.MSG_SIGNAL, a=7)],
    "signal with extra frames": [_h(_wire.MSG_SIGNAL), b"x"],
    "progress with extra frames": [_h(_wire.MSG_PROGRESS), b"x"],
    "put outside the buffer": [_h(_wire.MSG_PUT, nbytes=16, offset=(1 << 16) - 8), b"x" * 16],
    "put at a huge offset": [_h(_wire.MSG_PUT, nbytes=16, offset=(1 << 64) - 1), b"x" * 16],
    "put bigger than a frame": [_h(_wire.MSG_PUT, nbytes=(1 << 32) - 1), b"x"],
    "put into an unknown buffer": [_h(_wire.MSG_PUT, a=5, nbytes=4), b"xxxx"],
    "put without data": [_h(_wire.MSG_PUT, nbytes=4)],
    "put shorter than said": [_h(_wire.MSG_PUT, nbytes=64), b"x" * 10],
    "put with extra frames": [_h(_wire.MSG_PUT, nbytes=4), b"xxxx", b"y"],
    "data ack for no put": [_h(_wire.MSG_DATA_ACK)],
    "message over AHCOMM_MAX_MESSAGE": [_h(_wire.MSG_P2P, nbytes=1 << 20), b"m", b"x"],
    "message of another size": [_h(_wire.MSG_P2P, nbytes=100), b"m", b"x" * 10],
    "message without payload": [_h(_wire.MSG_P2P, nbytes=0), b"m"],
    "message without metadata": [_h(_wire.MSG_P2P, nbytes=0)],
    "message with huge metadata": [_h(_wire.MSG_P2P, nbytes=1), b"m" * 5000, b"x"],
    "message in too many frames": [_h(_wire.MSG_P2P, nbytes=3), b"m", b"x", b"y", b"z"],
    "control over MAX_CONTROL": [_h(_wire.MSG_CONTROL, nbytes=1 << 20), b"x"],
    "control of another size": [_h(_wire.MSG_CONTROL, nbytes=10), b"x"],
    "control without payload": [_h(_wire.MSG_CONTROL, nbytes=0)],
    "abort with a huge reason": [_h(_wire.MSG_ABORT, nbytes=4096), b"r" * 4096],
    "abort without reason": [_h(_wire.MSG_ABORT)],
    "goodbye with extra frames": [_h(_wire.MSG_BYE), b"x"],
}


@pytest.mark.parametrize("case", list(MALFORMED))
async def test_a_malformed_message_from_a_peer_fails_only_its_link(case: str) -> None:
    ch, link1, link2, as1, as2 = await _channel_with_peer()
    broken: list[tuple[int, str]] = []  # the communicator's hook: it fails the communicator on every rank
    for link in (link1, link2):
        link.attach(Events(on_broken=lambda peer, reason: broken.append((peer, reason))))
    waiter = asyncio.ensure_future(link1.wait(Signal.DATA, 0, 0))
    as1.send_multipart(MALFORMED[case])
    with pytest.raises(TransportError, match="rejected a message from rank 1") as info:
        await asyncio.wait_for(waiter, 5)
    assert (ch.rejected, link1.rejected) == (1, 1), info.value
    assert len(broken) == 1 and broken[0][0] == 1 and broken[0][1] in str(info.value), (broken, info.value)
    assert link1.stats()["rejected_messages"] == 1
    as2.send(_h(_wire.MSG_SIGNAL, Signal.DATA, 3, 0, 0, 0))  # the reader goes on; other links are untouched
    await asyncio.wait_for(link2.wait(Signal.DATA, 3, 0), 5)
    assert link2._error is None
    for sock in (as1, as2):
        sock.close(0)
    ch.close()


async def test_messages_travel_in_bounded_frames_and_are_capped() -> None:
    comms = await job(transport="rdma", max_message=16 << 20)
    big = np.arange(3 * _wire.FRAME_LIMIT // 8 + 5, dtype=np.float64)  # 12 MiB + 40 B: four frames
    _, got = await asyncio.wait_for(asyncio.gather(comms[0].send(big, 1), comms[1].recv(0)), 30)
    np.testing.assert_array_equal(got, big)
    with pytest.raises(TransportError, match="AHCOMM_MAX_MESSAGE"):
        comms[0].send(np.zeros((16 << 20) // 8 + 1), 1, tag=9)  # refused before anything is sent
    await works(comms)
    await close_all(comms)


async def test_the_rendezvous_survives_fuzzed_registrations() -> None:
    creds = Credentials.derive(SECRET)
    port, size = free_port(), 2
    stats = RendezvousStats()
    server = asyncio.ensure_future(serve("127.0.0.1", port, size, 20, creds, stats))
    await until(lambda: bool(stats.last_endpoint))
    assert stats.last_endpoint == f"tcp://127.0.0.1:{port}"  # the master address, not a wildcard
    sock = async_context().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    creds.client(sock)
    sock.connect(f"tcp://127.0.0.1:{port}")
    intruder = dealer(f"tcp://127.0.0.1:{port}", None)  # no credentials
    intruder.send(msgpack.packb({"rank": 0, "size": 2}))
    good = {"rank": 0, "size": 2, "host": "h", "endpoints": {"tcp": "tcp://127.0.0.1:1"}, "shm": None,
            "buffsize": 1024, "pid": 1, "probe": 0}
    rng = random.Random(7)
    junk: list[list[bytes]] = [
        [b"\xc1"], [b""], [b"\x92\x01"], [msgpack.packb([1, 2, 3])], [msgpack.packb("hello")],
        [b"\xdd\xff\xff\xff\xff"], [b"\xdf\xff\xff\xff\xff"], [b"\xdb\xff\xff\xff\xff"],  # 4G-element/4 GB claims
        [b"\xc6\xff\xff\xff\xff"], [b"\xc7\x01\x05x"], [b"\x91" * 5000],  # bin, ext, nesting
        [msgpack.packb({**good, "rank": "0"})], [msgpack.packb({**good, "rank": True})],
        [msgpack.packb({**good, "rank": 1 << 40})], [msgpack.packb({**good, "endpoints": {"udp": "x"}})],
        [msgpack.packb({**good, "endpoints": {"tcp": 5}})], [msgpack.packb({**good, "shm": ["a"]})],
        [msgpack.packb({**good, "host": None})], [msgpack.packb({**good, "tuning": {"a": [[[[[1]]]]]}})],
        [msgpack.packb({1: 2})], [msgpack.packb(good), b"second frame"],
    ] + [[rng.randbytes(rng.randrange(1, 200))] for _ in range(40)]
    for frames in junk:
        await sock.send_multipart(frames)
    await sock.send(b"x" * (MAX_MESSAGE + 8192))  # over the frame limit: libzmq drops the connection
    await until(lambda: stats.rejected_messages >= len(junk))
    tables = await asyncio.wait_for(asyncio.gather(*(register("127.0.0.1", port, {**good, "rank": r}, 20, creds)
                                                     for r in range(size))), 20)
    await asyncio.wait_for(server, 5)
    assert [e["rank"] for e in tables[0]] == [0, 1] and tables[0] == tables[1]
    assert stats.rejected_messages == len(junk), stats.reasons
    assert stats.rejected_handshakes >= 1
    sock.close(0)
    intruder.close(0)


# -- 3. bind addresses -----------------------------------------------------------------------------


def _listening() -> list[str]:
    """Local addresses of this process's listening tcp sockets, as ip:port."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in inodes:  # LISTEN, ours
                    addr, port = cols[1].split(":")
                    ip = ".".join(str(b) for b in bytes.fromhex(addr)[::-1]) if len(addr) == 8 else addr
                    found.append(f"{ip}:{int(port, 16)}")
    return found


async def test_sockets_bind_the_chosen_interface_only() -> None:
    port = free_port()
    stats = RendezvousStats()
    server = asyncio.ensure_future(serve("localhost", port, 1, 20, Credentials.derive(SECRET), stats))
    await until(lambda: bool(stats.last_endpoint))
    assert stats.last_endpoint == f"tcp://127.0.0.1:{port}"
    assert f"127.0.0.1:{port}" in _listening() and not any(a.startswith(("0.0.0.0", "0000")) for a in _listening())
    server.cancel()
    await asyncio.gather(server, return_exceptions=True)
    comms = await job(transport="rdma", if_ip="127.0.0.1")
    listening = _listening()
    for comm in comms:
        endpoint = channel_of(comm).endpoints["tcp"]
        assert endpoint.startswith("tcp://127.0.0.1:")
        assert endpoint.removeprefix("tcp://") in listening
    assert listening and all(a.startswith("127.0.0.1:") for a in listening), listening
    await close_all(comms)


# -- a live rank process ---------------------------------------------------------------------------

FUZZER = r'''
import asyncio, os, random, struct, sys, time
import numpy as np, zmq
import ahcomm
from ahcomm.transports._auth import Credentials, context
from ahcomm.transports._wire import HEADER, RANK_ID

def rss():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

async def main():
    comm = await ahcomm.init()
    r = comm.rank
    x = np.ones(100_000)
    await comm.all_reduce(x)
    before = rss()
    if r == 0:  # throw junk at rank 1's endpoint, holding the secret
        target = comm._executor.links[1].endpoint
        creds = Credentials.derive(os.environ["AHCOMM_JOB_SECRET"])
        socks = []
        for ident in (RANK_ID.pack(0), RANK_ID.pack(9), b"\x01\x02", None):  # rank 0's own identity is taken already
            s = context().socket(zmq.DEALER); s.setsockopt(zmq.LINGER, 0)
            if ident is not None:
                s.setsockopt(zmq.IDENTITY, ident)
            creds.client(s); s.connect(target); socks.append(s)
        rng = random.Random(99)
        for i in range(800):
            frames = [HEADER.pack(rng.randrange(256), rng.randrange(256), rng.randrange(1 << 16),
                                  rng.randrange(1 << 32), rng.randrange(1 << 62), rng.randrange(1 << 64),
                                  rng.choice([0, 0, 0, 7]))]
            frames[0] = frames[0][:rng.choice([26, 26, 26, 10, 0])]
            frames += [rng.randbytes(rng.randrange(300)) for _ in range(rng.randrange(3))]
            socks[i % 4].send_multipart(frames)
            if i % 100 == 0:
                await asyncio.sleep(0.01)
        await asyncio.sleep(1.0)
    await comm.barrier()
    for _ in range(3):
        got = await comm.all_reduce(x)
        assert np.all(got == comm.size)
    stats = comm.stats()
    link = stats["links"][1 - r]
    print(f"RANK {r} rejected={stats['endpoint']['rejected_messages']} state={link['state']} "
          f"rss_growth_mib={(rss() - before) / 2**20:.1f}", flush=True)
    await comm.close()

asyncio.run(main())
'''


@pytest.mark.multiprocess
@pytest.mark.parametrize("transport", ["sdma", "rdma"])
def test_a_fuzzed_rank_process_survives(tmp_path: Path, transport: str) -> None:
    script = tmp_path / "fuzzer.py"
    script.write_text(FUZZER)
    proc = run_job(2, str(script), env={"AHCOMM_BUFFSIZE": "1", "AHCOMM_TRANSPORT": transport,
                                        "AHCOMM_EXEC_TIMEOUT": "60"}, tag=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    found = {rank: (int(rejected), float(growth)) for rank, rejected, growth in
             re.findall(r"RANK (\d) rejected=(\d+) state=up rss_growth_mib=(-?[\d.]+)", proc.stdout)}
    assert set(found) == {"0", "1"}, proc.stdout + proc.stderr
    rejected, growth = found["1"]
    assert rejected == 600, proc.stdout  # the three strangers' messages; the duplicate identity's never arrive
    assert growth < 64, proc.stdout
    print(f"{transport}: live rank rejected {rejected} messages, RSS grew {growth} MiB")

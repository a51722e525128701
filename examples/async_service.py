"""A replicated asyncio HTTP/JSON counter service whose cluster-wide totals come from all_reduce.

    ahcomm-run -n 3 python examples/async_service.py --port 8100      # replicas on 8100, 8101, 8102
    curl -X POST -d '{"counter": "hits", "by": 2}' localhost:8101/incr
    curl localhost:8100/total
    curl -X POST localhost:8102/shutdown                              # stops every replica
    ahcomm-run -n 3 python examples/async_service.py --port 0 --demo  # self-test: prints "... OK"
    ahcomm-run -n 3 --on-failure restart python examples/async_service.py --survive --grow-after 2

Every rank serves HTTP on its own port (``--port`` or ``SERVICE_PORT``, plus the rank; with
``--port 0`` each replica takes a free port and prints it: no clashes, for tests) with
a minimal HTTP/1.1 handler on asyncio streams (standard library only) and keeps its own
counters: ``POST /incr`` ({"counter": NAME, "by": N}) adds to them at once, locally.
``GET /local`` shows them, ``GET /health`` answers at once, ``GET /total`` answers the
cluster-wide sums and ``POST /shutdown`` stops the whole service.

How a /total on one replica makes all the others join the all_reduce
---------------------------------------------------------------------
A collective needs every rank, and ranks are matched by the order of their collectives, so
all replicas must agree on when to run one. Rank 0 decides: every replica runs one task,
the *command loop*, which waits in ``broadcast_object(root=0)`` for rank 0's next command
and carries it out (``sync``: ``all_reduce`` of a snapshot of its counters; ``tick``:
nothing; ``stop``: a last sync, then shut down). Waiting there costs nothing: the HTTP
handlers run in the same event loop and are never blocked by a pending or running
collective, and point-to-point messages do not queue behind collectives.

- A /total on replica r registers a waiter with a fresh *want id* and tells rank 0
  (``comm.send`` of ``[WANT, id]``, eager; rank 0 keeps one ``recv`` posted per peer).
- Rank 0 wakes when any replica wants a sum (or its own handler does), waits a short
  coalescing window (``--batch-ms``: every /total arriving meanwhile rides the same round),
  and broadcasts ``{"cmd": "sync", "round": k, "acks": [highest want id seen per rank]}``.
- Each replica answers its waiters whose id is at most ``acks[rank]`` with that round's sum.

The answer is never stale: a replica's want leaves after its /total arrived, rank 0 decides
the round after receiving it, and every replica takes its snapshot after receiving that
decision, so every increment acknowledged anywhere before the /total began is counted.
Many concurrent /total requests, on any replicas, cost one all_reduce.

Keep-alive: an idle service would leave the command loop's broadcast and rank 0's receives
pending forever, past ``AHCOMM_EXEC_TIMEOUT``. So rank 0 broadcasts a ``tick`` after
``--heartbeat`` idle seconds and every replica answers a tick with a ``[PING, 0]`` message:
nothing stays pending longer than one heartbeat.

Surviving the loss of a replica (``--survive``; docs/elastic.md)
-----------------------------------------------------------------
Without it a replica's death ends the service (every other replica raises). With it, the
survivors' failed collective (``PeerFailure``, within about half a second) makes them
``shrink()`` to a communicator of themselves and go on: the lowest survivor decides, every
replica re-announces what it is waiting for, and no /total request is lost. Each replica's
counters live in its own memory, so the increments a dead replica had acknowledged die with
it: the totals are the sums over the replicas alive. With ``--grow-after S`` (launch with
``ahcomm-run --on-failure restart``, which starts the dead replica again) the deciding replica
commands a ``grow()`` S seconds after the shrink; the restarted replica's ``ahcomm.init()``
joins it, and it catches up on the cluster's state (counter names, round number) by
``broadcast_object`` from a survivor. It then serves with counters of its own from zero.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from typing import Any

import numpy as np

import ahcomm

WANT, STOP, PING = 1, 2, 3
TAG = 7  # the point-to-point tag of messages to rank 0
REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
           413: "Payload Too Large", 503: "Service Unavailable"}
MAX_BODY = 64 << 10


class Replica:
    def __init__(self, comm: ahcomm.Comm, counters: list[str], *, batch_s: float, heartbeat_s: float,
                 survive: bool = False, grow_after: float = 0.0) -> None:
        self.comm = comm
        self.survive, self.grow_after = survive, grow_after
        self.retired: list[ahcomm.Comm] = []  # communicators replaced by a shrink or a grow
        self.grow_due: float | None = None  # loop time the decider commands a grow
        self.names = counters
        self.index = {name: i for i, name in enumerate(counters)}
        self.local = np.zeros(len(counters), np.int64)
        self.requests = 0
        self.batch_s = batch_s
        self.heartbeat_s = heartbeat_s
        self.want_id = 0  # the last want id this replica issued
        self.waiters: list[tuple[int, asyncio.Future[dict[str, Any]]]] = []
        self.stopping = False
        self.rounds = 0
        self.final: dict[str, int] | None = None
        self.writers: set[asyncio.StreamWriter] = set()
        self.inflight = 0  # requests being answered (shutdown lets them finish)
        self.idle = asyncio.Event()
        self.reset()

    def reset(self) -> None:
        """Rank 0's view of what the replicas asked for (a new communicator starts it afresh)."""
        self.wanted = [0] * self.comm.size
        self.stop_wanted = False
        self.demand = asyncio.Event()

    @property
    def rank(self) -> int:
        """This replica's rank in the job (its communicator's rank changes with a shrink)."""
        return self.comm.world_ranks[self.comm.rank]

    # -- the command loop: every rank runs it; rank 0 decides ------------------------------
    async def command_loop(self) -> bool:
        """Run rank 0's commands until a stop (True) or a grow (False: run it again on the new
        communicator); raises the communicator's failure."""
        comm = self.comm
        receivers = [asyncio.create_task(self._receive_from(p)) for p in range(1, comm.size)] if comm.rank == 0 else []
        try:
            if self.waiters:  # asked for before a shrink or grow: rank 0 (perhaps another one) hears it again
                await self._ask_rank0(WANT, self.want_id)
            if self.stopping:
                await self._ask_rank0(STOP, 0)
            while True:
                if comm.rank == 0:
                    cmd = await comm.broadcast_object(await self._decide(), root=0)
                else:
                    cmd = await comm.broadcast_object(None, root=0)
                if cmd["cmd"] == "grow":
                    await self.grow()
                    return False
                if cmd["cmd"] == "tick":
                    if comm.rank != 0:
                        await comm.send(np.array([PING, 0], np.int64), 0, tag=TAG)
                    continue
                totals = await comm.all_reduce(self.local.copy())  # a snapshot: handlers keep adding
                self.rounds += 1
                answer = {"round": cmd["round"], "replicas": comm.size,
                          "totals": {n: int(v) for n, v in zip(self.names, totals)}}
                served = cmd["acks"][comm.rank]
                keep = []
                for want, fut in self.waiters:
                    if want <= served:
                        if not fut.done():
                            fut.set_result(answer)
                    else:
                        keep.append((want, fut))
                self.waiters = keep
                if cmd["cmd"] == "stop":
                    self.final = answer["totals"]
                    return True
        finally:
            for task in receivers:
                task.cancel()
            await asyncio.gather(*receivers, return_exceptions=True)
            if self.final is not None or not self.survive:
                for _, fut in self.waiters:
                    if not fut.done():
                        fut.set_exception(ConnectionAbortedError("the service is stopping"))

    async def _decide(self) -> dict[str, Any]:
        """Rank 0: the next command - when someone wants a sum or a stop, else a tick per heartbeat."""
        loop = asyncio.get_running_loop()
        wait = self.heartbeat_s if self.grow_due is None else min(self.heartbeat_s, self.grow_due - loop.time())
        try:
            await asyncio.wait_for(self.demand.wait(), max(0.0, wait))
        except TimeoutError:
            if self.grow_due is not None and loop.time() >= self.grow_due:
                self.grow_due = None
                return {"cmd": "grow"}
            return {"cmd": "tick"}
        if self.batch_s > 0 and not self.stop_wanted:
            await asyncio.sleep(self.batch_s)  # let concurrent /total requests join this round
        self.demand.clear()
        return {"cmd": "stop" if self.stop_wanted else "sync", "round": self.rounds + 1, "acks": list(self.wanted)}

    async def _receive_from(self, peer: int) -> None:
        """Rank 0: one receive always posted per peer (tag TAG), feeding the demand."""
        while True:
            kind, value = (int(v) for v in await self.comm.recv(peer, shape=(2,), dtype=np.int64, tag=TAG))
            if kind == WANT:
                self.wanted[peer] = max(self.wanted[peer], value)
                self.demand.set()
            elif kind == STOP:
                self.stop_wanted = True
                self.demand.set()

    async def _ask_rank0(self, kind: int, value: int) -> None:
        if self.comm.rank == 0:
            if kind == WANT:
                self.wanted[0] = max(self.wanted[0], value)
            else:
                self.stop_wanted = True
            self.demand.set()
        else:
            try:
                await self.comm.send(np.array([kind, value], np.int64), 0, tag=TAG)
            except ahcomm.AhcommError:
                if not self.survive:
                    raise  # (surviving: the command loop asks again once the communicator is mended)

    # -- losing a replica, and taking a restarted one back (--survive) ---------------------
    async def shrink(self, exc: BaseException) -> None:
        """Every survivor: go on with the replicas alive (the lowest one decides from now on)."""
        survivors = await self.comm.shrink()
        assert survivors is not None
        self.retired.append(self.comm)
        self.comm = survivors
        self.reset()
        if self.grow_after > 0:
            self.grow_due = asyncio.get_running_loop().time() + self.grow_after
        print(f"replica {self.rank}: {type(exc).__name__}; serving on {survivors.size} replicas (world ranks "
              f"{list(survivors.world_ranks)})", flush=True)

    async def grow(self) -> None:
        """Every member, at rank 0's command: take the restarted replica(s) back."""
        grown = await self.comm.grow()
        self.retired.append(self.comm)
        self.comm = grown
        self.reset()
        await self.agree(True)
        print(f"replica {self.rank}: grown back to {grown.size} replicas", flush=True)

    async def agree(self, have_state: bool) -> None:
        """The cluster's state (counter names, round number) from the lowest replica that has it
        (a restarted one has none)."""
        comm = self.comm
        mine = comm.rank if have_state else comm.size
        root = int((await comm.all_reduce(np.array([mine], np.int64), "min"))[0])
        state = await comm.broadcast_object({"counters": self.names, "rounds": self.rounds}, root=root)
        if not have_state:
            self.names, self.rounds = list(state["counters"]), int(state["rounds"])
            self.index = {name: i for i, name in enumerate(self.names)}
            self.local = np.zeros(len(self.names), np.int64)

    async def total(self) -> dict[str, Any]:
        if self.stopping:
            raise ConnectionAbortedError("the service is stopping")
        self.want_id += 1
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self.waiters.append((self.want_id, fut))
        await self._ask_rank0(WANT, self.want_id)
        return await fut

    # -- HTTP ---------------------------------------------------------------------------------
    async def route(self, method: str, path: str, body: bytes) -> tuple[int, Any]:
        self.requests += 1
        rank = self.rank
        if path == "/health":
            return 200, {"ok": True, "rank": rank}
        if path == "/local":
            return 200, {"rank": rank, "counters": {n: int(v) for n, v in zip(self.names, self.local)}}
        if path == "/total":
            if method != "GET":
                return 405, {"error": "use GET"}
            try:
                return 200, {"rank": rank, **await self.total()}
            except ConnectionAbortedError as exc:
                return 503, {"error": str(exc)}
        if path == "/incr":
            if method != "POST":
                return 405, {"error": "use POST"}
            try:
                req = json.loads(body or b"{}")
                name, by = req.get("counter", self.names[0]), int(req.get("by", 1))
            except (ValueError, TypeError, AttributeError) as exc:
                return 400, {"error": f"bad JSON body: {exc}"}
            if name not in self.index:
                return 404, {"error": f"no counter {name!r}; counters: {self.names}"}
            self.local[self.index[name]] += by
            return 200, {"rank": rank, "counter": name, "local": int(self.local[self.index[name]])}
        if path == "/shutdown":
            if method != "POST":
                return 405, {"error": "use POST"}
            if not self.stopping:
                self.stopping = True
                await self._ask_rank0(STOP, 0)
            return 200, {"rank": rank, "stopping": True}
        return 404, {"error": f"no route {path}"}

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writers.add(writer)
        try:
            while True:
                line = await reader.readline()
                if not line:
                    return
                method, target, version = line.decode("latin-1").split()
                headers: dict[str, str] = {}
                while (h := await reader.readline()) not in (b"\r\n", b"\n", b""):
                    key, _, value = h.decode("latin-1").partition(":")
                    headers[key.strip().lower()] = value.strip()
                length = int(headers.get("content-length", "0") or 0)
                if length > MAX_BODY:
                    status, payload = 413, {"error": "body too large"}
                    body = b""
                else:
                    body = await reader.readexactly(length) if length else b""
                    self.inflight += 1
                    self.idle.clear()
                    try:
                        status, payload = await self.route(method, target.split("?")[0], body)
                    finally:
                        self.inflight -= 1
                        if not self.inflight:
                            self.idle.set()
                keep = (version == "HTTP/1.1" and headers.get("connection", "").lower() != "close"
                        and length <= MAX_BODY)
                data = json.dumps(payload).encode()
                self.inflight += 1  # until the answer is written
                try:
                    writer.write(f"HTTP/1.1 {status} {REASONS[status]}\r\nContent-Type: application/json\r\n"
                                 f"Content-Length: {len(data)}\r\nConnection: {'keep-alive' if keep else 'close'}"
                                 f"\r\n\r\n".encode() + data)
                    await writer.drain()
                finally:
                    self.inflight -= 1
                    if not self.inflight:
                        self.idle.set()
                if not keep:
                    return
        except (ConnectionError, asyncio.IncompleteReadError, ValueError, UnicodeDecodeError):
            return
        finally:
            self.writers.discard(writer)
            writer.close()


# -- the --demo client (rank 0): a small self-test over real HTTP ---------------------------------
async def http(port: int, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    data = json.dumps(body).encode() if body is not None else b""
    writer.write(f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {len(data)}\r\n"
                 f"Connection: close\r\n\r\n".encode() + data)
    await writer.drain()
    raw = await reader.read()
    writer.close()
    head, _, payload = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(payload)


async def demo(ports: list[int], names: list[str]) -> None:
    size = len(ports)
    expected = dict.fromkeys(names, 0)
    calls = []
    for i in range(12 * size):
        name, by = names[i % len(names)], i % 5 + 1
        expected[name] += by
        calls.append(http(ports[i % size], "POST", "/incr", {"counter": name, "by": by}))
    assert all(status == 200 for status, _ in await asyncio.gather(*calls))
    start = time.monotonic()
    totals = asyncio.gather(*(http(p, "GET", "/total") for p in ports))
    health = [await http(p, "GET", "/health") for p in ports]
    health_s = time.monotonic() - start
    pending = "while the /total requests were pending" if not totals.done() else "(after the /total answers)"
    answers = await totals
    assert all(s == 200 and a["totals"] == expected for s, a in answers), (answers, expected)
    assert all(s == 200 for s, _ in health)
    rounds = {a["round"] for _, a in answers}
    print(f"demo: totals {expected} from all {size} replicas (rounds {sorted(rounds)}), "
          f"{size} health checks in {health_s * 1e3:.1f} ms {pending}", flush=True)
    await http(ports[-1], "POST", "/shutdown")


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--port", type=int, default=int(os.environ.get("SERVICE_PORT", "8100")),
                    help="base port: rank r listens on PORT + r (env SERVICE_PORT); 0: any free port, printed")
    ap.add_argument("--counters", default="hits,items,errors")
    ap.add_argument("--batch-ms", type=float, default=None,
                    help="rank 0's coalescing window for /total (default 2; 200 with --demo, to show requests "
                         "being served while a /total waits)")
    ap.add_argument("--heartbeat", type=float, default=10.0, help="idle seconds between keep-alive ticks")
    ap.add_argument("--demo", action="store_true", help="rank 0 runs a self-test client, then stops the service")
    ap.add_argument("--survive", action="store_true", help="keep serving on the survivors when a replica dies")
    ap.add_argument("--grow-after", type=float, default=0.0,
                    help="with --survive under `ahcomm-run --on-failure restart`: seconds after a shrink when the "
                         "survivors take the restarted replica back (0: never)")
    args = ap.parse_args()
    names = args.counters.split(",")
    if args.batch_ms is None:
        args.batch_ms = 200.0 if args.demo else 2.0
    restarted = int(os.environ.get("AHCOMM_RESTART_COUNT", "0") or 0) > 0  # ahcomm-run --on-failure restart
    comm = await ahcomm.init()  # a restarted replica joins the running job here (once the others grow)
    rep = Replica(comm, names, batch_s=args.batch_ms / 1e3, heartbeat_s=args.heartbeat, survive=args.survive,
                  grow_after=args.grow_after)
    try:
        if restarted:
            await rep.agree(False)  # the cluster's state, from a survivor
        server = await asyncio.start_server(rep.handle, "127.0.0.1", args.port + rep.rank if args.port else 0)
        port = server.sockets[0].getsockname()[1]
        print(f"replica {rep.rank}/{comm.size} listening on http://127.0.0.1:{port}", flush=True)
        if args.survive:
            print(f"replica {rep.rank} pid {os.getpid()}", flush=True)
        client = None
        if not restarted:
            ports = await comm.all_gather_object(port)  # also: every replica is up before anyone relies on it
            client = asyncio.create_task(demo(ports, rep.names)) if args.demo and comm.rank == 0 else None
        while True:
            try:
                if await rep.command_loop():
                    break  # stopped
            except (ahcomm.CommunicationError, ahcomm.CommClosedError) as exc:
                if not args.survive:
                    raise
                await rep.shrink(exc)
        server.close()  # no new connections; requests under way get their answers (2 s at most)
        if rep.inflight:
            try:
                await asyncio.wait_for(rep.idle.wait(), 2.0)
            except TimeoutError:
                pass
        if client is not None:
            await client
        for writer in list(rep.writers):
            writer.close()
        print(f"replica {rep.rank}: served {rep.requests} requests, {rep.rounds} sync rounds, "
              f"final totals {json.dumps(rep.final, sort_keys=True)}", flush=True)
        if rep.comm.rank == 0:
            print(f"async_service: {rep.comm.size} replicas stopped OK", flush=True)
    except BaseException as exc:  # tell the other replicas why this one stops (they raise PeerFailure)
        rep.comm.abort(f"{type(exc).__name__}: {exc}"[:2000])
        raise
    finally:
        for old in (rep.comm, *reversed(rep.retired)):
            await old.close()


if __name__ == "__main__":
    asyncio.run(main())
    sys.exit(0)

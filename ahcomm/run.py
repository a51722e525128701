"""ahcomm-run: start the ranks of a program, on this host or on several.

    ahcomm-run -n 4 python train.py          (also: python -m ahcomm.run -n 4 train.py)
    ahcomm-run --nnodes 2 --node-rank R --nproc-per-node 4 --master-addr HOST --master-port P prog.py
                                             (torchrun's style: run once on every host; -n may
                                             differ per host, ranks follow --node-rank order)
    ahcomm-run -H host1:4,host2:4 prog.py    (mpirun's style, also --hostfile FILE: one command
                                             starts every host's ranks over ssh, AHCOMM_RSH)

Each rank gets AHCOMM_RANK, AHCOMM_WORLD_SIZE, AHCOMM_LOCAL_RANK, AHCOMM_LOCAL_WORLD_SIZE,
AHCOMM_MASTER_ADDR and AHCOMM_MASTER_PORT, and the job secret AHCOMM_JOB_SECRET: the one
already in the environment, else a fresh ``secrets.token_hex(32)``. The secret travels in
the environment only (readable by the same user alone), never on a command line. Each rank
also gets torchrun's RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and
MASTER_PORT (a port of its own for torch.distributed's store), so torch scripts run unchanged.

Where ranks outnumber the cores they are bound one core each, round robin (``--bind-to auto``, the
default; AHCOMM_BIND; ``_binding``), and AHCOMM_CORES says how many the host's ranks share;
``--bind-to core`` binds at any count, ``none`` never.

SIGINT/SIGTERM are forwarded to every rank, and SIGUSR1 (each rank prints its state). If a
rank fails, the others are stopped (SIGTERM, then SIGKILL after ``--grace`` seconds) and
ahcomm-run exits with that rank's status, naming it. ``--on-failure continue`` keeps the others
running instead (the death is reported on stderr); ``--on-failure restart --max-restarts N``
starts the failed rank again, same rank and environment plus AHCOMM_RESTART_COUNT (1, 2, ...),
at most N times. Either way the exit status is non-zero when any rank failed. If ahcomm-run itself dies, even by
SIGKILL, its ranks get SIGTERM (Linux). When several ranks share the output, each line is
prefixed with ``[rank]`` (``--no-tag-output`` turns that off).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import signal
import sys
from collections.abc import Sequence

from ._binding import MODES, allowed_cores, bind_mode, checked_mode, plan, rank_cores
from ._buffers import reclaim_stale
from ._errors import ConfigError
from ._nodes import agree
from ._rootinfo import free_port
from ._runproc import Tagger, Watchdog, child_setup

GRACE_SECONDS = 3.0
SECRET_VAR = "AHCOMM_JOB_SECRET"
RESTART_VAR = "AHCOMM_RESTART_COUNT"
ON_FAILURE = ("stop", "continue", "restart")


def job_secret(env: dict[str, str]) -> str:
    """The job's secret: the one the caller set, else a new one (64 hex digits)."""
    return env.get(SECRET_VAR) or secrets.token_hex(32)


def torch_store_port(addr: str, port: int, *, single_host: bool) -> int:
    """MASTER_PORT for torch.distributed's store in the ranks: a free port other than ahcomm's
    rendezvous port on one host; ahcomm's port + 1 on several (every host must agree)."""
    if not single_host:
        return port + 1
    while True:
        other = free_port(addr)
        if other != port:
            return other


def rank_env(base: dict[str, str], rank: int, size: int, addr: str, port: int, *, local: int | None = None,
             local_size: int | None = None, torch_port: int | None = None) -> dict[str, str]:
    """A rank's environment: ahcomm's job layout, and torchrun's names for it (RANK, WORLD_SIZE,
    LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT = ``torch_port``) so that a
    torch.distributed script runs unchanged."""
    env = dict(base)
    local_rank = str(rank if local is None else local)
    local_world = str(size if local_size is None else local_size)
    env.update({
        "AHCOMM_RANK": str(rank), "AHCOMM_WORLD_SIZE": str(size),
        "AHCOMM_LOCAL_RANK": local_rank, "AHCOMM_LOCAL_WORLD_SIZE": local_world,
        "AHCOMM_MASTER_ADDR": addr, "AHCOMM_MASTER_PORT": str(port),
    })
    if torch_port is not None:
        env.update({"RANK": str(rank), "WORLD_SIZE": str(size), "LOCAL_RANK": local_rank,
                    "LOCAL_WORLD_SIZE": local_world, "MASTER_ADDR": addr, "MASTER_PORT": str(torch_port)})
    return env


def command_line(program: Sequence[str]) -> list[str]:
    """A script path, or a bare ``python``/``python3``, runs with this interpreter."""
    argv = list(program)
    if argv and argv[0] in ("python", "python3"):
        argv[0] = sys.executable
    elif argv and argv[0].endswith(".py"):
        argv.insert(0, sys.executable)
    return argv


def _signal_all(procs: list[asyncio.subprocess.Process], sig: int) -> None:
    for proc in procs:
        if proc.returncode is None:
            try:
                os.killpg(proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass


async def launch(nprocs: int, program: Sequence[str], *, tag_output: bool | None = False,
                 master_addr: str = "127.0.0.1", master_port: int | None = None,
                 env: dict[str, str] | None = None, grace: float = GRACE_SECONDS,
                 first_rank: int = 0, world_size: int | None = None, watch_stdin: bool = False,
                 on_failure: str = "stop", max_restarts: int = 0, bind_to: str | None = None) -> int:
    """Run ``program`` as ranks ``first_rank .. first_rank + nprocs - 1`` of a job of
    ``world_size`` (default ``nprocs``) ranks on this host; return the job's exit status.
    ``tag_output`` None: prefix lines with the rank when more than one rank shares the output.
    ``watch_stdin``: the end of standard input (the ssh connection of ``-H``'s launcher) stops the job.
    ``on_failure``: what a rank's failure does to the others: ``stop`` them (SIGTERM, SIGKILL after
    ``grace``), let them ``continue``, or ``restart`` the failed rank (same rank and environment plus
    AHCOMM_RESTART_COUNT = 1, 2, ...) at most ``max_restarts`` times, then go on without it. Any
    failure makes the exit status non-zero (the first failed rank's status). ``bind_to`` (default
    AHCOMM_BIND, else ``auto``): ``core`` gives each rank cores of its own out of this process's
    (``_binding.plan``) and says how many they share in AHCOMM_CORES, ``auto`` does so only where
    the ranks outnumber the cores, ``none`` leaves the ranks free."""
    if on_failure not in ON_FAILURE:
        raise ValueError(f"on_failure must be one of {', '.join(ON_FAILURE)}, not {on_failure!r}")
    cores = allowed_cores()
    binding = plan(nprocs, bind_mode(bind_to), cores)  # a bad AHCOMM_BIND raises before anything starts
    port = master_port or free_port(master_addr)
    size = nprocs if world_size is None else world_size
    tag = nprocs > 1 if tag_output is None else tag_output
    torch_port = torch_store_port(master_addr, port, single_host=size == nprocs)
    argv = command_line(program)
    pipe = asyncio.subprocess.PIPE if tag else None
    procs: list[asyncio.subprocess.Process] = []
    pumps: list[asyncio.Task[None]] = []
    base = dict(os.environ if env is None else env)
    base[SECRET_VAR] = job_secret(base)
    rank_cores(base, None if binding is None else len(cores))
    if tag:
        base.setdefault("PYTHONUNBUFFERED", "1")  # lines reach the tagger as they are printed
    loop = asyncio.get_running_loop()
    interrupted: list[int] = []

    def forward(sig: int) -> None:
        interrupted.append(sig)
        _signal_all(procs, sig)

    # Handlers first: a caught signal is reset to its default in the ranks at exec (an ignored one
    # would stay ignored, as SIGINT is in a background job); child_setup resets them as well.
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, forward, sig)
    # Ranks inherit SIGUSR1 ignored: one that has no communicator (yet) to report is not killed
    # by it; a communicator installs its own handler.
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    watchdog = Watchdog(grace)
    status = 0
    restarts = [0] * nprocs
    started: set[int] = set()  # every rank process's pid, restarts included

    async def start(local: int) -> int | None:
        """Start (or restart) the rank at ``local``; an exit status when it cannot be started."""
        rank = first_rank + local
        rank_vars = rank_env(base, rank, size, master_addr, port, local=local, local_size=nprocs,
                             torch_port=torch_port)
        if restarts[local]:
            rank_vars[RESTART_VAR] = str(restarts[local])
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv, env=rank_vars, stdout=pipe, stderr=pipe, start_new_session=True,
                preexec_fn=child_setup(None if binding is None else binding[local]))
        except OSError as exc:
            print(f"ahcomm-run: cannot start {argv[0]!r}: {exc.strerror or exc}", file=sys.stderr, flush=True)
            return 127 if isinstance(exc, FileNotFoundError) else 126
        if local < len(procs):
            procs[local] = proc
        else:
            procs.append(proc)
        started.add(proc.pid)
        watchdog.watch(proc.pid)  # its process group (start_new_session)
        if tag:
            assert proc.stdout is not None and proc.stderr is not None
            prefix = f"[{rank}] ".encode()
            pumps.append(asyncio.ensure_future(Tagger(prefix, sys.stdout.buffer).pump(proc.stdout)))
            pumps.append(asyncio.ensure_future(Tagger(prefix, sys.stderr.buffer).pump(proc.stderr)))
        return None

    try:
        for local in range(nprocs):
            code = await start(local)
            if code is not None:
                return code
        if interrupted:  # a signal came while the ranks were starting
            _signal_all(procs, interrupted[-1])
        if watch_stdin:
            stdin = sys.stdin.fileno()

            def on_stdin() -> None:
                try:
                    data = os.read(stdin, 4096)
                except OSError:
                    data = b""
                if not data:  # the launcher that started us over ssh is gone
                    loop.remove_reader(stdin)
                    forward(signal.SIGTERM)

            loop.add_reader(stdin, on_stdin)
        # SIGUSR1 asks every rank to print its state (which op it is in): passed on, not a stop.
        loop.add_signal_handler(signal.SIGUSR1, _signal_all, procs, signal.SIGUSR1)
        waiters = {asyncio.ensure_future(p.wait()): local for local, p in enumerate(procs)}
        pending = set(waiters)
        stopping = False
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            failed = sorted((waiters[f], f.result()) for f in done if f.result() != 0)
            for local, code in failed:
                rank = first_rank + local
                if status == 0:
                    status = code if code > 0 else 128 - code
                how = f"exited with code {code}" if code > 0 else f"was killed by signal {-code}"
                if interrupted or stopping:
                    continue
                if on_failure == "restart" and restarts[local] < max_restarts:
                    restarts[local] += 1
                    print(f"ahcomm-run: rank {rank} {how}; restarting it "
                          f"({RESTART_VAR}={restarts[local]}, {max_restarts - restarts[local]} restarts left)",
                          file=sys.stderr, flush=True)
                    if await start(local) is None:
                        waiter = asyncio.ensure_future(procs[local].wait())
                        waiters[waiter] = local
                        pending.add(waiter)
                        continue
                    how = "could not be restarted"
                if on_failure == "stop":
                    print(f"ahcomm-run: rank {rank} {how}; stopping the other ranks", file=sys.stderr, flush=True)
                    stopping = True
                    _signal_all(procs, signal.SIGTERM)
                    loop.call_later(grace, _signal_all, procs, signal.SIGKILL)
                else:
                    left = "" if on_failure == "continue" else f" after {restarts[local]} restarts"
                    print(f"ahcomm-run: rank {rank} {how}{left}; the other ranks go on", file=sys.stderr, flush=True)
        if status and not interrupted and not stopping and on_failure != "stop":
            recovered = sum(restarts)
            count = f" ({recovered} restart{'s' if recovered != 1 else ''})" if recovered else ""
            print(f"ahcomm-run: every rank has finished{count}; exiting {status}, the status of the first "
                  "failure (the exit status always says something died)", file=sys.stderr, flush=True)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
            loop.remove_signal_handler(sig)
        if watch_stdin:
            loop.remove_reader(sys.stdin.fileno())
        _signal_all(procs, signal.SIGKILL)
        watchdog.close()
        if pumps:
            await asyncio.gather(*pumps, return_exceptions=True)
        # a rank killed outright leaves its shared memory (ahcomm.alloc's segments live by name):
        # ours go now, not at the host's next init (once reaped: a zombie still counts as alive)
        await asyncio.gather(*(asyncio.wait_for(p.wait(), 2.0) for p in procs if p.returncode is None),
                             return_exceptions=True)
        reclaim_stale(pids=started)
    return status


def parse_hosts(spec: str) -> list[tuple[str, int]]:
    """'host1:4,host2:2' (a host without ':N' gets one slot) -> [(host, slots), ...]."""
    hosts = []
    for item in spec.split(","):
        item = item.strip()
        if not item:
            continue
        name, _, slots = item.partition(":")
        if not name or (slots and (not slots.isdigit() or int(slots) < 1)):
            raise ValueError(f"bad host entry {item!r}: expected HOST or HOST:SLOTS")
        hosts.append((name, int(slots) if slots else 1))
    if not hosts:
        raise ValueError("no hosts given")
    return hosts


def read_hostfile(path: str) -> list[tuple[str, int]]:
    """Lines 'host slots=N' (OpenMPI), 'host:N' or 'host'; '#' starts a comment."""
    entries = []
    with open(path) as f:
        for line in f:
            words = line.split("#", 1)[0].split()
            if not words:
                continue
            slots = next((w.split("=", 1)[1] for w in words[1:] if w.startswith("slots=")), None)
            entries.append(f"{words[0]}:{slots}" if slots else words[0])
    return parse_hosts(",".join(entries))


async def launch_hosts(hosts: list[tuple[str, int]], program: Sequence[str], *, master_addr: str | None,
                       master_port: int | None, tag_output: bool | None, grace: float,
                       on_failure: str = "stop", max_restarts: int = 0, bind_to: str | None = None) -> int:
    """mpirun's style: one launcher per host, started through AHCOMM_RSH (default ``ssh``);
    the job secret goes to each over its standard input, never on a command line."""
    import shlex

    env = dict(os.environ)
    env[SECRET_VAR] = job_secret(env)
    rsh = shlex.split(env.get("AHCOMM_RSH", "ssh"))
    addr = master_addr or hosts[0][0]
    port = master_port or free_port("0.0.0.0" if addr not in ("127.0.0.1", "localhost") else addr)
    size = sum(slots for _, slots in hosts)
    tag = size > 1 if tag_output is None else tag_output  # every host's output comes to this terminal
    procs: list[asyncio.subprocess.Process] = []
    first = 0
    for host, slots in hosts:
        remote = [sys.executable, "-m", "ahcomm.run", "--secret-stdin", "--nproc-per-node", str(slots),
                  "--first-rank", str(first), "--world-size", str(size), "--master-addr", addr,
                  "--master-port", str(port), "--grace", str(grace), "--on-failure", on_failure,
                  "--max-restarts", str(max_restarts), "--bind-to", bind_mode(bind_to),
                  "--tag-output" if tag else "--no-tag-output",
                  *command_line(program)]
        line = f"cd {shlex.quote(os.getcwd())} && exec {shlex.join(remote)}"
        # stdin stays open: its end tells the remote launcher that this one is gone (and the
        # parent-death signal ends ssh if this launcher is killed)
        proc = await asyncio.create_subprocess_exec(*rsh, host, line, stdin=asyncio.subprocess.PIPE, env=env,
                                                    preexec_fn=child_setup())
        assert proc.stdin is not None
        proc.stdin.write(env[SECRET_VAR].encode() + b"\n")
        await proc.stdin.drain()
        procs.append(proc)
        first += slots
    status = 0
    waiters = {asyncio.ensure_future(p.wait()): hosts[i][0] for i, p in enumerate(procs)}
    pending = set(waiters)
    while pending:
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        for fut in done:
            if fut.result() != 0 and status == 0:
                status = fut.result() if fut.result() > 0 else 128 - fut.result()
                if on_failure != "stop":  # that host's launcher reported its ranks; the others go on
                    continue
                print(f"ahcomm-run: the ranks on {waiters[fut]} failed (status {fut.result()}); stopping the others",
                      file=sys.stderr, flush=True)
                for proc in procs:  # the end of its stdin stops a remote launcher, however ssh passes signals
                    if proc.stdin is not None:
                        proc.stdin.close()
                    if proc.returncode is None:
                        proc.terminate()
    for proc in procs:
        if proc.stdin is not None:
            proc.stdin.close()
    return status


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="ahcomm-run", description="Start the ranks of PROGRAM.")
    parser.add_argument("-n", "--nproc", "--np", "--nproc-per-node", dest="nproc", type=int,
                        help="ranks to start on this host")
    parser.add_argument("--nnodes", type=int, default=1, help="hosts in the job (torchrun's style)")
    parser.add_argument("--node-rank", type=int, default=0, help="this host's index, 0 .. nnodes-1")
    parser.add_argument("-H", "--hosts", default=None,
                        help="host1:N,host2:M: start every host's ranks (mpirun's style)")
    parser.add_argument("--hostfile", default=None, help="a file of 'host slots=N' lines (mpirun's style)")
    parser.add_argument("--first-rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--world-size", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--secret-stdin", action="store_true", help=argparse.SUPPRESS)
    tagging = parser.add_mutually_exclusive_group()
    tagging.add_argument("--tag-output", dest="tag_output", action="store_true", default=None,
                         help="prefix every output line with [rank] (the default when several ranks share the output)")
    tagging.add_argument("--no-tag-output", dest="tag_output", action="store_false",
                         help="leave the ranks' output as it is")
    parser.add_argument("--master-addr", default=None, help="rendezvous address (rank 0 binds it)")
    parser.add_argument("--master-port", type=int, default=None, help="rendezvous port (default: a free one)")
    parser.add_argument("--grace", type=float, default=GRACE_SECONDS,
                        help="seconds between SIGTERM and SIGKILL when a failed rank stops the job (default 3)")
    parser.add_argument("--on-failure", choices=ON_FAILURE, default="stop",
                        help="when a rank fails: stop the others (default), let them continue, or restart it")
    parser.add_argument("--max-restarts", type=int, default=None,
                        help="with --on-failure restart: restarts per rank (default 3)")
    parser.add_argument("--bind-to", choices=MODES, default=None,
                        help="core: give each rank cores of its own out of the launcher's n cores (n // ranks or "
                             "one more; one each, round robin, where ranks outnumber cores). auto (the default; "
                             "AHCOMM_BIND): bind only where ranks outnumber cores. none: leave the ranks free")
    parser.add_argument("program", nargs=argparse.REMAINDER, help="program and its arguments")
    args = parser.parse_args(argv)
    if not args.program:
        parser.error("no program given")
    if args.max_restarts is not None and args.max_restarts < 0:
        parser.error("--max-restarts must be 0 or more")
    if args.max_restarts and args.on_failure != "restart":
        parser.error("--max-restarts needs --on-failure restart")
    restarts = (3 if args.max_restarts is None else args.max_restarts) if args.on_failure == "restart" else 0
    try:
        bind_to = checked_mode(args.bind_to)
    except ConfigError as exc:
        parser.error(str(exc))
    if args.secret_stdin:
        os.environ[SECRET_VAR] = sys.stdin.readline().strip()
    if args.hosts or args.hostfile:
        try:
            hosts = read_hostfile(args.hostfile) if args.hostfile else parse_hosts(args.hosts)
        except (OSError, ValueError) as exc:
            parser.error(str(exc))
        sys.exit(asyncio.run(launch_hosts(hosts, args.program, master_addr=args.master_addr,
                                          master_port=args.master_port, tag_output=args.tag_output,
                                          grace=args.grace, on_failure=args.on_failure,
                                          max_restarts=restarts, bind_to=bind_to)))
    if args.nproc is None:
        parser.error("-n is required: how many ranks to start on this host (e.g. -n 4)")
    if args.nproc < 1:
        parser.error("-n / --nproc-per-node must be at least 1")
    multi = args.nnodes > 1 or args.first_rank is not None
    if multi:
        if args.master_addr is None or args.master_port is None:
            parser.error("a job on several hosts needs --master-addr and --master-port (the same on every host)")
        if not os.environ.get(SECRET_VAR):
            parser.error(f"a job on several hosts needs the same {SECRET_VAR} exported on every host: "
                         f"export {SECRET_VAR}=$(python3 -c 'import secrets; print(secrets.token_hex(32))')")
        if not 0 <= args.node_rank < args.nnodes:
            parser.error(f"--node-rank {args.node_rank} is out of range for --nnodes {args.nnodes}")
    first = args.first_rank if args.first_rank is not None else args.node_rank * args.nproc
    size = args.world_size if args.world_size is not None else args.nnodes * args.nproc
    if args.nnodes > 1 and args.first_rank is None and args.world_size is None:  # hosts may differ in -n
        first, size = asyncio.run(agree(args.node_rank, args.nnodes, args.nproc, args.master_addr,
                                        args.master_port, os.environ[SECRET_VAR]))
    sys.exit(asyncio.run(launch(args.nproc, args.program, tag_output=args.tag_output,
                                master_addr=args.master_addr or "127.0.0.1", master_port=args.master_port,
                                grace=args.grace, first_rank=first, world_size=size,
                                watch_stdin=args.secret_stdin, on_failure=args.on_failure,
                                max_restarts=restarts, bind_to=bind_to)))


if __name__ == "__main__":
    main()

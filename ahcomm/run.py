"""ahcomm-run: start N ranks of a program on this host.

    ahcomm-run -n 4 python train.py          (also: python -m ahcomm.run -n 4 train.py)

Each rank gets AHCOMM_RANK, AHCOMM_WORLD_SIZE, AHCOMM_LOCAL_RANK, AHCOMM_LOCAL_WORLD_SIZE,
AHCOMM_MASTER_ADDR and AHCOMM_MASTER_PORT, and the job secret AHCOMM_JOB_SECRET: the one
already in the environment, else a fresh ``secrets.token_hex(32)``. The secret travels in
the environment only (readable by the same user alone), never on a command line.
SIGINT/SIGTERM are forwarded to every rank, and SIGUSR1 (each rank prints its state). If a rank fails, the others are stopped
(SIGTERM, then SIGKILL after ``--grace`` seconds) and ahcomm-run exits with that rank's
status, naming it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import signal
import socket
import sys
from typing import Sequence

GRACE_SECONDS = 3.0
SECRET_VAR = "AHCOMM_JOB_SECRET"


def job_secret(env: dict[str, str]) -> str:
    """The job's secret: the one the caller set, else a new one (64 hex digits)."""
    return env.get(SECRET_VAR) or secrets.token_hex(32)


def free_port(addr: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((addr, 0))
        return int(s.getsockname()[1])


def rank_env(base: dict[str, str], rank: int, size: int, addr: str, port: int) -> dict[str, str]:
    env = dict(base)
    env.update({
        "AHCOMM_RANK": str(rank), "AHCOMM_WORLD_SIZE": str(size),
        "AHCOMM_LOCAL_RANK": str(rank), "AHCOMM_LOCAL_WORLD_SIZE": str(size),
        "AHCOMM_MASTER_ADDR": addr, "AHCOMM_MASTER_PORT": str(port),
    })
    return env


def command_line(program: Sequence[str]) -> list[str]:
    """A script path, or a bare ``python``/``python3``, runs with this interpreter."""
    argv = list(program)
    if argv and argv[0] in ("python", "python3"):
        argv[0] = sys.executable
    elif argv and argv[0].endswith(".py"):
        argv.insert(0, sys.executable)
    return argv


async def _pump(stream: asyncio.StreamReader, rank: int, out: "object") -> None:
    prefix = f"[{rank}] ".encode()
    buffer = getattr(out, "buffer")
    while True:
        line = await stream.readline()
        if not line:
            return
        buffer.write(prefix + line if line.endswith(b"\n") else prefix + line + b"\n")
        buffer.flush()


def _signal_all(procs: list[asyncio.subprocess.Process], sig: int) -> None:
    for proc in procs:
        if proc.returncode is None:
            try:
                os.killpg(proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass


async def launch(nprocs: int, program: Sequence[str], *, tag_output: bool = False,
                 master_addr: str = "127.0.0.1", master_port: int | None = None,
                 env: dict[str, str] | None = None, grace: float = GRACE_SECONDS) -> int:
    """Run ``program`` as ``nprocs`` ranks; return the job's exit status."""
    port = master_port or free_port(master_addr)
    argv = command_line(program)
    pipe = asyncio.subprocess.PIPE if tag_output else None
    procs: list[asyncio.subprocess.Process] = []
    pumps: list[asyncio.Task[None]] = []
    base = dict(os.environ if env is None else env)
    base[SECRET_VAR] = job_secret(base)
    # Ranks inherit SIGUSR1 ignored: one that has no communicator (yet) to report is not killed
    # by it; a communicator installs its own handler.
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    for rank in range(nprocs):
        proc = await asyncio.create_subprocess_exec(
            *argv, env=rank_env(base, rank, nprocs, master_addr, port), stdout=pipe, stderr=pipe,
            start_new_session=True)
        procs.append(proc)
        if tag_output:
            assert proc.stdout is not None and proc.stderr is not None
            pumps.append(asyncio.ensure_future(_pump(proc.stdout, rank, sys.stdout)))
            pumps.append(asyncio.ensure_future(_pump(proc.stderr, rank, sys.stderr)))

    loop = asyncio.get_running_loop()
    interrupted: list[int] = []

    def forward(sig: int) -> None:
        interrupted.append(sig)
        _signal_all(procs, sig)

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, forward, sig)
    # SIGUSR1 asks every rank to print its state (which op it is in): passed on, not a stop.
    loop.add_signal_handler(signal.SIGUSR1, _signal_all, procs, signal.SIGUSR1)
    status = 0
    try:
        waiters = {asyncio.ensure_future(p.wait()): rank for rank, p in enumerate(procs)}
        pending = set(waiters)
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            failed = [(waiters[f], f.result()) for f in done if f.result() != 0]
            if failed and status == 0:
                rank, code = min(failed)
                status = code if code > 0 else 128 - code
                how = f"exited with code {code}" if code > 0 else f"was killed by signal {-code}"
                if not interrupted:
                    print(f"ahcomm-run: rank {rank} {how}; stopping the other ranks", file=sys.stderr, flush=True)
                _signal_all(procs, signal.SIGTERM)
                loop.call_later(grace, _signal_all, procs, signal.SIGKILL)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
            loop.remove_signal_handler(sig)
        _signal_all(procs, signal.SIGKILL)
        if pumps:
            await asyncio.gather(*pumps, return_exceptions=True)
    return status


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="ahcomm-run", description="Start N ranks of PROGRAM on this host.")
    parser.add_argument("-n", "--nproc", "--np", dest="nproc", type=int, required=True, help="number of ranks")
    parser.add_argument("--tag-output", action="store_true", help="prefix every output line with [rank]")
    parser.add_argument("--master-addr", default="127.0.0.1", help="rendezvous address (rank 0 binds it)")
    parser.add_argument("--master-port", type=int, default=None, help="rendezvous port (default: a free one)")
    parser.add_argument("--grace", type=float, default=GRACE_SECONDS,
                        help="seconds between SIGTERM and SIGKILL when a failed rank stops the job (default 3)")
    parser.add_argument("program", nargs=argparse.REMAINDER, help="program and its arguments")
    args = parser.parse_args(argv)
    if args.nproc < 1:
        parser.error("-n must be at least 1")
    if not args.program:
        parser.error("no program given")
    sys.exit(asyncio.run(launch(args.nproc, args.program, tag_output=args.tag_output,
                                master_addr=args.master_addr, master_port=args.master_port,
                                grace=args.grace)))


if __name__ == "__main__":
    main()

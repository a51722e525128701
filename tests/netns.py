"""Test hosts as Linux network namespaces: real network hops on one machine.

    with Fabric(hosts=2, delay_ms=0.2, rate_mbit=1000) as fabric:
        proc = fabric.popen(0, [sys.executable, "prog.py"], env)

Each host is a namespace with a veth pair to a bridge in a switch namespace; host i has the
address 10.<net>.0.<i+1>/24 on its ``eth0``, loopback up. ``tc netem`` on each host's
``eth0`` shapes what it sends (delay, rate): each direction between two hosts crosses one
shaped egress. Kernels without sch_netem get ``tbf`` instead: rate, but no delay
(``Fabric.shaping`` says which). Needs root (CAP_NET_ADMIN) and iproute2;
``Fabric.available()`` says why not where it cannot run. Namespaces are removed on exit,
whatever happened. Also a script: ``python tests/netns.py 2`` builds a fabric, pings across
it and tears it down.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Sequence


def _ip(*args: str, ns: str | None = None) -> None:
    argv = ["ip", *(["-n", ns] if ns else []), *args]
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {proc.stderr.strip()}")


class Fabric:
    """``hosts`` network namespaces on one bridge; addresses ``address(i)``."""

    def __init__(self, hosts: int, *, delay_ms: float = 0.0, rate_mbit: float = 0.0, net: int | None = None) -> None:
        self.hosts = hosts
        self.delay_ms = delay_ms
        self.rate_mbit = rate_mbit
        self.tag = f"ah{os.getpid() % 100000}"
        self.net = net if net is not None else 64 + os.getpid() % 128  # 10.<net>.0.0/24
        self.switch = f"{self.tag}-sw"
        self.names = [f"{self.tag}-h{i}" for i in range(hosts)]
        self._made: list[str] = []
        self.shaping = "none"

    @staticmethod
    def available() -> tuple[bool, str]:
        """Whether namespaces can be made here, and if not, why."""
        if shutil.which("ip") is None:
            return False, "iproute2 ('ip') is not installed"
        if os.geteuid() != 0:
            return False, "creating network namespaces needs root"
        probe = f"ahprobe{os.getpid()}"
        proc = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
        if proc.returncode != 0:
            return False, f"'ip netns add' is not permitted here: {proc.stderr.strip()}"
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
        return True, ""

    def address(self, host: int) -> str:
        return f"10.{self.net}.0.{host + 1}"

    def __enter__(self) -> "Fabric":
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _build(self) -> None:
        _ip("netns", "add", self.switch)
        self._made.append(self.switch)
        _ip("link", "add", "br0", "type", "bridge", ns=self.switch)
        _ip("link", "set", "br0", "up", ns=self.switch)
        for i, name in enumerate(self.names):
            _ip("netns", "add", name)
            self._made.append(name)
            host_end, switch_end = f"{self.tag}h{i}", f"{self.tag}s{i}"
            _ip("link", "add", host_end, "type", "veth", "peer", "name", switch_end)
            _ip("link", "set", host_end, "netns", name, "name", "eth0")
            _ip("link", "set", switch_end, "netns", self.switch)
            _ip("link", "set", switch_end, "master", "br0", ns=self.switch)
            _ip("link", "set", switch_end, "up", ns=self.switch)
            _ip("addr", "add", f"{self.address(i)}/24", "dev", "eth0", ns=name)
            _ip("link", "set", "eth0", "up", ns=name)
            _ip("link", "set", "lo", "up", ns=name)
            if self.delay_ms or self.rate_mbit:
                self._shape(name)

    def _shape(self, ns: str) -> None:
        """netem (delay and rate) where the kernel has it; else tbf, rate only."""
        netem = ["netem"]
        if self.delay_ms:
            netem += ["delay", f"{self.delay_ms}ms"]
        if self.rate_mbit:
            netem += ["rate", f"{self.rate_mbit}mbit"]
        exec_tc = ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "eth0", "root"]
        proc = subprocess.run([*exec_tc, *netem, "limit", "100000"], capture_output=True, text=True)
        if proc.returncode == 0:
            self.shaping = "netem"
            return
        if "unknown" not in proc.stderr or not self.rate_mbit:
            raise RuntimeError(f"tc netem on {ns}: {proc.stderr.strip()} (this kernel has no sch_netem: "
                               f"delay cannot be emulated)")
        burst = max(64_000, int(self.rate_mbit * 1e6 / 8 / 250))  # bytes: ~4 ms at the rate
        tbf = ["tbf", "rate", f"{self.rate_mbit}mbit", "burst", str(burst), "latency", "100ms"]
        proc = subprocess.run([*exec_tc, *tbf], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"tc tbf on {ns}: {proc.stderr.strip()}")
        self.shaping = "tbf (rate only: this kernel has no sch_netem, so no delay)"

    def command(self, host: int, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside host ``host``'s namespace."""
        return ["ip", "netns", "exec", self.names[host], *argv]

    def popen(self, host: int, argv: Sequence[str], env: dict[str, str] | None = None,
              **kwargs: object) -> "subprocess.Popen[str]":
        return subprocess.Popen(self.command(host, argv), env=env, text=True, **kwargs)  # type: ignore[call-overload]

    def close(self) -> None:
        for name in reversed(self._made):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        self._made.clear()


if __name__ == "__main__":
    ok, why = Fabric.available()
    if not ok:
        sys.exit(f"cannot build a fabric here: {why}")
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    with Fabric(count, rate_mbit=1000) as fabric:
        for h in range(count):
            subprocess.run(fabric.command(h, ["ip", "-brief", "addr", "show", "eth0"]), check=False)
        print("fabric of", count, "hosts:", [fabric.address(h) for h in range(count)], "shaping:", fabric.shaping)

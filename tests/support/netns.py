"""Hosts on one machine: network namespaces joined by a bridge, and the faults a network has.

A :class:`Network` makes one namespace per host plus a *switch* namespace holding the bridge;
each host gets ``eth0`` (a veth pair whose other end is a port of the bridge) with an address in
``10.213.<n>.0/24``. Nothing touches the machine's own namespace: no route, no address, no
rule, so the hosts can reach only each other.

Faults, each undone by its ``heal``/``clear`` counterpart:

- loss: ``iptables -m statistic --mode random`` DROP on INPUT, at both ends of a link (so no
  local error is ever returned to a sender: a dropped packet is simply gone);
- rate: a ``tc tbf`` qdisc on a host's ``eth0`` egress;
- partition: the host's bridge port set down in the switch (the cable pulled at the switch);
- latency: :mod:`tests.support.delay_proxy`, a TCP proxy started inside a namespace (this kernel
has no
  ``netem``).

Everything runs as root; :func:`unavailable` says why when namespaces cannot be made here.
Namespaces are named ``fl<pid>-<n>-<host>`` (``n`` counts networks, so a new network never
reuses a name whose namespace may still be dying): :meth:`Network.close` deletes its own,
and :func:`sweep` deletes those of test runs that died without cleaning up.
"""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from feedline.procs import Child

_PREFIX = "fl"
_count = itertools.count()
_NETNS_DIR = Path("/var/run/netns")


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if check and p.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: exit {p.returncode}: {p.stderr.strip()}")
    return p


def unavailable() -> str | None:
    """Why network namespace tests cannot run here, or None if they can."""
    if os.geteuid() != 0:
        return "needs root (ip netns, iptables, tc)"
    for tool in ("ip", "iptables", "tc"):
        if _run("sh", "-c", f"command -v {tool}", check=False).returncode != 0:
            return f"needs {tool} (Debian: iproute2, iptables)"
    probe = f"{_PREFIX}{os.getpid()}-probe"
    made = _run("ip", "netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    try:
        ipt = _run("ip", "netns", "exec", probe, "iptables", "-L", "-n", check=False)
        if ipt.returncode != 0:
            return f"iptables does not work in a namespace: {ipt.stderr.strip()}"
    finally:
        _run("ip", "netns", "del", probe, check=False)
    return None


def sweep() -> None:
    """Delete namespaces left by test runs whose process is gone (a crash, a kill -9)."""
    if not _NETNS_DIR.is_dir():
        return
    for entry in _NETNS_DIR.iterdir():
        m = re.fullmatch(rf"{_PREFIX}(\d+)-(\d+-)?\w+", entry.name)
        if m and not Path(f"/proc/{m.group(1)}").exists():
            _kill_inside(entry.name)
            _run("ip", "netns", "del", entry.name, check=False)


def _kill_inside(ns: str) -> None:
    pids = _run("ip", "netns", "pids", ns, check=False).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), 9)
        except (ProcessLookupError, ValueError):
            pass


class Host:
    """One namespace with ``eth0`` on the bridge."""

    def __init__(self, net: Network, name: str, index: int) -> None:
        self.net, self.name = net, name
        self.ns = f"{net.prefix}-{name}"
        self.addr = f"10.213.{net.subnet}.{index}"
        self.port = f"v{index}"  # its bridge port, in the switch namespace

    def exec(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
        return _run("ip", "netns", "exec", self.ns, *argv, check=check)

    def start(self, argv: Sequence[str], log_path: Path, env: dict[str, str] | None = None,
              ) -> Child:
        """Start a process inside this host (``ip netns exec`` execs it: the pid is the
        process itself, so ``kill -9`` and SIGSTOP reach it directly)."""
        return Child(["ip", "netns", "exec", self.ns, *argv], log_path, env)

    def python(self, module: str, *args: str | Path, log_path: Path) -> Child:
        repo = str(Path(__file__).resolve().parents[2])
        return self.start([sys.executable, "-m", module, *map(str, args)], log_path,
                          env={"PYTHONPATH": repo})

    def http_get(self, url: str) -> str:
        """GET from inside this host (metrics ports are reachable only on the bridge)."""
        code = ("import sys, urllib.request; "
                "sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=5)"
                ".read().decode())")
        return self.exec(sys.executable, "-c", code, url).stdout

    # -- faults -------------------------------------------------------------------------
    def lose(self, probability: float, peer: Host) -> None:
        """Drop ``probability`` of the packets between this host and ``peer``, both ways."""
        for a, b in ((self, peer), (peer, self)):
            a.exec("iptables", "-A", "INPUT", "-s", b.addr, "-m", "statistic", "--mode",
                   "random", "--probability", str(probability), "-j", "DROP")

    def clear_loss(self, peer: Host) -> None:
        for h in (self, peer):
            h.exec("iptables", "-F", "INPUT")

    def limit_rate(self, mbit: float) -> None:
        """Cap what this host sends at ``mbit`` Mbit/s (token bucket, 64 kB burst)."""
        self.exec("tc", "qdisc", "replace", "dev", "eth0", "root", "tbf", "rate",
                  f"{mbit}mbit", "burst", "64kb", "latency", "100ms")

    def clear_rate(self) -> None:
        self.exec("tc", "qdisc", "del", "dev", "eth0", "root", check=False)

    def partition(self) -> None:
        """Pull this host's cable at the switch: every packet to or from it is gone."""
        self.net.switch_exec("ip", "link", "set", self.port, "down")

    def heal(self) -> None:
        self.net.switch_exec("ip", "link", "set", self.port, "up")


class Network:
    """A bridge and the named hosts on it. ``close()`` removes all of it."""

    def __init__(self, names: Sequence[str], subnet: int = 0) -> None:
        self.prefix = f"{_PREFIX}{os.getpid()}-{next(_count)}"
        self.subnet = subnet
        self.switch = f"{self.prefix}-sw"
        self.hosts: dict[str, Host] = {}
        try:
            _run("ip", "netns", "add", self.switch)
            self.switch_exec("ip", "link", "add", "br0", "type", "bridge")
            self.switch_exec("ip", "link", "set", "br0", "up")
            for i, name in enumerate(names, start=1):
                self._add(name, i)
        except BaseException:
            self.close()
            raise

    def switch_exec(self, *argv: str) -> None:
        _run("ip", "netns", "exec", self.switch, *argv)

    def _add(self, name: str, index: int) -> None:
        h = Host(self, name, index)
        _run("ip", "netns", "add", h.ns)
        self.hosts[name] = h
        _run("ip", "link", "add", "name", "eth0", "netns", h.ns, "type", "veth", "peer", "name",
             h.port, "netns", self.switch)
        self.switch_exec("ip", "link", "set", h.port, "master", "br0")
        self.switch_exec("ip", "link", "set", h.port, "up")
        h.exec("ip", "addr", "add", f"{h.addr}/24", "dev", "eth0")
        h.exec("ip", "link", "set", "eth0", "up")
        h.exec("ip", "link", "set", "lo", "up")

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def close(self) -> None:
        for ns in [h.ns for h in self.hosts.values()] + [self.switch]:
            _kill_inside(ns)
            _run("ip", "netns", "del", ns, check=False)
        self.hosts.clear()


def metric_sum(text: str, name: str, **labels: str) -> float:
    """Sum of a metric's samples whose labels include ``labels``, in a Prometheus text
    exposition."""
    from feedline.scrape import parse

    return parse("", text, 0.0).total(name, **labels)


__all__ = ["Host", "Network", "metric_sum", "sweep", "unavailable"]

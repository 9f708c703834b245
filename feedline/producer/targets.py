"""Where a producer sends: one or more brokers or direct-mode trainers.

A producer may be given several addresses (``--broker`` repeated) and each may be a DNS name
that stands for several hosts (a Kubernetes headless Service resolves to one address per
ready pod). :class:`Targets` expands them into concrete ``tcp://IP:PORT`` endpoints, one
channel each, and resolves the names again every ``interval`` seconds in a thread of its own
(``getaddrinfo`` may block), so training hosts that join or leave are found without a
restart. ``ipc://`` addresses and IP literals are used as given.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading
from collections.abc import Callable, Sequence

log = logging.getLogger(__name__)

Resolve = Callable[[str, int], list[str]]


def _getaddrinfo(host: str, port: int) -> list[str]:
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


def _is_name(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
        return False
    except ValueError:
        return host not in ("*", "localhost") and not host.startswith("[")


def _split(addr: str) -> tuple[str, int] | None:
    """``(host, port)`` of a tcp:// address whose host is a DNS name, else None."""
    if not addr.startswith("tcp://"):
        return None
    host, _, port = addr[len("tcp://"):].rpartition(":")
    if not port.isdigit() or not _is_name(host):
        return None
    return host, int(port)


def _endpoint(ip: str, port: int) -> str:
    return f"tcp://[{ip}]:{port}" if ":" in ip else f"tcp://{ip}:{port}"


class Targets:
    """The concrete endpoints behind a producer's addresses (thread-safe)."""

    def __init__(self, addrs: Sequence[str], interval: float = 30.0,
                 resolve: Resolve = _getaddrinfo) -> None:
        self.addrs, self.interval, self._resolve = list(addrs), interval, resolve
        self._lock = threading.Lock()
        self._names = {a: _split(a) for a in self.addrs}
        self._current: dict[str, list[str]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.refresh()

    def refresh(self) -> None:
        """Resolve every name now (a name that does not resolve keeps its last endpoints,
        or, never resolved, stands for itself: libzmq keeps trying it)."""
        for addr, name in self._names.items():
            if name is None:
                found = [addr]
            else:
                try:
                    found = [_endpoint(ip, name[1]) for ip in self._resolve(*name)]
                except OSError as e:
                    log.warning("cannot resolve %s (%s); keeping %s", addr, e,
                                self._current.get(addr) or "the name")
                    continue
            with self._lock:
                if found and found != self._current.get(addr):
                    if addr in self._current and name is not None:
                        log.info("%s now resolves to %s", addr, ", ".join(found))
                    self._current[addr] = found
        with self._lock:
            for addr in self.addrs:
                self._current.setdefault(addr, [addr])

    def endpoints(self) -> list[str]:
        """Every concrete endpoint now, in a stable order, without duplicates."""
        with self._lock:
            out: list[str] = []
            for addr in self.addrs:
                out += [e for e in self._current.get(addr, [addr]) if e not in out]
            return out

    def start(self) -> None:
        """Re-resolve names in the background (only if some address is a name)."""
        if self._thread is None and any(self._names.values()):
            self._thread = threading.Thread(target=self._run, name="feedline-resolve",
                                            daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.refresh()

    def stop(self) -> None:
        self._stop.set()

"""The broker's table of registered peers, one for each role, and their liveness.

A peer is known by its ROUTER identity (one per connection). The table is bounded: a HELLO
beyond ``capacity`` is refused, so a flood of registrations cannot grow the broker. Liveness
is the same for both roles: a peer silent for ``heartbeat_timeout`` is expired; one to whom
nothing was sent for ``heartbeat_interval`` is due a heartbeat; and when the broker's own loop
stalled (a long drain, the host paused us), every silence clock restarts, because that
silence was ours.
"""

from __future__ import annotations

import os
import socket
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from feedline.errors import Refusal


@dataclass
class Peer:
    """What the table keeps of every registered peer (roles extend it)."""

    ident: bytes
    name: str  # the id it registered with
    session: int
    registration: int
    stream: str
    last_seen: float = 0.0
    last_sent: float = 0.0
    fd: int = -1  # its connection's socket, to cut it off if it breaks the rules
    fd_ino: int = 0  # ... and that socket's inode: the fd number may be reused later


P = TypeVar("P", bound=Peer)


class PeerTable(Generic[P]):
    """Registered peers of one role, by ROUTER identity; at most ``capacity`` of them."""

    def __init__(self, role: str, capacity: int) -> None:
        self.role, self.capacity = role, capacity
        self._peers: dict[bytes, P] = {}

    def __len__(self) -> int:
        return len(self._peers)

    def __iter__(self) -> Iterator[P]:
        return iter(list(self._peers.values()))

    def __contains__(self, ident: bytes) -> bool:
        return ident in self._peers

    def get(self, ident: bytes) -> P | None:
        return self._peers.get(ident)

    def full(self) -> bool:
        return len(self._peers) >= self.capacity

    def add(self, peer: P) -> None:
        """Register ``peer`` (replacing an earlier registration on its connection)."""
        if peer.ident not in self._peers and self.full():
            raise Refusal("too_many_peers", f"more than {self.capacity} {self.role}s")
        self._peers[peer.ident] = peer

    def remove(self, ident: bytes) -> P | None:
        return self._peers.pop(ident, None)

    def seen(self, peer: P, now: float) -> None:
        peer.last_seen = now

    def expired(self, now: float, timeout: float) -> list[P]:
        """Peers silent for longer than ``timeout``."""
        return [p for p in self._peers.values() if now - p.last_seen > timeout]

    def due(self, now: float, interval: float) -> list[P]:
        """Peers to whom nothing was sent for ``interval``: send them a heartbeat."""
        return [p for p in self._peers.values() if now - p.last_sent >= interval]

    def pause(self, now: float) -> None:
        """Our loop did not run for a while: that silence was ours, not the peers'."""
        for p in self._peers.values():
            p.last_seen = max(p.last_seen, now)


HELLO_RATE = 10  # new registrations per second from one connection, at most


class HelloRate:
    """New registrations per second from one connection, at most ``rate``: an honest peer
    registers again after a restart or a reconnect, not ten times a second, and a flood would
    cost a registration each (tables, replies, what its HELLO carries). Remembers at most
    ``capacity`` connections (the oldest are forgotten)."""

    def __init__(self, rate: int, capacity: int) -> None:
        self.rate, self.capacity = rate, capacity
        self._seen: OrderedDict[bytes, tuple[float, int]] = OrderedDict()

    def too_often(self, ident: bytes, now: float) -> bool:
        start, n = self._seen.pop(ident, (now, 0))
        if now - start >= 1.0:
            start, n = now, 0
        self._seen[ident] = (start, n + 1)
        while len(self._seen) > self.capacity:
            self._seen.popitem(last=False)
        return n + 1 > self.rate


def connection(fd: int) -> tuple[int, int]:
    """``(fd, inode)`` of a received message's connection (``zmq.SRCFD``), or ``(-1, 0)``."""
    try:
        return fd, os.fstat(fd).st_ino
    except (OSError, TypeError):
        return -1, 0


def cut_off(fd: int, ino: int) -> bool:
    """Close a peer's connection under libzmq's feet (shutdown, not close: libzmq owns the
    descriptor and closes it when it sees the end). libzmq offers no way for a bound socket
    to drop one peer; this is it. The inode check makes sure the descriptor still is that
    connection, not a reused number. True if it was cut."""
    if fd < 0:
        return False
    try:
        if os.fstat(fd).st_ino != ino:
            return False
        s = socket.socket(fileno=os.dup(fd))
    except OSError:
        return False
    try:
        s.shutdown(socket.SHUT_RDWR)
        return True
    except OSError:
        return False
    finally:
        s.close()


@dataclass
class Producer(Peer):
    label: str = ""
    pending_gap: int = 0  # lost before a re-registration: reported with its next batch
    fleet: tuple[str, int] = ("", 0)  # the supervisor that started it, and its --max
    exact: bool = False  # it serves an exact stream
    pipeline: int = 0  # its pipeline's fingerprint, as its HELLO said (0: not said)
    # Its series of received batches and bytes, looked up once: ``labels()`` per batch cost
    # ~3 us (the label is held while it is registered, so the series stays).
    counted: tuple[Any, Any] = (None, None)

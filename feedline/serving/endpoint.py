"""One bound server socket of a host, and everything done with it as a socket.

An :class:`Endpoint` is what a broker binds for its producers, its consumers and tensorpack,
and what a direct-mode trainer binds for its producers: the same code, so a protection exists
once and holds for both.

- **Bind.** The address is checked first (:func:`feedline.endpoints.check_bind`: one bind per
  address; a second process binding a live ``ipc://`` path would silently take it over), then
  bound with the socket options: receive high-water mark, ``ZMQ_MAXMSGSIZE`` (a frame's
  size), ``ROUTER_MANDATORY`` (sending to a peer that is gone fails instead of vanishing),
  libzmq's own heartbeats where the peers' connections must close when they stop answering,
  CURVE where the host has keys.
- **Receive.** :meth:`Endpoint.drain` reads at most :data:`DRAIN_BUDGET` messages a turn,
  each frame by frame with its frame count and its size weighed as it arrives
  (:func:`feedline.protocol.framing.recv_message`), and hands each to its side's handler. What a
  handler refuses (:class:`~feedline.errors.Refusal`) or fails on is refused and counted
  (:class:`Refusals`: a metric by reason, a rate-limited log line naming the socket and the
  peer); nothing a peer sends stops the loop. The sender of a message larger than the host
  ever takes is cut off: no honest peer sends one (WELCOME tells producers the largest, and
  no credit covers more).
- **Cut off** a peer: its connection is shut down under libzmq's feet
  (:func:`feedline.serving.peers.cut_off`), counted and logged.
- **Close** with a bounded linger, and remove the ``ipc://`` socket file only if it is still
  the one this endpoint bound (another process may have bound the path since).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

import zmq

from feedline import endpoints
from feedline.errors import Refusal
from feedline.logs import RateLimitedLog
from feedline.protocol.framing import TOO_LARGE, Oversized, recv_message, send_frames, waiting
from feedline.security import ServerKeys
from feedline.serving.metrics import BrokerMetrics
from feedline.serving.peers import PeerTable, connection, cut_off

DRAIN_BUDGET = 256  # messages handled per socket per loop turn: the other sockets get a turn
_SNDHWM = 10_000  # messages queued towards peers: each is counted in the budget before
_ENVELOPE = 256  # bytes of a ROUTER's peer identity frame, at most (libzmq's own bound)


class Side(Protocol):
    """What handles the messages of one endpoint: a host's producer or consumer side."""

    @property
    def peers(self) -> PeerTable[Any]: ...

    def on_message(self, ident: bytes, frames: list[zmq.Frame], fd: int, now: float) -> None:
        ...

    def liveness(self, now: float, interval: float, timeout: float) -> None: ...


class Refusals:
    """Refused messages: counted by reason (``feedline_broker_rejected_messages_total`` and
    :attr:`counts`), and logged at most once every 5 s, naming the socket and the peer."""

    def __init__(self, metrics: BrokerMetrics, log: logging.Logger) -> None:
        self.metrics, self.log = metrics, log
        self.counts: dict[str, int] = {}
        self._log = RateLimitedLog(log, interval=5.0)
        self._unknown = RateLimitedLog(log, interval=5.0)

    def __call__(self, reason: str, detail: str, where: str, who: str) -> None:
        self.metrics.rejected.labels(reason).inc()
        self.counts[reason] = self.counts.get(reason, 0) + 1
        if reason == "unknown_peer":
            # What every peer of the broker's life before a restart sends until it hears the
            # Reset it is answered with (beats, batches in flight): expected, counted in the
            # metric as ever, and said at INFO, not as a warning.
            self._unknown.log(logging.INFO, "a peer not registered here (one of this "
                              "broker's before it restarted, or one it dropped) sent %s on "
                              "the %s: told to register again", detail, where)
            return
        self._log.warning("rejected a message on the %s from %s: %s%s", where, who, reason,
                          f": {detail}" if detail else "")

    def cut_off(self, fd: int, ino: int, role: str, reason: str) -> None:
        """Close a peer's connection that broke the rules (counted and logged if it was)."""
        if cut_off(fd, ino):
            self.metrics.cut_off.labels(role, reason).inc()
            self.log.warning("cut off a %s's connection: %s", role, reason)


class Endpoint:
    """A socket bound at ``addr`` (``name``: ingress, egress or tensorpack, as logs say it;
    ``flag``: how the operator gave the address, for its errors). Raises
    :class:`feedline.endpoints.AddressError` (one line) for an address in use or unusable,
    ``zmq.ZMQError`` if the bind fails all the same; nothing stays bound then.

    ``max_message``: the most bytes one message may weigh (ZMQ_MAXMSGSIZE bounds each frame
    by it too); ``heartbeats``: libzmq's (interval, timeout) in seconds, or None.
    """

    def __init__(self, ctx: zmq.Context, addr: str, *, name: str, flag: str, kind: int,
                 rcvhwm: int, max_message: int, max_frames: int, linger_ms: int,
                 refusals: Refusals, heartbeats: tuple[float, float] | None = None,
                 keys: ServerKeys | None = None) -> None:
        endpoints.check_bind(addr, flag)
        self.name, self.addr, self.refusals = name, addr, refusals
        self.max_message, self.max_frames, self.linger_ms = max_message, max_frames, linger_ms
        self.sock = s = ctx.socket(kind)
        try:
            s.setsockopt(zmq.LINGER, linger_ms)
            s.setsockopt(zmq.RCVHWM, rcvhwm)
            s.setsockopt(zmq.SNDHWM, _SNDHWM)
            s.setsockopt(zmq.MAXMSGSIZE, max_message)
            if kind == zmq.ROUTER:
                # Sending to a peer that is gone raises instead of dropping silently.
                s.setsockopt(zmq.ROUTER_MANDATORY, 1)
            if heartbeats is not None:
                # libzmq's own heartbeats close a connection whose peer stopped answering
                # (dead, paused, partitioned): what was queued for it is freed.
                s.setsockopt(zmq.HEARTBEAT_IVL, int(heartbeats[0] * 1000))
                s.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(heartbeats[1] * 1000))
            if keys is not None:
                keys.apply(s)
            s.bind(addr)
        except BaseException:
            s.close(linger=0)
            raise
        self._owner = endpoints.ipc_owner(addr)
        self.endpoint = s.getsockopt_string(zmq.LAST_ENDPOINT)

    def send(self, ident: bytes, frames: list[Any]) -> int:
        """Send to one peer without blocking: 0, or EHOSTUNREACH (gone) or EAGAIN (its pipe
        is full)."""
        try:
            send_frames(self.sock, [ident, *frames])
            return 0
        except zmq.ZMQError as e:
            return e.errno or zmq.EAGAIN

    def drain(self, side: Side, keepalive: Callable[[], None]) -> int:
        """Hand waiting messages to ``side`` (at most :data:`DRAIN_BUDGET`); returns how many
        were read. ``keepalive`` runs now and then while an oversized message is read."""
        handler, table = side.on_message, side.peers

        def oversized(reason: str, fd: int) -> None:
            if reason == TOO_LARGE:
                # Larger than anything this host takes (WELCOME says so, and no credit covers
                # it): the sender ignores the rules. Cut off at once, before the rest of the
                # message is read: what it sends next is then never held.
                self.refusals.cut_off(*connection(fd), table.role, reason)

        n = 0
        for n in range(1, DRAIN_BUDGET + 1):
            if n > 1 and not waiting(self.sock):
                return n - 1
            try:
                frames = recv_message(self.sock, self.max_frames + 1, keepalive=keepalive,
                                      max_bytes=self.max_message + _ENVELOPE,
                                      oversized=oversized)
            except zmq.Again:
                return n - 1
            except Oversized as e:
                self.refuse(e.reason, f"{e.what} in {e.seconds:.1f}s", table, e.first)
                continue
            ident = frames[0].bytes
            if len(frames) < 2:
                self.refuse("bad_envelope", "", table, ident)
                continue
            try:
                fd = frames[0].get(zmq.SRCFD)
            except zmq.ZMQError:  # not every transport has one (ZMTP 1.0 peers, inproc)
                fd = -1
            try:
                handler(ident, frames[1:], fd, time.monotonic())
            except Refusal as e:  # DecodeError included: both are counted
                self.refuse(e.reason, e.detail, table, ident)  # str(e) repeats the reason
            except Exception as e:  # a peer's message must never stop the host
                self.refuse("internal_error", f"{type(e).__name__}: {e}"[:200], table, ident)
        return n

    def refuse(self, reason: str, detail: str, table: PeerTable[Any] | None,
               ident: bytes = b"") -> None:
        """Count and log a refused message, naming the peer if ``table`` knows it."""
        peer = table.get(ident) if table is not None else None
        who = (f"{table.role} {peer.name}" if table is not None and peer is not None
               else f"an unregistered peer ({ident.hex()[:16] or 'unknown'})")
        self.refusals(reason, detail, self.name, who)

    def close(self) -> None:
        """Close with the bounded linger; remove our ipc:// file if it is still ours."""
        if not self.sock.closed:
            self.sock.close(linger=self.linger_ms)
        if self._owner is not None:
            endpoints.remove_ipc(self.addr, self._owner)
            self._owner = None

"""The client side of a broker connection, shared by producers and consumers.

A :class:`BrokerLink` owns one DEALER socket to the broker and does the liveness work of the
zguide's Paranoid Pirate pattern: it says HELLO, sends a HEARTBEAT whenever it has been quiet
for one interval, treats a broker that has been silent for ``heartbeat_timeout`` as dead and
then closes the socket and reconnects with exponential backoff and jitter. A RESET from the
broker, or a message from a broker with another instance id, means the broker restarted and
forgot us: the link says HELLO again and tells its owner through ``on_register``. RESETs that
arrive while that HELLO is unanswered answer messages sent before it, and are ignored.

Create it in the thread that uses it; it is not thread-safe.
"""

from __future__ import annotations

import logging
import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq

from feedline import wire
from feedline.liveness import HEARTBEAT_INTERVAL, HEARTBEAT_TIMEOUT

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LinkConfig:
    """Liveness and socket settings of a producer's or consumer's link to the broker."""

    heartbeat_interval: float = HEARTBEAT_INTERVAL
    heartbeat_timeout: float = HEARTBEAT_TIMEOUT
    reconnect_min: float = 0.1
    reconnect_max: float = 5.0
    linger_ms: int = 0  # on reconnect: drop what was queued for the dead broker
    flush_ms: int = 3000  # on a final close: let queued batches, EOS and BYE go out, bounded
    limits: wire.Limits = wire.DEFAULT_LIMITS
    curve: Any = None  # feedline.security.ClientKeys, or None for plain TCP


class Backoff:
    """Exponential backoff with full jitter, reset on success."""

    def __init__(self, lo: float, hi: float, rng: random.Random | None = None) -> None:
        self.lo, self.hi, self.attempt = lo, hi, 0
        self._rng = rng or random.Random()

    def next_delay(self) -> float:
        cap = min(self.hi, self.lo * (2**self.attempt))
        self.attempt += 1
        return self._rng.uniform(self.lo, max(self.lo, cap))

    def reset(self) -> None:
        self.attempt = 0


class BrokerLink:
    """One DEALER connection to a broker with hello, heartbeats and reconnects.

    ``hello`` returns the fields of this peer's HELLO (called at every (re)registration).
    ``on_register`` is called when a new registration starts (connect, reconnect, reset), so
    the owner can forget credit given by a broker that no longer knows it.
    """

    def __init__(
        self,
        ctx: zmq.Context,
        addr: str,
        hello: Callable[[], dict[str, Any]],
        config: LinkConfig,
        on_register: Callable[[], None] = lambda: None,
        rcvhwm: int = 1000,
        sndhwm: int = 1000,
    ) -> None:
        self.ctx, self.addr, self.cfg = ctx, addr, config
        self._hello, self._on_register = hello, on_register
        self._rcvhwm, self._sndhwm = rcvhwm, sndhwm
        self._backoff = Backoff(config.reconnect_min, config.reconnect_max)
        self.socket: zmq.Socket | None = None
        self.broker_id: int | None = None
        self._previous: deque[int] = deque(maxlen=8)  # instance ids of restarted brokers
        self.welcomed = False  # a broker has answered since our last HELLO
        self.reconnects = 0
        self._last_recv = self._last_send = self._hello_at = 0.0
        self._last_tick = time.monotonic()
        self._retry_at = 0.0
        self._connect()

    # -- socket lifecycle ---------------------------------------------------------------
    def _connect(self) -> None:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, self.cfg.linger_ms)
        # Queue nothing for a broker we are not connected to: a send then fails fast (EAGAIN)
        # and the batch is kept by the caller instead of dying in a pipe nobody reads.
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.setsockopt(zmq.RCVHWM, self._rcvhwm)
        sock.setsockopt(zmq.SNDHWM, self._sndhwm)
        sock.setsockopt(zmq.MAXMSGSIZE, self.cfg.limits.max_message_bytes)
        # libzmq retries a lost TCP connection by itself, doubling the interval. Capped at
        # one heartbeat interval (not reconnect_max): a restarted broker or a healed link is
        # then found within about a second (measured in docs/reliability.md). A SYN lost in a
        # partition would otherwise wait for the kernel's own retransmission (1, 3, 7, 15 s
        # ...): the connect attempt is abandoned and retried after a few heartbeats instead.
        # The link's own backoff, with jitter, still paces whole re-registrations.
        retry_ms = int(min(self.cfg.reconnect_max, self.cfg.heartbeat_interval) * 1000)
        sock.setsockopt(zmq.RECONNECT_IVL, min(int(self.cfg.reconnect_min * 1000), retry_ms))
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, retry_ms)
        sock.setsockopt(zmq.CONNECT_TIMEOUT, max(1000, 2 * retry_ms))
        if self.cfg.curve is not None:
            self.cfg.curve.apply(sock)
        sock.connect(self.addr)
        self.socket = sock
        now = time.monotonic()
        self._last_recv = now  # the timeout counts from the connect
        self._register(now)

    def _register(self, now: float) -> None:
        self.welcomed = False
        self._on_register()
        self._hello_at = 0.0
        self._try_hello(now)

    def _try_hello(self, now: float) -> None:
        if self.send_control(wire.Kind.HELLO, **self._hello()):
            self._hello_at = now

    def reconnect(self) -> None:
        """Drop the socket (and whatever it had queued) and connect afresh after backoff."""
        self.close()
        self.reconnects += 1
        self._retry_at = time.monotonic() + self._backoff.next_delay()

    def close(self, flush: bool = False) -> None:
        """Close the socket. ``flush``: give queued messages up to ``flush_ms`` to leave
        (a final close); otherwise drop them at once (a reconnect)."""
        if self.socket is not None:
            self.socket.close(linger=self.cfg.flush_ms if flush else self.cfg.linger_ms)
            self.socket = None

    # -- sending ------------------------------------------------------------------------
    def send_control(self, kind: wire.Kind, **fields: Any) -> bool:
        return self.send_frames([wire.encode_control(kind, **fields)])

    def send_frames(self, frames: list[Any], copy: bool = False) -> bool:
        """Send without blocking; False if not connected or the pipe is full."""
        if self.socket is None:
            return False
        try:
            self.socket.send_multipart(frames, flags=zmq.NOBLOCK, copy=copy)
        except zmq.Again:
            return False
        self._last_send = time.monotonic()
        return True

    # -- receiving and liveness ---------------------------------------------------------
    def handle(self, header: dict[str, Any]) -> bool:
        """Book-keep a message from the broker. True if it was link-level (fully handled)."""
        self._last_recv = time.monotonic()
        bid = header.get("b")
        kind = header["k"]
        if bid is not None and bid in self._previous:
            # A message of a broker instance that has since restarted (still in the pipe of
            # its dead connection): not a reason to register with it again.
            return kind in (wire.Kind.RESET, wire.Kind.HEARTBEAT)
        if bid is not None and self.broker_id is not None and bid != self.broker_id:
            log.info("broker %s restarted (new instance); registering again", self.addr)
            self._previous.append(self.broker_id)
            self.broker_id = bid
            self._register(self._last_recv)
            return kind in (wire.Kind.RESET, wire.Kind.HEARTBEAT)
        if bid is not None:
            self.broker_id = bid
        if kind == wire.Kind.RESET:
            if not self.welcomed and self._hello_at > 0.0:
                # Our HELLO is on its way, so this RESET answers something we sent before
                # it (the broker never answers a HELLO with RESET). Registering again would
                # make the broker start our credit from zero once more while batches and
                # credit of the registration it is about to accept are in flight.
                return True
            log.info("broker %s does not know us; registering again", self.addr)
            self._register(self._last_recv)
            return True
        if not self.welcomed and kind != wire.Kind.HEARTBEAT:
            self.welcomed = True
            self._backoff.reset()
        return kind == wire.Kind.HEARTBEAT

    def tick(self) -> None:
        """Heartbeat, hello retry and dead-broker detection; call at least every interval/2
        (a gap of more than half the timeout between calls is taken as our own absence)."""
        now = time.monotonic()
        if self.socket is None:
            if now >= self._retry_at:
                self._connect()
            return
        away = now - self._last_tick
        self._last_tick = now
        if away > self.cfg.heartbeat_timeout / 2:
            # We were not running (SIGSTOP, a long pause of the process or of our owner): that
            # is our silence, not the broker's. Restart its clock instead of reconnecting,
            # which would throw away the batches the broker delivered meanwhile; messages
            # waiting for us (or the answer to our next heartbeat) show whether it is alive.
            self._last_recv = max(self._last_recv, now)
        if now - self._last_recv > self.cfg.heartbeat_timeout:
            log.warning(
                "broker %s silent for %.1fs; reconnecting", self.addr, now - self._last_recv
            )
            self.reconnect()
            return
        if not self.welcomed and self._hello_at == 0.0:
            # Only a HELLO that could not be queued is retried. One that was queued reaches
            # the broker or the connection breaks; a second one could make the broker grant
            # credit twice. No answer within the timeout means reconnect, as above.
            self._try_hello(now)
        elif now - self._last_send >= self.cfg.heartbeat_interval:
            self.send_control(wire.Kind.HEARTBEAT)

    def poll_timeout_ms(self) -> int:
        return max(1, int(self.cfg.heartbeat_interval * 500))

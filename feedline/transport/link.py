"""The client end of a broker connection, shared by producers and consumers.

A :class:`Link` owns one DEALER socket to a broker (or a direct-mode trainer) and does the
liveness work of the zguide's Paranoid Pirate pattern: it registers with a HELLO, sends a
HEARTBEAT whenever it has been quiet for one interval, treats a broker silent for
``heartbeat_timeout`` as dead and then closes the socket and reconnects with exponential
backoff and jitter. It receives frame by frame (:func:`feedline.protocol.framing.recv_message`),
decodes control messages (:mod:`feedline.protocol.messages`), counts what it refuses, and hands its
owner only the messages that are the owner's business (``on_message``).

Registration rules (each one learned from a fault scenario, docs/architecture.md):

- Every HELLO carries a registration number. A HELLO that gets no WELCOME is sent again,
  the same registration, with backoff: the broker treats a repeated HELLO of a registration
  it knows as a no-op, so a lost HELLO never strands a peer, and a repeated one never restarts
  its credit.
- RESETs that arrive while the HELLO is unanswered answer messages sent before it: counted,
  not acted on; the link's report of a search that lasts (below) counts them.
- A message from a broker instance other than the one we registered with means the broker
  restarted: register again. A message from an instance that has since been replaced (still
  in the pipe of its dead connection) is dropped whatever it says (a late credit included).
- A gap of more than half the timeout between two of our own ticks is our own absence
  (SIGSTOP, a long pause), not the broker's silence: its clock restarts.

What the link knows of the other side (:class:`Reach`): a socket monitor (libzmq's events,
read in :meth:`Link.tick`, not polled) tells whether a connection was ever made and how its
handshake ended, so that a link without a broker says why, in words (:func:`explain`):
nothing accepts connections there, the broker has CURVE keys and we have none (or the
reverse), the CURVE handshake fails (the wrong broker key), our key is not allowed, or the
broker is connected and does not answer. It says so at WARNING after ``heartbeat_timeout``,
then again with backoff (10 s, 20 s, 40 s, then once a minute) for as long as it lasts; a
consumer's :class:`~feedline.errors.ReceiveTimeout` says the same.

Create, use and close a Link in one thread (rule 12); :class:`feedline.transport.client.ClientLoop`
is that thread for producers and consumers.
"""

from __future__ import annotations

import logging
import random
import struct
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import zmq

from feedline.errors import ConfigError
from feedline.liveness import HEARTBEAT_INTERVAL, HEARTBEAT_TIMEOUT
from feedline.logs import RateLimitedLog
from feedline.protocol import messages as m
from feedline.protocol.codec import DEFAULT_LIMITS, DecodeError, Limits
from feedline.protocol.framing import recv_message, send_frames, waiting
from feedline.security import ClientKeys

log = logging.getLogger(__name__)
_REMEMBER_BYTES = 64  # control frames up to this size are remembered with their message
_NAG_MAX = 60.0  # seconds between two "no broker" reports, at most (they double up to it)
# The monitor events a link reads: whether a connection was made, and how its handshake
# ended (connect retries are not read: a missing CONNECTED says as much, without an event
# every retry).
_EVENTS = (zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED
           | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
           | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
_TELLING = {"": 0, "handshake": 1, "mechanism": 2, "auth": 3}  # Reach.failure, by what it says
_MONITOR_EVERY = 0.1  # seconds between two reads of the monitor while not welcomed
_EVENT = struct.Struct("=HI")  # a monitor event's first frame: event, value (zmq_socket_monitor)


class KeysHint(NamedTuple):
    """How a peer's operator gives it CURVE keys, in the words of its own interface: the
    keys, and the broker's public key among them (for :func:`explain`)."""

    keys: str = "CURVE keys (--curve-secret and --curve-broker-key; in Python, curve=ClientKeys)"
    broker_key: str = "--curve-broker-key"


PRODUCER_KEYS = KeysHint()  # a producer's (its command line, and its Python API)


@dataclass(frozen=True)
class LinkConfig:
    """Liveness and socket settings of a producer's or consumer's link to a broker."""

    heartbeat_interval: float = HEARTBEAT_INTERVAL
    heartbeat_timeout: float = HEARTBEAT_TIMEOUT
    reconnect_min: float = 0.1
    reconnect_max: float = 5.0
    linger_ms: int = 0  # on reconnect: drop what was queued for the dead broker
    flush_ms: int = 3000  # on a final close: let queued batches, EOS and BYE go out, bounded
    limits: Limits = DEFAULT_LIMITS
    credit_warn: float = 30.0  # a producer's batch waiting this long for credit is logged

    def __post_init__(self) -> None:
        if not 0 < self.heartbeat_interval < self.heartbeat_timeout:
            raise ConfigError(f"LinkConfig: heartbeat_interval ({self.heartbeat_interval}) "
                              f"must be > 0 and below heartbeat_timeout "
                              f"({self.heartbeat_timeout}), or a live peer is dropped")


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


OnMessage = Callable[["Link", m.Message, list[zmq.Frame]], None]


@dataclass
class Reach:
    """What a link knows of the broker it tries to reach. Written by the link's thread only;
    plain values, so another thread (a consumer's iterating one, composing a timeout's
    message) may read them. Times are ``time.monotonic()``.

    ``since``: when the link last started looking for a broker (its creation, or the loss of
    the one that had welcomed it); ``connected`` and ``handshaken``: the last time a
    connection was made and its handshake done (0: never); ``failure``, about that search:
    how the last handshake failed
    (``mechanism``: one side has CURVE keys, the other none; ``handshake``: it failed
    without detail, for a CURVE client the broker's public key it was given is not the
    broker's; ``auth``: the broker did not allow our key; empty: none failed, or one
    succeeded after). ``welcomed_at``: the first WELCOME ever (None: never);
    ``heard_at``: the last message of a broker (0: never)."""

    since: float
    connected: float = 0.0
    handshaken: float = 0.0
    open: bool = False  # the last connection event was CONNECTED, not DISCONNECTED
    failure: str = ""
    welcomed_at: float | None = None
    heard_at: float = 0.0
    resets: int = 0  # RESETs to our HELLOs since ``since``
    refusal: m.Refused | None = None  # the broker refused our registration (since ``since``)

    def lost(self, now: float, connection: bool) -> None:
        """A new search: the broker that welcomed us went silent (``connection``: its
        connection is gone, what the monitor saw of it is history), restarted, or forgot us."""
        self.since, self.resets, self.refusal = now, 0, None
        if connection:
            self.connected = self.handshaken = 0.0
            self.failure, self.open = "", False


def explain(r: Reach, addr: str, curve: bool, hint: KeysHint = PRODUCER_KEYS) -> str:
    """Why a link has no broker at ``addr``, as the operator can act on it (one clause).
    ``curve``: the link has CURVE keys."""
    if r.refusal is not None:
        detail = f" ({r.refusal.detail})" if r.refusal.detail else ""
        if r.refusal.reason == m.WAIT_OLD_PRODUCERS:
            return f"the broker at {addr} has us wait{detail}"
        return f"the broker at {addr} refused our registration: {r.refusal.reason}{detail}"
    if r.failure == "mechanism":
        if curve:
            return (f"a connection to {addr} was made but its handshake never completed: "
                    "this process has CURVE keys and the server there has none (a broker "
                    "without --curve-secret?); give the broker its keys, or drop ours")
        return (f"a connection to {addr} was made but its handshake never completed: the "
                f"broker there has CURVE keys and this process has none; give it {hint.keys}, "
                "with our public key in the broker's --curve-allowed directory")
    if r.failure == "auth":
        return (f"the broker at {addr} did not accept our CURVE key: add our .key file to "
                "its --curve-allowed directory")
    if r.failure == "handshake":
        if curve:
            return (f"a connection to {addr} was made but its CURVE handshake never "
                    f"completed: is the broker key we were given ({hint.broker_key}) that "
                    "broker's public key?")
        return (f"a connection to {addr} was made but its handshake never completed: does "
                f"the broker there have CURVE keys (then give this process {hint.keys}), "
                "and is it a feedline broker?")
    up = r.open  # a connection is open now (perhaps made before the search)
    if not up and r.connected < r.since or not r.connected:
        return (f"nothing accepts connections at {addr}: is the broker running, and is "
                "this its address and port?")
    if not (r.handshaken >= r.since or up and r.handshaken >= r.connected):
        return (f"{addr} accepts connections but never completed a ZeroMQ handshake: is it "
                "a feedline broker?")
    if r.resets:
        return (f"{addr} answers but does not accept our registration ({r.resets} RESETs): "
                "is it a feedline broker of the same version, and the right port?")
    return (f"{addr} is connected but has not answered our registration: is it a feedline "
            "broker's address for this side (producers: its --ingress; trainers: its "
            "--egress)?")


class Link:
    """One DEALER connection to a broker with registration, heartbeats and reconnects.

    ``hello(registration)`` returns this peer's HELLO for a registration number;
    ``on_register(registration)`` is called when a new registration starts (connect,
    reconnect, broker restart, RESET), so the owner can forget credit given under the old
    one. ``on_reject`` counts a refused message by reason (a metric). ``what`` names the peer
    in log lines.
    """

    def __init__(
        self,
        ctx: zmq.Context,
        addr: str,
        hello: Callable[[int], m.ProducerHello | m.ConsumerHello],
        config: LinkConfig | None = None,
        *,
        curve: ClientKeys | None = None,
        on_register: Callable[[int], None] = lambda registration: None,
        on_reject: Callable[[str], None] = lambda reason: None,
        rcvhwm: int = 1000,
        sndhwm: int = 1000,
        what: str = "peer",
        keys_hint: KeysHint = PRODUCER_KEYS,
    ) -> None:
        self.ctx, self.addr = ctx, addr
        self.cfg = config or LinkConfig()
        self.curve, self.what, self.keys_hint = curve, what, keys_hint
        self._hello, self._on_register, self._on_reject = hello, on_register, on_reject
        self._rcvhwm, self._sndhwm = rcvhwm, sndhwm
        self._backoff = Backoff(self.cfg.reconnect_min, self.cfg.reconnect_max)
        self._log = RateLimitedLog(log, interval=30.0)
        self.socket: zmq.Socket | None = None
        self._monitor: zmq.Socket | None = None
        self._monitor_read = 0.0
        self.broker_id: int | None = None
        self._previous: deque[int] = deque(maxlen=8)  # instance ids of replaced brokers
        self.registration = 0
        self.welcomed = False  # the broker accepted this registration
        self.ever_answered = False  # some broker answered us at some point
        self.reconnects = 0
        self.resets_unanswered = 0
        self.refusal: m.Refused | None = None  # the last registration refusal, for errors
        self._tries = 0
        self._last_raw = b""  # the last small frame decoded, and its message (_decode)
        self._last_msg: m.Message | None = None
        now = time.monotonic()
        self._last_recv = self._last_send = self._last_tick = self._hello_at = now
        self._hello_retry = 0.0
        self._retry_at = 0.0
        self.reach = Reach(since=now)
        self._nag_delay = self.cfg.heartbeat_timeout
        self._nag_at = now + self._nag_delay  # the next "no broker" report
        self._nagged = False  # one was made since the last WELCOME
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
        sock.setsockopt(zmq.MAXMSGSIZE, self.cfg.limits.max_message_bytes
                        + self.cfg.limits.max_header_bytes)
        # libzmq retries a lost TCP connection by itself, doubling the interval. Capped at
        # one heartbeat interval: a restarted broker or a healed link is then found within
        # about a second (docs/reliability.md). A SYN lost in a partition would otherwise wait
        # for the kernel's retransmissions (1, 3, 7, 15 s ...): the attempt is abandoned and
        # retried instead. The link's own backoff still paces whole re-registrations.
        retry_ms = int(min(self.cfg.reconnect_max, self.cfg.heartbeat_interval) * 1000)
        sock.setsockopt(zmq.RECONNECT_IVL, min(int(self.cfg.reconnect_min * 1000), retry_ms))
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, retry_ms)
        sock.setsockopt(zmq.CONNECT_TIMEOUT, max(1000, 2 * retry_ms))
        if self.curve is not None:
            self.curve.apply(sock)
        # Whether a connection was made and how its handshake ended is only visible as a
        # monitor event: it is how a link without a broker can say why (Reach, explain).
        # Read in tick(), not polled: a busy link's turns do not pay for it.
        self._monitor = sock.get_monitor_socket(_EVENTS)
        sock.connect(self.addr)
        self.socket = sock
        now = time.monotonic()
        self._last_recv = now  # the timeout counts from the connect
        self.register(now)

    def register(self, now: float | None = None) -> None:
        """Start a new registration (a new number) and say HELLO."""
        now = time.monotonic() if now is None else now
        if self.welcomed:  # the broker restarted or forgot us: a new search, on the connection
            self._lost(now, connection=False)
        self.registration = (self.registration + 1) % (1 << 31)
        self.welcomed = False
        self.resets_unanswered = 0
        self._tries = 0
        self._on_register(self.registration)
        self._hello_retry = max(1.0, 2 * self.cfg.heartbeat_interval)
        self._hello_at = -self._hello_retry  # not queued yet
        self._say_hello(now)

    def _lost(self, now: float, connection: bool) -> None:
        """The broker that welcomed us is gone: reports of the search start a timeout from now."""
        self.reach.lost(now, connection)
        self._nag_delay = self.cfg.heartbeat_timeout
        self._nag_at = now + self._nag_delay

    def _say_hello(self, now: float) -> bool:
        # A HELLO that could not be queued (not connected yet: IMMEDIATE) is retried at the
        # next tick; one that was queued, after the retry delay.
        if self.send_msg(self._hello(self.registration)):
            self._tries += 1
            self._hello_at = now
            return True
        return False

    def reconnect(self) -> None:
        """Drop the socket (and whatever it had queued) and connect afresh after backoff."""
        self.close()
        self.reconnects += 1
        self._retry_at = time.monotonic() + self._backoff.next_delay()

    def close(self, flush: bool = False) -> None:
        """Close the socket. ``flush``: give queued messages up to ``flush_ms`` to leave
        (a final close); otherwise drop them at once (a reconnect)."""
        if self._monitor is not None and self.socket is not None:
            self._read_monitor(time.monotonic())  # what it saw last, before it goes
            self.reach.open = False
            self.socket.disable_monitor()
            self._monitor.close(linger=0)
            self._monitor = None
        if self.socket is not None:
            self.socket.close(linger=self.cfg.flush_ms if flush else self.cfg.linger_ms)
            self.socket = None

    # -- sending ------------------------------------------------------------------------
    def send_msg(self, msg: m.Message) -> bool:
        return self.send_frames([m.encode(msg)])

    def send_frames(self, frames: list[Any], copy: bool = False) -> bool:
        """Send without blocking; False if not connected or the pipe is full."""
        if self.socket is None:
            return False
        try:
            send_frames(self.socket, frames, copy)
        except zmq.Again:
            return False
        self._last_send = time.monotonic()
        return True

    # -- receiving ----------------------------------------------------------------------
    def poll_sockets(self) -> list[zmq.Socket]:
        """The sockets the owner's poller waits on for this link (its monitor is read by
        :meth:`tick`, not polled)."""
        return [] if self.socket is None else [self.socket]

    def receive(self, on_message: OnMessage, budget: int = 1000) -> int:
        """Handle up to ``budget`` waiting messages; the owner's get ``on_message``.
        Returns how many messages were read."""
        n = 0
        while self.socket is not None and n < budget:
            if n and not waiting(self.socket):  # the first: the poll said one is there
                break
            try:
                frames = recv_message(self.socket, self.cfg.limits.max_frames)
            except zmq.Again:
                break
            except DecodeError as e:
                self._reject(e)
                n += 1
                continue
            n += 1
            try:
                msg = self._decode(frames[0])
            except DecodeError as e:
                self._reject(e)
                continue
            if self._handle(msg) and self.socket is not None:
                on_message(self, msg, frames[1:])
        return n

    def _decode(self, frame: Any) -> m.Message:
        """:func:`messages.decode`, remembering the last small frame: a batch's envelope
        (DELIVER) is the same bytes batch after batch, and messages are immutable."""
        if len(frame) > _REMEMBER_BYTES:
            return m.decode(frame, self.cfg.limits)
        raw = frame.bytes if isinstance(frame, zmq.Frame) else bytes(frame)
        if raw == self._last_raw and self._last_msg is not None:
            return self._last_msg
        msg = m.decode(raw, self.cfg.limits)
        self._last_raw, self._last_msg = raw, msg
        return msg

    def _reject(self, e: DecodeError) -> None:
        self._on_reject(e.reason)
        self._log.warning("%s: refused a message from %s: %s", self.what, self.addr, e)

    def _handle(self, msg: m.Message) -> bool:
        """Link-level bookkeeping; True if the owner should see ``msg`` too."""
        now = self._last_recv = self.reach.heard_at = time.monotonic()
        bid = m.broker_of(msg)
        if bid is not None and bid in self._previous:
            return False  # a replaced broker's message still in the pipe: whatever it says
        if bid is not None and self.broker_id is not None and bid != self.broker_id:
            log.info("%s: broker %s restarted (new instance); registering again",
                     self.what, self.addr)
            self._previous.append(self.broker_id)
            self.broker_id = bid
            self.register(now)
            return isinstance(msg, m.Refused)
        if bid is not None:
            self.broker_id = bid
        if isinstance(msg, m.Welcome):
            if msg.registration != self.registration:
                return False  # the answer to an earlier registration's HELLO
            self.welcomed = self.ever_answered = True
            self._backoff.reset()
            self.refusal = self.reach.refusal = None
            if self.reach.welcomed_at is None:
                self.reach.welcomed_at = now
            if self._nagged:  # the end of what the warnings were about
                log.info("%s: registered with the broker at %s (after %.0fs)", self.what,
                         self.addr, now - self.reach.since)
            self._nagged = False
            self._nag_delay = self.cfg.heartbeat_timeout
            return True
        if isinstance(msg, m.Reset):
            if not self.welcomed:
                self.resets_unanswered += 1  # answers what we sent before our HELLO
                self.reach.resets += 1
                return False
            log.info("%s: broker %s does not know us; registering again", self.what, self.addr)
            self.register(now)
            return False
        if isinstance(msg, m.Refused) and not self.welcomed:
            self.ever_answered = True
            self.refusal = self.reach.refusal = msg
            if msg.reason == m.WAIT_OLD_PRODUCERS:  # not an error: asked to wait, we ask again
                self._log.info("%s: the broker at %s has us wait: %s", self.what, self.addr,
                               msg.detail)
                self._nagged = True  # ... and the WELCOME that ends the wait says so
            else:
                self._log.warning("%s: the broker at %s refused our registration: %s%s",
                                  self.what, self.addr, msg.reason,
                                  f" ({msg.detail})" if msg.detail else "")
            return True
        return not isinstance(msg, m.Heartbeat)

    def _read_monitor(self, now: float) -> None:
        """Note what the monitor saw since the last read (connections, handshakes)."""
        self._monitor_read = now
        mon, r = self._monitor, self.reach
        while mon is not None:
            try:
                frames = mon.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 2 or len(frames[0]) != _EVENT.size:
                continue
            event, value = _EVENT.unpack(frames[0])
            if event == zmq.EVENT_CONNECTED:
                r.connected, r.open = now, True
            elif event == zmq.EVENT_DISCONNECTED:
                r.open = False
            elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                r.handshaken, r.failure = now, ""
            elif event in (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                           zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL):
                # The most telling failure of the search stays: a server that closes at once
                # makes some of the same failures read as "no detail" (EPIPE).
                kind = ("mechanism" if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                        and value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH else "handshake")
                if _TELLING[kind] >= _TELLING[r.failure]:
                    r.failure = kind
            elif event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                r.failure = "auth"
                if self.curve is not None:
                    self._log.warning(
                        "%s: the broker at %s did not accept our CURVE key (public key %s): "
                        "add our .key file to the broker's --curve-allowed directory",
                        self.what, self.addr, self.curve.public.decode()[:12] + "...")

    def explain(self) -> str:
        """Why this link has no broker now, in words (see :func:`explain`)."""
        return explain(self.reach, self.addr, self.curve is not None, self.keys_hint)

    # -- liveness -----------------------------------------------------------------------
    def tick(self) -> None:
        """Heartbeat, hello retries and dead-broker detection; call at least every
        interval/2 (a gap of more than half the timeout is taken as our own absence)."""
        now = time.monotonic()
        # Also while there is no socket (a reconnect's backoff): the wait for the retry is
        # not our absence.
        away = now - self._last_tick
        self._last_tick = now
        if self._monitor is not None and now - self._monitor_read >= (
                self.cfg.heartbeat_interval if self.welcomed else _MONITOR_EVERY):
            self._read_monitor(now)
        if not self.welcomed and now >= self._nag_at:
            self._nag(now)
        if self.socket is None:
            if now >= self._retry_at:
                self._connect()
            return
        if away > self.cfg.heartbeat_timeout / 2:
            # We were not running (SIGSTOP, a long pause of the process): that is our
            # silence, not the broker's. Restart its clock instead of reconnecting, which
            # would throw away the batches the broker delivered meanwhile.
            self._last_recv = max(self._last_recv, now)
        if now - self._last_recv > self.cfg.heartbeat_timeout:
            if self.welcomed:
                # The broker that welcomed us went silent: said once here, then by _nag
                # with backoff for as long as no broker welcomes us again.
                log.warning("%s: broker %s silent for %.1fs (it stopped, restarted, or the "
                            "network between us is down); reconnecting", self.what,
                            self.addr, now - self._last_recv)
                self.welcomed = False
                self._lost(now, connection=True)
            self.reconnect()
            return
        if not self.welcomed:
            # Until a WELCOME, only HELLOs: anything else would be answered with RESET.
            queued_before = self._tries > 0
            if now - self._hello_at >= self._hello_retry and self._say_hello(now) \
                    and queued_before:  # the same registration again: a no-op if it arrived
                self._hello_retry = min(2 * self._hello_retry, self.cfg.heartbeat_timeout)
        elif now - self._last_send >= self.cfg.heartbeat_interval:
            self.send_msg(m.Heartbeat())

    def _nag(self, now: float) -> None:
        """Say that no broker has us, and why, at WARNING; again after twice the delay (up
        to a minute) for as long as that lasts: an operator who looks at the log an hour
        later still finds it, and it does not fill the log. Not while the broker has us wait
        (it said why, and for how long at most, when it did)."""
        r = self.reach.refusal
        if r is not None and r.reason == m.WAIT_OLD_PRODUCERS:
            self._nag_at = now + self._nag_delay
            return
        if self.reach.welcomed_at is None:
            log.warning("%s: never %s a broker (trying for %.0fs): %s", self.what,
                        "registered with" if self.reach.refusal else "connected to",
                        now - self.reach.since, self.explain())
        else:
            log.warning("%s: no broker for %.0fs (the one we had went silent): %s",
                        self.what, now - self.reach.since, self.explain())
        self._nagged = True
        self._nag_delay = min(_NAG_MAX, 2 * self._nag_delay)
        self._nag_at = now + self._nag_delay

    def poll_timeout_ms(self) -> int:
        return max(1, int(self.cfg.heartbeat_interval * 500))

"""The broker's event loop: one thread, three sockets, bounded state.

Ingress (ROUTER, producers connect DEALERs): HELLO registers a producer; the broker grants it
credit (CREDIT with ``t``, the absolute number of batches granted since its HELLO, so a
repeated message is harmless). A producer sends one BATCH per credit. Credit is granted only
while ``buffered + outstanding < max_batches`` and the byte budget allows it, so the broker's
memory is bounded whatever the producers do; a BATCH without credit is refused.

Egress (ROUTER, consumers connect DEALERs): HELLO carries the consumer's window ``c``;
CREDIT carries ``t``, the total batches it has consumed. A consumer may hold
``c + t - delivered`` more; the broker sends buffered batches round-robin to consumers with
room, each prefixed by an envelope frame. Array frames are forwarded as received
(``copy=False``); the broker reads headers only.

Liveness: every peer is sent a HEARTBEAT when nothing else went to it for one interval; a peer
silent for ``heartbeat_timeout`` is dropped (its credit returns to the pool). Unknown peers
get RESET and say HELLO again, which is how everyone recovers from a broker restart.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

import zmq
from prometheus_client import CollectorRegistry

from broker.config import BrokerConfig
from broker.metrics import BrokerMetrics
from feedline import wire
from feedline.logs import RateLimitedLog

log = logging.getLogger(__name__)
_MAX_SESSIONS = 4096
_CONTROL_SLACK = 64  # EOS/ERROR messages queued beyond max_batches, at most


@dataclass
class _Producer:
    pid: str
    session: int
    label: str
    granted: int = 0  # credit granted since HELLO (absolute, echoed in CREDIT "t")
    received: int = 0  # batches received since HELLO
    largest: int = 0  # largest batch seen, for the byte budget
    last_seen: float = 0.0
    last_sent: float = 0.0

    @property
    def outstanding(self) -> int:
        return self.granted - self.received


@dataclass
class _Consumer:
    cid: str
    window: int
    consumed: int = 0  # as last reported ("t")
    delivered: int = 0
    last_seen: float = 0.0
    last_sent: float = 0.0

    @property
    def room(self) -> int:
        return self.window + self.consumed - self.delivered


@dataclass
class _Buffered:
    frames: list[Any]  # [header, arrays...] as received
    nbytes: int
    session: int
    gap: int
    broadcast: bool = False  # EOS / ERROR: to every consumer, in order behind the batches


@dataclass
class BrokerStats:
    received: int = 0
    forwarded: int = 0
    rejected: dict[str, int] = field(default_factory=dict)


class Broker:
    """Run with :meth:`run` (blocks until ``stop`` is set). Create and run in one thread."""

    def __init__(
        self,
        config: BrokerConfig,
        registry: CollectorRegistry | None = None,
        ctx: zmq.Context | None = None,
    ) -> None:
        self.cfg = config
        self.registry = registry if registry is not None else CollectorRegistry()
        self.metrics = BrokerMetrics(self.registry)
        self.metrics.buffer_capacity_batches.set(config.max_batches)
        self.metrics.buffer_capacity_bytes.set(config.max_bytes)
        self._own_ctx = ctx is None
        self.ctx = ctx or zmq.Context(io_threads=config.io_threads)
        self.instance = random.getrandbits(62)
        self.stats = BrokerStats()
        self._producers: dict[bytes, _Producer] = {}
        self._consumers: dict[bytes, _Consumer] = {}
        self._rr: deque[bytes] = deque()  # consumers, rotated for fairness
        self._buffer: deque[_Buffered] = deque()
        self._buffered_bytes = 0
        # producer session -> last seq received; LRU-bounded (sessions end with restarts)
        self._last_seq: OrderedDict[int, int] = OrderedDict()
        self._tp_seq = 0
        self._grant_rr = 0
        self._reject_log = RateLimitedLog(log, interval=5.0)
        # The ZAP handler must run before any CURVE socket binds, or early handshakes race it.
        self._auth = config.curve.authenticator(self.ctx) if config.curve is not None else None
        self._ingress = self._bind(zmq.ROUTER, config.ingress)
        self._egress = self._bind(zmq.ROUTER, config.egress)
        self._tp: zmq.Socket | None = None
        if config.tensorpack_ingress:
            # tensorpack's PUSH cannot speak CURVE: this port is plain (the CLI keeps it local).
            self._tp = self._bind(
                zmq.PULL, config.tensorpack_ingress, hwm=config.max_batches, curve=False
            )
        self.ingress_endpoint = self._ingress.getsockopt_string(zmq.LAST_ENDPOINT)
        self.egress_endpoint = self._egress.getsockopt_string(zmq.LAST_ENDPOINT)
        self.tensorpack_endpoint = (
            self._tp.getsockopt_string(zmq.LAST_ENDPOINT) if self._tp is not None else None
        )

    def _bind(self, kind: int, addr: str, hwm: int = 10_000, curve: bool = True) -> zmq.Socket:
        s = self.ctx.socket(kind)
        s.setsockopt(zmq.LINGER, self.cfg.linger_ms)
        s.setsockopt(zmq.RCVHWM, hwm)
        s.setsockopt(zmq.SNDHWM, 10_000)
        s.setsockopt(zmq.MAXMSGSIZE, self.cfg.limits.max_message_bytes)
        if kind == zmq.ROUTER:
            # Sending to a peer that is gone raises instead of dropping silently.
            s.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if curve and self.cfg.curve is not None:
            self.cfg.curve.apply(s)
        s.bind(addr)
        return s

    # ---------------------------------------------------------------------------- loop
    def run(self, stop: threading.Event) -> None:
        log.info(
            "broker up: ingress %s, egress %s%s",
            self.ingress_endpoint,
            self.egress_endpoint,
            f", tensorpack {self.tensorpack_endpoint}" if self._tp is not None else "",
        )
        poller = zmq.Poller()
        poller.register(self._ingress, zmq.POLLIN)
        poller.register(self._egress, zmq.POLLIN)
        tp_registered = False
        tick_ms = max(1, int(self.cfg.heartbeat_interval * 250))
        next_tick = 0.0
        try:
            while not stop.is_set():
                if self._tp is not None:
                    # Read tensorpack's PUSH only while there is room: its HWM then pushes
                    # back on the sender, the only flow control a tensorpack producer knows.
                    want = self._has_room()
                    if want and not tp_registered:
                        poller.register(self._tp, zmq.POLLIN)
                    elif tp_registered and not want:
                        poller.unregister(self._tp)
                    tp_registered = want
                events = dict(poller.poll(tick_ms))
                if self._egress in events:
                    self._drain(self._egress, self._on_consumer)
                if self._ingress in events:
                    self._drain(self._ingress, self._on_producer)
                if self._tp is not None and self._tp in events:
                    self._drain_tensorpack()
                self._dispatch()
                now = time.monotonic()
                if now >= next_tick:
                    self._liveness(now)
                    self._grant()
                    self._update_gauges()
                    next_tick = now + tick_ms / 1000
        finally:
            self.close()

    def close(self) -> None:
        for s in (self._ingress, self._egress, self._tp):
            if s is not None and not s.closed:
                s.close(linger=self.cfg.linger_ms)
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        if self._own_ctx:
            self.ctx.term()

    def _drain(self, sock: zmq.Socket, handler: Any, budget: int = 256) -> None:
        for _ in range(budget):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if len(frames) < 2:
                self._reject("bad_envelope")
                continue
            try:
                handler(frames[0].bytes, frames[1:])
            except Exception as e:  # a peer's message must never stop the broker
                self._reject("internal_error", f"{type(e).__name__}: {e}"[:200])

    # ------------------------------------------------------------------------ ingress
    def _reject(self, reason: str, detail: str = "") -> None:
        self.metrics.rejected.labels(reason).inc()
        self.stats.rejected[reason] = self.stats.rejected.get(reason, 0) + 1
        self._reject_log.warning("rejected a message: %s %s", reason, detail)

    def _send(self, sock: zmq.Socket, ident: bytes, frames: list[Any]) -> bool:
        try:
            sock.send_multipart([ident, *frames], flags=zmq.NOBLOCK, copy=False)
            return True
        except zmq.ZMQError as e:  # EHOSTUNREACH (peer gone) or EAGAIN (pipe full)
            log.debug("send to %r failed: %s", ident, e)
            return False

    def _control(self, sock: zmq.Socket, ident: bytes, kind: wire.Kind, **fields: Any) -> bool:
        return self._send(sock, ident, [wire.encode_control(kind, b=self.instance, **fields)])

    def _on_producer(self, ident: bytes, frames: list[zmq.Frame]) -> None:
        if len(frames) > self.cfg.limits.max_frames:
            self._reject("too_many_arrays")
            return
        try:
            header = wire.decode_header(frames[0], self.cfg.limits)
        except wire.DecodeError as e:
            self._reject(e.reason, str(e))
            return
        kind = header["k"]
        now = time.monotonic()
        prod = self._producers.get(ident)
        if kind == wire.Kind.HELLO:
            self._hello_producer(ident, header, now)
            return
        if prod is None:
            if kind != wire.Kind.BYE:
                self._reject("unknown_peer")
                self._control(self._ingress, ident, wire.Kind.RESET)
            return
        prod.last_seen = now
        if kind == wire.Kind.BATCH:
            self._on_batch(ident, prod, header, frames)
        elif kind in (wire.Kind.EOS, wire.Kind.ERROR):
            # Queued, not sent now: it must not overtake the batches sent before it.
            if len(self._buffer) >= self.cfg.max_batches + _CONTROL_SLACK:
                self._reject("buffer_full", kind.name)
            else:
                self._buffer.append(_Buffered([frames[0]], 0, prod.session, 0, True))
        elif kind == wire.Kind.BYE:
            self._drop_producer(ident, "bye")
        elif kind != wire.Kind.HEARTBEAT:
            self._reject("bad_kind", kind.name)

    def _hello_producer(self, ident: bytes, header: dict, now: float) -> None:
        pid, session = header.get("p"), header.get("q")
        if (
            header.get("r") != "producer"
            or not isinstance(pid, str)
            or not 0 < len(pid) <= self.cfg.limits.max_id_len
            or not isinstance(session, int)
        ):
            self._reject("bad_hello")
            return
        nxt = header.get("n", 0)
        if isinstance(nxt, int) and nxt > 0 and session not in self._last_seq:
            self._last_seq[session] = nxt - 1
        old = self._producers.get(ident)
        if old is not None:  # a second HELLO on one connection
            self.metrics.producer_label.release(old.label)
        self._producers[ident] = _Producer(
            pid=pid, session=session, label=self.metrics.producer_label.acquire(pid),
            last_seen=now,
        )
        self.metrics.init_producer(self._producers[ident].label)
        log.info("producer %s joined (%d connected)", pid, len(self._producers))
        self._grant()

    def _on_batch(self, ident: bytes, prod: _Producer, header: dict, frames: list) -> None:
        try:
            # The whole decoder, structure included (array views only, no payload read): a
            # batch every consumer would refuse must not be forwarded, or each one would cost
            # a consumer a credit it never gets back.
            nbytes = wire.decode_batch(frames, self.cfg.limits, header=header).nbytes
        except wire.DecodeError as e:
            self._reject(e.reason, str(e))
            return
        if header["q"] != prod.session:
            self._reject("bad_header", "session changed without HELLO")
            return
        if prod.outstanding <= 0:
            # A producer that ignores flow control is dropped: it cannot grow our memory.
            self._reject("no_credit")
            self._drop_producer(ident, "no_credit")
            self._control(self._ingress, ident, wire.Kind.RESET)
            return
        prod.received += 1
        prod.largest = max(prod.largest, nbytes)
        seq = header["s"]
        last = self._last_seq.get(prod.session)
        gap = 0
        if last is not None and seq > last + 1:
            gap = seq - last - 1
            self.metrics.lost_batches.labels(prod.label).inc(gap)
        if last is None or seq > last:
            self._last_seq[prod.session] = seq
            self._last_seq.move_to_end(prod.session)
            if len(self._last_seq) > _MAX_SESSIONS:
                self._last_seq.popitem(last=False)
        self.stats.received += 1
        self.metrics.received_batches.labels(prod.label).inc()
        self.metrics.received_bytes.labels(prod.label).inc(nbytes)
        self._buffer.append(_Buffered(frames, nbytes, prod.session, gap))
        self._buffered_bytes += nbytes

    def _drain_tensorpack(self) -> None:
        assert self._tp is not None
        while self._has_room():
            try:
                frame = self._tp.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                dp = wire.decode_tensorpack(frame, self.cfg.limits)
                frames = wire.encode_batch(
                    dp, producer="tensorpack", session=0, seq=self._tp_seq
                )
            except (wire.DecodeError, wire.EncodeError) as e:
                self._reject(getattr(e, "reason", "bad_structure"), str(e))
                continue
            except Exception as e:  # a decoder bug must not stop the broker either
                self._reject("internal_error", f"{type(e).__name__}: {e}"[:200])
                continue
            self._tp_seq += 1
            nbytes = sum(getattr(f, "nbytes", 0) for f in frames[1:])
            self.stats.received += 1
            self.metrics.received_batches.labels("tensorpack").inc()
            self.metrics.received_bytes.labels("tensorpack").inc(nbytes)
            self._buffer.append(_Buffered(frames, nbytes, 0, 0))
            self._buffered_bytes += nbytes

    def _broadcast(self, header_frame: Any) -> None:
        for ident in list(self._consumers):
            self._send(self._egress, ident, [header_frame])

    # ---------------------------------------------------------------------- credit
    def _outstanding(self) -> int:
        return sum(p.outstanding for p in self._producers.values())

    def _has_room(self, outstanding: int | None = None) -> bool:
        if outstanding is None:
            outstanding = self._outstanding()
        return (
            len(self._buffer) + outstanding < self.cfg.max_batches
            and self._buffered_bytes < self.cfg.max_bytes
        )

    def _grant(self) -> None:
        """Give producers credit for the free buffer space, fewest-outstanding first."""
        if not self._producers:
            return
        outstanding = self._outstanding()
        budget_bytes = self.cfg.max_bytes - self._buffered_bytes
        reserved = sum(p.outstanding * p.largest for p in self._producers.values())
        grants: dict[bytes, int] = {}
        # Fewest-outstanding first; ties broken by a rotating start so no producer is favoured.
        items = list(self._producers.items())
        self._grant_rr = (self._grant_rr + 1) % len(items)
        items = items[self._grant_rr:] + items[: self._grant_rr]
        order = sorted(items, key=lambda kv: kv[1].outstanding)
        progress = True
        while progress and len(self._buffer) + outstanding < self.cfg.max_batches:
            progress = False
            for ident, p in order:
                if len(self._buffer) + outstanding >= self.cfg.max_batches:
                    break
                if p.outstanding >= self.cfg.producer_window:
                    continue
                if reserved + p.largest > budget_bytes and (reserved or self._buffer):
                    continue
                p.granted += 1
                outstanding += 1
                reserved += p.largest
                grants[ident] = p.granted
                progress = True
        now = time.monotonic()
        for ident, total in grants.items():
            if self._control(self._ingress, ident, wire.Kind.CREDIT, t=total):
                self._producers[ident].last_sent = now

    # ---------------------------------------------------------------------- egress
    def _on_consumer(self, ident: bytes, frames: list[zmq.Frame]) -> None:
        if len(frames) != 1:
            self._reject("bad_envelope", "consumer message with array frames")
            return
        try:
            header = wire.decode_header(frames[0], self.cfg.limits)
        except wire.DecodeError as e:
            self._reject(e.reason, str(e))
            return
        kind, now = header["k"], time.monotonic()
        cons = self._consumers.get(ident)
        if kind == wire.Kind.HELLO:
            window, cid = header.get("c"), header.get("p", "consumer")
            if (
                header.get("r") != "consumer"
                or not isinstance(window, int)
                or not 0 < window <= 4096
                or not isinstance(cid, str)
            ):
                self._reject("bad_hello")
                return
            if ident not in self._consumers:
                self._rr.append(ident)
            self._consumers[ident] = _Consumer(cid=cid[:256], window=window, last_seen=now)
            log.info("consumer %s joined (%d connected)", cid, len(self._consumers))
            self._control(self._egress, ident, wire.Kind.CREDIT, t=0)
            return
        if cons is None:
            if kind != wire.Kind.BYE:
                self._reject("unknown_peer")
                self._control(self._egress, ident, wire.Kind.RESET)
            return
        cons.last_seen = now
        if kind == wire.Kind.CREDIT:
            t = header.get("t")
            if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                self._reject("bad_credit")
                return
            # Never more than was delivered: a consumer that counts a batch of an earlier
            # registration (or of a broker before a restart) as taken is ahead of us. Refusing
            # its CREDIT would leave it waiting for batches and us waiting for credit forever;
            # clamping keeps its room within its window all the same.
            cons.consumed = max(cons.consumed, min(t, cons.delivered))
        elif kind == wire.Kind.BYE:
            self._drop_consumer(ident, "bye")
        elif kind != wire.Kind.HEARTBEAT:
            self._reject("bad_kind", kind.name)

    def _dispatch(self) -> None:
        sent_any = False
        while self._buffer and self._rr:
            if self._buffer[0].broadcast:
                self._broadcast(self._buffer.popleft().frames[0])
                continue
            ident = self._next_consumer()
            if ident is None:
                break
            item = self._buffer.popleft()
            envelope = wire.encode_control(wire.Kind.DELIVER, b=self.instance, g=item.gap)
            cons = self._consumers[ident]
            if not self._send(self._egress, ident, [envelope, *item.frames]):
                self._buffer.appendleft(item)
                self._drop_consumer(ident, "unreachable")
                continue
            self._buffered_bytes -= item.nbytes
            cons.delivered += 1
            cons.last_sent = time.monotonic()
            self.stats.forwarded += 1
            self.metrics.forwarded_batches.inc()
            self.metrics.forwarded_bytes.inc(item.nbytes)
            sent_any = True
        if sent_any:
            self._grant()

    def _next_consumer(self) -> bytes | None:
        for _ in range(len(self._rr)):
            ident = self._rr[0]
            self._rr.rotate(-1)
            if self._consumers[ident].room > 0:
                return ident
        return None

    # -------------------------------------------------------------------- liveness
    def _liveness(self, now: float) -> None:
        timeout, interval = self.cfg.heartbeat_timeout, self.cfg.heartbeat_interval
        for ident, p in list(self._producers.items()):
            if now - p.last_seen > timeout:
                self._drop_producer(ident, "timeout")
            elif now - p.last_sent >= interval:
                if self._control(self._ingress, ident, wire.Kind.HEARTBEAT):
                    p.last_sent = now
        for ident, c in list(self._consumers.items()):
            if now - c.last_seen > timeout:
                self._drop_consumer(ident, "timeout")
            elif now - c.last_sent >= interval:
                if self._control(self._egress, ident, wire.Kind.HEARTBEAT):
                    c.last_sent = now

    def _drop_producer(self, ident: bytes, reason: str) -> None:
        p = self._producers.pop(ident, None)
        if p is not None:
            self.metrics.producer_label.release(p.label)
            log.info("producer %s dropped (%s)", p.pid, reason)
            self.metrics.dropped_peers.labels("producer", reason).inc()
            if reason != "bye":  # what it may have sent that will never arrive here
                self.metrics.unconfirmed.labels("producer").inc(max(0, p.outstanding))

    def _drop_consumer(self, ident: bytes, reason: str) -> None:
        c = self._consumers.pop(ident, None)
        if c is not None:
            self._rr.remove(ident)
            log.info("consumer %s dropped (%s)", c.cid, reason)
            self.metrics.dropped_peers.labels("consumer", reason).inc()
            if reason != "bye":  # delivered to it, never acknowledged as taken
                unacked = max(0, c.delivered - c.consumed)
                self.metrics.unconfirmed.labels("consumer").inc(unacked)

    def _update_gauges(self) -> None:
        m = self.metrics
        m.buffer_batches.set(len(self._buffer))
        m.buffer_bytes.set(self._buffered_bytes)
        m.credit_outstanding.set(self._outstanding())
        m.peers.labels("producer").set(len(self._producers))
        m.peers.labels("consumer").set(len(self._consumers))
        m.consumer_credit.set(sum(max(0, c.room) for c in self._consumers.values()))

"""The broker: three sockets, one loop, bounded state. The work is done by its parts.

- :mod:`feedline.serving.producers` — producers: registrations, credit
(:mod:`feedline.serving.credit`), batches,
  sequence gaps (:mod:`feedline.serving.gaps`);
- :mod:`feedline.broker.egress` — consumers: windows, dispatch, bytes in flight;
- :mod:`feedline.broker.buffer` — what waits in between, per stream;
- :mod:`feedline.serving.tensorpack` — tensorpack's ``send_dataflow_zmq`` in;
- :mod:`feedline.serving.peers` — the peer tables and their liveness, and cutting a peer off.

This module owns the sockets and the loop: it receives each message frame by frame (the frame
count checked first), hands it to the side it arrived on, counts and logs what they refuse
(naming the socket and the peer), and keeps the budget: everything a peer can make the broker
hold (buffered batches, batches in flight to consumers, credit granted to producers) is at
most ``max_bytes`` (docs/architecture.md has the formula and what lies outside it).
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq
from prometheus_client import CollectorRegistry

from feedline.broker.buffer import Buffer
from feedline.broker.config import BrokerConfig
from feedline.broker.egress import ConsumerSide
from feedline.broker.sizing import BrokerSizing
from feedline.errors import Refusal
from feedline.framing import TooManyFrames, recv_message, waiting
from feedline.logs import RateLimitedLog
from feedline.serving.coordinator import ExactStreams
from feedline.serving.held import Held
from feedline.serving.metrics import BrokerMetrics
from feedline.serving.peers import cut_off
from feedline.serving.producers import IngressConfig, ProducerSide
from feedline.serving.sizing import SizingConfig
from feedline.serving.tensorpack import TensorpackIngress

log = logging.getLogger(__name__)
_BUDGET = 256  # messages handled per socket per loop turn


@dataclass
class BrokerStats:
    received: int = 0
    forwarded: int = 0
    rejected: dict[str, int] = field(default_factory=dict)


class _Sink:
    """Accepted batches go to the buffer; what the budget counts is buffer + in flight."""

    def __init__(self, broker: Broker) -> None:
        self._b = broker

    def held(self) -> tuple[int, int]:
        b, y = self._b.egress.inflight()
        return self._b.buffer.batches + b, self._b.buffer.nbytes + y

    def read(self, stream: str) -> bool:
        return self._b.egress.demand(stream)

    def held_by_stream(self) -> dict[str, tuple[int, int]]:
        out = {s: (b, y) for s, (b, y) in self._b.buffer.by_stream().items()}
        for s, (b, y) in self._b.egress.inflight_by_stream().items():
            b0, y0 = out.get(s, (0, 0))
            out[s] = (b0 + b, y0 + y)
        return out

    def accept(self, stream: str, item: Held) -> bool:
        ok = self._b.buffer.push(stream, item)
        if ok and not item.broadcast:
            self._b.stats.received += 1
        return ok

    def epoch_end(self, stream: str, epoch: int) -> None:
        self._b.egress.epoch_end(stream, epoch)


class Broker:
    """Run with :meth:`run` (blocks until ``stop`` is set). Create and run in one thread.

    A constructor that fails (an address in use, bad keys) releases everything it started.
    """

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
        self.buffer = Buffer()
        self._reject_log = RateLimitedLog(log, interval=5.0)
        self._sockets: list[zmq.Socket] = []
        self._auth: Any = None
        self._ipc_files: list[tuple[str, int]] = []
        self._tp: TensorpackIngress | None = None
        try:
            self._open()
        except BaseException:
            self.close()
            raise
        sink = _Sink(self)
        lim = config.limits
        self.exact = ExactStreams(Path(config.state_dir) if config.state_dir else None)
        self.egress = ConsumerSide(self._sender(self._egress), self.buffer, self.metrics, lim,
                                   config.max_bytes, config.max_batches, config.max_peers,
                                   self.instance,
                                   self._cut_off, self.exact)
        self.ingress = ProducerSide(
            self._sender(self._ingress), sink, self.metrics, lim,
            IngressConfig(config.max_batches, config.max_bytes, config.producer_window,
                          config.credit_lease, config.max_peers,
                          recovery_grace=config.heartbeat_timeout),
            self.instance, self._cut_off, self.exact)
        self.sizing = BrokerSizing(self.metrics, SizingConfig.for_window(config.sizing_window))
        if self._tp_sock is not None:
            self._tp = TensorpackIngress(self._tp_sock, sink, self.metrics, lim,
                                         config.max_bytes, config.tensorpack_stream)

    def _open(self) -> None:
        cfg, lim = self.cfg, self.cfg.limits
        # The ZAP handler must run before any CURVE socket binds, or early handshakes race it.
        if cfg.curve is not None:
            denied = self.metrics.curve_denied
            self._auth = cfg.curve.authenticator(self.ctx, on_denied=lambda _a, _k: denied.inc())
        batch_max = min(lim.max_message_bytes + lim.max_header_bytes, cfg.max_bytes)
        # A producer has at most its window of batches in flight, plus a few controls.
        self._ingress = self._bind(zmq.ROUTER, cfg.ingress, rcvhwm=cfg.producer_window + 16,
                                   maxmsg=batch_max)
        # No ZMTP heartbeats towards consumers: a paused consumer's connection must outlive
        # its registration, so that what was sent to it is still there when it wakes (it
        # takes it, then registers again). A dead one's kernel closes the connection.
        self._egress = self._bind(zmq.ROUTER, cfg.egress, rcvhwm=1000,
                                  maxmsg=lim.max_header_bytes, heartbeats=False)
        self._tp_sock: zmq.Socket | None = None
        if cfg.tensorpack_ingress:
            # tensorpack's PUSH cannot speak CURVE: this port is plain (the CLI keeps it
            # local). One message per connection waits in libzmq, at most.
            self._tp_sock = self._bind(zmq.PULL, cfg.tensorpack_ingress, rcvhwm=1,
                                       maxmsg=batch_max, curve=False)
        self.ingress_endpoint = self._ingress.getsockopt_string(zmq.LAST_ENDPOINT)
        self.egress_endpoint = self._egress.getsockopt_string(zmq.LAST_ENDPOINT)
        self.tensorpack_endpoint = (self._tp_sock.getsockopt_string(zmq.LAST_ENDPOINT)
                                    if self._tp_sock is not None else None)

    def _bind(self, kind: int, addr: str, rcvhwm: int, maxmsg: int,
              curve: bool = True, heartbeats: bool = True) -> zmq.Socket:
        s = self.ctx.socket(kind)
        self._sockets.append(s)
        s.setsockopt(zmq.LINGER, self.cfg.linger_ms)
        s.setsockopt(zmq.RCVHWM, rcvhwm)
        s.setsockopt(zmq.SNDHWM, 10_000)
        s.setsockopt(zmq.MAXMSGSIZE, maxmsg)
        if kind == zmq.ROUTER:
            # Sending to a peer that is gone raises instead of dropping silently.
            s.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if kind == zmq.ROUTER and heartbeats:
            # libzmq's own heartbeats close a connection whose peer stopped answering (dead,
            # paused, partitioned): what was queued for it is freed, and a probe to it fails.
            s.setsockopt(zmq.HEARTBEAT_IVL, int(self.cfg.heartbeat_interval * 1000))
            s.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(self.cfg.heartbeat_timeout * 1000))
        if curve and self.cfg.curve is not None:
            self.cfg.curve.apply(s)
        s.bind(addr)
        if addr.startswith("ipc://"):
            path = addr[len("ipc://"):]
            try:
                self._ipc_files.append((path, os.stat(path).st_ino))
            except OSError:
                pass
        return s

    def _sender(self, sock: zmq.Socket) -> Any:
        def send(ident: bytes, frames: list[Any]) -> int:
            try:
                sock.send_multipart([ident, *frames], flags=zmq.NOBLOCK, copy=False)
                return 0
            except zmq.ZMQError as e:  # EHOSTUNREACH (peer gone) or EAGAIN (pipe full)
                return e.errno or zmq.EAGAIN
        return send

    def _cut_off(self, fd: int, ino: int, role: str, reason: str) -> None:
        if cut_off(fd, ino):
            self.metrics.cut_off.labels(role, reason).inc()
            log.warning("cut off a %s's connection: %s", role, reason)

    # ---------------------------------------------------------------------------- loop
    def run(self, stop: threading.Event) -> None:
        log.info("broker up: ingress %s, egress %s%s", self.ingress_endpoint,
                 self.egress_endpoint,
                 f", tensorpack {self.tensorpack_endpoint}" if self._tp else "")
        tick = max(0.001, self.cfg.heartbeat_interval / 4)
        next_tick = last = time.monotonic()
        try:
            while not stop.is_set():
                poller = zmq.Poller()
                poller.register(self._ingress, zmq.POLLIN)
                poller.register(self._egress, zmq.POLLIN)
                if self._tp is not None and self._tp.has_room(self.ingress.outstanding()[1]):
                    # Read tensorpack's PUSH only while there is room: its HWM then pushes
                    # back on the sender, the only flow control a tensorpack producer knows.
                    poller.register(self._tp.sock, zmq.POLLIN)
                events = dict(poller.poll(int(tick * 1000)))
                now = time.monotonic()
                if now - last > self.cfg.heartbeat_timeout / 2:
                    # Our loop did not run (a long drain, the host paused us): that silence
                    # was ours. Nobody is dropped for it.
                    self.ingress.producers.pause(now)
                    self.egress.consumers.pause(now)
                last = now
                if self._egress in events:
                    self._drain(self._egress, "egress")
                if self._ingress in events:
                    self._drain(self._ingress, "ingress")
                if self._tp is not None and self._tp.sock in events:
                    self._tp.drain(self.ingress.outstanding()[1], self._reject)
                if time.monotonic() - now > self.cfg.heartbeat_timeout / 2:
                    # A long drain (an oversized message read to its end): the peers' messages
                    # waited behind it; their silence was ours.
                    self.ingress.producers.pause(time.monotonic())
                    self.egress.consumers.pause(time.monotonic())
                now = time.monotonic()
                self.stats.forwarded += self.egress.dispatch(now)
                self.ingress.plan(now)
                if now >= next_tick:
                    self.ingress.liveness(now, self.cfg.heartbeat_interval,
                                          self.cfg.heartbeat_timeout)
                    self.egress.liveness(now, self.cfg.heartbeat_interval,
                                         self.cfg.heartbeat_timeout)
                    self._update_gauges()
                    self.sizing.tick(now, self.ingress, self.egress)
                    self._enforce_shares()
                    self.exact.commit()
                    next_tick = now + tick
        finally:
            self.close()

    def _drain(self, sock: zmq.Socket, side: str) -> None:
        handler = (self.ingress if side == "ingress" else self.egress).on_message
        max_frames = self.cfg.limits.max_frames + 1  # the peer identity, then the message
        for n in range(_BUDGET):
            if n and not waiting(sock):
                return
            try:
                frames = recv_message(sock, max_frames, keepalive=self._keepalive)
            except zmq.Again:
                return
            except TooManyFrames as e:
                self._reject(e.reason, f"{e.frames} frames in {e.seconds:.1f}s", side,
                             e.first)
                continue
            if len(frames) < 2:
                self._reject("bad_envelope", "", side, frames[0].bytes)
                continue
            ident = frames[0].bytes
            try:
                fd = frames[0].get(zmq.SRCFD)
            except zmq.ZMQError:  # not every transport has one (ZMTP 1.0 peers, inproc)
                fd = -1
            try:
                handler(ident, frames[1:], fd, time.monotonic())
            except Refusal as e:  # DecodeError included: both are counted
                self._reject(e.reason, str(e), side, ident)
            except Exception as e:  # a peer's message must never stop the broker
                self._reject("internal_error", f"{type(e).__name__}: {e}"[:200], side, ident)

    def _keepalive(self) -> None:
        """Called while an oversized message is drained: peers must not think us dead."""
        now = time.monotonic()
        interval = self.cfg.heartbeat_interval
        self.ingress.liveness(now, interval, float("inf"))
        self.egress.liveness(now, interval, float("inf"))

    def _reject(self, reason: str, detail: str = "", side: str = "tensorpack",
                ident: bytes = b"") -> None:
        self.metrics.rejected.labels(reason).inc()
        self.stats.rejected[reason] = self.stats.rejected.get(reason, 0) + 1
        self._reject_log.warning("rejected a message on the %s from %s: %s %s", side,
                                 self._who(side, ident), reason, detail)

    def _who(self, side: str, ident: bytes) -> str:
        peer = (self.ingress.producers if side == "ingress" else self.egress.consumers).get(
            ident) if side in ("ingress", "egress") else None
        role = "producer" if side == "ingress" else "consumer"
        if peer is not None:
            return f"{role} {peer.name}"
        return f"an unregistered peer ({ident.hex()[:16] or 'unknown'})"

    def _update_gauges(self) -> None:
        m = self.metrics
        out_b, out_y = self.ingress.outstanding()
        _, in_y = self.egress.inflight()
        m.buffer_batches.set(self.buffer.batches)
        m.buffer_bytes.set(self.buffer.nbytes)
        m.inflight_bytes.set(in_y)
        m.reserved_bytes.set(out_y)
        m.credit_outstanding.set(out_b)
        m.peers.labels("producer").set(len(self.ingress.producers))
        m.peers.labels("consumer").set(len(self.egress.consumers))
        m.consumer_credit.set(sum(max(0, c.window - (c.delivered - c.taken))
                                  for c in self.egress.consumers))
        self._stream_gauges()

    def _enforce_shares(self) -> None:
        """With several streams, one that nobody reads keeps at most half its share buffered:
        the oldest batches beyond it are dropped and counted (an exact stream's are produced
        again later), so that it cannot hold the budget the others need."""
        streams = {p.stream for p in self.ingress.producers}
        if len(streams) < 2:
            return
        cap_b = max(1, self.cfg.max_batches // (2 * len(streams)))
        cap_y = max(1, self.cfg.max_bytes // (2 * len(streams)))
        held = self.buffer.by_stream()
        for s in streams:
            b, y = held.get(s, (0, 0))
            if (b <= cap_b and y <= cap_y) or self.egress.demand(s):
                continue
            coord = self.exact.get(s)
            for item in self.buffer.evict(s, cap_b, cap_y):
                self.metrics.evicted.labels(self.metrics.stream_label.label(s)).inc()
                if coord is not None and item.batch is not None:
                    coord.lost(item.batch.key)

    def _stream_gauges(self) -> None:
        """Per-stream series: buffered batches, peers, and exact streams' progress."""
        m = self.metrics
        peers: dict[tuple[str, str], int] = {}
        for role, table in (("producer", self.ingress.producers),
                            ("consumer", self.egress.consumers)):
            for p in table:
                key = (p.stream, role)
                peers[key] = peers.get(key, 0) + 1
        streams = {s for s, _ in peers} | set(self.buffer.streams()) | set(self.exact.streams)
        for s in streams:
            label = m.stream_label.acquire(s)
            m.stream_buffer.labels(label).set(self.buffer.count(s))
            for role in ("producer", "consumer"):
                m.stream_peers.labels(label, role).set(peers.get((s, role), 0))
            c = self.exact.get(s)
            if c is not None:
                m.exact_epoch.labels(label).set(c.epoch)
                m.exact_units.labels(label, "done").set(len(c.done))
                m.exact_units.labels(label, "total").set(c.plan.units)
            m.stream_label.release(label)

    # --------------------------------------------------------------------------- close
    def close(self) -> None:
        """Close the sockets, stop the authenticator, remove our ipc socket files."""
        for s in self._sockets:
            if not s.closed:
                s.close(linger=self.cfg.linger_ms)
        self._sockets.clear()
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        for path, ino in self._ipc_files:
            try:
                if os.stat(path).st_ino == ino:  # still ours, not a newer broker's
                    os.unlink(path)
            except OSError:
                pass
        self._ipc_files.clear()
        if self._own_ctx and not self.ctx.closed:
            self.ctx.term()

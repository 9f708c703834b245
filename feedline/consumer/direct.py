"""Direct mode: the training process serves its producers itself, no broker in between.

``RemoteDataZMQ("tcp://0.0.0.0:7878", bind=True, curve=server_keys)`` binds a ROUTER in the
consumer's I/O thread and runs the broker's producer side on it (:class:`feedline.serving.producers.
ProducerSide`: the same protocol, registrations, credit in batches and bytes, leases,
liveness, limits, cut-offs, metrics), with one difference: accepted batches go straight into
this process's queue. The budget is the consumer's own: at most ``window`` batches and
``max_bytes`` bytes queued here plus granted to producers. The same producers and pipeline
files work unchanged; ``--tensorpack-ingress``'s equivalent is ``tensorpack=ADDR``.

Use a broker instead to share one host between several training processes or to buffer
across trainer restarts (docs/tensorflow.md says when to use which).
"""

from __future__ import annotations

import logging
import os
import random
import time
from dataclasses import dataclass
from typing import Any

import zmq

from feedline import messages as m
from feedline.codec import Limits
from feedline.consumer.io import Delivery, EpochMark, Marker, Shared
from feedline.errors import ProducerError, Refusal
from feedline.framing import TooManyFrames, recv_message, waiting
from feedline.link import LinkConfig
from feedline.logs import RateLimitedLog
from feedline.security import ServerKeys
from feedline.serving.held import Held
from feedline.serving.metrics import BrokerMetrics
from feedline.serving.peers import cut_off
from feedline.serving.producers import IngressConfig, ProducerSide
from feedline.serving.tensorpack import TensorpackIngress

log = logging.getLogger(__name__)
_BUDGET = 256  # messages handled per loop turn
_PLAN_EVERY = 0.05  # seconds: the longest a credit plan waits when nothing was taken
_STREAMING = 0.02  # seconds since the last batch arrived: more are on the way


@dataclass(frozen=True)
class DirectConfig:
    producer_window: int = 4
    credit_lease: float = 2.0
    max_producers: int = 1024
    tensorpack: str | None = None  # also accept tensorpack's send_dataflow_zmq here


class _LocalSink:
    """Accepted batches go into the consumer's queue; what it holds is what it queued."""

    def __init__(self, shared: Shared) -> None:
        self.shared = shared

    def held(self) -> tuple[int, int]:
        s = self.shared
        with s.lock:
            return s.queue.qsize(), s.queued_bytes

    def read(self, stream: str) -> bool:
        return True  # the trainer itself

    def held_by_stream(self) -> dict[str, tuple[int, int]]:
        return {self.shared.stream: self.held()}

    def accept(self, stream: str, item: Held) -> bool:
        s = self.shared
        if item.broadcast:
            self._control(m.decode(item.frames[0]))
            return True
        assert item.batch is not None
        with s.lock:
            st = s.producer(item.batch.producer)
            st.received += 1
            st.bytes += item.batch.nbytes
            st.lost += item.gap
            s.queued_bytes += item.nbytes
        s.metrics.received_batches.inc()
        s.metrics.received_bytes.inc(item.batch.nbytes)
        if item.gap:
            s.metrics.lost_batches.inc(item.gap)
        s.queue.put_nowait(Delivery(0, item.batch, item.nbytes))  # credit made the room
        return True

    def epoch_end(self, stream: str, epoch: int) -> None:
        self.shared.queue.put_nowait(EpochMark(epoch))

    def _control(self, msg: m.Message) -> None:
        s = self.shared
        if isinstance(msg, m.Eos):
            with s.lock:
                s.producer(msg.producer).finished = True
        elif isinstance(msg, m.Error):
            err = ProducerError(msg.producer, msg.message, msg.traceback)
            if s.on_error == "raise":
                s.queue.put_nowait(Marker(err))
            else:
                log.error("%s", err)


class DirectIO:
    """The client loop's role for a trainer that serves its producers (I/O thread only)."""

    def __init__(self, ctx: zmq.Context, addr: str, link: LinkConfig, keys: ServerKeys | None,
                 shared: Shared, cfg: DirectConfig, metrics: BrokerMetrics) -> None:
        self.shared, self.link_cfg, self.limits = shared, link, link.limits
        self.metrics = metrics
        self._log = RateLimitedLog(log, interval=5.0)
        self._auth = keys.authenticator(ctx, on_denied=lambda _a, _k: metrics.curve_denied
                                        .inc()) if keys is not None else None
        self._ipc: tuple[str, int] | None = None
        self._socks: list[zmq.Socket] = []
        try:
            self.sock = self._bind(ctx, addr, keys, shared.window + 16)
            tp_sock = (self._bind(ctx, cfg.tensorpack, None, 1)
                       if cfg.tensorpack else None)
        except BaseException:
            self.on_close()
            raise
        instance = random.getrandbits(62)
        sink = _LocalSink(shared)
        self.ingress = ProducerSide(
            self._send, sink, metrics, self.limits,
            IngressConfig(shared.window, shared.max_bytes, cfg.producer_window,
                          cfg.credit_lease, cfg.max_producers, stream=shared.stream),
            instance, self._cut_off)
        self.tensorpack = (TensorpackIngress(tp_sock, sink, metrics, self.limits,
                                             shared.max_bytes, shared.stream)
                           if tp_sock is not None else None)
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._sink = sink
        shared.collect_keys = True  # exact streams settle here as the model takes batches
        self._next_tick = 0.0
        self._next_plan = 0.0
        self._arrived = 0.0  # when a batch last arrived
        self._planned_taken = -1
        self._last = time.monotonic()
        shared.answered = True  # nobody to answer us: we serve
        log.info("serving producers directly on %s%s", self.endpoint,
                 f", tensorpack on {cfg.tensorpack}" if cfg.tensorpack else "")

    def _bind(self, ctx: zmq.Context, addr: str, keys: ServerKeys | None,
              rcvhwm: int) -> zmq.Socket:
        kind = zmq.ROUTER if rcvhwm > 1 else zmq.PULL
        sock = ctx.socket(kind)
        self._socks.append(sock)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, rcvhwm)
        sock.setsockopt(zmq.MAXMSGSIZE, min(self.limits.max_message_bytes
                                            + self.limits.max_header_bytes,
                                            self.shared.max_bytes))
        if kind == zmq.ROUTER:
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if keys is not None and kind == zmq.ROUTER:
            keys.apply(sock)
        sock.bind(addr)
        if addr.startswith("ipc://") and kind == zmq.ROUTER:
            path = addr[len("ipc://"):]
            self._ipc = (path, os.stat(path).st_ino)
        return sock

    def _send(self, ident: bytes, frames: list[Any]) -> int:
        try:
            self.sock.send_multipart([ident, *frames], flags=zmq.NOBLOCK, copy=False)
            return 0
        except zmq.ZMQError as e:
            return e.errno or zmq.EAGAIN

    def _cut_off(self, fd: int, ino: int, role: str, reason: str) -> None:
        if cut_off(fd, ino):
            self.metrics.cut_off.labels(role, reason).inc()
            log.warning("cut off a %s's connection: %s", role, reason)

    def _reject(self, reason: str, detail: str) -> None:
        self.metrics.rejected.labels(reason).inc()
        self._log.warning("rejected a message from a producer: %s %s", reason, detail)

    # -- the loop's callbacks -----------------------------------------------------------
    def links(self) -> list:
        return []

    def sockets(self) -> list[zmq.Socket]:
        out = [self.sock]
        tp = self.tensorpack
        if tp is not None and tp.has_room(self.ingress.outstanding()[1]):
            out.append(tp.sock)
        return out

    def on_ready(self, ready: list[zmq.Socket]) -> None:
        if self.sock in ready:
            self._drain()
            self._arrived = time.monotonic()
        tp = self.tensorpack
        if tp is not None and tp.sock in ready:
            tp.drain(self.ingress.outstanding()[1], self._reject)

    def _drain(self) -> None:
        limits: Limits = self.limits
        for n in range(_BUDGET):
            if n and not waiting(self.sock):
                return
            try:
                frames = recv_message(self.sock, limits.max_frames + 1,
                                      keepalive=self._keepalive)
            except zmq.Again:
                return
            except TooManyFrames as e:
                self._reject(e.reason, f"{e.frames} frames")
                continue
            if len(frames) < 2:
                self._reject("bad_envelope", "")
                continue
            try:
                fd = frames[0].get(zmq.SRCFD)
            except zmq.ZMQError:
                fd = -1
            try:
                self.ingress.on_message(frames[0].bytes, frames[1:], fd, time.monotonic())
            except Refusal as e:  # DecodeError included: both are counted
                self._reject(e.reason, str(e))
            except Exception as e:  # a peer's message must never stop the trainer
                self._reject("internal_error", f"{type(e).__name__}: {e}"[:200])

    def _keepalive(self) -> None:
        self.ingress.liveness(time.monotonic(), self.link_cfg.heartbeat_interval, float("inf"))

    def on_wake(self) -> None:
        pass  # on_tick follows in the same turn of the loop: one plan per turn is enough

    def _settle(self) -> None:
        s = self.shared
        with s.lock:
            keys, s.taken_keys = s.taken_keys, []
        coord = self.ingress.exact.get(s.stream)
        if coord is None:
            return
        for key in keys:
            for epoch in coord.settle(key):
                self._sink.epoch_end(s.stream, epoch)

    def on_tick(self) -> None:
        now = time.monotonic()
        if now - self._last > self.link_cfg.heartbeat_timeout / 2:
            self.ingress.producers.pause(now)  # our pause, not their silence
        self._last = now
        if now >= self._next_tick:
            cfg = self.link_cfg
            self.ingress.liveness(now, cfg.heartbeat_interval, cfg.heartbeat_timeout)
            out_b, out_y = self.ingress.outstanding()
            self.metrics.credit_outstanding.set(out_b)
            self.metrics.reserved_bytes.set(out_y)
            self.metrics.peers.labels("producer").set(len(self.ingress.producers))
            self._next_tick = now + cfg.heartbeat_interval / 4
            self.ingress.exact.commit()
        # Plan when the model took a batch (room freed), when something else happened, and
        # every 50 ms (credit leases run on the clock); not after every batch that arrives.
        s = self.shared
        while True:
            taken = s.taken
            if self.ingress.dirty or taken != self._planned_taken or now >= self._next_plan:
                self.ingress.dirty = False
                self._planned_taken = taken
                self._next_plan = now + _PLAN_EVERY
                self._settle()
                self.ingress.plan(now)
            # Takes need not wake us while batches stream in (Shared.expecting); a take that
            # read the old flag is seen here, as ``taken`` has grown since.
            s.expecting = (now - self._arrived < _STREAMING
                           and self.ingress.outstanding()[0] > 0)
            if s.taken == taken:
                break

    def on_close(self) -> None:
        for sock in self._socks:
            if not sock.closed:
                sock.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        if self._ipc is not None:
            path, ino = self._ipc
            try:
                if os.stat(path).st_ino == ino:
                    os.unlink(path)
            except OSError:
                pass
            self._ipc = None

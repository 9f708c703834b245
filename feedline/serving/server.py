"""The serving core: what a broker and a direct-mode trainer both run to serve producers.

A :class:`Server` owns, for its host: CURVE's authenticator, the producers' endpoint
(:class:`feedline.serving.endpoint.Endpoint`: bind, options, drain, refusals, cut-offs, the
ipc file), the producer side (:class:`feedline.serving.producers.ProducerSide`: registrations,
credit within the host's :class:`~feedline.serving.budget.Budget`, batches), tensorpack's
ingress, and the steps of a loop turn: drain what is ready, notice a stall of our own (a
long drain, a paused process: that silence was ours, nobody is dropped for it), liveness,
gauges, close. The two hosts build it the same way and differ only in

- the sink: a broker's buffer and consumer side (:mod:`feedline.broker`), or the trainer's
  own queue (:mod:`feedline.consumer.direct`);
- who owns the loop: the broker's own, or the consumer's client loop
  (:mod:`feedline.transport.client`);
- what else they attach: the broker its consumers' endpoint (:meth:`Server.bind`,
  :meth:`Server.attach`).

So whatever a hostile peer cannot do to a broker, it cannot do to a trainer in direct mode:
it meets the same code. One rule is checked here for both before anything binds: an address
that is not loopback-only needs CURVE keys (:func:`check_exposure`), and tensorpack's, which
cannot speak CURVE, must be loopback-only either way (unless the operator insists).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import zmq

from feedline import endpoints, security
from feedline.errors import ConfigError
from feedline.exact import ExactConfig, ExactStreams
from feedline.liveness import HEARTBEAT_INTERVAL, HEARTBEAT_TIMEOUT
from feedline.protocol.codec import Limits
from feedline.protocol.messages import DEFAULT_STREAM
from feedline.security import ServerKeys
from feedline.serving.budget import Budget
from feedline.serving.endpoint import Endpoint, Refusals, Side
from feedline.serving.job_link import JobLink
from feedline.serving.metrics import BrokerMetrics
from feedline.serving.producers import IngressConfig, ProducerSide, Sink
from feedline.serving.tensorpack import TensorpackIngress


@dataclass(frozen=True)
class Remedy:
    """How the user of a host says what :func:`check_exposure` asks for (flags or
    arguments), and how they named each address."""

    keys: str = ("give --curve-secret and --curve-allowed (see `feedline keys generate` and "
                 "docs/security.md)")
    insecure: str = "--insecure"
    ingress: str = "--ingress"
    tensorpack: str = "--tensorpack-ingress"


BROKER = Remedy()
DIRECT = Remedy(keys="pass curve=ServerKeys.load(secret, allowed_dir)",
                insecure="options=ConsumerOptions(insecure=True)",
                ingress="RemoteDataZMQ(bind=True) address",
                tensorpack="DirectConfig(tensorpack=)")


def check_exposure(addrs: Sequence[str | None], tensorpack: str | None, keyed: bool,
                   insecure: bool, how: Remedy = BROKER) -> list[str]:
    """The addresses a host would serve without keys to more than this machine.

    Without keys, every address (``addrs`` and ``tensorpack``) must be loopback-only
    (``ipc://``, ``127.0.0.0/8``, ...); with keys, tensorpack's still must (its PUSH cannot
    speak CURVE). Raises :class:`~feedline.errors.ConfigError` (one line: which address, why,
    what to do) unless ``insecure``; returns the exposed addresses (to warn about then)."""
    if keyed:
        exposed = security.exposed([tensorpack])
        why = ("tensorpack's send_dataflow_zmq cannot speak CURVE, so anyone who reaches it "
               "could inject training data")
        todo = f"bind {how.tensorpack} to 127.0.0.1 / ipc://, or pass {how.insecure}"
    else:
        exposed = security.exposed([*addrs, tensorpack])
        why = "anyone who reaches it could inject or read training data"
        todo = f"{how.keys}, bind 127.0.0.1 / ipc://, or pass {how.insecure}"
    if exposed and not insecure:
        raise ConfigError(f"refusing to listen on {', '.join(exposed)} without CURVE keys: "
                         f"{why}. {todo[0].upper()}{todo[1:]} on a network you trust")
    return exposed


# What a host gives its producers, written once: ServingConfig, the broker's BrokerConfig
# (and so its flags) and a direct-mode trainer's DirectConfig default to these.
PRODUCER_WINDOW = 4  # the most credit one producer holds at once
CREDIT_LEASE = 2.0  # seconds: credit unused this long is asked back when others wait
MAX_PEERS = 1024  # registered producers (and, separately, consumers), at most
LINGER_MS = 100  # what a closing broker's sockets still send, at most (a trainer's: 0)


@dataclass(frozen=True)
class ServingConfig:
    """What the core needs of its host's configuration, built from it in one call: a
    broker's by :meth:`feedline.broker.config.BrokerConfig.serving` (its flags), a direct-mode
    trainer's by :meth:`feedline.consumer.direct.DirectConfig.serving` (its
    ``RemoteDataZMQ(bind=True)`` arguments and options)."""

    ingress: str
    budget: Budget
    producer_window: int = PRODUCER_WINDOW
    credit_lease: float = CREDIT_LEASE
    max_peers: int = MAX_PEERS
    heartbeat_interval: float = HEARTBEAT_INTERVAL
    heartbeat_timeout: float = HEARTBEAT_TIMEOUT
    linger_ms: int = LINGER_MS
    limits: Limits = field(default_factory=Limits)
    curve: ServerKeys | None = None
    tensorpack: str | None = None
    tensorpack_stream: str = DEFAULT_STREAM
    stream: str | None = None  # the only stream accepted (a direct-mode trainer), or any
    # Exact streams: the state directory, the stream limit, the recovery wait, reclaiming.
    exact: ExactConfig = field(default_factory=ExactConfig)
    insecure: bool = False  # allow exposed addresses without keys (check_exposure)
    how: Remedy = BROKER
    # Windows count small batches by their bytes (a direct-mode trainer: budget.depth).
    by_bytes: bool = False
    bundle: int = 0  # the most batches producers may send in one message (feedline.protocol.bundle)
    join: int = 0  # the largest batch (array bytes) sent joined in one (0: JOIN_BYTES)
    whole: bool = False  # the sink takes a bundle as one item (a broker: IngressConfig.whole)


PIPE_DEPTH = 16  # messages a connection's pipe holds per batch of a producer's window


class Server:
    """The core of one host, used from the host's loop thread only (a socket belongs to one
    thread). A constructor that fails (an address in use, bad keys, an exposed address)
    releases everything it started."""

    def __init__(self, ctx: zmq.Context, cfg: ServingConfig, sink: Sink,
                 metrics: BrokerMetrics, instance: int, log: logging.Logger) -> None:
        self.ctx, self.cfg, self.metrics, self.log = ctx, cfg, metrics, log
        self.sink = sink
        self.exact = ExactStreams(cfg.exact)
        self.exact.live = self.live_streams
        self.instance = instance
        self.refusals = Refusals(metrics, log)
        self._endpoints: list[Endpoint] = []
        self._sides: list[tuple[Endpoint, Side]] = []
        self._auth: Any = None
        self._last = time.monotonic()
        try:
            # The ZAP handler must run before any CURVE socket binds, or early handshakes
            # race it.
            if cfg.curve is not None:
                denied = metrics.curve_denied
                self._auth = cfg.curve.authenticator(ctx, on_denied=lambda _a, _k: denied.inc())
            # A producer has at most its window of batches in flight (small ones counted by
            # bytes if ``by_bytes``: budget.depth), plus a few controls; small batches mostly
            # in bundles, so the pipe holds 16 messages a window's batch, not DEPTH: a
            # connection that floods cannot make libzmq hold more (one that sends small
            # batches one by one is slowed by TCP, not refused).
            window = PIPE_DEPTH * cfg.producer_window if cfg.by_bytes else cfg.producer_window
            self.ingress = self.bind(cfg.ingress, "ingress", cfg.how.ingress, zmq.ROUTER,
                                     rcvhwm=window + 16,
                                     max_message=cfg.budget.max_message(cfg.limits))
            tp_ep = None
            if cfg.tensorpack is not None:
                # tensorpack's PUSH cannot speak CURVE: this port is plain (check_exposure
                # keeps it local). One message per connection waits in libzmq, at most.
                tp_ep = self.bind(cfg.tensorpack, "tensorpack", cfg.how.tensorpack, zmq.PULL,
                                  rcvhwm=1, max_message=cfg.budget.max_message(cfg.limits),
                                  heartbeats=False, curve=False)
        except BaseException:
            self.close()
            raise
        self.producers = ProducerSide(
            self.ingress.send, sink, metrics, cfg.limits,
            IngressConfig(cfg.budget, cfg.producer_window, cfg.credit_lease, cfg.max_peers,
                          stream=cfg.stream, by_bytes=cfg.by_bytes, bundle=cfg.bundle,
                          whole=cfg.whole, join=cfg.join,
                          heartbeat_timeout=cfg.heartbeat_timeout),
            instance, self.refusals.cut_off, self.exact)
        self.attach(self.ingress, self.producers)
        self.tensorpack = (TensorpackIngress(tp_ep, sink, metrics, cfg.limits,
                                             self.producers.planner,
                                             cfg.stream or cfg.tensorpack_stream)
                           if tp_ep is not None else None)
        # Several hosts serve each exact stream: the link to the job's coordinator.
        self.job = (JobLink(ctx, cfg.exact.coordinator, self.exact, sink.epoch_end, sink.keys,
                            lambda reason: metrics.rejected.labels(reason).inc())
                    if cfg.exact.coordinator is not None else None)

    def bind(self, addr: str, name: str, flag: str, kind: int, rcvhwm: int, max_message: int,
             heartbeats: bool = True, curve: bool = True) -> Endpoint:
        """Bind one more endpoint of this host (released by :meth:`close`), after the
        address checks: :func:`check_exposure` (``curve=False``: a plain port, such as
        tensorpack's, must be loopback-only even when the host has keys) and
        :func:`feedline.endpoints.check_bind` (one bind per address)."""
        cfg = self.cfg
        for exposed in check_exposure([addr] if curve else [], None if curve else addr,
                                      cfg.curve is not None, cfg.insecure, cfg.how):
            self.log.warning("%s: %s has no CURVE keys: %s can send batches into training "
                             "and read them; %s unless that network is trusted",
                             cfg.how.insecure, exposed, endpoints.reach(exposed), cfg.how.keys)
        ep = Endpoint(self.ctx, addr, name=name, flag=flag, kind=kind, rcvhwm=rcvhwm,
                      max_message=max_message, max_frames=cfg.limits.max_frames,
                      linger_ms=cfg.linger_ms, refusals=self.refusals,
                      heartbeats=((cfg.heartbeat_interval, cfg.heartbeat_timeout)
                                  if heartbeats else None),
                      keys=cfg.curve if curve else None)
        self._endpoints.append(ep)
        return ep

    def attach(self, endpoint: Endpoint, side: Side) -> None:
        """``side`` handles what arrives on ``endpoint``; its peers share the liveness."""
        self._sides.append((endpoint, side))

    # -- the loop's steps ---------------------------------------------------------------
    def sockets(self) -> list[zmq.Socket]:
        """What to poll now: every endpoint with a side, and tensorpack's only while it holds
        credit (its PUSH's high-water mark then pushes back on the sender, the only flow
        control a tensorpack producer knows). Call once a loop turn."""
        out = [ep.sock for ep, _ in self._sides]
        if self.job is not None:
            out.append(self.job.sock)
        tp = self.tensorpack
        if tp is not None:
            if tp.has_room():
                out.append(tp.sock)
            elif tp.credit.wanting:
                self.producers.dirty = True  # plan: it asked
        return out

    def awake(self, now: float) -> None:
        """Call once a loop turn, before liveness: if our loop did not run for half the
        timeout (a long drain, the host paused us), that silence was ours."""
        if now - self._last > self.cfg.heartbeat_timeout / 2:
            self._stalled(now)
        self._last = now

    def on_ready(self, ready: Sequence[zmq.Socket]) -> bool:
        """Drain the ready sockets; True if producers (or tensorpack) sent something."""
        t0 = time.monotonic()
        got = False
        for ep, side in reversed(self._sides):  # what frees room (consumers) first
            if ep.sock in ready:
                n = ep.drain(side, self.keepalive)
                got = got or (n > 0 and side is self.producers)
        tp = self.tensorpack
        if tp is not None and tp.sock in ready and tp.drain(self._refuse_tensorpack):
            got = self.producers.dirty = True
        now = time.monotonic()
        if self.job is not None:  # its views, and what the producers' asks made
            if self.job.sock in ready:
                self.job.on_ready(now)
            else:
                self.job.flush()
        if now - t0 > self.cfg.heartbeat_timeout / 2:
            # The peers' messages waited behind a long drain: their silence was ours.
            self._stalled(now)
        return got

    def keepalive(self) -> None:
        """Called while an oversized message is drained: peers must not think us dead."""
        now = time.monotonic()
        for _, side in self._sides:
            side.liveness(now, self.cfg.heartbeat_interval, float("inf"))

    def tick(self, now: float) -> None:
        """Liveness of every peer, the producer side's gauges, exact streams' journals, and
        the state of exact streams nobody used for a while reclaimed (a stream is in use while
        a registered peer names it or the sink holds any of it: buffered, in flight, or in
        flight to a consumer that is gone)."""
        cfg, m = self.cfg, self.metrics
        for _, side in self._sides:
            side.liveness(now, cfg.heartbeat_interval, cfg.heartbeat_timeout)
        out_b, out_y = self.producers.outstanding()
        m.credit_outstanding.set(out_b)
        m.reserved_bytes.set(out_y)
        m.peers.labels("producer").set(len(self.producers.peers))
        if self.job is not None:
            self.job.tick(now)
        self.exact.commit(now)
        self.exact.reclaim(now, self.live_streams() | set(self.sink.held_by_stream()))

    def live_streams(self) -> set[str]:
        """Streams a registered peer (producer, consumer) of any side names."""
        return {p.stream for _, side in self._sides for p in side.peers}

    def _stalled(self, now: float) -> None:
        for _, side in self._sides:
            side.peers.pause(now)
        self._last = now

    def _refuse_tensorpack(self, reason: str, detail: str) -> None:
        ep = self.tensorpack
        if ep is not None:
            ep.endpoint.refuse(reason, detail, None)

    def close(self) -> None:
        """Close every endpoint (bounded linger, ipc files), stop the authenticator."""
        if getattr(self, "job", None) is not None:
            self.job.close()  # type: ignore[union-attr]
            self.job = None
        for ep in self._endpoints:
            ep.close()
        self._endpoints.clear()
        if self._auth is not None:
            self._auth.stop()
            self._auth = None

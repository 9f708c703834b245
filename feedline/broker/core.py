"""The broker: the serving core, a buffer and a consumer side, run by one loop.

- :mod:`feedline.serving.server` — the serving core it shares with a direct-mode trainer: the
  producers' endpoint (bind, drain, refusals, cut-offs), the producer side and its credit,
  tensorpack's ingress, liveness;
- :mod:`feedline.broker.egress` — consumers: windows, dispatch, bytes in flight, bound as one
  more endpoint of the core;
- :mod:`feedline.broker.buffer` — what waits in between, per stream.

This module is the host: the sink the core puts accepted batches in (the buffer, with what
is in flight to consumers, is what the budget counts), the loop, the stream shares the
buffer keeps (``Budget.per_stream``), and the gauges. Everything a peer can make the broker
hold (buffered batches, batches in flight to consumers, credit granted to producers) is
within its :class:`~feedline.serving.budget.Budget` (docs/architecture.md has the formula and
what lies outside it).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from dataclasses import dataclass, field

import zmq
from prometheus_client import CollectorRegistry

from feedline.broker.buffer import Buffer
from feedline.broker.config import BrokerConfig
from feedline.broker.egress import ConsumerSide
from feedline.broker.pipelines import Leftovers
from feedline.broker.sizing import BrokerSizing
from feedline.logs import RateLimitedLog
from feedline.protocol import messages as m
from feedline.protocol.wire import Batch
from feedline.serving.held import Held
from feedline.serving.metrics import BrokerMetrics
from feedline.serving.server import Server
from feedline.serving.sizing import SizingConfig

log = logging.getLogger(__name__)

PLAN_EVERY = 0.05  # seconds: the longest a credit plan waits (leases run on the clock)


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
        kb, ky = self._b.leftovers.held()
        return self._b.buffer.batches + b + kb, self._b.buffer.nbytes + y + ky

    def read(self, stream: str) -> bool:
        return self._b.egress.demand(stream)

    def held_by_stream(self) -> dict[str, tuple[int, int]]:
        out = {s: (b, y) for s, (b, y) in self._b.buffer.by_stream().items()}
        for part in (self._b.egress.inflight_by_stream(), self._b.leftovers.held_by_stream()):
            for s, (b, y) in part.items():
                b0, y0 = out.get(s, (0, 0))
                out[s] = (b0 + b, y0 + y)
        return out

    def accept(self, stream: str, item: Held) -> bool:
        held_back = self._b.leftovers.held_back
        if held_back and item.session in held_back:
            self._b.leftovers.heard(item.session)  # it produces: what it held is served
        ok = self._b.buffer.push(stream, item)
        if ok and not item.broadcast:
            self._b.stats.received += item.count
        return ok

    def accept_batches(self, stream: str, batches: list[Batch], gap: int) -> None:
        raise NotImplementedError("a broker's ingress keeps a bundle whole, frames and all "
                                  "(IngressConfig.whole): it never hands over its batches")

    def epoch_end(self, stream: str, epoch: int) -> None:
        self._b.egress.epoch_end(stream, epoch)

    def producer_joined(self, stream: str, producer: str) -> None:
        # An ERROR waits in line for consumers; if none came before the stream was served
        # again, a trainer started later would die of a crash that is over.
        stale: list[str] = []

        def void(h: Held) -> bool:
            if not h.broadcast:
                return False
            msg = m.decode(h.frames[0])
            if isinstance(msg, m.Error):
                stale.append(msg.producer)
                return True
            return False

        if self._b.buffer.discard(stream, void):
            log.info("stream %s: the error of producer %s, which no consumer took, is "
                     "dropped: producer %s serves the stream now", stream,
                     ", ".join(sorted(set(stale))), producer)

    def keys(self, stream: str) -> set[tuple[int, int, int]]:
        return self._b.egress.held_keys(stream) | self._b.leftovers.keys(stream)


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
        self.budget = config.budget
        self.registry = registry if registry is not None else CollectorRegistry()
        self.metrics = BrokerMetrics(self.registry)
        self.metrics.buffer_capacity_batches.set(config.max_batches)
        self.metrics.buffer_capacity_bytes.set(config.max_bytes)
        self._own_ctx = ctx is None
        self.ctx = ctx or zmq.Context(io_threads=config.io_threads)
        self.instance = random.getrandbits(62)
        self.buffer = Buffer()
        self._sink = _Sink(self)
        self.stats = BrokerStats()
        self._exact_labelled: set[str] = set()  # exact streams with series last tick
        self._gauged: set[str] = set()  # streams with peers or buffered batches last tick
        self._evict_log = RateLimitedLog(log, interval=10.0, burst=4)
        # Batches evicted per stream to make room for read ones, for the log line (bounded:
        # the streams a broker has state for); the metric counts every eviction.
        self._evicted: dict[str, int] = {}
        self.server: Server | None = None
        try:
            self.server = server = Server(self.ctx, config.serving(), self._sink, self.metrics,
                                          self.instance, log)
            # No ZMTP heartbeats towards consumers: a paused consumer's connection must
            # outlive its registration, so that what was sent to it is still there when it
            # wakes (it takes it, then registers again). A dead one's kernel closes it.
            egress = server.bind(config.egress, "egress", "--egress", zmq.ROUTER, rcvhwm=1000,
                                 max_message=config.limits.max_header_bytes, heartbeats=False)
        except BaseException:
            self.close()
            raise
        self.stats.rejected = server.refusals.counts
        self.exact = server.exact
        self.leftovers = Leftovers(self.buffer, self.metrics,
                                   lambda s: self.exact.get(s) is not None)
        self.ingress = server.producers
        self.egress = ConsumerSide(egress.send, self.buffer, self.metrics, config.limits,
                                   self.budget, config.max_peers, self.instance,
                                   server.refusals.cut_off, self.exact)
        server.attach(egress, self.egress)
        self.sizing = BrokerSizing(self.metrics, SizingConfig.for_window(
            config.sizing_window, settle=2 * config.heartbeat_timeout))
        self.ingress_endpoint = server.ingress.endpoint
        self.egress_endpoint = egress.endpoint
        self.tensorpack_endpoint = (server.tensorpack.endpoint.endpoint
                                    if server.tensorpack is not None else None)

    # ---------------------------------------------------------------------------- loop
    def run(self, stop: threading.Event) -> None:
        server = self.server
        assert server is not None
        log.info("broker up: ingress %s, egress %s%s", self.ingress_endpoint,
                 self.egress_endpoint,
                 f", tensorpack {self.tensorpack_endpoint}" if self.tensorpack_endpoint else "")
        if self.cfg.coordinator is not None:
            # Nothing is said to the job's coordinator before an exact stream has state here
            # (its first producer's HELLO): say so, or a silent log reads as a broken link.
            log.info("host %s of a job: each exact stream joins the job's coordinator at %s "
                     "when its first producer registers here", self.cfg.job_host(),
                     self.cfg.coordinator)
        tick = max(0.001, self.cfg.heartbeat_interval / 4)
        next_tick = next_plan = time.monotonic()
        poller = zmq.Poller()
        polled: tuple[zmq.Socket, ...] = ()
        try:
            while not stop.is_set():
                # A new poller only when the sockets to poll change (tensorpack's comes and
                # goes with its credit): building one each turn cost a few us a batch.
                socks = tuple(server.sockets())
                if socks != polled:
                    poller, polled = zmq.Poller(), socks
                    for sock in socks:
                        poller.register(sock, zmq.POLLIN)
                events = dict(poller.poll(int(tick * 1000)))
                server.awake(time.monotonic())
                if events:
                    server.on_ready([s for s in events if isinstance(s, zmq.Socket)])
                now = time.monotonic()
                if len(self.ingress.producers) != self.leftovers.registered or (
                        self.egress.freed and self.leftovers.departed):
                    # A producer came or left, or a consumer came while departed ones' batches
                    # are held: what they left is judged before anything of it is sent.
                    self._leftovers(now)
                self.stats.forwarded += self.egress.dispatch(now)
                # A plan when it may grant more (feedline.serving.credit: ``due``, and
                # ``blocked`` with room freed by a consumer: once it took ``wake`` batches, or
                # came or left), when something else happened (``dirty``), and on the clock;
                # not every turn (a plan was 7 us a batch).
                ing, eg = self.ingress, self.egress
                if ing.dirty or ing.planner.due or now >= next_plan or ing.units.waiting() \
                        or (ing.planner.blocked
                            and (eg.freed or eg.taken_since >= ing.planner.wake)):
                    ing.dirty = eg.freed = False
                    eg.taken_since = 0
                    next_plan = now + PLAN_EVERY
                    ing.plan(now)
                if now >= next_tick:
                    server.tick(now)
                    self._update_gauges()
                    self.sizing.tick(now, self.ingress, self.egress)
                    self._enforce_shares()
                    self._leftovers(now)
                    next_tick = now + tick
        finally:
            self.close()

    def _update_gauges(self) -> None:
        m = self.metrics
        in_b, in_y = self.egress.inflight()
        m.buffer_batches.set(self.buffer.batches)
        m.inflight_batches.set(in_b)
        # The batch limit in force: --max-batches, small batches counted by their bytes.
        m.buffer_capacity_batches.set(self.ingress.planner.budget.max_batches)
        m.buffer_bytes.set(self.buffer.nbytes)
        m.inflight_bytes.set(in_y)
        m.peers.labels("consumer").set(len(self.egress.consumers))
        m.consumer_credit.set(sum(max(0, c.in_force - (c.delivered - c.taken))
                                  for c in self.egress.consumers))
        self._stream_gauges()

    def _enforce_shares(self) -> None:
        """What unread streams may keep of the budget, in two rules:

        - A stream that nobody reads keeps at most its share buffered (half an equal part
          when several streams are produced: ``Budget.per_stream``, counted for the deepest
          count the budget has had, so that a producer of large batches joining evicts
          nothing granted to small ones).
        - A stream that is read and produced always gets room for its floor
          (``Budget.stream_floor`` of the budget in force, in batches and in bytes): what it
          holds and was granted under it that the budget's free room cannot cover is taken
          from the unread streams, oldest batches first (:meth:`_room_for_read`). Without it
          an unread stream's leftovers of small batches, counted against the budget's batches
          for a read stream's large ones, starved that stream for as long as they stayed
          (issue 53, finding 1).

        An evicted batch is dropped and counted (an exact stream's is produced again
        later). What a consumer that is gone left in flight on a training stream is taken
        back last, by cutting its connection (:meth:`ConsumerSide.reclaim`)."""
        held = self.buffer.by_stream()
        orphaned = self.egress.reclaimable() != (0, 0)
        if not held and not orphaned:
            return
        known = held.keys() | {p.stream for p in self.ingress.producers}
        unread = {s for s in known if not self.egress.demand(s)}
        over = unread & held.keys()  # unread streams with something buffered
        if not over and not orphaned:
            return
        if over:
            by_stream = self._sink.held_by_stream()
            shares = self.ingress.planner.shares(by_stream, unread)
            for s in over:
                b, y = held[s]
                share = shares.get(s)
                if share is None or (b <= share.batches and y <= share.nbytes):
                    continue
                self._evict(s, share.batches, share.nbytes)
        self._room_for_read(unread)

    def _room_for_read(self, unread: set[str]) -> None:
        """Evict the oldest batches of the ``unread`` streams (those that hold most first)
        until the budget in force has room for what the read streams that are produced lack
        of their floor; then, if that was not enough, take back what consumers that are gone
        left in flight on training streams. A read stream counts while one of its producers
        may ask for credit (not one that gave its credit back and has not asked again: a
        finished one)."""
        planner = self.ingress.planner
        floor = planner.budget.stream_floor  # the count in force: shares() rescaled it
        need_b = need_y = 0
        needy: list[str] = []
        by_stream = self._sink.held_by_stream()
        mine: dict[str, list[int]] = {}
        for p in planner.producers.values():
            if p.stream in unread:
                continue
            t = mine.setdefault(p.stream, [0, 0, 0, 0])
            t[0] += p.outstanding
            t[1] += p.reserved
            t[2] |= int((not p.idle or p.wanting) and p.revoking_since is None)
            t[3] = max(t[3], p.unit)
        for s, (ob, oy, asking, unit) in mine.items():
            if not asking:
                continue
            # No more of either than its batches can use: the floor's batches of its
            # largest, or as many as the floor's bytes hold (evicting for bytes it could
            # never be granted would lose batches for nothing).
            fb, fy = floor.batches, floor.nbytes
            if unit:
                fb = min(fb, max(1, fy // unit))
                fy = min(fy, fb * unit)
            b, y = by_stream.get(s, (0, 0))
            if b + ob < fb or y + oy < fy:
                needy.append(s)
                need_b += max(0, fb - b - ob)
                need_y += max(0, fy - y - oy)
        if not needy:
            return
        held_b, held_y = self._sink.held()
        out_b, out_y = planner.outstanding()
        short_b = need_b - (planner.budget.max_batches - held_b - out_b)
        short_y = need_y - (planner.budget.max_bytes - held_y - out_y)
        if short_b <= 0 and short_y <= 0:
            return
        held = self.buffer.by_stream()
        for s in sorted(unread & held.keys(), key=lambda s: held[s], reverse=True):
            if short_b <= 0 and short_y <= 0:
                break
            b, y = held[s]
            gone_b, gone_y = self._evict(s, b - max(0, short_b), y - max(0, short_y))
            short_b, short_y = short_b - gone_b, short_y - gone_y
            self._evicted[s] = self._evicted.get(s, 0) + gone_b
            self._evict_log.info(
                "stream %s: %d batches (%s) that nobody reads evicted to make room for %s "
                "(read; its floor is %d batches, %s, of a budget of %d batches counted for "
                "its batches); %d evicted from it so far (feedline_broker_evicted_batches_"
                "total)", s, gone_b, _size(gone_y), ", ".join(sorted(needy)),
                floor.batches, _size(floor.nbytes), planner.budget.max_batches,
                self._evicted[s])
        if short_b > 0 or short_y > 0:
            self.egress.reclaim(max(0, short_b), max(0, short_y), needy)

    def _evict(self, stream: str, batches: int, nbytes: int) -> tuple[int, int]:
        """Drop the oldest batches of ``stream`` until it holds at most ``batches`` and
        ``nbytes``; count them; returns (batches, bytes) dropped."""
        coord = self.exact.get(stream)
        self.ingress.dirty = True  # room freed: a plan
        gone_b = gone_y = 0
        label = self.metrics.stream_label.label(stream)
        for item in self.buffer.evict(stream, max(0, batches), max(0, nbytes)):
            self.metrics.evicted.labels(label).inc(item.count)
            gone_b, gone_y = gone_b + item.count, gone_y + item.nbytes
            if coord is not None and item.batch is not None:
                coord.lost(item.batch.key)
        return gone_b, gone_y

    def _leftovers(self, now: float) -> None:
        """What producers that left, or went silent, have buffered, against what produces
        each stream now (:mod:`feedline.broker.pipelines`)."""
        if self.leftovers.judge(now, self.ingress.producers, self.egress.demand):
            self.ingress.dirty = True  # room freed: a plan

    def _stream_gauges(self) -> None:
        """Per-stream series: buffered batches, peers, and exact streams' progress."""
        m = self.metrics
        peers: dict[tuple[str, str], int] = {}
        for role, table in (("producer", self.ingress.producers),
                            ("consumer", self.egress.consumers)):
            for p in table:
                key = (p.stream, role)
                peers[key] = peers.get(key, 0) + 1
        # Last tick's streams too: a stream whose last peer left (and that buffers nothing)
        # is set to 0 once, not left showing the peers it had (`feedline top`'s phantoms).
        now = {s for s, _ in peers} | set(self.buffer.streams())
        streams = now | set(self.exact.streams) | self._exact_labelled | self._gauged
        self._gauged = now
        m.exact_streams.set(len(self.exact.streams))
        for s in streams:
            label = m.stream_label.acquire(s)
            m.stream_buffer.labels(label).set(self.buffer.count(s))
            for role in ("producer", "consumer"):
                m.stream_peers.labels(label, role).set(peers.get((s, role), 0))
            c = self.exact.get(s)
            if c is None and s in self._exact_labelled:
                m.forget_exact(label)  # reclaimed
            if c is not None:
                m.exact_epoch.labels(label).set(c.epoch)
                m.exact_units.labels(label, "done").set(len(c.done))
                m.exact_units.labels(label, "total").set(c.plan.units)
                m.exact_durable.labels(label).set(c.journal is not None
                                                  and c.journal.error is None)
            m.stream_label.release(label)
        self._exact_labelled = set(self.exact.streams)

    def summary(self) -> str:
        """What it served since it started, and what it holds (lost with it when it stops):
        the broker's last line."""
        kb, ky = self.leftovers.held()
        buf_b, buf_y = self.buffer.batches + kb, self.buffer.nbytes + ky
        in_b, in_y = self.egress.inflight()
        out_b, _ = self.ingress.planner.outstanding()
        exact = ""
        if self.exact.streams:
            exact = (f"; exact streams' progress is in {self.cfg.state_dir}: a broker "
                     "started on it serves the rest" if self.cfg.state_dir else
                     "; exact streams' progress was in memory only (--exact-ephemeral)")
        return (f"served {self.stats.forwarded} batches to consumers; dropped what it held: "
                f"{buf_b} batches buffered ({_size(buf_y)}), {in_b} delivered to consumers "
                f"and not reported taken ({_size(in_y)}), credit for {out_b} granted to "
                f"producers{exact}")

    # --------------------------------------------------------------------------- close
    def close(self) -> None:
        """Close the sockets (bounded linger), stop the authenticator, remove our ipc files."""
        if self.server is not None:
            self.server.close()
        if self._own_ctx and not self.ctx.closed:
            self.ctx.term()


def _size(nbytes: int) -> str:
    return f"{nbytes / 1e6:.1f} MB" if nbytes >= 100_000 else f"{nbytes} bytes"

"""The broker's side of sizing: it samples what its producers and consumers do, keeps one
:class:`~feedline.serving.sizing.StreamSizer` per stream and exports the number.

Called on every tick of the broker's loop (a few times a second): once
:attr:`~feedline.serving.sizing.SizingConfig.settle` seconds have passed since the first tick
(a broker that just started, or restarted, says no number while its producers and trainers
reconnect one by one: a sizer started then would hold a partial count, "1" for a fleet of 4
coming back, and the fleet would stop the others; nor does it sample them), about once a
second it
hands each stream's counters to its sizer (with the time every producer held unused credit,
which the credit planner keeps exactly: what tells a producer that runs free from one the
trainers hold back) and sets
``feedline_broker_stream_producers_wanted`` and the figures behind it, and each supervisor's
share (``feedline_broker_fleet_*``: producers started by ``feedline fleet --id X`` say so in
their HELLO, with the supervisor's ``--max``).

It reads, and never changes: the producer side's registrations (``stream``, ``fleet``) and its
credit planner's per-producer ``received`` and ``credit_seconds``; the consumer side's
registrations (``taken``, ``delivered``, ``waited``, the window in force:
``Consumer.in_force``).
"""

from __future__ import annotations

import math
from typing import Any

from feedline.serving.metrics import BrokerMetrics
from feedline.serving.sizing import (
    VERDICTS,
    ConsumerSample,
    Estimate,
    ProducerSample,
    SizingConfig,
    StreamSizer,
    fleet_shares,
)

_EVERY = 1.0  # seconds between estimates


class BrokerSizing:
    """Per-stream sizers, fed from the broker's tables (one thread: the broker's loop)."""

    def __init__(self, metrics: BrokerMetrics, cfg: SizingConfig) -> None:
        self.metrics, self.cfg = metrics, cfg
        self.sizers: dict[str, StreamSizer] = {}
        self.estimates: dict[str, Estimate] = {}
        self.shares: dict[str, dict[str, int]] = {}
        self._quiet: dict[str, float] = {}  # stream -> since when it has no peer
        self._fleet_series: set[tuple[str, str]] = set()
        self._next = 0.0
        self._started: float | None = None  # the first tick

    def tick(self, now: float, ingress: Any, egress: Any) -> None:
        if self._started is None:
            self._started = now
        if now < self._next:
            return
        self._next = now + _EVERY
        if now - self._started < self.cfg.settle:
            return  # peers still reconnecting: what is connected now is a partial count
        self._estimate(now, ingress, egress)

    def _estimate(self, now: float, ingress: Any, egress: Any) -> None:
        planned = ingress.planner.producers
        producers: dict[str, list[ProducerSample]] = {}
        fleets: dict[str, dict[str, tuple[int, int]]] = {}  # stream -> fleet -> (n, max)
        for p in ingress.producers:
            c = planned.get(p.ident)
            key = (p.ident, p.registration)
            producers.setdefault(p.stream, []).append(ProducerSample(
                key, c.received if c else 0, c.credit_seconds(now) if c else 0.0))
            n, top = fleets.setdefault(p.stream, {}).get(p.fleet[0], (0, 0))
            fleets[p.stream][p.fleet[0]] = (n + 1, max(top, p.fleet[1]))
        consumers: dict[str, list[ConsumerSample]] = {}
        for c in egress.consumers:
            consumers.setdefault(c.stream, []).append(ConsumerSample(
                (c.ident, c.registration), c.taken, c.waited, c.delivered - c.taken,
                c.in_force))
        series: set[tuple[str, str]] = set()
        buffered = egress.buffer.by_stream()
        for stream in set(producers) | set(consumers) | set(self.sizers):
            ps, cs = producers.get(stream, []), consumers.get(stream, [])
            sizer = self.sizers.setdefault(stream, StreamSizer(self.cfg))
            est = sizer.observe(now, cs, ps, buffered.get(stream, (0, 0))[0])
            if ps or cs:
                self._quiet.pop(stream, None)
            elif now - self._quiet.setdefault(stream, now) > self.cfg.window + \
                    self.cfg.down_hold and est.wanted == 0:
                # Nobody left for long: forget it (its series go when its label does).
                del self.sizers[stream], self._quiet[stream]
                self.estimates.pop(stream, None)
                self.shares.pop(stream, None)
                continue
            self.estimates[stream] = est
            mine = fleets.get(stream, {})
            unmanaged = mine.pop("", (0, 0))[0]
            self.shares[stream] = fleet_shares(est.wanted, {f: m for f, (_, m) in mine.items()},
                                               unmanaged)
            self._export(stream, est, mine, series)
        for stale in self._fleet_series - series:
            for g in (self.metrics.fleet_producers, self.metrics.fleet_wanted,
                      self.metrics.fleet_max):
                try:
                    g.remove(*stale)
                except KeyError:
                    pass
        self._fleet_series = series

    def _export(self, stream: str, est: Estimate, fleets: dict[str, tuple[int, int]],
                series: set[tuple[str, str]]) -> None:
        m = self.metrics
        label = m.stream_label.acquire(stream)
        try:
            if label == m.stream_label.OTHER:
                return  # beyond the named streams: one "other" series could not say it
            nan = math.nan
            m.demand.labels(label).set(nan if est.demand is None else est.demand)
            m.capacity.labels(label).set(nan if est.capacity is None else est.capacity)
            m.supply.labels(label).set(nan if est.supply is None else est.supply)
            m.consumer_wait.labels(label).set(nan if est.wait_share is None else est.wait_share)
            m.producers_wanted.labels(label).set(est.wanted)
            for v in VERDICTS:
                m.bottleneck.labels(label, v).set(1 if est.verdict == v else 0)
            shares = self.shares[stream]
            for fleet, (n, top) in fleets.items():
                f = m.fleet_label.acquire(fleet)
                if f != m.fleet_label.OTHER:
                    m.fleet_producers.labels(label, f).set(n)
                    m.fleet_wanted.labels(label, f).set(shares.get(fleet, 0))
                    m.fleet_max.labels(label, f).set(top)
                    series.add((label, f))
                m.fleet_label.release(f)
        finally:
            m.stream_label.release(label)

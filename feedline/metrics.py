"""Metric helpers shared by every component."""

from __future__ import annotations

import bisect
import logging
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from feedline.endpoints import AddressError, check_port
from feedline.errors import ConfigError

log = logging.getLogger(__name__)


class BoundedLabel:
    """Maps unbounded values (producer ids) onto at most ``limit`` label values.

    :meth:`acquire` gives a value its own label while fewer than ``limit - 1`` labels are in
    use, and ``"other"`` beyond that. A label whose holders have all :meth:`release`-d it
    stays (a producer that reconnects keeps its series) until room is needed for a new value:
    then the least recently released one is evicted and ``on_evict(label)`` is called, so the
    owner can remove its series. A fleet that keeps replacing producers (new pod names on
    every rollout) thus keeps per-producer series for the ones connected now, and the number
    of series stays bounded.
    """

    OTHER = "other"

    def __init__(self, limit: int, on_evict: Callable[[str], None] = lambda _: None) -> None:
        self.limit = limit
        self._on_evict = on_evict
        self._holders: dict[str, int] = {}  # label -> connected holders
        self._idle: OrderedDict[str, None] = OrderedDict()  # labels nobody holds, LRU first

    def acquire(self, value: str) -> str:
        if value == self.OTHER:
            return value
        if value not in self._holders:
            if len(self._holders) >= self.limit - 1:
                if not self._idle:
                    return self.OTHER
                old, _ = self._idle.popitem(last=False)
                del self._holders[old]
                self._on_evict(old)
            self._holders[value] = 0
        self._holders[value] += 1
        self._idle.pop(value, None)
        return value

    def label(self, value: str) -> str:
        """The label ``value`` has, without holding it: its own while there is room (a value
        counted before anything acquired it, the first batch of a new stream, gets its own
        label, as :meth:`acquire` would give it), "other" beyond that."""
        if value in self._holders:
            return value
        label = self.acquire(value)
        self.release(label)
        return label

    def release(self, label: str) -> None:
        n = self._holders.get(label)
        if n is None:  # "other", or evicted already
            return
        self._holders[label] = n - 1
        if n - 1 == 0:
            self._idle[label] = None


class OwnedCounter(Collector):
    """A counter that one thread increments without a lock, exported when scraped.

    prometheus_client's ``Counter.inc`` takes a lock on every call; a counter bumped for
    every batch by one thread (an I/O thread, a training loop) needs none: under the GIL one
    writer's ``+=`` is never lost and a scrape reads a whole value. Exposed as
    ``NAME_total``, as a ``Counter`` named ``name`` would be. Only the owning thread may call
    :meth:`inc`.
    """

    def __init__(self, name: str, documentation: str, registry: CollectorRegistry) -> None:
        self.name, self.documentation = name, documentation
        self.value = 0.0
        registry.register(self)

    def inc(self, amount: float = 1) -> None:
        self.value += amount

    def describe(self) -> Iterator[Metric]:
        yield CounterMetricFamily(self.name, self.documentation)

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily(self.name, self.documentation, value=self.value)


class _Owned:
    """One series of :class:`OwnedCounters`: what ``Counter.labels(...)`` gives, unlocked."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1) -> None:
        self.value += amount


class OwnedCounters(Collector):
    """A labelled :class:`OwnedCounter`: ``labels(...)`` and ``remove(...)`` as a labelled
    ``Counter`` has them, each series incremented by one thread without a lock (the
    serving core's loop thread counts every batch of every producer: prometheus_client's
    ``inc`` took 0.8 us of it, a lock and two checks, twice per batch). Only the owning
    thread may call :meth:`labels`, :meth:`remove` and a series' ``inc``; scrapes read."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str],
                 registry: CollectorRegistry) -> None:
        self.name, self.documentation = name, documentation
        self.labelnames = tuple(labelnames)
        self._series: dict[tuple[str, ...], _Owned] = {}
        registry.register(self)

    def labels(self, *values: str) -> _Owned:
        series = self._series.get(values)  # the labels are strings already: one lookup
        if series is not None:
            return series
        if len(values) != len(self.labelnames):
            raise ConfigError(f"{self.name} takes labels {self.labelnames}, got {values}")
        key = tuple(str(v) for v in values)
        series = self._series.get(key)
        if series is None:
            series = self._series[key] = _Owned()
        return series

    def remove(self, *values: str) -> None:
        """Drop a series, if there is one (as ``Counter.remove``)."""
        self._series.pop(tuple(str(v) for v in values), None)

    def describe(self) -> Iterator[Metric]:
        yield CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for key, series in list(self._series.items()):  # one C call: whole under the GIL
            family.add_metric(list(key), series.value)
        yield family


class OwnedHistogram(Collector):
    """A histogram that one thread observes into without a lock (see :class:`OwnedCounter`),
    exposed as a ``Histogram`` named ``name`` with ``buckets`` would be."""

    def __init__(self, name: str, documentation: str, buckets: Sequence[float],
                 registry: CollectorRegistry) -> None:
        self.name, self.documentation = name, documentation
        self.bounds = sorted(float(b) for b in buckets)
        self.counts = [0] * (len(self.bounds) + 1)  # the last: above every bound (+Inf)
        self.sum = 0.0
        registry.register(self)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def describe(self) -> Iterator[Metric]:
        yield HistogramMetricFamily(self.name, self.documentation)

    def collect(self) -> Iterator[Metric]:
        counts, total = list(self.counts), self.sum
        cumulative, buckets = 0, []
        for bound, n in zip([*map(floatToGoString, self.bounds), "+Inf"], counts, strict=True):
            cumulative += n
            buckets.append((bound, cumulative))
        yield HistogramMetricFamily(self.name, self.documentation, buckets=buckets,
                                    sum_value=total)


def serve_metrics(
    registry: CollectorRegistry, port: int | None, addr: str = "0.0.0.0",
    flag: str = "--metrics-port",
) -> Any | None:
    """Serve ``registry`` on http://addr:port/metrics from a daemon thread (None: don't).

    Returns the HTTP server (call ``.shutdown()`` and ``.server_close()`` to stop it), or
    None. A training process serves its consumer metrics this way: pass the same registry to
    ``RemoteDataZMQ(options=ConsumerOptions(registry=...))`` and to
    ``serve_metrics(registry, 9400)``.

    A port that cannot be bound (in use, privileged, an address not of this host) raises
    :class:`feedline.endpoints.AddressError` with a one-line message naming ``flag``, the
    port and what to do, instead of the HTTP server's ``OSError``.
    """
    if port is None:
        return None
    try:
        server, _thread = start_http_server(port, addr=addr, registry=registry)
    except OSError:
        check_port(port, addr, flag)  # says why, in one line
        raise AddressError(f"{flag} {port}: cannot serve metrics on {addr}:{port}; give "
                           f"{flag} another port, or {flag} 0 to serve none") from None
    log.info("metrics on http://%s:%d/metrics", addr, port)
    return server

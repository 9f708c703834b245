"""The producer's Prometheus metrics, registered on a registry that is passed in."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from feedline.metrics import OwnedCounter, OwnedHistogram

# Credit waits range from none (trainer keeps up) to seconds (trainer is the bottleneck).
WAIT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class ProducerMetrics:
    """The per-batch series count without a lock (:class:`OwnedCounter`): the sent ones by
    the I/O thread only, ``credit_wait`` and ``pipeline_seconds`` by the sending thread."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.sent_batches = OwnedCounter(
            "feedline_producer_sent_batches", "Batches sent to the broker.", r)
        self.sent_bytes = OwnedCounter(
            "feedline_producer_sent_bytes", "Array bytes sent to the broker.", r)
        self.sent_bundles = OwnedCounter(
            "feedline_producer_sent_bundles",
            "Messages that carried several batches (to a direct-mode trainer: "
            "feedline.protocol.bundle; "
            "sent_batches counts their batches).", r)
        self.credit_wait = OwnedHistogram(
            "feedline_producer_credit_wait_seconds",
            "Time a batch waited for broker credit (long waits: the trainer is the bottleneck).",
            WAIT_BUCKETS, r)
        self.pipeline_seconds = OwnedCounter(
            "feedline_producer_pipeline_seconds",
            "Time spent waiting for the pipeline's next batch (its rate near 1: preprocessing "
            "is the bottleneck).", r)
        self.registrations = Counter(
            "feedline_producer_registrations",
            "HELLOs to a broker (first connect, reconnects, broker restarts).", registry=r)
        self.rejected = Counter(
            "feedline_producer_rejected_messages", "Messages from the broker refused, by reason.",
            ["reason"], registry=r)
        self.refused = Counter(
            "feedline_producer_refused_messages",
            "Messages of ours the broker refused (it said why), by reason.", ["reason"],
            registry=r)


class CountedStage(Protocol):
    """What :class:`StageMetrics` reads: a :class:`~feedline.producer.dataflow.CountData`."""

    name: str
    count: int
    skips: tuple

    @property
    def skipped(self) -> int: ...


class StageMetrics(Collector):
    """Per-stage counts of the pipeline, read from its counting stages at scrape time.

    ``stages`` are the pipeline's :class:`~feedline.producer.dataflow.CountData` stages
    (:func:`feedline.producer.pipeline.pipeline_stages`); their names, taken from the pipeline file,
    are the ``stage`` label, so the label set is as bounded as the file. The datapoint path
    pays one integer increment per stage; the metric families are built only when scraped.
    Stages that can skip datapoints (map stages, a factory's pipeline) also export their
    skip count, 0 included.
    """

    def __init__(self, registry: CollectorRegistry, stages: Sequence[CountedStage] = ()) -> None:
        self.stages = list(stages)
        registry.register(self)

    def describe(self) -> Iterator[Metric]:
        return iter(self._families(()))

    def collect(self) -> Iterator[Metric]:
        return iter(self._families(self.stages))

    @staticmethod
    def _families(stages: Iterable[CountedStage]) -> list[Metric]:
        out = CounterMetricFamily(
            "feedline_producer_stage_datapoints",
            "Datapoints that came out of each pipeline stage (its rate is the stage's rate).",
            labels=["stage"])
        skipped = CounterMetricFamily(
            "feedline_producer_skipped_datapoints",
            "Datapoints a stage dropped under the skip error policy (corrupt images, ...).",
            labels=["stage"])
        workers = GaugeMetricFamily(
            "feedline_producer_stage_workers",
            "Threads or processes a parallel map stage runs now (parallel: auto tunes it).",
            labels=["stage", "mode"])
        for s in stages:
            out.add_metric([s.name], s.count)
            if s.skips:
                skipped.add_metric([s.name], s.skipped)
            for m in s.skips:
                active, mode = getattr(m, "active", None), getattr(m, "mode", "")
                if isinstance(active, int) and mode:
                    workers.add_metric([s.name, mode], active)
        return [out, skipped, workers]


class ShardCounts(Protocol):
    """What :class:`ShardMetrics` reads: a sharded source's ``format`` and ``stats``."""

    format: str
    stats: Any


# (metric name, help, ShardStats attribute)
_SHARD_FAMILIES = (
    ("feedline_producer_shard_retries", "Reads of a shard retried after a transient failure "
     "(connection reset, timeout, 5xx, a body cut short).", "retries"),
    ("feedline_producer_shards_failed", "Shards given up on after every retry (skipped in "
     "training, an error under exact delivery); the log names each.", "failed_shards"),
    ("feedline_producer_corrupt_records", "Records skipped as corrupt (bad CRC, bad tar "
     "header, truncated member, missing field); the log names each.", "corrupt_records"),
    ("feedline_producer_shards_read", "Shards read to their end.", "shards_read"),
    ("feedline_producer_shard_read_bytes", "Bytes read from shards.", "bytes_read"),
)


class ShardMetrics(Collector):
    """The counters of the pipeline's sharded sources, read at scrape time, by ``format``."""

    def __init__(self, registry: CollectorRegistry, sources: Sequence[ShardCounts]) -> None:
        self.sources = list(sources)
        registry.register(self)

    def describe(self) -> Iterator[Metric]:
        return iter(self._families(()))

    def collect(self) -> Iterator[Metric]:
        return iter(self._families(self.sources))

    @staticmethod
    def _families(sources: Iterable[ShardCounts]) -> list[Metric]:
        out: list[Metric] = []
        for name, doc, attr in _SHARD_FAMILIES:
            fam = CounterMetricFamily(name, doc, labels=["format"])
            for s in sources:
                fam.add_metric([s.format], getattr(s.stats, attr))
            out.append(fam)
        return out

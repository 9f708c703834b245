"""The producer's Prometheus metrics, registered on a registry that is passed in."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

# Credit waits range from none (trainer keeps up) to seconds (trainer is the bottleneck).
WAIT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class ProducerMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.sent_batches = Counter(
            "feedline_producer_sent_batches", "Batches sent to the broker.", registry=r)
        self.sent_bytes = Counter(
            "feedline_producer_sent_bytes", "Array bytes sent to the broker.", registry=r)
        self.credit_wait = Histogram(
            "feedline_producer_credit_wait_seconds",
            "Time a batch waited for broker credit (long waits: the trainer is the bottleneck).",
            buckets=WAIT_BUCKETS, registry=r)
        self.pipeline_seconds = Counter(
            "feedline_producer_pipeline_seconds",
            "Time spent waiting for the pipeline's next batch (its rate near 1: preprocessing "
            "is the bottleneck).", registry=r)
        self.registrations = Counter(
            "feedline_producer_registrations",
            "HELLOs to a broker (first connect, reconnects, broker restarts).", registry=r)
        self.rejected = Counter(
            "feedline_producer_rejected_messages", "Messages from the broker refused, by reason.",
            ["reason"], registry=r)

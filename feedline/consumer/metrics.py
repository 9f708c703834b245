"""The training process's Prometheus metrics, registered on a registry that is passed in."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from feedline.metrics import OwnedCounter, OwnedHistogram

# Time the model waited for the next batch: ~0 when input keeps up, large when input-bound.
WAIT_BUCKETS = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class ConsumerMetrics:
    """The per-batch series are counted without a lock (:class:`OwnedCounter`): the received
    ones by the I/O thread only, ``wait`` by the iterating thread only."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.received_batches = OwnedCounter(
            "feedline_consumer_received_batches", "Batches received from the broker.", r)
        self.received_bytes = OwnedCounter(
            "feedline_consumer_received_bytes", "Array bytes received from the broker.", r)
        self.lost_batches = OwnedCounter(
            "feedline_consumer_lost_batches",
            "Batches the broker reported missing from producer sequences.", r)
        self.rejected = Counter(
            "feedline_consumer_rejected_messages", "Messages refused, by reason.",
            ["reason"], registry=r)
        self.wait = OwnedHistogram(
            "feedline_consumer_wait_seconds",
            "Time the training loop waited for a batch (long waits: input-bound).",
            WAIT_BUCKETS, r)
        self.local_queue = Gauge(
            "feedline_consumer_local_queue_batches",
            "Batches received and not yet taken by the training loop.", registry=r)
        # local_queue / window is the occupancy: ~1 model-bound, ~0 input-bound.
        self.window = Gauge(
            "feedline_consumer_window_batches",
            "Batches this process may hold undelivered to the model (its credit window).",
            registry=r)
        # Info-style: 1 for the stream this process receives, so that a query can join the
        # consumer's series to the broker's per-stream ones (``* on (instance)
        # group_left (stream) feedline_consumer_stream_info``).
        self.stream_info = Gauge(
            "feedline_consumer_stream_info",
            "The named stream this training process receives (value 1).", ["stream"],
            registry=r)

    def set_stream(self, stream: str) -> None:
        """The stream this process receives; one at a time (a process has one stream)."""
        self.stream_info.clear()
        self.stream_info.labels(stream).set(1)


class QueueMetrics:
    """The training-side input queue (QueueInput), sampled every step by OccupancyMonitor."""

    def __init__(self, registry: CollectorRegistry, queue: str = "input") -> None:
        r = registry
        labels = {"queue": queue}
        self.size = Gauge(
            "feedline_consumer_queue_batches",
            "Batches waiting in the training process's TensorFlow input queue.",
            ["queue"], registry=r).labels(**labels)
        self.capacity = Gauge(
            "feedline_consumer_queue_capacity_batches",
            "Capacity of the TensorFlow input queue.", ["queue"], registry=r).labels(**labels)
        self.average = Gauge(
            "feedline_consumer_queue_occupancy_ratio",
            "Moving average of queue size / capacity: ~1 model-bound, ~0 input-bound.",
            ["queue"], registry=r).labels(**labels)

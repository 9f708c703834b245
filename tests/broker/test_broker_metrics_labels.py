"""Per-producer metric series stay bounded and follow the producers connected now.

A fleet that replaces its producers (a Kubernetes rollout names every pod anew) must neither
grow one series per producer ever seen nor end with every producer lumped into "other".
"""

from __future__ import annotations

import numpy as np
from prometheus_client import CollectorRegistry

from feedline.consumer import ConsumerOptions, RemoteDataZMQ
from feedline.metrics import BoundedLabel
from feedline.procs import free_port, wait_for
from feedline.producer import Sender
from feedline.serving.metrics import BrokerMetrics
from feedline.transport.link import LinkConfig
from tests.support.netns import metric_sum

FAST = LinkConfig(heartbeat_interval=0.2, heartbeat_timeout=1.5)


def test_bounded_label_reuses_the_room_of_departed_values() -> None:
    evicted: list[str] = []
    labels = BoundedLabel(3, on_evict=evicted.append)  # two named labels, then "other"
    assert labels.acquire("a") == "a" and labels.acquire("b") == "b"
    assert labels.acquire("c") == "other", "full while a and b are connected"
    labels.release("a")
    assert labels.acquire("b") == "b", "a second holder of b"
    assert labels.acquire("a") == "a" and evicted == [], "a reconnecting value keeps its label"
    labels.release("a")
    assert labels.acquire("c") == "c" and evicted == ["a"], "a departed value makes room"
    labels.release("b")
    assert labels.acquire("d") == "other", "b still has a holder"
    labels.release("b")
    assert labels.acquire("d") == "d" and evicted == ["a", "b"]


def test_a_value_counted_before_it_is_acquired_gets_its_own_label() -> None:
    # A broker counts a stream's forwarded batches by `label`; its per-stream gauges acquire
    # the stream a tick later. The first batches once went to "other" (a CI run showed an
    # "other" stream row in `feedline top` with two streams).
    labels = BoundedLabel(3)
    assert labels.label("a") == "a", "room: its own label"
    assert labels.acquire("b") == "b" and labels.acquire("a") == "a"
    assert labels.label("c") == "other", "full while a and b are held"
    labels.release("a")
    assert labels.label("c") == "c", "a released label makes room"


def test_eviction_removes_the_departed_producers_series() -> None:
    reg = CollectorRegistry()
    m = BrokerMetrics(reg, max_producer_labels=2)
    a = m.producer_label.acquire("a")
    m.init_producer(a)
    m.received_batches.labels(a).inc(5)
    m.producer_label.release(a)
    b = m.producer_label.acquire("b")
    m.init_producer(b)
    names = {s.labels.get("producer") for fam in reg.collect() for s in fam.samples
             if s.name == "feedline_broker_received_batches_total"}
    assert names == {"b"}


def test_a_broker_keeps_series_for_connected_producers_after_many_came_and_went(
        thread_broker, endpoints) -> None:
    tb = thread_broker(max_batches=256)  # room for every batch: no consumer here
    limit = tb.broker.metrics.producer_label.limit
    for i in range(limit + 10):  # more producers than labels, one after another
        with Sender(endpoints.ingress, producer_id=f"pod-{i}", link=FAST) as s:
            s.send([np.zeros(4, np.uint8)])
        wait_for(lambda: not len(tb.broker.ingress.producers), 10, what="BYE processed")
    with Sender(endpoints.ingress, producer_id="newest", link=FAST) as s:
        s.send([np.zeros(4, np.uint8)])
        wait_for(lambda: len(tb.broker.ingress.producers), 10, what="newest registered")
        series = {s.labels.get("producer") for fam in tb.broker.registry.collect()
                  for s in fam.samples if s.name == "feedline_broker_received_batches_total"}
    assert "newest" in series, "a producer connected now has its own series"
    assert len(series) <= limit, "series stay bounded"


def _metric(port: int, name: str, **labels: str) -> float:
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
    return metric_sum(text.decode(), name, **labels)


def test_a_streams_consumer_count_falls_to_zero_when_its_last_consumer_leaves(
        broker_proc, endpoints) -> None:
    """A stream with no producer whose only consumer leaves (a bye): before, its
    ``feedline_broker_stream_peers{role="consumer"}`` stayed 1 (the per-stream series were
    set only for streams with peers or batches now), so `feedline top` showed a phantom
    consumer while ``feedline_broker_peers`` said 0. Now it falls to 0."""
    port = free_port()
    broker_proc("--metrics-port", str(port))
    src = RemoteDataZMQ(endpoints.egress, stream="lonely", timeout=30,
                        options=ConsumerOptions(link=FAST))
    try:
        src._start()  # registers (its HELLO) without waiting for a batch
        wait_for(lambda: _metric(port, "feedline_broker_stream_peers", stream="lonely",
                                 role="consumer") == 1, 20, what="the consumer to register")
    finally:
        src.close()  # a bye
    wait_for(lambda: _metric(port, "feedline_broker_peers", role="consumer") == 0, 20,
             what="the broker to drop the consumer")
    wait_for(lambda: _metric(port, "feedline_broker_stream_peers", stream="lonely",
                             role="consumer") == 0, 5,
             what="the stream's consumer count to fall to 0 (before: it stayed 1)")

"""A broker counts small batches by their bytes, as a direct-mode trainer does.

A window of ``n`` batches holds ``n`` batches of 8 MiB or more and as many smaller ones as fit
in ``n`` x 8 MiB, at most 128 ``n`` (:func:`feedline.serving.budget.depth`): each producer's
window, the budget's batches, a consumer's window and the per-consumer share. What a broker
may keep of an unread stream is counted for the deepest count its budget has had, so that a
producer of large batches joining cannot make it evict batches it granted to small ones.
Real processes: a broker, ``feedline producer`` daemons, ``RemoteDataZMQ`` on its egress.
"""

from __future__ import annotations

import textwrap
import time

import pytest
import yaml
from prometheus_client import CollectorRegistry

from feedline.broker.consumers import Consumer
from feedline.consumer import ConsumerOptions, RemoteDataZMQ
from feedline.procs import wait_for
from feedline.serving.budget import DEPTH, SMALL_BATCH, Budget, depth, top_up
from feedline.serving.credit import CreditPlanner
from tests.support.exact_run import pipeline, producer
from tests.support.flow_support import (
    FAST,
    CountingConsumer,
    fake_yaml,
    queue_when_settled,
    run_script,
    start_broker,
    start_producer,
)

MiB = 1 << 20


def test_a_consumers_window_counts_small_batches_by_the_largest_it_was_sent():
    """Window 4, caps of 16 batches and 64 MiB: 512 batches of 16 KB fit (128 x 4), not
    513; an 8 MiB batch then waits until fewer than 4 are in flight (the count for the largest
    batch, this one included: the consumer, counting the same batches, never finds more than
    its window)."""
    c = Consumer(ident=b"c", name="c", session=1, registration=1, stream="default",
                 window=4, max_bytes=64 * MiB)
    held = depth(4, 16_000)
    assert held == 512
    for _ in range(held):
        assert c.room(16_000, 64 * MiB, 16)
        c.delivered += 1
        c.inflight_bytes += 16_000
        c.largest = 16_000
    assert not c.room(16_000, 64 * MiB, 16), "513 batches of 16 KB in a window of 4"
    assert not c.room(SMALL_BATCH, 64 * MiB, 16)
    c.taken = held - 3  # 3 in flight
    c.inflight_bytes = 3 * 16_000
    assert c.room(SMALL_BATCH, 64 * MiB, 16)
    c.largest = SMALL_BATCH
    c.taken = held - 4  # 4 in flight: a window of 4 large batches is full
    assert not c.room(16_000, 64 * MiB, 16), "the count stays for the largest batch sent"


def test_a_brokers_eviction_share_never_shrinks_under_what_it_granted():
    """A broker's planner (by bytes): 50 tiny batches of an unread stream are held under a
    count of 4,096 (DEPTH x 32); a producer of 8 MiB batches joins and the count for
    granting falls back to 32, but what the broker may keep of the stream stays counted for
    4,096 (before: its share fell to 32 and the broker evicted 18 of the 50 it had
    granted)."""
    cp = CreditPlanner(Budget(32, 1 << 30), 4, 2.0, by_bytes=True)
    cp.join(b"tiny", declared=100)
    cp.want(b"tiny", sent=0, sent_bytes=0, size=100)
    cp.plan(0.0, 0, 0, {}, unread={"default"})
    assert cp.budget.max_batches == DEPTH * 32
    cp.leave(b"tiny")
    cp.join(b"large", declared=SMALL_BATCH)
    cp.want(b"large", sent=0, sent_bytes=0, size=SMALL_BATCH)
    held = {"default": (50, 50 * 100)}
    cp.plan(0.0, 50, 50 * 100, held, unread={"default"})
    assert cp.budget.max_batches == 32, "granting counts for the large batches now"
    assert cp.producers[b"large"].outstanding == 0, "50 held: no room under 32"
    share = cp.shares(held, {"default"})["default"]
    assert share.batches == DEPTH * 32, share


def test_a_producer_of_large_batches_joining_evicts_nothing_granted(broker_proc, daemons,
                                                                     tmp_path, endpoints):
    """End to end: 50 tiny batches arrive while nobody reads their stream (their producer
    is done and gone), then a producer of 8 MiB batches registers. A consumer that comes
    later gets all 50 and the large ones; the broker evicted none (the same with the eviction
    share counted for the budget now: 18 evicted). The tiny ones' producer says no pipeline
    fingerprint (``send_dataflow`` without one): a departed pipeline's batches of another
    fingerprint than the one producing would be dropped (tests/broker/test_broker_pipelines.py)."""
    _, metrics = start_broker(broker_proc)
    tiny = run_script(textwrap.dedent(f"""
        import numpy as np
        from feedline.transport.link import LinkConfig
        from feedline.producer import send_dataflow
        send_dataflow([[np.zeros(16, np.uint8)] for _ in range(50)], {endpoints.ingress!r},
                      epochs=1, producer_id="tiny",
                      link=LinkConfig(heartbeat_interval=0.2, heartbeat_timeout=1.5))
        """), tmp_path / "tiny.log")
    try:
        wait_for(lambda: metrics.value("feedline_broker_received_batches_total") >= 50, 20,
                 what="the 50 tiny batches")
        assert tiny.wait(20) == 0, (tmp_path / "tiny.log").read_text()
    finally:
        tiny.kill()
        tiny.wait(10)
    start_producer(daemons, endpoints.ingress, fake_yaml(
        tmp_path, "large", [[2048, 1024]], ["float32"], size=3, epochs=1), "large")
    wait_for(lambda: metrics.value("feedline_broker_peers", role="producer") >= 1, 20,
             what="the large producer's registration")
    time.sleep(1.0)  # shares are enforced on the broker's tick (0.2 s here): five of them
    consumer = CountingConsumer(endpoints.egress, 4, FAST)
    try:
        wait_for(lambda: consumer.counts.get("tiny", 0) >= 50
                 and consumer.counts.get("large", 0) >= 3, 30, what="every batch")
    finally:
        consumer.close()
    assert metrics.value("feedline_broker_evicted_batches_total") == 0
    assert consumer.counts == {"tiny": 50, "large": 3}


@pytest.mark.parametrize("shape, most", [
    ([1], DEPTH * 2),  # tiny batches: the window of 2 counts them by bytes
    ([9 * MiB], 2),  # batches over 8 MiB: 2, one by one
])
def test_a_consumer_that_stops_taking_holds_its_window_counted_by_bytes(
        broker_proc, daemons, tmp_path, endpoints, shape, most):
    """Via a broker, as in direct mode (test_direct_mode.py): a model that took one batch
    and stopped has at most its window of batches queued, counted by bytes: 256 tiny ones
    with a window of 2, 2 of 9 MiB. Before, the broker sent 2 tiny batches at a time and
    the credit round trip set their rate. Tiny batches come in bundles, and a broker splits
    one to fill a window only once an eighth of it is free (feedline.broker.parts): the
    consumer may hold less than its window by less than an eighth of it."""
    start_broker(broker_proc)
    cfg = tmp_path / "p.yaml"
    cfg.write_text(yaml.safe_dump({"source": {"fake": {
        "shapes": [shape], "dtypes": ["uint8"], "size": 1000, "random": False}}}))
    start_producer(daemons, endpoints.ingress, cfg, "p")
    registry = CollectorRegistry()
    with RemoteDataZMQ(endpoints.egress, timeout=30,
                       options=ConsumerOptions(window=2, link=FAST, registry=registry)) as src:
        samples = queue_when_settled(iter(src), registry)
    assert most - top_up(most) < max(samples) <= most, samples


def test_an_exact_streams_consumer_counts_its_window_in_batches(broker_proc, daemons,
                                                                 tmp_path, endpoints):
    """An exact stream's ranks split each epoch: a rank's window of 2 holds 2 of its batches
    of 2 KB, not 32 (a first rank would otherwise take a short epoch's 24 batches from the
    others: tests/exact/test_exact_resume.py). The window gauge says the same."""
    broker_proc("--state-dir", str(tmp_path / "state"))
    producer(daemons, pipeline(tmp_path, epochs=1), endpoints.ingress, "p")
    registry = CollectorRegistry()
    with RemoteDataZMQ(endpoints.egress, stream="val", timeout=30,
                       options=ConsumerOptions(window=2, link=FAST, registry=registry)) as src:
        samples = queue_when_settled(iter(src.epoch()), registry)
        window = registry.get_sample_value("feedline_consumer_window_batches")
    assert max(samples) == 2 and window == 2, (samples, window)

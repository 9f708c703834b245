"""A real Prometheus server scrapes a broker, two producers and a training process.

What Prometheus reports (rates, queue occupancy, totals) must agree with what the consumer
itself counted: that is what makes the dashboard and ``feedline top`` trustworthy.
"""

from __future__ import annotations

import time
from pathlib import Path

import yaml
from prometheus_client import CollectorRegistry

from feedline.commands import top
from feedline.consumer import ConsumerOptions, RemoteDataZMQ
from feedline.metrics import serve_metrics
from feedline.procs import free_port, wait_for
from feedline.serving.budget import DEPTH, depth, top_up
from tests.support.ops_support import Prometheus, needs_prometheus, scrape_config

TAKE = 150  # batches the test's training loop takes
STEP = 0.03  # its simulated model step: far slower than producers of small fake batches
WINDOW = 4

PIPELINE = {"source": {"fake": {"shapes": [[8, 16, 16, 3], [8]], "dtypes": ["uint8", "int32"],
                                "random": False, "size": 50}}}


def write_pipeline(tmp_path: Path) -> Path:
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(PIPELINE))
    return path


@needs_prometheus
def test_prometheus_rates_and_queue_agree_with_the_consumer(
    tmp_path: Path, endpoints, broker_proc, daemons
) -> None:
    broker_port, consumer_port = free_port(), free_port()
    producer_ports = [free_port(), free_port()]
    broker_proc("--metrics-port", str(broker_port), "--metrics-addr", "127.0.0.1")
    cfg = write_pipeline(tmp_path)
    for i, port in enumerate(producer_ports):
        daemons("feedline.producer", "--config", cfg, "--broker", endpoints.ingress, "--id",
                f"p{i}",
                "--metrics-port", port, "--metrics-addr", "127.0.0.1",
                "--heartbeat-interval", "0.2", "--heartbeat-timeout", "1.5", name=f"p{i}")
    registry = CollectorRegistry()
    server = serve_metrics(registry, consumer_port, "127.0.0.1")
    prom = Prometheus(scrape_config({
        "broker": [f"127.0.0.1:{broker_port}"],
        "producer": [f"127.0.0.1:{p}" for p in producer_ports],
        "trainer": [f"127.0.0.1:{consumer_port}"],
    }), tmp_path / "prometheus")
    try:
        with RemoteDataZMQ(endpoints.egress, timeout=30,
                           options=ConsumerOptions(window=WINDOW, registry=registry)) as source:
            prom.wait_all_up(4)
            it = iter(source)
            next(it)  # everything is connected and batches flow
            t0 = time.time()
            for _ in range(TAKE):
                next(it)
                time.sleep(STEP)  # the "model"
            t1 = time.time()

            def received() -> float:
                return registry.get_sample_value(
                    "feedline_consumer_received_batches_total") or 0.0

            # We take no more, so no credit returns: the broker fills our window and stops.
            # Batches of 6 KB count by their bytes: the window holds DEPTH x WINDOW of them;
            # they come in bundles, split to fill a window once an eighth of it is free
            # (feedline.broker.parts), so the window fills to within an eighth of it.
            filled = depth(WINDOW, 8 * 16 * 16 * 3 + 8 * 4)
            assert filled == DEPTH * WINDOW
            seen = [-1.0]

            def stopped() -> bool:
                seen.append(received())
                return seen[-1] == seen[-2] and seen[-1] > TAKE + 1 + filled - top_up(filled)

            wait_for(stopped, 20, interval=0.5, what="window filled")
            counted = received()
            assert counted <= TAKE + 1 + filled, counted

            # Totals, once Prometheus has scraped the final (frozen) values: exact agreement.
            def settled() -> bool:
                return (
                    prom.value("feedline_consumer_received_batches_total") == counted
                    and prom.value("feedline_broker_forwarded_batches_total") == counted
                    and prom.value("sum(feedline_producer_sent_batches_total)")
                    == prom.value("sum(feedline_broker_received_batches_total)")
                    # A scrape can land between a batch's count and its buffering (the
                    # client library reads the series one by one): the frozen state's own
                    # scrape must balance.
                    and prom.value(balance) == 0
                )
            balance = ("sum(feedline_broker_received_batches_total)"
                       " - sum(feedline_broker_forwarded_batches_total)"
                       " - sum(feedline_broker_buffer_batches)")
            wait_for(settled, 30, interval=0.2, what="Prometheus to scrape the final totals")
            assert prom.value("feedline_consumer_received_batches_total"
                              " - feedline_consumer_local_queue_batches") == TAKE + 1
            assert prom.value(balance) == 0
            per_producer = prom.query("feedline_broker_received_batches_total")
            assert {r["metric"]["producer"] for r in per_producer} == {"p0", "p1"}

            # Rates over the consuming phase, evaluated at its end, against our own count.
            span = max(2, int(t1 - t0))
            ours = TAKE / (t1 - t0)
            rates = {
                "consumer": prom.value(
                    f"rate(feedline_consumer_received_batches_total[{span}s])", at=t1),
                "broker": prom.value(
                    f"rate(feedline_broker_forwarded_batches_total[{span}s])", at=t1),
                "producers": prom.value(
                    f"sum(rate(feedline_producer_sent_batches_total[{span}s]))", at=t1),
                # The pipeline is its source (one datapoint is one batch): its stage rate.
                "pipeline stage": prom.value(
                    "sum(rate(feedline_producer_stage_datapoints_total"
                    f'{{stage="source:fake"}}[{span}s]))', at=t1),
            }
            for who, rate in rates.items():
                # Prometheus extrapolates to the window's edges: agreement within a third.
                assert rate is not None and rate > 0, (who, rate)
                assert 0.66 < rate / ours < 1.5, (who, rate, ours)
            bytes_rate = prom.value(
                f"rate(feedline_consumer_received_bytes_total[{span}s])", at=t1)
            per_batch = 8 * 16 * 16 * 3 + 8 * 4
            assert bytes_rate is not None
            assert abs(bytes_rate / rates["consumer"] - per_batch) < 1  # type: ignore[operator]

            # Queue occupancy over the phase: non-zero, within the window, and full enough
            # that the verdict is "model-bound" (the model step is ~100x a producer's batch).
            occupancy = prom.value(
                f"avg_over_time(feedline_consumer_local_queue_batches[{span}s])"
                " / feedline_consumer_window_batches", at=t1)
            assert occupancy is not None and 0 < occupancy <= 1
            wait_share = prom.value(
                f"rate(feedline_consumer_wait_seconds_sum[{span}s])", at=t1)
            assert wait_share is not None
            assert top.verdict(occupancy, wait_share).startswith("MODEL-BOUND"), (
                occupancy, wait_share)
            # The producers waited for credit: the same verdict seen from their side.
            credit_wait = prom.value(
                f"sum(rate(feedline_producer_credit_wait_seconds_sum[{span}s]))", at=t1)
            assert credit_wait is not None and credit_wait > 0
    finally:
        prom.stop()
        if server is not None:
            server.shutdown()
            server.server_close()

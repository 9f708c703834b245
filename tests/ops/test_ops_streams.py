"""Named streams where operators look: `feedline top`, the dashboard's per-stream panels in a
real Prometheus, and the consumer's stream label, on a live two-stream run.

One broker serves two streams: ``default`` (a plain producer, training delivery) and ``val``
(two producers of an exact-delivery pipeline that runs epochs forever). A training process per
stream (RemoteDataZMQ in a thread of this test, its metrics served on its own port) takes
batches at a model's pace until the test ends. A direct-mode trainer, which serves broker and
consumer metrics on one endpoint, is shown by `feedline top` under both.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry

from feedline.commands import top
from feedline.consumer import ConsumerOptions, RemoteDataZMQ
from feedline.metrics import serve_metrics
from feedline.procs import free_port, wait_for
from feedline.scrape import Scrape, scrape
from feedline.serving.budget import DEPTH
from feedline.transport.link import LinkConfig
from tests.support import ROOT
from tests.support.ops_support import Prometheus, needs_prometheus, scrape_config

DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "feedline.json"

FAST = LinkConfig(heartbeat_interval=0.2, heartbeat_timeout=1.5)
LIVENESS = ("--heartbeat-interval", "0.2", "--heartbeat-timeout", "1.5")
SIZE, UNIT = 64, 8  # the exact stream's dataset and unit: 8 units an epoch
PLAIN = {"source": {"fake": {"shapes": [[4, 8]], "dtypes": ["uint8"], "random": False,
                             "size": 50}}}
EXACT = {"stream": "val", "delivery": "exact", "exact": {"unit_size": UNIT}, "epochs": None,
         "source": {"fake": {"shapes": [[8]], "dtypes": ["uint8"], "size": SIZE}},
         "steps": [{"batch": {"batch_size": 4}}]}


@dataclass
class Trainer:
    """A RemoteDataZMQ on one stream, iterated by a thread at ``step`` seconds a batch, its
    metrics served on ``port``."""

    remote: RemoteDataZMQ
    port: int
    server: Any
    taken: int = 0
    stop: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/metrics"

    def start(self, step: float) -> Trainer:
        def run() -> None:
            for _ in self.remote:
                self.taken += 1
                if self.stop.wait(step):  # the "model"
                    return
        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        return self

    def close(self) -> None:
        self.stop.set()
        self.remote.close()
        if self.thread is not None:
            self.thread.join(10)
        self.server.shutdown()
        self.server.server_close()


def trainer(addr: str, stream: str = "default", **kw: Any) -> Trainer:
    registry, port = CollectorRegistry(), free_port()
    server = serve_metrics(registry, port, "127.0.0.1")
    options = ConsumerOptions(link=FAST, registry=registry)
    return Trainer(RemoteDataZMQ(addr, stream=stream, timeout=60, options=options, **kw), port,
                   server)


@dataclass
class TwoStreams:
    broker_metrics: int
    producer_metrics: int
    trainers: dict[str, Trainer]

    @property
    def broker_url(self) -> str:
        return f"http://127.0.0.1:{self.broker_metrics}/metrics"


@pytest.fixture
def two_streams(tmp_path: Path, endpoints, broker_proc, daemons) -> Iterator[TwoStreams]:
    broker_metrics, producer_metrics = free_port(), free_port()
    broker_proc("--metrics-port", str(broker_metrics), "--metrics-addr", "127.0.0.1",
                "--state-dir", str(tmp_path / "state"))
    plain, exact = tmp_path / "plain.yaml", tmp_path / "exact.yaml"
    plain.write_text(yaml.safe_dump(PLAIN))
    exact.write_text(yaml.safe_dump(EXACT))
    daemons("feedline.producer", "--config", plain, "--broker", endpoints.ingress, "--id", "plain",
            "--metrics-port", producer_metrics, "--metrics-addr", "127.0.0.1", *LIVENESS,
            name="plain")
    for i in range(2):
        daemons("feedline.producer", "--config", exact, "--broker", endpoints.ingress, "--id",
                f"val-{i}", *LIVENESS, name=f"val-{i}")
    trainers: dict[str, Trainer] = {}
    try:
        for stream in ("default", "val"):
            trainers[stream] = trainer(endpoints.egress, stream).start(step=0.01)
        # Both streams flow: each trainer has taken more than an exact epoch's batches.
        wait_for(lambda: all(t.taken > SIZE // 4 for t in trainers.values()), 60,
                 interval=0.1, what="batches of both streams")
        yield TwoStreams(broker_metrics, producer_metrics, trainers)
    finally:
        for t in trainers.values():
            t.close()


def stream_rows(screen: str) -> dict[str, list[str]]:
    """The STREAMS section's rows of a `feedline top` screen: stream -> its fields."""
    lines = screen.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("STREAMS"))
    rows: dict[str, list[str]] = {}
    for line in lines[start + 2:]:
        if not line.strip():
            break
        name, *fields = line.split()
        rows[name] = fields
    return rows


def test_top_shows_each_stream_and_each_consumers_stream(two_streams: TwoStreams,
                                                         tmp_path: Path) -> None:
    urls = [two_streams.broker_url, *(t.url for t in two_streams.trainers.values()),
            f"http://127.0.0.1:{two_streams.producer_metrics}/metrics"]
    first = top.snapshot(urls)
    assert all(s.error is None for s in first.values()), first
    second: dict[str, Scrape] = {}

    def forwarded(snap: dict[str, Scrape], stream: str) -> float:
        return snap[two_streams.broker_url].get(
            "feedline_broker_stream_forwarded_batches_total", stream=stream) or 0.0

    def registered(snap: dict[str, Scrape], stream: str) -> float:
        return snap[two_streams.broker_url].get(
            "feedline_broker_stream_peers", stream=stream, role="producer") or 0.0

    def moved_on() -> bool:  # and every producer registered (under load one may start late)
        second.update(top.snapshot(urls))
        return all(forwarded(second, s) >= forwarded(first, s) + 10 for s in ("default", "val")) \
            and (registered(second, "default"), registered(second, "val")) == (1, 2)
    wait_for(moved_on, 60, interval=0.2, what="10 more batches of each stream, its producers")
    screen = top.render(first, second)
    (tmp_path / "top-screen.txt").write_text(screen)

    rows = stream_rows(screen)
    assert set(rows) == {"default", "val"}, screen
    # The broker's batch limit in force: its 32, small batches counted by their bytes.
    cap = second[two_streams.broker_url].get("feedline_broker_buffer_capacity_batches")
    assert cap is not None and 32 <= cap <= DEPTH * 32, cap
    # batches/s, buffered, producers, consumers, exact epoch, units done, duplicates
    for name, producers in (("default", 1), ("val", 2)):
        rate, buffered, prods, cons, *_ = rows[name]
        assert float(rate) > 0 and 0 <= int(buffered) <= cap, screen
        assert (int(prods), int(cons)) == (producers, 1), screen
    assert rows["default"][4:] == ["-", "-", "-"], screen  # not an exact stream
    epoch, units, dups = rows["val"][4:]
    done, total = units.split("/")
    assert int(epoch) >= 1 and int(total) == SIZE // UNIT and 0 <= int(done) <= int(total)
    assert dups in ("-", "0"), screen  # no producer was lost: nothing produced twice
    # Each training process's row names its stream.
    for stream, t in two_streams.trainers.items():
        (row,) = [line for line in screen.splitlines()
                  if line.strip().startswith(f"127.0.0.1:{t.port}")]
        assert row.split()[-1] == stream, screen
    assert "unknown" not in screen


def test_top_lists_a_direct_mode_trainer_as_broker_and_consumer(tmp_path: Path,
                                                                daemons) -> None:
    """A trainer that serves its producers (bind=True) is both; `feedline top` shows its
    producers, its buffer and its queue, and judges the bottleneck from it."""
    port = free_port()
    direct = trainer(f"tcp://127.0.0.1:{port}", bind=True).start(step=0.02)
    try:
        cfg = tmp_path / "plain.yaml"
        cfg.write_text(yaml.safe_dump(PLAIN))
        daemons("feedline.producer", "--config", cfg, "--broker", f"tcp://127.0.0.1:{port}", "--id",
                "to-direct", *LIVENESS, name="to-direct")
        wait_for(lambda: direct.taken > 10, 60, interval=0.1, what="batches, direct")
        out = subprocess.run(
            [sys.executable, "-m", "feedline.commands", "top", "--once", "--interval", "0.5",
             f"127.0.0.1:{direct.port}"],
            capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert out.returncode == 0, out.stderr
        screen = out.stdout
        assert f"PRODUCERS (as direct-mode trainer {direct.url}" in screen, screen
        assert re.search(r"^\s+to-direct\s+[\d.]+", screen, re.M), screen
        assert re.search(r"BROKER \(direct mode\)  buffer \d+ batches", screen), screen
        assert re.search(rf"held \d+ batches of {DEPTH * 4} \(\d+%; window for the largest",
                         screen), screen
        assert "CONSUMERS" in screen, screen
        (row,) = [line for line in screen.splitlines()
                  if line.strip().startswith(f"127.0.0.1:{direct.port}")]
        # Its queue over the window in force: the default 4, its small batches counted by
        # their bytes (64; before, the queue read "64.0/4").
        assert re.search(rf"\d\.\d/{DEPTH * 4} ", row) and row.split()[-1] == "default", screen
        verdict = next(line for line in screen.splitlines() if line.startswith("VERDICT"))
        assert "unknown" not in verdict, screen
    finally:
        direct.close()


def live(expr: str, stream: str = ".*") -> str:
    """A panel's query as Grafana sends it: $__rate_interval is >= 4 scrapes (2 s at 500 ms),
    $stream the selected streams' regex (All: .*)."""
    return expr.replace("$__rate_interval", "2s").replace("$stream", stream)


@needs_prometheus
def test_per_stream_panels_return_each_stream_from_prometheus(two_streams: TwoStreams,
                                                              tmp_path: Path) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    (variable,) = dashboard["templating"]["list"]
    per_stream = [(p["title"], t["expr"]) for p in dashboard["panels"] for t in p["targets"]
                  if "$stream" in t["expr"]]
    assert len(per_stream) >= 6, per_stream
    prom = Prometheus(scrape_config({
        "broker": [f"127.0.0.1:{two_streams.broker_metrics}"],
        "trainer": [f"127.0.0.1:{t.port}" for t in two_streams.trainers.values()],
    }), tmp_path / "prometheus")
    try:
        prom.wait_all_up(3)

        def streams(expr: str, stream: str = ".*") -> set[str]:
            return {r["metric"].get("stream", "?") for r in prom.query(live(expr, stream))}

        # Every rate window holds samples of both streams, an exact epoch went by, and the
        # broker has given both streams a sizing verdict (it settles for twice its heartbeat
        # timeout after it starts, then needs half a sizing window of samples).
        wait_for(lambda: streams(per_stream[0][1]) == {"default", "val"}
                 and (prom.value('feedline_broker_exact_epoch{stream="val"}') or 0) >= 1
                 and streams("feedline_broker_stream_bottleneck == 1") == {"default", "val"},
                 60, interval=0.2, what="both streams and their verdicts in Prometheus")
        # The variable's values (Grafana's label_values(METRIC, stream)).
        metric = re.fullmatch(r"label_values\((\w+), stream\)", variable["definition"])
        assert metric, variable
        values = prom.api("label/stream/values", **{"match[]": metric.group(1)})
        assert set(values) == {"default", "val"}
        for title, expr in per_stream:
            if "feedline_broker_fleet_" in expr:
                # Supervisors' panels: no `feedline fleet` runs here, so no series at all
                # (tests/commands/test_fleet.py has fleets).
                assert streams(expr) == set(), (title, live(expr))
                continue
            want = {"val"} if "feedline_broker_exact_" in expr else {"default", "val"}
            assert streams(expr) == want, (title, live(expr))
            assert streams(expr, "val") == {"val"}, (title, live(expr, "val"))
        # The figures agree with the broker's own: the exact stream's units in all.
        total = prom.value('sum(feedline_broker_exact_units{stream="val",state="total"})')
        assert total == SIZE // UNIT
        peers = {(r["metric"]["stream"], r["metric"]["role"]): float(r["value"][1])
                 for r in prom.query(live("sum by (stream, role) "
                                          "(feedline_broker_stream_peers{stream=~\"$stream\"})"))}
        assert peers == {("default", "producer"): 1, ("default", "consumer"): 1,
                         ("val", "producer"): 2, ("val", "consumer"): 1}
    finally:
        prom.stop()


def test_consumer_exports_its_stream() -> None:
    """feedline_consumer_stream_info{stream} 1: the label dashboards join on (set when the
    RemoteDataZMQ is made, before it connects anywhere)."""
    registry = CollectorRegistry()
    remote = RemoteDataZMQ(f"tcp://127.0.0.1:{free_port()}", stream="val",
                           options=ConsumerOptions(registry=registry))
    try:
        assert registry.get_sample_value("feedline_consumer_stream_info",
                                         {"stream": "val"}) == 1
        assert registry.get_sample_value("feedline_consumer_stream_info",
                                         {"stream": "default"}) is None
    finally:
        remote.close()


def test_a_stream_without_consumers_does_not_starve_another(tmp_path: Path, endpoints,
                                                            broker_proc, daemons) -> None:
    """A producer of stream `default` whose training process has not started yet (or has
    died) must not stop stream `val` from flowing."""
    metrics = free_port()
    broker_proc("--metrics-port", str(metrics), "--metrics-addr", "127.0.0.1")
    plain = tmp_path / "plain.yaml"
    plain.write_text(yaml.safe_dump(PLAIN))
    daemons("feedline.producer", "--config", plain, "--broker", endpoints.ingress, "--id",
            "nobody-reads",
            *LIVENESS, name="default")

    def buffered() -> float:
        return scrape(metrics).get("feedline_broker_stream_buffer_batches", stream="default") or 0.0
    wait_for(lambda: buffered() >= 16, 30, interval=0.1, what="default's batches buffered")
    daemons("feedline.producer", "--config", plain, "--broker", endpoints.ingress, "--stream",
            "val",
            "--id", "val", *LIVENESS, name="val")
    with RemoteDataZMQ(endpoints.egress, stream="val", timeout=20,
                       options=ConsumerOptions(link=FAST)) as src:
        got = [b for _, b in zip(range(10), src, strict=False)]
    assert len(got) == 10

"""What a stream's consumers get of a pipeline whose producers left (issue 53, finding 2).

A broker keeps what a departed producer sent on a stream; which pipeline made it is its
producer's HELLO fingerprint (`feedline producer` declares the pipeline file's). Real
processes: a broker and ``feedline producer`` daemons on 127.0.0.1, a ``RemoteDataZMQ`` on
its egress.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
import yaml

from feedline.consumer import ConsumerOptions, RemoteDataZMQ
from feedline.errors import ConfigError
from feedline.procs import wait_for
from feedline.producer import Sender
from feedline.producer.pipeline import training_fingerprint
from tests.support.flow_support import (
    FAST,
    Metrics,
    fake_yaml,
    log_lines,
    start_broker,
    start_producer,
)

TAKE = 10


def _buffered(metrics: Metrics, stream: str = "default") -> float:
    return metrics.value("feedline_broker_stream_buffer_batches", stream=stream)


def test_a_departed_pipelines_leftovers_are_dropped_once_another_produces(
        tmp_path: Path, broker_proc, daemons, endpoints) -> None:
    """A pipeline of [4, 8] uint8 batches serves the default stream, which nobody reads, and
    its producer leaves; a pipeline of [16] float32 batches then produces it and a trainer
    reads it: every batch it gets is the new pipeline's; the old one's are dropped, counted,
    and one WARNING names both pipelines (before: its first batches were the old
    pipeline's, of another shape: what crashed a Keras ``fit``)."""
    broker, metrics = start_broker(broker_proc)
    old = start_producer(daemons, endpoints.ingress, fake_yaml(
        tmp_path, "old", [[4, 8]], ["uint8"]), "old")
    wait_for(lambda: _buffered(metrics) >= 20, 30, what="the old pipeline's batches")
    old.stop()
    left = _buffered(metrics)
    start_producer(daemons, endpoints.ingress, fake_yaml(
        tmp_path, "new", [[16]], ["float32"]), "new")
    wait_for(lambda: metrics.value("feedline_broker_peers", role="producer") == 1, 20,
             what="the new pipeline's producer")
    with RemoteDataZMQ(endpoints.egress, timeout=20, return_meta=True,
                       options=ConsumerOptions(link=FAST)) as src:
        got = list(itertools.islice(src, TAKE))
    shapes = {(b.producer, b.datapoint[0].shape, str(b.datapoint[0].dtype)) for b in got}
    assert shapes == {("new", (16,), "float32")}, shapes
    replaced = metrics.value("feedline_broker_replaced_batches_total", stream="default")
    assert replaced >= left >= 20, (replaced, left)
    lines = log_lines(broker.log_text(), "WARNING", "stream default: dropped", "producer old",
                      "producer new")
    assert len(lines) == 1 and lines[0].count("pipeline ") == 2, lines


def test_a_replaced_runs_error_does_not_reach_a_trainer_started_after(
        tmp_path: Path, broker_proc, daemons, endpoints) -> None:
    """A run fails (its pipeline raises after 3 batches) while nobody reads its stream, and
    its producer exits; a new run of another pipeline produces the stream and a trainer
    starts: it gets the new run's batches, not the old run's ``ProducerError`` (before: the
    old run's 3 batches, then its ProducerError)."""
    broker, metrics = start_broker(broker_proc)
    cfg = tmp_path / "failing.yaml"
    cfg.write_text(yaml.safe_dump({"factory": "tests.support.stream_data:failing",
                                   "args": {"after": 3}, "epochs": 1}))
    old = start_producer(daemons, endpoints.ingress, cfg, "old")
    wait_for(lambda: not old.alive(), 30, what="the failing run's exit")
    assert _buffered(metrics) == 3, broker.log_text()
    start_producer(daemons, endpoints.ingress, fake_yaml(
        tmp_path, "new", [[16]], ["float32"]), "new")
    wait_for(lambda: metrics.value("feedline_broker_peers", role="producer") == 1, 20,
             what="the new pipeline's producer")
    with RemoteDataZMQ(endpoints.egress, timeout=20, return_meta=True,
                       options=ConsumerOptions(link=FAST)) as src:
        got = [b.producer for b in itertools.islice(src, TAKE)]
    assert got == ["new"] * TAKE, got
    assert metrics.value("feedline_broker_replaced_batches_total", stream="default") == 3


def test_a_crashed_runs_error_does_not_reach_a_trainer_started_after_its_restart(
        tmp_path: Path, broker_proc, daemons, endpoints) -> None:
    """The new-user review: a producer crashed (its pipeline raised) while no trainer read,
    the user mended the data and started the same pipeline again, then the trainer: it died
    of the old crash's ``ProducerError``. The error nobody took is dropped once a producer
    serves the stream again (said at INFO); the old run's batches, of the same pipeline,
    are served."""
    broker, metrics = start_broker(broker_proc)
    cfg = tmp_path / "failing.yaml"
    mended = tmp_path / "mended"
    cfg.write_text(yaml.safe_dump({"factory": "tests.support.stream_data:failing",
                                   "args": {"after": 3, "fixed": str(mended)}, "epochs": 1}))
    old = start_producer(daemons, endpoints.ingress, cfg, "first")
    wait_for(lambda: not old.alive(), 30, what="the failing run's exit")
    mended.touch()
    start_producer(daemons, endpoints.ingress, cfg, "again")
    wait_for(lambda: "which no consumer took, is dropped" in broker.log_text(), 20,
             what="the broker dropping the stale error")
    with RemoteDataZMQ(endpoints.egress, timeout=20, return_meta=True,
                       options=ConsumerOptions(link=FAST)) as src:
        got = [b.producer for b in itertools.islice(src, TAKE)]
    assert got[:3] == ["first"] * 3 and set(got[3:]) == {"again"}, got


def test_leftovers_served_when_nothing_else_produces_are_named(
        tmp_path: Path, broker_proc, daemons, endpoints) -> None:
    """A run of 5 batches ends before its trainer starts, and nothing else produces the
    stream: the trainer gets all 5 (they are the only data there is), and the broker warns
    once that it serves a departed producer's batches, naming it and its pipeline (before:
    nothing said where they came from)."""
    broker, metrics = start_broker(broker_proc)
    old = start_producer(daemons, endpoints.ingress, fake_yaml(
        tmp_path, "old", [[4, 8]], ["uint8"], size=5, epochs=1), "old")
    wait_for(lambda: not old.alive(), 30, what="the run's exit")
    with RemoteDataZMQ(endpoints.egress, timeout=20, return_meta=True,
                       options=ConsumerOptions(link=FAST)) as src:
        got = [b.producer for b in itertools.islice(src, 5)]
    assert got == ["old"] * 5
    lines = wait_for(lambda: log_lines(broker.log_text(), "WARNING", "stream default: serving "
                                       "batches left by producer old (pipeline "), 10,
                     what="the broker's warning")
    assert len(lines) == 1 and "no producer of the stream is registered now" in lines[0], lines
    assert metrics.value("feedline_broker_replaced_batches_total") == 0


def test_a_pipeline_files_fingerprint_is_what_makes_its_batches() -> None:
    """Producers of one file (any stream, any epochs) declare the same fingerprint; another
    source, another; a Sender refuses one that is not a fingerprint, in one line."""
    cfg = {"source": {"fake": {"shapes": [[4, 8]], "dtypes": ["uint8"]}}, "stream": "a",
           "epochs": 1}
    same = training_fingerprint(cfg)
    assert 0 < same < 1 << 63
    assert training_fingerprint({**cfg, "stream": "b", "epochs": None}) == same
    other = {**cfg, "source": {"fake": {"shapes": [[16]], "dtypes": ["float32"]}}}
    assert training_fingerprint(other) != same
    with pytest.raises(ConfigError, match="pipeline must be a fingerprint"):
        Sender("tcp://127.0.0.1:1", pipeline=-1)


def test_two_pipelines_feeding_one_stream_lose_nothing_when_one_ends(
        tmp_path: Path, broker_proc, daemons, endpoints) -> None:
    """Two pipelines feed the default stream on purpose; one ends (5 batches) while nobody
    reads, the other goes on: a trainer that starts then gets the ended one's 5 batches too
    (the other did not replace it: it produced beside it), and the broker's line says so
    (before: "it says no fingerprint to compare", of a producer that said one)."""
    broker, metrics = start_broker(broker_proc)
    paced = tmp_path / "b.yaml"  # 20 batches a second: room for a's beside them
    paced.write_text(yaml.safe_dump({"factory": "tests.support.ledger_data:make",
                                     "args": {"nbytes": 64, "rate": 20}}))
    start_producer(daemons, endpoints.ingress, paced, "b")
    wait_for(lambda: _buffered(metrics) >= 1, 30, what="b's batches")
    a = start_producer(daemons, endpoints.ingress, fake_yaml(
        tmp_path, "a", [[4, 8]], ["uint8"], size=5, epochs=1), "a")
    wait_for(lambda: not a.alive(), 30, what="a's exit")
    assert metrics.value("feedline_broker_received_batches_total", producer="a") == 5
    counts: dict[str, int] = {}
    with RemoteDataZMQ(endpoints.egress, timeout=20, return_meta=True,
                       options=ConsumerOptions(link=FAST)) as src:
        for b in itertools.islice(src, 2000):
            counts[b.producer] = counts.get(b.producer, 0) + 1
            if counts.get("a") == 5:
                break
    assert counts.get("a") == 5, counts
    assert metrics.value("feedline_broker_replaced_batches_total") == 0
    said = log_lines(broker.log_text(), "WARNING", "serving batches left by producer a ")
    assert len(said) == 1 and "produced the stream beside it" in said[0] \
        and "no pipeline fingerprint" not in said[0], said


def test_a_killed_pipelines_leftovers_do_not_reach_the_next_pipelines_trainer(
        tmp_path: Path, broker_proc, daemons, endpoints) -> None:
    """A producer of one pipeline is killed (``kill -9``) while nobody reads its stream; within
    the broker's heartbeat timeout (6 s here), so that the broker still counts it registered,
    a producer of another pipeline registers and its trainer starts: every batch the trainer
    gets is the new pipeline's, and at the timeout the killed one's are dropped and counted
    (before: its leftovers were served first, as it had not left yet)."""
    broker, metrics = start_broker(broker_proc, "--heartbeat-timeout", "6")
    paced = tmp_path / "old.yaml"  # 100 batches a second: a few hundred buffered
    paced.write_text(yaml.safe_dump({"factory": "tests.support.ledger_data:make",
                                     "args": {"nbytes": 64, "rate": 100}}))
    old = start_producer(daemons, endpoints.ingress, paced, "old")
    wait_for(lambda: _buffered(metrics) >= 20, 30, what="the old pipeline's batches")
    old.kill9()
    left = _buffered(metrics)
    start_producer(daemons, endpoints.ingress, fake_yaml(
        tmp_path, "new", [[16]], ["float32"]), "new")
    wait_for(lambda: metrics.value("feedline_broker_peers", role="producer") == 2, 20,
             what="the new pipeline's producer, beside the killed one not yet dropped")
    with RemoteDataZMQ(endpoints.egress, timeout=20, return_meta=True,
                       options=ConsumerOptions(link=FAST)) as src:
        got = list(itertools.islice(src, TAKE))
    shapes = {(b.producer, b.datapoint[0].shape, str(b.datapoint[0].dtype)) for b in got}
    assert shapes == {("new", (16,), "float32")}, shapes
    replaced = wait_for(lambda: metrics.value("feedline_broker_replaced_batches_total",
                                              stream="default"), 20,
                        what="the killed producer's batches dropped at its timeout")
    assert replaced >= left >= 20, (replaced, left)
    lines = log_lines(broker.log_text(), "WARNING", "stream default: dropped", "producer old",
                      "producer new")
    assert len(lines) == 1 and lines[0].count("pipeline ") == 2, lines


def test_a_quiet_live_producers_batches_are_served_beside_another_pipeline(
        tmp_path: Path, broker_proc, daemons, endpoints) -> None:
    """A producer of one pipeline sends 5 batches while nobody reads and stays connected,
    sending nothing more (its link still heartbeats); a producer of another pipeline
    registers: the quiet one's batches may be held back until it is next heard from, never
    dropped: a trainer gets all 5 (two pipelines feeding one stream together)."""
    broker, metrics = start_broker(broker_proc)
    with Sender(endpoints.ingress, producer_id="quiet", link=FAST, pipeline=7) as quiet:
        for i in range(5):
            quiet.send([np.full(4, i, np.int32)])
        wait_for(lambda: _buffered(metrics) == 5, 20, what="the quiet producer's batches")
        start_producer(daemons, endpoints.ingress, fake_yaml(
            tmp_path, "new", [[16]], ["float32"]), "new")
        wait_for(lambda: metrics.value("feedline_broker_peers", role="producer") == 2, 20,
                 what="the other pipeline's producer")
        counts: dict[str, int] = {}
        with RemoteDataZMQ(endpoints.egress, timeout=20, return_meta=True,
                           options=ConsumerOptions(link=FAST)) as src:
            for b in itertools.islice(src, 5000):
                counts[b.producer] = counts.get(b.producer, 0) + 1
                if counts.get("quiet") == 5:
                    break
    assert counts.get("quiet") == 5, counts
    assert metrics.value("feedline_broker_replaced_batches_total") == 0, broker.log_text()

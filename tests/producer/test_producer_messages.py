"""What a producer (and a broker) says when a user's run goes wrong in the first hour: the
cause named in one line, with what to do."""

from __future__ import annotations

import re
from pathlib import Path

from feedline.consumer import ConsumerOptions, RemoteDataZMQ
from tests.support.jpeg_data import make_folder
from tests.support.operator_support import ROOT, feedline


def test_an_epoch_without_a_batch_names_the_batch_that_dropped_its_remainder(tmp_path: Path):
    """The docs' ImageNet config (batch_size 64, remainder: false) on a 48-image folder: the
    whole epoch is the dropped remainder, and the error says so rather than "nothing"."""
    make_folder(tmp_path / "data", classes=2, per_class=24, sizes=(40, 60))
    r = feedline("producer", "--config", str(ROOT / "examples/imagenet_train.yaml"),
                 "--data", str(tmp_path / "data"), "--broker", "tcp://127.0.0.1:9",
                 "--metrics-port", "0", timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    line = r.stderr.strip().splitlines()[-1]
    assert "the dataflow yielded nothing in a whole epoch" in line, line
    assert line.endswith("the source gave 48 samples and batch (batch_size 64, remainder: "
                         "false) dropped them: lower batch_size or set remainder: true"), line


def test_a_producer_at_a_brokers_egress_ends_at_once_saying_why_once(broker_proc, endpoints,
                                                                     tmp_path: Path):
    """``--broker`` given a broker's egress: the wrong_port refusal ends the producer with
    the reason once at WARNING (the link's) and once in its last line; nothing about telling
    a broker of the failure or of never registering (it was refused, and said so)."""
    broker_proc()
    cfg = tmp_path / "fake.yaml"
    cfg.write_text("source: {fake: {shapes: [[4]], size: 100}}\n"
                   "steps: [{batch: {batch_size: 10}}]\n")
    r = feedline("producer", "--config", str(cfg), "--broker", endpoints.egress,
                 "--metrics-port", "0", timeout=60)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    said = [line for line in lines if "wrong_port" in line]
    assert len(said) == 2, r.stderr
    assert "WARNING feedline.transport.link" in said[0] and said[1] == lines[-1], r.stderr
    assert lines[-1].endswith("refused this producer (wrong_port): this is a broker's "
                              "egress: producers connect to its --ingress address"), lines[-1]
    for noise in ("could not tell", "never registered", "never connected", "not connected"):
        assert noise not in r.stderr, r.stderr


def test_an_exact_producer_stopped_counts_the_batches_a_broker_took(broker_proc, daemons,
                                                                    endpoints, tmp_path):
    """An exact producer serving epochs until stopped (``epochs: null``), one trainer reading
    an epoch of it, then SIGTERM: its last line counts the batches it sent under the
    broker's credit (at least the epoch the trainer got), not "sent 0 batches"."""
    from tests.support.exact_run import FAST, pipeline, producer

    broker_proc("--state-dir", str(tmp_path / "state"))
    cfg = pipeline(tmp_path, epochs=None)
    p = producer(daemons, cfg, endpoints.ingress, "p0")
    with RemoteDataZMQ(endpoints.egress, stream="val", timeout=30,
                       options=ConsumerOptions(link=FAST)) as src:
        got = len(list(src.epoch()))
    assert got == 96 // 4
    assert p.stop() == 0, p.log_text()[-2000:]
    sent = re.findall(r"INFO feedline.producer.cli: sent (\d+) batches \([\d.]+ MB\) in ",
                      p.log_text())
    assert len(sent) == 1 and int(sent[0]) >= got, p.log_text()[-2000:]

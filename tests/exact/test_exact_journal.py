"""An exact stream's journal against what happens to files (issue 22, findings 10-13): a
broker restarted at the start of an epoch, a disk that fills up (a real, small tmpfs), one
corrupt byte, a last record cut short. Real broker and producer processes; the journals of
findings 10, 12 and 13 are written here as the broker writes them (records without checksums,
as every broker before this one wrote them, which it still reads), so that the same test runs
against any version."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
import zmq

from feedline.exact.cursor import Cursor
from feedline.procs import free_port, wait_for
from feedline.producer.exact import build_exact
from feedline.protocol import messages as m
from tests.support.exact_run import (
    BATCH,
    UNIT,
    N,
    assert_exactly_once,
    pipeline,
    producer,
    remote,
    rest,
    samples,
)
from tests.support.flow_support import Metrics

UNITS = N // UNIT
PER_UNIT = UNIT // BATCH


def journal(state: Path, *records: dict, torn: str = "") -> Path:
    state.mkdir(parents=True, exist_ok=True)
    path = state / "val.exact.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + torn)
    return path


def start(broker_proc, daemons, endpoints, tmp_path: Path, epochs: int = 2) -> Path:
    broker_proc("--state-dir", str(tmp_path / "state"))
    cfg = pipeline(tmp_path, epochs=epochs)
    for i in range(2):
        producer(daemons, cfg, endpoints.ingress, f"p{i}")
    return cfg


def report_again(egress: str, cursor: Cursor) -> None:
    """A consumer that took ``cursor`` before the broker restarted registers again (its HELLO
    reports it), then leaves."""
    with zmq.Context() as ctx, ctx.socket(zmq.DEALER) as s:
        s.linger = 0
        s.connect(egress)
        s.send(m.encode(m.ConsumerHello(consumer="back", session=7, window=1, max_bytes=1 << 30,
                                        stream="val", registration=1,
                                        cursor=cursor.encode())))
        assert s.poll(10_000), "no answer to the HELLO"
        assert isinstance(m.decode(s.recv()), m.Welcome)
        s.send(m.encode(m.Bye()))


def test_a_broker_restarted_at_the_start_of_an_epoch_waits_for_the_reports(
        broker_proc, daemons, endpoints, tmp_path):
    """Finding 10: the broker died just after epoch 0 ended: its journal holds the plan and
    ``epoch 1``, two records; a consumer had taken unit 0's first four batches of epoch 1 and
    reports them when it registers again, a second after the producers. Before: a journal of
    two records skipped the wait for the consumers' reports, those batches were served again
    (16 samples twice)."""
    journal(tmp_path / "state", {"plan": [N, UNIT, 2]}, {"epoch": 1})
    cfg = start(broker_proc, daemons, endpoints, tmp_path)
    pipe = build_exact(yaml.safe_load(cfg.read_text()))
    took = Cursor.from_dict({"stream": "val", "epoch": 1, "taken": {"0": [0, 1, 2, 3]}})
    before = [(int(b[1][k][0]), b[0][k].tobytes()) for j, b in pipe.batches(1, 0) if j < 4
              for k in range(len(b[1]))]
    late = threading.Timer(1.0, report_again, (endpoints.egress, took))
    late.start()
    with remote(endpoints.egress) as src:
        after = rest(src)
    late.join()
    assert_exactly_once(before + after, cfg, 1)


def test_one_corrupt_byte_is_one_line_naming_the_journal(broker_proc, daemons, endpoints,
                                                         tmp_path):
    """Finding 12: one byte of a journal's middle record is not UTF-8. Before: every HELLO
    raised UnicodeDecodeError, 0 batches, nothing named the journal. Now the producer is
    refused with one line that names the file and what to do, and exits."""
    path = journal(tmp_path / "state", {"plan": [N, UNIT, 2]}, {"epoch": 0},
                   {"total": [0, PER_UNIT]}, {"settled": [0, [0, 1]]})
    data = bytearray(path.read_bytes())
    data[data.index(b'"total"') + 2] = 0xFF
    path.write_bytes(bytes(data))
    broker = broker_proc("--state-dir", str(tmp_path / "state"))
    p = producer(daemons, pipeline(tmp_path, epochs=2), endpoints.ingress, "p0")
    wait_for(lambda: not p.alive(), 30, what="the producer to give up")
    last = p.log_text().strip().splitlines()[-1]
    assert str(path) in last and "corrupt" in last and "delete" in last, last
    assert "UnicodeDecodeError" not in broker.log_text() and broker.alive()


def test_a_last_done_record_cut_short_still_ends_the_epoch(broker_proc, daemons, endpoints,
                                                           tmp_path):
    """Finding 13: the broker died while writing the record that marks the last unit of
    epoch 0 done; every batch of that unit is settled in the journal. Before: that unit was
    never marked done, the epoch never ended (and epoch 1 never came). Now the torn record is
    left out with a warning, the unit is done by its settled batches, and a job gets epoch 1
    whole."""
    records = [{"plan": [N, UNIT, 2]}, {"epoch": 0}]
    records += [{"done": [u, PER_UNIT]} for u in range(UNITS - 1)]
    records += [{"total": [UNITS - 1, PER_UNIT]},
                {"settled": [UNITS - 1, list(range(PER_UNIT))]}]
    journal(tmp_path / "state", *records, torn='{"done": [5, ')
    cfg = start(broker_proc, daemons, endpoints, tmp_path)
    with remote(endpoints.egress) as src:
        batches = list(src.epoch())
    assert {b.epoch for b in batches} == {1}
    assert_exactly_once([s for b in batches for s in samples(b)], cfg, 1)


# -- finding 11: a full disk, for real ------------------------------------------------------

@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs mounted for this test (root only)."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("needs root to mount a tmpfs")
    mnt = tmp_path / "disk"
    mnt.mkdir()
    got = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)],
                         capture_output=True, text=True)
    if got.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {got.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def fill(disk: Path) -> None:
    """Fill ``disk`` to the last byte."""
    try:
        with open(disk / "filler", "wb") as f:
            while True:
                f.write(b"\0" * 4096)
                f.flush()
    except OSError:
        pass  # full


def test_a_full_disk_from_the_start_keeps_serving_and_says_so(broker_proc, daemons, endpoints,
                                                              small_disk, tmp_path):
    """Finding 11, full from the start: the state directory is on a full disk. Before: the
    broker stayed up and served nothing; the producer said the broker was "silent". Now it
    serves the stream (without durability), says why in one line naming the state directory,
    and its metric says the stream's progress is not durable."""
    state = small_disk / "state"
    state.mkdir()
    fill(small_disk)
    port = free_port()
    broker = broker_proc("--state-dir", str(state), "--metrics-port", str(port))
    cfg = pipeline(tmp_path, epochs=1)
    p = producer(daemons, cfg, endpoints.ingress, "p0")
    with remote(endpoints.egress) as src:
        seen = rest(src)
        wait_for(lambda: Metrics(port).by_label("feedline_broker_exact_durable", "stream")
                 == {"val": 0}, 10, what="the metric saying the stream is not durable")
    assert_exactly_once(seen, cfg, 0)
    lines = [ln for ln in broker.log_text().splitlines() if "ERROR" in ln]
    assert lines and str(state) in lines[0] and "No space left" in lines[0], lines
    assert "silent" not in p.log_text()


def test_a_disk_that_fills_mid_epoch_keeps_serving_and_recovers(broker_proc, daemons,
                                                               endpoints, small_disk, tmp_path):
    """Finding 11, mid-epoch: the disk fills while the epoch runs, and is freed later. Before:
    the broker died in its loop (55-74 of 128 batches never delivered). Now every batch is
    delivered once, the broker says so in one line, and writes the journal whole again once
    there is room."""
    state = small_disk / "state"
    broker = broker_proc("--state-dir", str(state))
    cfg = pipeline(tmp_path, epochs=1, delay=0.002, n=960)
    for i in range(2):
        producer(daemons, cfg, endpoints.ingress, f"p{i}")
    seen: list = []
    with remote(endpoints.egress) as src:
        for n, b in enumerate(src.epoch()):
            seen += samples(b)
            if n == 10:
                fill(small_disk)
    assert_exactly_once(seen, cfg, 0)
    text = broker.log_text()
    assert "No space left" in text and str(state) in text, text[-3000:]
    (small_disk / "filler").unlink()
    wait_for(lambda: (state / "val.exact.jsonl").exists()
             and not (state / "val.exact.jsonl.stale").exists(), 15,
             what="the journal written whole again")
    assert broker.alive()

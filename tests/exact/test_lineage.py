"""Lineage, replay and diff with real broker and producer processes (issue 56): ledger lines
replayed offline give byte for byte the batches the consumer received, for the checksummed
test pipeline and for the ImageNet train preset over JPEG shards served over HTTP; a pipeline
file changed by one number is named by ``feedline diff``; a run interrupted and resumed from
its checkpoint and the same run uninterrupted have ledgers ``feedline diff`` calls identical.

FEEDLINE_LINEAGE_LINES=N (20 by default) sizes the two replay runs to give at least N ledger
lines and replays N of them: the issue's figure is N=200 (about 2 minutes on 2 cores).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from feedline.commands.replay import components, load, regenerate
from feedline.consumer import ConsumerOptions, RemoteDataZMQ
from feedline.errors import DataError, FeedlineError
from feedline.exact import Ledger, diff, ledger_line, read_ledger
from feedline.version import code_version
from tests.support import ROOT
from tests.support.exact_run import FAST, LIVENESS, pipeline
from tests.support.jpeg_data import make_folder
from tests.support.shard_server import file_server

LINES = int(os.environ.get("FEEDLINE_LINEAGE_LINES", "20"))  # ledger lines replayed per run


def producer(daemons, cfg: Path, broker: str, name: str, stream: str):
    return daemons("feedline.producer", "--config", cfg, "--broker", broker, "--id", name,
                   "--stream", stream, *LIVENESS, name=name)


def consume(addr: str, stream: str, ledger: Path, epochs: int, **kw: Any) -> list[Any]:
    """Every batch of ``epochs`` epochs, as received (datapoints), in the ledger's order."""
    got = []
    with RemoteDataZMQ(addr, stream=stream, timeout=60, return_meta=True,
                       options=ConsumerOptions(link=FAST, ledger=ledger), **kw) as src:
        for _ in range(epochs):
            for b in src.epoch():
                got.append(b.datapoint)
                lin = src.lineage
                assert lin is not None and (lin.epoch, lin.unit, lin.index) == b.key
    return got


def feedline(*args: Any) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "feedline.commands", *map(str, args)],
                          capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def assert_replayed(cfg: Path, ledger: Path, got: list[Any], lines: int = LINES) -> None:
    """``lines`` random ledger lines made again offline equal what the consumer received,
    component by component: dtype, shape and bytes."""
    pipe = load(str(cfg))
    entries = list(read_ledger(ledger))
    assert len(entries) == len(got) >= lines
    for n, lin in random.Random(5).sample(entries, min(lines, len(entries))):
        assert (lin.pipeline, lin.pipeline_file, lin.code) == \
            (pipe.fingerprint, pipe.file_fingerprint, code_version())
        again = dict(components(regenerate(pipe, lin.epoch, lin.unit, lin.index)))
        received = dict(components(got[n - 1]))
        assert again.keys() == received.keys()
        for k, a in again.items():
            r = received[k]
            assert (a.dtype, a.shape) == (r.dtype, r.shape), f"line {n} component {k}"
            assert a.tobytes() == r.tobytes(), f"line {n} component {k}: other bytes"


def test_ledger_lines_replay_to_the_received_batches(broker_proc, daemons, endpoints,
                                                     tmp_path):
    broker_proc("--state-dir", str(tmp_path / "state"))
    cfg = pipeline(tmp_path, n=max(96, 32 * math.ceil(LINES / 16)))  # 2 epochs of n / 4
    for i in range(2):
        producer(daemons, cfg, endpoints.ingress, f"p{i}", "val")
    ledger = tmp_path / "ledger.jsonl"
    got = consume(endpoints.egress, "val", ledger, epochs=2)
    assert_replayed(cfg, ledger, got)
    # The command line: one line replayed, its sha256 per component those received.
    r = feedline("replay", cfg, "--ledger", ledger, "--line", 7, "--json",
                 "--out", tmp_path / "b.npz")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    want = dict(components(got[6]))
    assert [c["name"] for c in out["components"]] == list(want)
    for c in out["components"]:
        assert c["sha256"] == hashlib.sha256(want[c["name"]].tobytes()).hexdigest()
    with np.load(tmp_path / "b.npz") as saved:
        assert all(saved[k].tobytes() == a.tobytes() for k, a in want.items())


def test_jpeg_shards_with_the_train_preset_replay_bit_for_bit(broker_proc, daemons,
                                                              endpoints, tmp_path):
    # 3 classes of p images in units of 4, batches of 3: 1.5 p batches an epoch, 2 epochs.
    make_folder(tmp_path / "images", classes=3, per_class=max(8, math.ceil(LINES / 3)))
    r = feedline("convert", tmp_path / "images", tmp_path / "shards", "--shard-size", "20KB",
                 "--no-progress")
    assert r.returncode == 0, r.stderr
    broker_proc("--exact-ephemeral")
    with file_server(str(tmp_path / "shards")) as url:
        cfg = tmp_path / "shards.yaml"
        cfg.write_text(yaml.safe_dump({
            "delivery": "exact", "stream": "train", "seed": 11, "epochs": 2,
            "exact": {"unit_size": 4},
            "source": {"webdataset": {"manifest": f"{url}/manifest.json"}},
            "parallel": {"workers": 2},
            "steps": [{"imagenet_train": {"size": 40, "scale": [0.2, 1.0]}},
                      {"batch": {"batch_size": 3}}]}))
        producer(daemons, cfg, endpoints.ingress, "p0", "train")
        ledger = tmp_path / "ledger.jsonl"
        got = consume(endpoints.egress, "train", ledger, epochs=2)
        assert_replayed(cfg, ledger, got)


def test_diff_names_a_pipeline_file_changed_by_one_number(broker_proc, daemons, endpoints,
                                                          tmp_path):
    broker_proc("--state-dir", str(tmp_path / "state"))
    a = pipeline(tmp_path / "a", epochs=1)
    b = tmp_path / "b.yaml"
    text = a.read_text()
    assert text.count("nbytes: 512") == 1
    b.write_text(text.replace("nbytes: 512", "nbytes: 513"))
    producer(daemons, a, endpoints.ingress, "pa", "a")
    producer(daemons, b, endpoints.ingress, "pb", "b")
    consume(endpoints.egress, "a", tmp_path / "a.jsonl", epochs=1)
    consume(endpoints.egress, "b", tmp_path / "b.jsonl", epochs=1)
    r = feedline("diff", tmp_path / "a.jsonl", tmp_path / "b.jsonl")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "line 1" in r.stdout and "another pipeline file" in r.stdout, r.stdout
    same = feedline("diff", tmp_path / "a.jsonl", tmp_path / "a.jsonl")
    assert same.returncode == 0 and same.stdout.startswith("identical"), same.stdout


def test_a_resumed_run_and_an_uninterrupted_one_have_identical_ledgers(
        broker_proc, daemons, endpoints, tmp_path):
    broker_proc("--state-dir", str(tmp_path / "state"))
    cfg = pipeline(tmp_path)  # two epochs
    producer(daemons, cfg, endpoints.ingress, "pu", "whole")
    producer(daemons, cfg, endpoints.ingress, "pi", "resumed")
    whole = tmp_path / "whole.jsonl"
    consume(endpoints.egress, "whole", whole, epochs=2)
    resumed = tmp_path / "resumed.jsonl"
    with RemoteDataZMQ(endpoints.egress, stream="resumed", timeout=60,
                       options=ConsumerOptions(link=FAST, ledger=resumed)) as src:
        it = src.epoch()
        for _ in range(7):
            next(it)
        saved = src.state().to_dict()  # the checkpoint
        for _ in range(3):
            next(it)  # taken after it: the crash loses them, the resumed run re-takes them
    consume(endpoints.egress, "resumed", resumed, epochs=2, resume=saved)
    result = diff(read_ledger(whole), read_ledger(resumed))
    assert result.first is None, result.first
    assert result.repeated == (0, 3) and result.batches == 2 * 96 // 4
    r = feedline("diff", whole, resumed)
    assert r.returncode == 0 and "identical" in r.stdout, r.stdout + r.stderr


# -- the new-user review's findings (stop 62), on ledgers written by hand ------------------

def _line(step: int, unit: int, pipeline: int = 7) -> str:
    return json.dumps({"step": step, "stream": "s", "epoch": 0, "unit": unit, "index": 0,
                       "producer": "p", "pipeline": pipeline if unit >= 0 else 0,
                       "file": 3 if unit >= 0 else 0, "code": "c" if unit >= 0 else ""}) + "\n"


def test_training_mode_ledgers_are_refused_not_called_identical(tmp_path):
    """Two training-mode runs of other seeds and sizes were "identical": their lines hold no
    place and no fingerprints. A ledger with such lines cannot be compared: exit 2, why."""
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text(_line(0, -1) + _line(1, -1))
    b.write_text(_line(0, -1) + _line(1, -1))
    with pytest.raises(DataError, match="line 1 of the first ledger is a training-mode"):
        diff(read_ledger(a), read_ledger(b))
    exact = tmp_path / "e.jsonl"
    exact.write_text(_line(0, 0))
    with pytest.raises(DataError, match="of the second ledger"):
        diff(read_ledger(exact), read_ledger(b))
    r = feedline("diff", a, b)
    assert r.returncode == 2 and "training-mode" in r.stdout, r.stdout + r.stderr


def test_unreadable_ledger_bytes_are_one_line_and_exit_2(tmp_path):
    """Bytes that are no UTF-8 gave a traceback and exit 1 ("they differ"); a torn line gave
    the parser's words only. Both are one line that names the file's line, exit 2."""
    good, bad = tmp_path / "good.jsonl", tmp_path / "bad.jsonl"
    good.write_text(_line(0, 0))
    bad.write_bytes(b"\xff\xfe" + _line(0, 0).encode())
    r = feedline("diff", good, bad)
    assert r.returncode == 2 and "bad.jsonl:1: not a ledger line" in r.stdout, r.stdout
    assert "Traceback" not in r.stdout + r.stderr
    torn = tmp_path / "torn.jsonl"
    torn.write_text(_line(0, 0) + _line(1, 1)[:40])
    r = feedline("diff", good, torn)
    assert r.returncode == 2 and "torn.jsonl:2" in r.stdout and "delete it" in r.stdout
    r = feedline("replay", tmp_path / "none.yaml", "--ledger", tmp_path / "missing.jsonl",
                 "--line", "1")
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert "missing.jsonl" in r.stderr


def test_the_workers_of_an_exact_file_are_not_another_pipeline_file(tmp_path):
    """A run with ``parallel.workers: 4`` makes the same bytes as one with 1 (each sample's
    randomness is its own), so the lineage's file fingerprint leaves ``parallel`` out; a step's
    number still changes it."""
    one = pipeline(tmp_path / "one")
    text = one.read_text()
    four = tmp_path / "four.yaml"
    four.write_text(text + "parallel: {workers: 4}\n")
    other = tmp_path / "other.yaml"
    other.write_text(text.replace("nbytes: 512", "nbytes: 513"))
    a, b, c = (load(str(p)) for p in (one, four, other))
    assert b.threads == 4 != a.threads
    assert a.file_fingerprint == b.file_fingerprint != c.file_fingerprint
    assert a.fingerprint == b.fingerprint


def test_a_missing_line_names_the_ledgers_range_and_an_epoch_past_the_files_replays(
        tmp_path, caplog):
    """``--line 9`` of a 2-line ledger said "has no line 9" only; an epoch past the file's
    ``epochs:`` (a run given more, or resumed past it) was refused though the file makes it;
    a ledger appended to said nothing (its steps count from 0 again)."""
    path = tmp_path / "l.jsonl"
    path.write_text(_line(0, 0) + _line(1, 1))
    with pytest.raises(DataError, match=r"has no line 9: its lines are 1\.\.2"):
        ledger_line(path, 9)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(DataError, match="it holds no ledger line"):
        ledger_line(empty, 1)
    with caplog.at_level(logging.INFO, logger="feedline.exact.lineage"):
        Ledger(empty, "s").close()
        assert not caplog.records  # a new ledger: nothing to say
        Ledger(path, "s").close()
    assert [r.getMessage() for r in caplog.records] == [
        f"ledger {path}: appending to its {path.stat().st_size} bytes (steps count from 0 "
        "again; give another path to start a new ledger)"]
    pipe = load(str(pipeline(tmp_path, epochs=2)))
    late = dict(components(regenerate(pipe, 5, 0, 0)))
    first = dict(components(regenerate(pipe, 0, 0, 0)))
    assert late.keys() == first.keys()
    assert any(late[k].tobytes() != first[k].tobytes() for k in late)  # another epoch's
    with pytest.raises(FeedlineError, match="epochs are >= 0"):
        regenerate(pipe, -1, 0, 0)

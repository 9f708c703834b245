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
from feedline.errors import ConfigError, DataError, FeedlineError
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


# -- the attack review's findings (stop 63) ---------------------------------------------------

def _stepped(step: int, unit: int, **kw: Any) -> str:
    d = json.loads(_line(step, unit))
    d.update(kw)
    return json.dumps(d) + "\n"


def test_a_batch_taken_again_with_another_lineage_or_twice_in_one_run_is_a_difference(
        tmp_path):
    """diff kept a re-taken batch's first line and dropped the rest unread: a resume onto a
    changed pipeline file read as identical, and so did a run that took one batch twice."""
    whole = tmp_path / "whole.jsonl"
    whole.write_text("".join(_stepped(i, i) for i in range(4)))
    # Resumed after step 1 (steps from 0 again), the re-takes of units 2 and 3 the same: one
    # batch each, said as repeats.
    same = tmp_path / "same.jsonl"
    same.write_text("".join(_stepped(i, i) for i in range(3))
                    + "".join(_stepped(i, u) for i, u in enumerate((2, 3))))
    result = diff(read_ledger(whole), read_ledger(same))
    assert result.first is None and result.repeated == (0, 1), result
    # The same resume onto a pipeline file changed by one number: the re-take differs.
    changed = tmp_path / "changed.jsonl"
    changed.write_text("".join(_stepped(i, i) for i in range(3))
                       + "".join(_stepped(i, u, file=4) for i, u in enumerate((2, 3))))
    first = diff(read_ledger(whole), read_ledger(changed)).first
    assert first is not None and first.line_b == 4, first
    assert "another pipeline file" in first.why and "taken again after line 3" in first.why
    # One run (steps never back to 0) that took unit 1 twice.
    twice = tmp_path / "twice.jsonl"
    twice.write_text("".join(_stepped(i, u) for i, u in enumerate((0, 1, 1, 2, 3))))
    first = diff(read_ledger(twice), read_ledger(whole)).first
    assert first is not None and first.line_a == 3 and "taken twice in one run" in first.why
    r = feedline("diff", whole, changed)
    assert r.returncode == 1 and "taken again" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize("bad", ["Infinity", "1e400", "1.7", '"1"', "true", "null", "-3"])
def test_a_ledger_value_of_another_type_is_refused_not_coerced(tmp_path, bad):
    """Infinity crashed diff with OverflowError (exit 1: "they differ"); 1.7, "1" and true
    were read as units 1, another batch's place; -3 made an exact line a training one."""
    path = tmp_path / "l.jsonl"
    path.write_text(_line(0, 0) + _line(1, 1).replace('"unit": 1', f'"unit": {bad}'))
    with pytest.raises(DataError, match=r"l\.jsonl:2: not a ledger line: unit is"):
        list(read_ledger(path))
    r = feedline("diff", path, path)
    assert r.returncode == 2 and "Traceback" not in r.stdout + r.stderr, r.stdout + r.stderr


def test_a_ledger_nested_too_deep_is_one_line(tmp_path):
    path = tmp_path / "deep.jsonl"
    path.write_text("[" * 100_000 + "\n")
    with pytest.raises(DataError, match="deep.jsonl:1: not a ledger line"):
        list(read_ledger(path))


def test_a_torn_line_is_ended_before_a_resumed_run_appends(tmp_path, caplog):
    """A part line (kill -9, a full disk) took the resumed run's first line into it: the
    file was refused from there on with "a torn last line", in its middle."""
    path = tmp_path / "l.jsonl"
    path.write_text(_line(0, 0) + _line(1, 1)[:30])
    ledger = Ledger(path, "s")
    ledger.close()
    text = path.read_text()
    assert text.endswith("\n") and text.count("\n") == 2
    path.write_text(text + _line(0, 1))  # the resumed run's line, whole on its own line
    with pytest.raises(DataError, match=r"l\.jsonl:2: not a ledger line.*delete it"):
        list(read_ledger(path))
    lines = path.read_text().splitlines()
    path.write_text(lines[0] + "\n" + lines[2] + "\n")  # what the message says to do
    assert [lin.unit for _, lin in read_ledger(path)] == [0, 1]


def test_a_ledger_path_that_cannot_take_lines_is_refused_when_the_options_are_made(tmp_path):
    """A directory, a missing directory or "" failed inside epoch(), from the I/O thread;
    a FIFO hung epoch() for ever."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path, what in ((tmp_path, "not a regular file"), (fifo, "not a regular file"),
                       (tmp_path / "no" / "l.jsonl", "does not exist"), ("", "empty path")):
        with pytest.raises(ConfigError, match=what):
            ConsumerOptions(ledger=path)


def test_replay_checks_its_place_and_out_before_the_work_and_keeps_every_name(tmp_path):
    """--epoch -1 and --out DIR gave tracebacks (the latter after the batch was made); a
    component named "file" or "allow_pickle" broke np.savez's keywords."""
    cfg = pipeline(tmp_path)
    for args, what in ((["--epoch", "-1", "--unit", "0"], "epochs are >= 0"),
                       (["--epoch", "0", "--unit", "99"], "the pipeline has units"),
                       (["--epoch", "0", "--unit", "0", "--out", tmp_path], "a directory"),
                       (["--epoch", "0", "--unit", "0", "--out", tmp_path / "no" / "b.npz"],
                        "does not exist")):
        r = feedline("replay", cfg, *args)
        assert r.returncode == 1 and what in r.stderr, (args, r.stderr)
        assert "Traceback" not in r.stderr, r.stderr
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(b"\xff\xfe\x00source")
    r = feedline("replay", binary, "--epoch", "0", "--unit", "0")
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    r = feedline("replay", tmp_path / "none.yaml", "--epoch", "0", "--unit", "0")
    assert r.returncode == 1 and "none.yaml" in r.stderr, r.stderr
    from feedline.commands.replay import _write_npz
    parts = [("file", np.arange(3)), ("allow_pickle", np.ones(2, np.uint8))]
    _write_npz(str(tmp_path / "n.npz"), parts)
    with np.load(tmp_path / "n.npz") as saved:
        assert sorted(saved.files) == ["allow_pickle", "file"]
        assert saved["file"].tolist() == [0, 1, 2]

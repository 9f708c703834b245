"""The exact-delivery blocks of docs/pipelines.md and docs/tensorflow.md, run as the pages say.

Those blocks are marked ``<!-- not run: ... -->`` for tests/docs/test_docs.py (which runs each page
against one plain stream); their markers name this file. Here the pipeline file of
pipelines.md runs in two producers on the demo dataset (512 JPEGs in 14 classes, its path for
``/data/imagenet/val``); tensorflow.md's validation loop reads that stream and must count the
dataset exactly; its checkpoint loop runs on a ``train`` stream of the same file, is killed
(``kill -9``) after its first checkpoint, and run again: the second run takes the rest of the
epoch, no more and no less. The page's claims about units (short last batch, determinism
whatever the threads) are checked on the same file.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from feedline.procs import Child, free_port, wait_for
from feedline.producer.exact import ExactPipeline, build_exact
from tests.support import tcp_ready
from tests.support.doc_support import DOCS, ROOT, Block, Session, blocks
from tests.support.jpeg_data import make_folder

HERE = "tests/docs/test_docs_exact.py"
LIVENESS = ["--heartbeat-interval", "0.2", "--heartbeat-timeout", "1.5"]
# `model` of the snippets: small, with the demo dataset's 14 classes.
MODEL = """\
import tensorflow as tf
tf.keras.utils.set_random_seed(0)
model = tf.keras.Sequential([tf.keras.layers.Rescaling(1 / 255),
    tf.keras.layers.GlobalAveragePooling2D(), tf.keras.layers.Dense(14)])
model.compile("sgd", tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
"""


def marked(name: str) -> list[Block]:
    """The blocks of docs/NAME whose marker says this file runs them."""
    (doc,) = [d for d in DOCS if d.name == name]
    return [b for b in blocks(doc) if HERE in b.marker]


def test_every_exact_block_is_one_this_file_runs() -> None:
    (pipeline,) = marked("pipelines.md")
    assert pipeline.lang == "yaml" and "delivery: exact" in pipeline.code
    validation, resume = marked("tensorflow.md")
    assert "remote.epoch()" in validation.code and "CursorState" in resume.code


def _config(root: Path) -> dict:
    cfg = yaml.safe_load(marked("pipelines.md")[0].code)
    cfg["source"]["image_folder"]["root"] = str(root)
    return cfg


def _batches(pipe: ExactPipeline, epoch: int, unit: int) -> list[Any]:
    out = [b for _, b in pipe.batches(epoch, unit)]
    assert all(b is not None for b in out)  # no sample skipped here
    return out


def test_units_short_batches_and_determinism_as_the_page_says(tmp_path: Path) -> None:
    """The page's file on 3 classes x 7 images, units of 8 in batches of 3: each unit ends
    with a short batch, every image once; a random step gives the same bytes in 1 thread or
    3 (randomness per sample, not per worker)."""
    make_folder(tmp_path / "imgs", classes=3, per_class=7)
    cfg = _config(tmp_path / "imgs")
    cfg["exact"]["unit_size"], cfg["steps"][-1]["batch"]["batch_size"] = 8, 3
    pipe = build_exact(cfg)
    assert pipe.stream == "val" and pipe.spec.dataset_size == 21
    sizes = [[len(b[1]) for b in _batches(pipe, 0, u)] for u in range(3)]
    assert sizes == [[3, 3, 2], [3, 3, 2], [3, 2]]
    labels = sorted(int(x) for u in range(3) for b in _batches(pipe, 0, u) for x in b[1])
    assert labels == [0] * 7 + [1] * 7 + [2] * 7

    def unit_bytes(threads: int) -> list[bytes]:
        c = {**cfg, "parallel": {"workers": threads},
             "steps": [{"imagenet_train": {"size": 32}}, cfg["steps"][-1]]}
        return [b[0].tobytes() for b in _batches(build_exact(c), 1, 2)]
    assert unit_bytes(1) == unit_bytes(3)


@pytest.fixture
def session(tmp_path: Path):
    s = Session(tmp_path / "work", {}, {"FEEDLINE_METRICS_PORT": ""})
    s.cwd.mkdir()
    yield s
    s.close()


def _demo() -> Path:
    from feedline.producer.demo_data import build, default_dir

    return build(default_dir(os.environ.get("XDG_CACHE_HOME"), count=512), count=512,
                 progress=False)


def _feed(session: Session, producers: list[list[str]]) -> Path:
    """A broker and producers of the page's pipeline file (each with its extra flags) on the
    demo dataset; the page's socket path points at the broker."""
    sock, port = session.cwd / "feedline.sock", free_port()
    session.subst["/tmp/feedline.sock"] = str(sock)
    broker = session.start(["broker", "--ingress", f"tcp://127.0.0.1:{port}", "--egress",
                            f"ipc://{sock}", "--metrics-port", "0", "--state-dir",
                            str(session.cwd / "state"), *LIVENESS], "broker")
    wait_for(lambda: (tcp_ready(port) and sock.exists()) or not broker.alive(), 30,
             what="broker")
    assert broker.alive(), broker.log_text()
    cfg = session.cwd / "val.yaml"
    cfg.write_text(yaml.safe_dump(_config(_demo())))
    for i, extra in enumerate(producers):
        session.start(["producer", "--config", str(cfg), "--broker",
                       f"tcp://127.0.0.1:{port}", "--id", f"p{i}", *LIVENESS, *extra],
                      f"producer-{i}")
    return cfg


@pytest.mark.tf
def test_validation_block_counts_the_dataset_exactly(session: Session) -> None:
    pytest.importorskip("tensorflow")
    _feed(session, [[], []])
    validation, _ = marked("tensorflow.md")
    out = session.run_python(validation, MODEL, lambda _pid: 0.0, enough=1, timeout=300)
    m = re.search(r"^top-1 (\S+) over (\d+) samples$", out, re.M)
    assert m, out[-3000:]
    assert 0 <= float(m.group(1)) <= 1 and int(m.group(2)) == 512


@pytest.mark.tf
def test_checkpoint_block_resumes_where_its_checkpoint_was(session: Session) -> None:
    """First run: killed right after its first save (step 0: one batch taken). Second run:
    restores it and takes the epoch's 7 other batches (512 images in batches of 64)."""
    pytest.importorskip("tensorflow")
    _feed(session, [["--stream", "train"]])
    _, resume = marked("tensorflow.md")
    script = session.cwd / "train.py"
    script.write_text(MODEL + session.text(resume.code)
                      + '\nprint("batches this run:", step + 1)\n')
    env = {"PYTHONPATH": str(ROOT), "TF_CPP_MIN_LOG_LEVEL": "3"}
    first = Child([sys.executable, str(script)], session.cwd / "first.log", env=env,
                  cwd=session.cwd)
    try:
        saved = session.cwd / "checkpoints" / "checkpoint"
        wait_for(lambda: saved.exists() or not first.alive(), 240, interval=0.02,
                 what="the first checkpoint")
        assert first.alive(), first.log_text()[-3000:]
        first.kill9()
    finally:
        first.stop()
    second = Child([sys.executable, str(script)], session.cwd / "second.log", env=env,
                   cwd=session.cwd)
    try:
        wait_for(lambda: not second.alive(), 240, interval=0.2, what="the second run")
    finally:
        second.stop()
    text = second.log_text()
    assert second.proc.returncode == 0, text[-3000:]
    assert "batches this run: 7" in text, text[-3000:]

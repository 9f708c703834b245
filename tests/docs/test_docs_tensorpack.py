"""The feedline blocks of docs/tensorpack.md, run as the page says.

tests/docs/test_docs.py leaves docs/tensorpack.md to this file (``RUN_ELSEWHERE``); the page's
tensorpack blocks are marked ``<!-- not run: ... -->`` (tensorpack's code, for comparison),
every other block runs here, in a scratch directory, in document order within each test:

- the Efficient DataFlow pipeline (the preset, then the augmentors one by one) over a small
  JPEG folder, its batches and workers fewer than the page's;
- the direct-mode training process and a data machine's ``send_dataflow_zmq``, as two
  processes: the training process must end by itself after its ``TestDataSpeed``;
- the tensorpack DataFlow served by ``feedline producer`` through ``factory:``, against the
  real tensorpack 0.11 (``import tensorpack``): its module, its pipeline file and the command,
  into a direct-mode trainer in this process, which must receive its batches;
- the ``QueueInput`` / ``StagingInput`` loop fed by a producer, and the measuring blocks.

The page's addresses and paths are replaced by live ones (``Session.subst``).
"""

from __future__ import annotations

import importlib.util
import itertools
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from feedline import RemoteDataZMQ
from feedline.procs import Child, free_port
from tests.support.doc_support import DOCS, ROOT, Block, Session, blocks
from tests.support.jpeg_data import make_folder

(PAGE,) = [d for d in DOCS if d.name == "tensorpack.md"]
IMAGES = {"source": {"fake": {"shapes": [[8, 32, 32, 3], [8]], "dtypes": ["uint8", "int32"],
                              "random": True, "size": 1000}}}
# The training process of "Across machines" (its last line, then TestDataSpeed's)
TRAINER = "bind=True, options=ConsumerOptions(insecure=True))\nprint"


def runnable() -> list[Block]:
    return [b for b in blocks(PAGE) if b.runnable]


def block_with(text: str) -> Block:
    (b,) = [b for b in runnable() if text in b.code]
    return b


def run_to_the_end(session: Session, b: Block, timeout: float = 240) -> str:
    """Run Python block ``b``; it passes when it exits 0 by itself (no broker counter)."""
    return session.run_python(b, "", lambda _pid: 0.0, enough=float("inf"), timeout=timeout)


@pytest.fixture
def session(tmp_path: Path):
    s = Session(tmp_path / "work", {}, {"FEEDLINE_METRICS_PORT": ""})
    s.cwd.mkdir()
    yield s
    s.close()


def test_every_runnable_block_is_one_a_test_here_runs() -> None:
    """The page's runnable blocks, in order, are the ones the tests below pick by their text;
    every tensorpack block says it is not run."""
    langs = [b.lang for b in runnable()]
    assert langs == ["python"] * 5 + ["yaml", "sh"] + ["python"] * 3, langs
    picked = ["ImageNetTrain(224)", "Augment([", TRAINER,
              "send_dataflow_zmq(df", "AugmentImageComponent", "factory:",
              "feedline producer", "StagingInput(queue", "random=False", "DummyConstantInput("]
    assert [block_with(t) for t in picked] == runnable()
    reasons = [b.not_run for b in blocks(PAGE) if b.not_run]
    assert sum(r.startswith("tensorpack's code, for comparison") for r in reasons) == 4, reasons


def test_the_names_tensorpack_users_write_are_feedline_s() -> None:
    """The aliases the page's table promises: the same objects, exported where the page
    imports them from."""
    import feedline
    import feedline.producer as producer
    import feedline.producer.dataflow as dataflow

    assert dataflow.MultiProcessRunnerZMQ is dataflow.MultiProcessRunner
    assert "MultiProcessRunnerZMQ" in dataflow.__all__
    assert feedline.send_dataflow_zmq is producer.send_dataflow_zmq is producer.send_dataflow
    assert "send_dataflow_zmq" in feedline.__all__ and "send_dataflow_zmq" in producer.__all__
    with pytest.raises(TypeError, match="hwm"):  # tensorpack's hwm= is refused, not ignored
        feedline.send_dataflow_zmq([], "tcp://127.0.0.1:1", hwm=50)  # type: ignore[call-arg]


def test_the_efficient_dataflow_pipelines_run(session: Session) -> None:
    make_folder(session.cwd / "train", classes=2, per_class=16)  # 32 JPEGs
    session.subst.update({"/data/imagenet/train": str(session.cwd / "train"),
                          "num_proc=25": "num_proc=2", "BatchData(ds, 256)": "BatchData(ds, 8)"})
    for text in ("ImageNetTrain(224)", "Augment(["):
        log = run_to_the_end(session, block_with(text))
        assert "batches/s" in log, log[-2000:]


def test_the_training_process_serves_send_dataflow_zmq(session: Session) -> None:
    port = free_port()
    session.subst.update({"tcp://0.0.0.0:8877": f"tcp://127.0.0.1:{port}",
                          "tcp://trainer.example:8877": f"tcp://127.0.0.1:{port}"})
    trainer = block_with(TRAINER)
    data = block_with("send_dataflow_zmq(df")
    script = session.cwd / "data_machine.py"
    script.write_text(session.text(data.code))
    sender = Child([sys.executable, str(script)], session.cwd / "data_machine.log",
                   cwd=session.cwd, env={"PYTHONPATH": str(ROOT)})
    session.background.append(sender)
    log = run_to_the_end(session, trainer)  # ends after TestDataSpeed's 100 batches
    assert "batches/s" in log, log[-2000:]
    assert sender.alive(), sender.log_text()[-2000:]  # it sends forever, as tensorpack's


def test_a_tensorpack_dataflow_is_served_by_feedline_producer(session: Session) -> None:
    """The page's tensorpack module, pipeline file and command, against tensorpack 0.11: the
    trainer receives batches of the tensorpack pipeline (imgaug's 224x224 crops, uint8, the
    folder's labels)."""
    if importlib.util.find_spec("tensorpack") is None:
        pytest.skip("tensorpack 0.11 is in the test extra")
    # tensorpack is imported only in the producer: its import patches msgpack in-process.
    make_folder(session.cwd / "train", classes=2, per_class=6)
    port = free_port()
    session.subst.update({"/data/imagenet/train": str(session.cwd / "train"),
                          "batch: 64": "batch: 4",
                          "tcp://trainer.example:8877": f"tcp://127.0.0.1:{port}"})
    module, pipeline, command = (block_with("AugmentImageComponent"), block_with("factory:"),
                                 block_with("feedline producer"))
    (session.cwd / "my_tensorpack_flows.py").write_text(module.code)
    cfg = yaml.safe_load(session.text(pipeline.code))
    assert cfg["factory"] == "my_tensorpack_flows:imagenet_train", cfg
    (session.cwd / "tensorpack.yaml").write_text(yaml.safe_dump(cfg))
    with RemoteDataZMQ(f"tcp://127.0.0.1:{port}", bind=True, timeout=120) as trainer:
        session.run_shell(command, lambda argv: lambda: True)
        got = list(itertools.islice(trainer, 6))
    assert len(got) == 6
    for images, labels in got:
        assert images.shape == (4, 224, 224, 3) and images.dtype == np.uint8
        assert labels.shape == (4,) and set(labels.tolist()) <= {0, 1}
    assert len({int(images.sum()) for images, _ in got}) > 1, "every batch the same"


@pytest.mark.tf
def test_queue_input_and_staging_input_block_trains(session: Session) -> None:
    pytest.importorskip("tensorflow")
    port = free_port()
    session.subst["tcp://0.0.0.0:8877"] = f"tcp://127.0.0.1:{port}"
    cfg = session.cwd / "images.yaml"
    cfg.write_text(yaml.safe_dump(IMAGES))
    session.start(["producer", "--config", str(cfg), "--broker", f"tcp://127.0.0.1:{port}"],
                  "producer")
    run_to_the_end(session, block_with("StagingInput(queue"))  # its 100 steps, then exit 0


@pytest.mark.tf
def test_the_measuring_blocks_run(session: Session) -> None:
    log = run_to_the_end(session, block_with("random=False"))
    assert "batches/s" in log, log[-2000:]
    pytest.importorskip("tensorflow")
    run_to_the_end(session, block_with("DummyConstantInput("))

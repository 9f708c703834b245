"""The direct-mode blocks of docs/tensorflow.md and docs/pytorch.md, run as the pages say: two
training hosts fed by one producer fleet.

Those blocks are marked ``<!-- not run: ... -->`` (tensorflow.md) or ``<!-- run: ... -->``
(pytorch.md) for tests/docs/test_docs.py and tests/consumer/test_torch_input.py, which run each page
against one broker; their markers name this file, which runs them in document order in a
scratch directory: the keys block (``feedline keys``, ``mkdir``, ``cp``), then the TensorFlow
loop as host 1 and the PyTorch loop as host 2 (each binding its own port on 127.0.0.1, with
the CURVE keys the first block made), then the producer command, whose two ``--broker`` are
those two hosts. Each training loop must end by itself (exit status 0, no traceback) after
its steps, which it can only do if the producer fed it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

from feedline.procs import Child, free_port, wait_for
from tests.support.doc_support import DOCS, ROOT, Block, Session, blocks

HERE = "tests/docs/test_docs_direct_mode.py"
STEPS = 20  # the TensorFlow loop's `steps`; the PyTorch block takes 20 batches itself
IMAGES = {"source": {"fake": {"shapes": [[8, 32, 32, 3], [8]], "dtypes": ["uint8", "int32"],
                              "random": True, "size": 1000}}}


def marked(name: str) -> list[Block]:
    """The blocks of docs/NAME whose marker says this file runs them."""
    (doc,) = [d for d in DOCS if d.name == name]
    return [b for b in blocks(doc) if HERE in b.marker]


def test_every_direct_mode_block_is_one_this_file_runs() -> None:
    assert [b.lang for b in marked("tensorflow.md")] == ["sh", "python", "sh"]
    assert [b.lang for b in marked("pytorch.md")] == ["python"]
    keys, loop, producer = marked("tensorflow.md")
    assert "bind=True" in loop.code and "bind=True" in marked("pytorch.md")[0].code
    assert producer.code.count("--broker") == 2


@pytest.mark.tf
def test_direct_mode_blocks_run_as_two_training_hosts(tmp_path: Path) -> None:
    pytest.importorskip("tensorflow")
    pytest.importorskip("torch")
    keys, tf_loop, producer = marked("tensorflow.md")
    (torch_loop,) = marked("pytorch.md")
    session = Session(tmp_path / "work", {}, {"FEEDLINE_METRICS_PORT": ""})
    session.cwd.mkdir()
    hosts: dict[str, Child] = {}
    try:
        session.run_shell(keys, lambda argv: lambda: True)
        for n, block in enumerate((tf_loop, torch_loop), start=1):
            port = free_port()
            code = (block.code.replace("tcp://0.0.0.0:7878", f"tcp://127.0.0.1:{port}")
                    .replace("serve_metrics(registry, 9400)",
                             f"serve_metrics(registry, {free_port()})"))
            script = session.cwd / f"host{n}.py"
            script.write_text(f"steps = {STEPS}\n" + code)
            hosts[f"host{n}"] = Child([sys.executable, str(script)],
                                      session.cwd / f"host{n}.log", cwd=session.cwd,
                                      env={"PYTHONPATH": str(ROOT), "TF_CPP_MIN_LOG_LEVEL": "3"})
            session.subst[f"trainer-{n}.example:7878"] = f"127.0.0.1:{port}"
        pipeline = session.cwd / "images.yaml"
        pipeline.write_text(yaml.safe_dump(IMAGES))
        session.subst["examples/fake.yaml"] = str(pipeline)
        session.run_shell(producer, lambda argv: lambda: True)
        for name, child in hosts.items():
            wait_for(lambda c=child: not c.alive(), 240, interval=0.2,
                     what=f"{name}'s training loop to finish")
            assert child.proc.returncode == 0, child.log_text()[-4000:]
            assert "Traceback" not in child.log_text(), child.log_text()[-4000:]
        assert "20 batches straight from the producers" in hosts["host2"].log_text()
        # The one producer fed both: its log names both hosts as its targets.
        (log,) = session.cwd.glob("producer-*.log")
        assert all(session.subst[f"trainer-{n}.example:7878"] in log.read_text()
                   for n in (1, 2)), log.read_text()[-2000:]
    finally:
        for child in hosts.values():
            child.stop()
        session.close()

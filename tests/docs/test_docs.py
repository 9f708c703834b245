"""Every fenced code block of README.md and docs/*.md runs here, or its page says why not.

The convention, for whoever writes docs:

- ```text (or ```console) is not code: output, a transcript, a diagram.
- A block that cannot run here (it installs packages, needs Docker, a cluster, root, or takes
  minutes) has on the line right above its fence ``<!-- not run: REASON -->``; the reason is
  required and should name the test that covers it otherwise.
- Every other block runs, in document order, in a scratch directory, against live daemons:
  shell blocks (```sh, or no language) command by command (``feedline broker``/``producer``
  start in the background; ``feedline keys|lmdb``, ``mkdir``, ``cp``, ``mv`` must exit 0);
  Python blocks in a subprocess, passing when they exit 0 or, for a training loop that runs
  until stopped, when the broker has handed them more batches than any of their queues holds;
  YAML pipelines are built and give a batch. The doc's addresses and dataset paths are
  replaced by the live ones (each test's ``subst``), and names a snippet leaves to the reader
  (``my_dataflow``, ``model``, ``steps``) are defined by :data:`PRELUDE`.
- docs/pytorch.md's blocks run in tests/consumer/test_torch_input.py (same markers).
- Whether a block runs or not, each ``feedline ...`` command in it must parse with feedline's
  own argument parser, and each ``python benchmarks/X.py --flag`` must name flags X has.
- No page points outside the repository: no ``../shared``, every relative link resolves.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from feedline.procs import free_port
from tests.support import tcp_ready
from tests.support.doc_support import (
    DOCS,
    ROOT,
    Block,
    Session,
    blocks,
    check_feedline_argv,
    check_script_flags,
    commands,
    counter,
    shell_lines,
)

# Pages whose runnable blocks a test below runs (all of them, in order), or another test does.
RUN_HERE = {"README.md", "operations.md", "security.md", "tensorflow.md", "pipelines.md"}
RUN_ELSEWHERE = {"pytorch.md": ROOT / "tests" / "consumer" / "test_torch_input.py",
                 "tensorpack.md": ROOT / "tests" / "docs" / "test_docs_tensorpack.py"}
MORE_THAN_QUEUED = 64  # batches: more than any doc's QueueInput capacity + window + stage

PRELUDE = {
    "steps": "steps = 3",
    "my_dataflow": "import numpy as np\nmy_dataflow = [[np.zeros((8, 8), np.uint8)]] * 4",
    "model": "import tensorflow as tf\n"
             "model = tf.keras.Sequential([tf.keras.layers.Rescaling(1 / 255),\n"
             "    tf.keras.layers.GlobalAveragePooling2D(), tf.keras.layers.Dense(10)])\n"
             "model.compile('sgd', tf.keras.losses.SparseCategoricalCrossentropy("
             "from_logits=True))",
}
ALL = [b for doc in DOCS for b in blocks(doc)]


def prelude(code: str) -> str:
    """Definitions of the names ``code`` uses without defining."""
    return "\n".join(text for name, text in PRELUDE.items()
                     if re.search(rf"\b{name}\b", code) and not re.search(rf"^{name} =", code,
                                                                          re.M))


def runnable(doc: str) -> list[Block]:
    return [b for b in ALL if b.doc.name == doc and b.runnable]


# ---------------------------------------------------------------------- what every page owes


def test_every_block_runs_somewhere_or_says_why_not():
    for b in ALL:
        if b.not_run is not None:
            assert len(b.not_run) > 10, f"{b.where}: say why it does not run"
    unowned = [b.where for b in ALL if b.runnable
               and b.doc.name not in RUN_HERE | set(RUN_ELSEWHERE)]
    assert not unowned, f"blocks no test runs (mark them or add a test): {unowned}"
    for doc, test in RUN_ELSEWHERE.items():
        assert f"docs/{doc}" in test.read_text(), f"{test} does not run docs/{doc}"


@pytest.mark.parametrize("b", [b for b in ALL if b.lang in ("", "sh", "bash")],
                         ids=lambda b: b.where)
def test_commands_in_the_docs_parse(b: Block):
    for line in shell_lines(b.code):
        for argv in commands(line):
            argv = argv[1:] if argv[:1] == ["sudo"] else argv
            if argv[:1] == ["feedline"]:
                assert check_feedline_argv(argv) is None, (b.where, argv,
                                                           check_feedline_argv(argv))
            elif argv[:1] in (["python"], ["python3"]) and argv[1].startswith("benchmarks/"):
                assert check_script_flags(argv) is None, (b.where, check_script_flags(argv))


def test_no_page_points_outside_the_repository():
    for doc in DOCS:
        text = doc.read_text()
        assert "../shared" not in text and "DESIGN.md" not in text, doc
        for target in re.findall(r"\]\(([^)#\s]+)", text):
            if "://" not in target:
                assert (doc.parent / target).exists(), f"{doc.name}: broken link {target}"


# ------------------------------------------------------------------------------ the pages


@pytest.fixture
def session(tmp_path: Path):
    s = Session(tmp_path / "work", {}, {"FEEDLINE_METRICS_PORT": ""})
    s.cwd.mkdir()
    yield s
    s.close()


def _broker_ready(port: int, sock: Path):
    def ready(argv: list[str]):
        return (lambda: tcp_ready(port) and sock.exists()) if argv[1] == "broker" \
            else (lambda: True)
    return ready


def test_readme_walkthrough_runs(session: Session):
    """Keys, the allowed directory, a CURVE broker, a producer, the training process's loop and
    send_dataflow: the README top to bottom on one host."""
    port, metrics = free_port(), free_port()
    sock = session.cwd / "feedline.sock"
    session.subst.update({"tcp://0.0.0.0:7878": f"tcp://0.0.0.0:{port}",
                          "trainer.example:7878": f"127.0.0.1:{port}",
                          "/tmp/feedline.sock": str(sock),
                          "examples/fake.yaml": str(ROOT / "examples" / "fake.yaml")})
    session.daemon_env["broker"] = {"FEEDLINE_METRICS_PORT": str(metrics)}
    ran = []
    for b in runnable("README.md"):
        ran.append(b.lang or "sh")
        if b.lang != "python":
            session.run_shell(b, _broker_ready(port, sock))
        elif "send_dataflow(" in b.code:
            # A training process takes the batches, so that the broker has room for them.
            session.start(["drain", "--broker", f"ipc://{sock}"], "drain",
                          {"FEEDLINE_CURVE_SECRET": "keys/trainer.key_secret",
                           "FEEDLINE_CURVE_BROKER_KEY": "keys/broker.key"})
            session.run_python(b, prelude(b.code), lambda pid: counter(
                metrics, "feedline_broker_received_batches_total", pid), enough=8)
        else:
            session.run_python(b, prelude(b.code), lambda _pid: counter(
                metrics, "feedline_broker_forwarded_batches_total"), enough=MORE_THAN_QUEUED)
    assert ran == ["sh", "sh", "sh", "sh", "python", "python"], ran


def _plain_broker(session: Session, egress: str, images: bool) -> tuple[int, int]:
    """A broker (no keys) and a producer of small image batches; (ingress port, metrics)."""
    port, metrics = free_port(), free_port()
    session.start(["broker", "--ingress", f"tcp://127.0.0.1:{port}", "--egress", egress,
                   "--metrics-port", str(metrics)], "broker")
    cfg = session.cwd / "images.yaml"
    shapes = [[8, 32, 32, 3], [8]] if images else [[4]]
    cfg.write_text(yaml.safe_dump({"source": {"fake": {
        "shapes": shapes, "dtypes": ["uint8", "int32"][:len(shapes)], "random": True,
        "size": 1000}}}))  # random int32 labels are 0: a valid class
    session.start(["producer", "--config", str(cfg), "--broker", f"tcp://127.0.0.1:{port}"],
                  "producer")
    return port, metrics


def test_operations_python_block_runs(session: Session):
    egress_port = free_port()
    _, metrics = _plain_broker(session, f"tcp://127.0.0.1:{egress_port}", images=False)
    session.subst.update({"tcp://127.0.0.1:7879": f"tcp://127.0.0.1:{egress_port}",
                          "9400": str(free_port())})
    todo = runnable("operations.md")
    assert [b.lang for b in todo] == ["python"]
    session.run_python(todo[0], prelude(todo[0].code), lambda _pid: counter(
        metrics, "feedline_broker_forwarded_batches_total"), enough=MORE_THAN_QUEUED)


def test_security_python_block_runs_with_keys_from_the_environment(session: Session):
    from feedline import security

    keys = session.cwd / "keys"
    _, broker_secret = security.generate_keypair(keys, "broker")
    trainer_public, trainer_secret = security.generate_keypair(keys, "trainer")
    (keys / "allowed").mkdir()
    (keys / "allowed" / "trainer.key").write_bytes(trainer_public.read_bytes())
    egress_port, metrics = free_port(), free_port()
    session.start(["broker", "--ingress", f"tcp://127.0.0.1:{free_port()}", "--egress",
                   f"tcp://127.0.0.1:{egress_port}", "--metrics-port", str(metrics),
                   "--curve-secret", str(broker_secret), "--curve-allowed",
                   str(keys / "allowed")], "broker")
    session.env.update({"FEEDLINE_CURVE_SECRET": str(trainer_secret),
                        "FEEDLINE_CURVE_BROKER_KEY": str(keys / "broker.key")})
    session.subst["tcp://broker-host:7879"] = f"tcp://127.0.0.1:{egress_port}"
    todo = runnable("security.md")
    assert [b.lang for b in todo] == ["python"]
    session.run_python(todo[0], prelude(todo[0].code), lambda _pid: 0.0, enough=1)


@pytest.mark.tf
def test_tensorflow_blocks_run(session: Session):
    pytest.importorskip("tensorflow")
    sock = session.cwd / "feedline.sock"
    _, metrics = _plain_broker(session, f"ipc://{sock}", images=True)
    session.subst["/tmp/feedline.sock"] = str(sock)
    todo = [b for b in runnable("tensorflow.md") if "depth(" not in b.code]
    assert [b.lang for b in todo] == ["python", "python", "python"]
    options, loop, keras = todo
    # ConsumerOptions: it takes its 20 batches and exits 0 (no progress counts as done)
    session.run_python(options, prelude(options.code), lambda _pid: 0.0, enough=1)
    # the custom loop ends after `steps`
    session.run_python(loop, prelude(loop.code), lambda _pid: counter(
        metrics, "feedline_broker_forwarded_batches_total"), enough=MORE_THAN_QUEUED)
    # Keras fit runs until stopped: here until it printed what the page says its callback
    # prints (issue 53 finding 19: it logged at INFO, so a user saw nothing).
    shown = re.compile(r"^step 100: queue \d+/50 \(avg [\d.]+\) -> "
                       r"(input-bound|balanced|model-bound)$", re.M)
    log = session.cwd / f"block_{keras.doc.stem}_{keras.line}.log"
    out = session.run_python(keras, prelude(keras.code), lambda _pid: float(
        log.exists() and bool(shown.search(log.read_text(errors="replace")))), enough=1)
    assert shown.search(out), out[-2000:]


def test_tensorflow_small_batches_block_states_the_windows_the_planner_uses():
    """The "Small batches" block of docs/tensorflow.md asserts how many batches a window of 4
    holds at four sizes: it runs against the rule the credit planner applies
    (feedline.serving.budget.depth; the planner's own use of it is tested in
    tests/broker/test_broker_parts.py and end to end in tests/consumer/test_direct_mode.py)."""
    (b,) = [b for b in runnable("tensorflow.md") if "depth(" in b.code]
    assert b.code.count("assert ") == 4, b.code
    exec(compile(b.code, b.where, "exec"), {})  # noqa: S102 - the repository's own docs


def test_pipelines_yaml_builds_and_lmdb_commands_run(session: Session):
    import os
    import subprocess
    import sys

    from feedline.producer.demo_data import build, default_dir
    from feedline.producer.exact import build_exact
    from feedline.producer.pipeline import build_pipeline
    from tests.support.jpeg_data import make_folder

    demo = build(default_dir(os.environ.get("XDG_CACHE_HOME"), count=512), count=512,
                 progress=False)
    make_folder(session.cwd / "images", classes=2, per_class=3)
    # The sharded pipelines read the demo dataset as shards (four of 128 images).
    shards = session.cwd / "demo-shards"
    r = subprocess.run([sys.executable, "-m", "feedline.commands", "convert", str(demo),
                        str(shards), "--shard-size", "6MB", "--no-progress"],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    session.subst.update({
        "/data/train": str(demo), "/data/imagenet/train": str(session.cwd / "images"),
        "https://data.example.com/imagenet/shard-{000000..000003}.tar":
            str(shards / "shard-*.tar"),
        "https://data.example.com/imagenet-val/manifest.json": str(shards / "manifest.json")})
    todo = runnable("pipelines.md")
    assert [b.lang or "sh" for b in todo] == ["yaml", "yaml", "yaml", "yaml", "sh", "sh"], todo
    for b in todo:
        if b.lang == "yaml":
            cfg = yaml.safe_load(session.text(b.code))
            if cfg.get("delivery") == "exact":
                _, batch = next(build_exact(cfg).batches(0, 0))
                assert batch is not None
                images, labels = batch
            else:
                with build_pipeline(cfg) as df:
                    df.reset_state()
                    images, labels = next(iter(df))
            assert images.shape == (64, 224, 224, 3) and labels.shape == (64,)
        else:
            session.run_shell(b, lambda argv: lambda: True)
    assert (session.cwd / "train.lmdb").is_file()
    assert len(list((session.cwd / "shards").glob("shard-*.tar"))) == 1
    assert (session.cwd / "shards" / "checked.json").is_file()

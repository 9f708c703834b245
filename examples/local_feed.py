"""A broker and a producer on this host for the training examples, when no --egress is given.

The producer runs ``examples/imagenet_train.yaml`` on ``--data``: by default ImageNet's train
folder at ``/data/imagenet/train`` when it exists, else the demo dataset (512 JPEGs in 14
classes cut from the photos inside scikit-image, made once under ``~/.cache/feedline``; it
needs ``pip install '.[demo]'``). Both processes stop when the example ends (or dies).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

from feedline.procs import Daemon, free_port, wait_for

IMAGENET_TRAIN = "/data/imagenet/train"
PIPELINE = Path(__file__).resolve().parent / "imagenet_train.yaml"


def default_data() -> str:
    """ImageNet's train folder if this host has it, else the demo dataset (built if needed)."""
    if os.path.isdir(IMAGENET_TRAIN):
        return IMAGENET_TRAIN
    from feedline.producer.demo_data import build, default_dir

    data = build(default_dir(os.environ.get("XDG_CACHE_HOME"), count=512), count=512)
    print(f"no ImageNet at {IMAGENET_TRAIN}: training on the demo dataset in {data}")
    return str(data)


def add_data_flags(ap: argparse.ArgumentParser) -> None:
    """``--egress`` (an existing broker) and ``--data`` (what a local producer reads)."""
    ap.add_argument("--egress", default=None,
                    help="an existing broker's egress; default: start a broker and a "
                    "producer on this host")
    ap.add_argument("--data", default=None,
                    help=f"image folder for the local producer (default: {IMAGENET_TRAIN} "
                    "if it exists, else the demo dataset)")


@contextlib.contextmanager
def feed(egress: str | None, data: str | None) -> Iterator[str]:
    """Yield ``egress`` as is, or start a broker and a producer and yield their egress."""
    if egress is not None:
        yield egress
        return
    data = data or default_data()
    with tempfile.TemporaryDirectory(prefix="feedline-example-") as tmp:
        ingress, egress = f"tcp://127.0.0.1:{free_port()}", f"ipc://{tmp}/egress.sock"
        daemons = [Daemon("feedline.broker", ["--ingress", ingress, "--egress", egress,
                                     "--metrics-port", "0"], Path(tmp) / "broker.log")]
        daemons.append(Daemon("feedline.producer", ["--config", str(PIPELINE), "--data", data,
                                           "--broker", ingress, "--metrics-port", "0"],
                              Path(tmp) / "producer.log"))
        try:
            wait_for(lambda: Path(egress[len("ipc://"):]).exists() or not daemons[0].alive(),
                     30, what="the local broker")
            if not daemons[0].alive():
                raise SystemExit(f"the local broker did not start:\n{daemons[0].log_text()}")
            yield egress
        finally:
            for d in reversed(daemons):
                d.stop()

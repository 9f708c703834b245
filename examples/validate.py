"""Top-1 accuracy over exactly the validation set, with a producer killed half way.

    python examples/validate.py                     # broker + 2 producers here, see --data
    python examples/validate.py --data /my/imagenet/val --model my_model.keras
    python examples/validate.py --egress ipc:///tmp/feedline.sock   # producers already running

Without ``--egress`` it starts a broker and ``--producers`` (2) producers of
examples/imagenet_val.yaml (exact delivery, stream ``val``) on ``--data``:
``/data/imagenet/val`` (class sub-folders) when it exists, else the demo dataset (512 JPEGs in
14 classes cut from scikit-image's photos, made on first use; needs ``pip install
'.[demo]'``). Half way through the epoch it kills one producer with ``kill -9``
(``--no-kill-one``: it does not); the broker gives the dead producer's work unit to the other,
which makes the same batches again, and drops the ones it already had.

It reads one epoch with ``RemoteDataZMQ(egress, stream="val").epoch()``, runs the model on
every batch, and prints the top-1 accuracy and the samples it counted, which must be the
dataset's: every sample exactly once (exit status 1 otherwise). The model is ``--model`` (a
saved Keras model) or the small untrained one of examples/train_loop.py: the point here is
which samples are counted, not the accuracy.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf  # noqa: E402
from prometheus_client import CollectorRegistry  # noqa: E402
from train_loop import build_model  # noqa: E402  (examples/, next to this file)

from feedline import ConsumerOptions, RemoteDataZMQ  # noqa: E402
from feedline.metrics import serve_metrics  # noqa: E402
from feedline.procs import Daemon, free_port, wait_for  # noqa: E402
from feedline.producer.dataflow.image_folder import scan_folder  # noqa: E402
from feedline.scrape import scrape  # noqa: E402

IMAGENET_VAL = "/data/imagenet/val"
PIPELINE = Path(__file__).resolve().parent / "imagenet_val.yaml"
STREAM = "val"  # the pipeline file's stream
# Local daemons: a dead producer is noticed in 3 s (the default is 5 s) and producers run at
# most 2 batches ahead of the model, so that half way through the epoch they are still in
# the middle of their work units (as on a real dataset, far larger than the broker's buffer).
LIVENESS = ["--heartbeat-interval", "0.5", "--heartbeat-timeout", "3"]
BROKER_BUFFER = ["--max-batches", "2", "--producer-window", "1"]


def default_data() -> str:
    """ImageNet's validation folder if this host has it, else the demo dataset."""
    if os.path.isdir(IMAGENET_VAL):
        return IMAGENET_VAL
    from feedline.producer.demo_data import build, default_dir

    data = build(default_dir(os.environ.get("XDG_CACHE_HOME"), count=512), count=512)
    print(f"no ImageNet at {IMAGENET_VAL}: validating on the demo dataset in {data}")
    return str(data)


@dataclass
class Cluster:
    """The local broker and producers (or none of them, with --egress)."""

    egress: str
    producers: dict[str, Daemon] = field(default_factory=dict)  # by producer id
    broker_metrics: int | None = None


@contextlib.contextmanager
def local_cluster(data: str, producers: int) -> Iterator[Cluster]:
    """A broker and ``producers`` producers of the validation pipeline on ``data``; all of
    them stop when this ends (or this process dies)."""
    with tempfile.TemporaryDirectory(prefix="feedline-validate-") as tmp:
        ingress, egress = f"tcp://127.0.0.1:{free_port()}", f"ipc://{tmp}/egress.sock"
        metrics = free_port()
        broker = Daemon("feedline.broker", ["--ingress", ingress, "--egress", egress,
                                   "--metrics-port", str(metrics), "--metrics-addr",
                                   "127.0.0.1", "--state-dir", str(Path(tmp) / "state"),
                                   *BROKER_BUFFER, *LIVENESS],
                        Path(tmp) / "broker.log")
        cluster = Cluster(egress, {}, metrics)
        try:
            wait_for(lambda: Path(egress[len("ipc://"):]).exists() or not broker.alive(), 30,
                     what="the local broker")
            if not broker.alive():
                raise SystemExit(f"the local broker did not start:\n{broker.log_text()}")
            for i in range(producers):
                pid = f"val-{i}"
                cluster.producers[pid] = Daemon(
                    "producer", ["--config", str(PIPELINE), "--data", data, "--broker",
                                 ingress, "--id", pid, "--metrics-port", "0", *LIVENESS],
                    Path(tmp) / f"{pid}.log")
            yield cluster
        finally:
            for d in cluster.producers.values():
                d.stop()
            broker.stop()


@dataclass
class Tally:
    """What one epoch delivered: samples, hits, and where each batch came from."""

    samples: int = 0
    correct: int = 0
    per_class: collections.Counter[int] = field(default_factory=collections.Counter)
    batches: dict[tuple[int, int], str] = field(default_factory=dict)  # (unit, batch) -> id
    repeated: int = 0  # batches delivered twice: must stay 0
    # producer id -> its last batch delivered: (unit, index in the unit, the unit's last?)
    last: dict[str, tuple[int, int, bool]] = field(default_factory=dict)

    def add(self, producer: str, unit: int, index: int, last: bool, labels: np.ndarray,
            predicted: np.ndarray) -> None:
        if (unit, index) in self.batches:
            self.repeated += 1
        self.batches[(unit, index)] = producer
        self.last[producer] = (unit, index, last)
        self.samples += len(labels)
        self.correct += int(np.sum(predicted == labels))
        self.per_class.update(int(x) for x in labels)

    def by_producer(self) -> dict[str, int]:
        return dict(sorted(collections.Counter(self.batches.values()).items()))

    def shared_units(self) -> dict[int, list[str]]:
        """Units whose batches came from more than one producer (taken over)."""
        units: dict[int, set[str]] = collections.defaultdict(set)
        for (unit, _), pid in self.batches.items():
            units[unit].add(pid)
        return {u: sorted(p) for u, p in sorted(units.items()) if len(p) > 1}


def pick_victim(tally: Tally, producers: dict[str, Daemon]) -> str | None:
    """A live producer in the middle of a unit (its last batch seen was not its unit's last),
    the one least far into its unit (it has the most left to make), else one not seen yet (it
    holds a unit it has not delivered from); None if neither."""
    alive = [p for p, d in producers.items() if d.alive()]
    if len(alive) < 2:
        return None  # the last one standing finishes the epoch
    mid = sorted((tally.last[p][1], p) for p in alive if p in tally.last and not tally.last[p][2])
    unseen = [p for p in alive if p not in tally.last]
    return mid[0][1] if mid else unseen[0] if unseen else None


def load_model(path: str | None, classes: int) -> tf.keras.Model:
    if path:
        return tf.keras.models.load_model(path)
    tf.keras.utils.set_random_seed(0)  # the same untrained weights every run
    return build_model(classes)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--egress", default=None,
                    help="an existing broker's egress, with producers of imagenet_val.yaml "
                    "(stream val); default: start a broker and producers on this host")
    ap.add_argument("--data", default=None,
                    help=f"the validation image folder (class sub-folders); default: "
                    f"{IMAGENET_VAL} if it exists, else the demo dataset. With --egress: "
                    "optional, to check the count against it")
    ap.add_argument("--producers", type=int, default=2, help="local producers")
    ap.add_argument("--kill-one", action=argparse.BooleanOptionalAction, default=None,
                    help="kill -9 one local producer half way through the epoch (default: "
                    "on without --egress)")
    ap.add_argument("--model", default=None,
                    help="a saved Keras model (default: examples/train_loop.py's, untrained)")
    ap.add_argument("--classes", type=int, default=None,
                    help="classes of the default model (default: the dataset's, else 1000)")
    ap.add_argument("--metrics-port", type=int, default=0, help="Prometheus port; 0: off")
    args = ap.parse_args()
    if args.egress is not None and args.kill_one:
        ap.error("--kill-one kills a producer this script started: not with --egress")
    if args.producers < 1:
        ap.error("--producers must be >= 1")
    kill_one = args.kill_one if args.kill_one is not None else args.egress is None

    data = args.data if args.data or args.egress else default_data()
    expected: collections.Counter[int] | None = None
    if data:
        _, labels, classes = scan_folder(data)
        expected = collections.Counter(labels)
        print(f"validation set: {len(labels)} images in {len(classes)} classes ({data})")
    model = load_model(args.model, args.classes or (len(expected) if expected else 1000))
    predict = tf.function(lambda x: tf.argmax(model(x, training=False), axis=-1),
                          input_signature=[tf.TensorSpec([None, None, None, 3], tf.uint8)])

    registry = CollectorRegistry()
    serve_metrics(registry, args.metrics_port or None)
    feed = (contextlib.nullcontext(Cluster(args.egress)) if args.egress
            else local_cluster(data, args.producers))
    tally = Tally()
    killed: str | None = None
    with feed as cluster, RemoteDataZMQ(cluster.egress, stream=STREAM, timeout=120,
                                        return_meta=True,
                                        options=ConsumerOptions(registry=registry)) as remote:
        for batch in remote.epoch():
            images, labels = batch.datapoint
            tally.add(batch.producer, batch.unit, batch.index, batch.last, labels,
                      predict(images).numpy())
            if kill_one and killed is None and expected is not None \
                    and 2 * tally.samples >= expected.total():
                killed = pick_victim(tally, cluster.producers)
                if killed is not None:
                    cluster.producers[killed].kill9()
                    seen = tally.last.get(killed)
                    where = (f"in the middle of unit {seen[0]} (batch {seen[1]} of it was its "
                             "last delivered)" if seen else "before it delivered anything")
                    print(f"killed producer {killed} (kill -9) after {tally.samples} samples, "
                          f"{where}")
        duplicates = _duplicates(cluster.broker_metrics)
    return report(tally, expected, killed, duplicates)


def _duplicates(port: int | None) -> float | None:
    """Batches the local broker dropped because it had them already (re-made after a kill)."""
    if port is None:
        return None
    s = scrape(port)
    return None if s.error else s.total("feedline_broker_duplicate_batches_total",
                                        stream=STREAM)


def report(tally: Tally, expected: collections.Counter[int] | None, killed: str | None,
           duplicates: float | None) -> int:
    """Print the figures; 0 when the epoch was the dataset exactly once (as far as known)."""
    acc = tally.correct / tally.samples if tally.samples else 0.0
    size = f" (the dataset has {expected.total()})" if expected is not None else ""
    print(f"top-1 accuracy {acc:.4f} over {tally.samples} samples{size}")
    per = ", ".join(f"{p} {n}" for p, n in tally.by_producer().items())
    print(f"  batches by producer: {per}")
    for unit, pids in tally.shared_units().items():
        print(f"  unit {unit} was made by {' and '.join(pids)}"
              + (f" ({killed} was killed)" if killed in pids else ""))
    if duplicates is not None:
        print(f"  the broker dropped {duplicates:.0f} batches it already had")
    ok = tally.repeated == 0
    if tally.repeated:
        print(f"  {tally.repeated} batches were delivered twice")
    if expected is not None:
        same = tally.per_class == expected
        print("  per class: " + ("as in the dataset" if same else
                                 f"differs from the dataset: {dict(tally.per_class - expected)} "
                                 f"extra, {dict(expected - tally.per_class)} missing"))
        ok = ok and same and tally.samples == expected.total()
    print("every sample exactly once" if ok else "NOT the validation set exactly once")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

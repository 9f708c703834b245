"""Train from a feedline broker with Keras ``fit``, through a tf.data adapter.

    python examples/train_keras.py --steps 200               # broker + producer here, see --data
    python examples/train_keras.py --data /my/imagenet/train # the local producer reads this folder
    python examples/train_keras.py --egress ipc:///tmp/feedline.sock   # a broker already running

Without ``--egress`` it starts a broker and a producer on this host (examples/local_feed.py)
running examples/imagenet_train.yaml on ``--data``: ``/data/imagenet/train`` when it exists,
else the demo dataset (512 JPEGs cut from scikit-image's photos, made on first use; needs
``pip install '.[demo]'``), so it runs on any machine.

The dataset dequeues from a QueueInput inside tf.data (no Python generator per batch); an
OccupancyMonitor callback logs whether the input or the model is the bottleneck.
"""

from __future__ import annotations

import argparse
import logging
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf  # noqa: E402
from local_feed import add_data_flags, feed  # noqa: E402  (examples/, next to this file)
from prometheus_client import CollectorRegistry  # noqa: E402

from feedline import ConsumerOptions, OccupancyMonitor, QueueInput, RemoteDataZMQ, as_dataset  # noqa: E402
from feedline.metrics import serve_metrics  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_data_flags(ap)
    ap.add_argument("--steps", type=int, default=100, help="steps per epoch")
    ap.add_argument("--epochs", type=int, default=1, help="epochs")
    ap.add_argument("--classes", type=int, default=1000, help="number of classes")
    ap.add_argument("--capacity", type=int, default=50, help="FIFOQueue capacity (batches)")
    ap.add_argument("--metrics-port", type=int, default=0, help="Prometheus port; 0: off")
    ap.add_argument("--log-every", type=int, default=50, help="steps between summary lines")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")

    registry = CollectorRegistry()
    serve_metrics(registry, args.metrics_port or None)
    with feed(args.egress, args.data) as egress, \
            QueueInput(RemoteDataZMQ(egress, timeout=120,
                                     options=ConsumerOptions(registry=registry)),
                       capacity=args.capacity) as queue:
        monitor = OccupancyMonitor(queue, every=args.log_every, registry=registry)
        L = tf.keras.layers
        model = tf.keras.Sequential([
            L.Rescaling(1 / 127.5, offset=-1.0),
            L.Conv2D(16, 3, strides=2, activation="relu"),
            L.GlobalAveragePooling2D(),
            L.Dense(args.classes),
        ])
        model.compile(optimizer="adam",
                      loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        dataset = as_dataset(queue, map_fn=lambda batch: (batch[0], batch[1]))
        hist = model.fit(dataset, steps_per_epoch=args.steps, epochs=args.epochs, verbose=2,
                         callbacks=[monitor.keras_callback()])
    print(f"final loss {hist.history['loss'][-1]:.3f}; {monitor.summary()}")


if __name__ == "__main__":
    main()

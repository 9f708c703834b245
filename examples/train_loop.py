"""Train from a feedline broker with a custom step: QueueInput + StagingInput + tf.function.

    python examples/train_loop.py --steps 200               # broker + producer here, see --data
    python examples/train_loop.py --data /my/imagenet/train # the local producer reads this folder
    python examples/train_loop.py --egress ipc:///tmp/feedline.sock   # a broker already running

Without ``--egress`` it starts a broker and a producer on this host (examples/local_feed.py)
running examples/imagenet_train.yaml on ``--data``: ``/data/imagenet/train`` when it exists,
else the demo dataset (512 JPEGs cut from scikit-image's photos, made on first use; needs
``pip install '.[demo]'``), so it runs on any machine.

Expects batches of [uint8 images NHWC, int labels] (the ImageNet-style example pipelines).
"""

from __future__ import annotations

import argparse
import logging
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf  # noqa: E402
from local_feed import add_data_flags, feed  # noqa: E402  (examples/, next to this file)
from prometheus_client import CollectorRegistry  # noqa: E402

from feedline import ConsumerOptions, OccupancyMonitor, QueueInput, RemoteDataZMQ, StagingInput  # noqa: E402
from feedline.metrics import serve_metrics  # noqa: E402


def build_model(num_classes: int) -> tf.keras.Model:
    L = tf.keras.layers
    return tf.keras.Sequential([
        L.Rescaling(1 / 127.5, offset=-1.0),  # uint8 on the wire, normalised on the device
        L.Conv2D(16, 3, strides=2, activation="relu"),
        L.Conv2D(32, 3, strides=2, activation="relu"),
        L.GlobalAveragePooling2D(),
        L.Dense(num_classes),
    ])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_data_flags(ap)
    ap.add_argument("--steps", type=int, default=100, help="training steps")
    ap.add_argument("--classes", type=int, default=1000, help="number of classes")
    ap.add_argument("--capacity", type=int, default=50, help="FIFOQueue capacity (batches)")
    ap.add_argument("--nr-stage", type=int, default=1, help="batches staged ahead")
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
        staged = StagingInput(queue, nr_stage=args.nr_stage).start()
        monitor = OccupancyMonitor(queue, every=args.log_every, registry=registry)
        model = build_model(args.classes)
        optimizer = tf.keras.optimizers.SGD(0.01, momentum=0.9)

        @tf.function
        def step() -> tf.Tensor:
            images, labels = staged.get()
            with tf.GradientTape() as tape:
                logits = model(images, training=True)
                loss = tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(
                    labels, logits, from_logits=True))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
            return loss

        t0 = time.monotonic()
        for _ in range(args.steps):
            loss = step()
            monitor.step()
        dt = time.monotonic() - t0
    print(f"{args.steps} steps in {dt:.1f}s ({args.steps / dt:.1f} steps/s), "
          f"final loss {float(loss):.3f}; {monitor.summary()}")


if __name__ == "__main__":
    main()

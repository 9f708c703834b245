"""The demo's trainer: a small image classifier trained from the broker's stream.

RemoteDataZMQ -> QueueInput (FIFOQueue) -> StagingInput (Stage/Unstage) -> a ``tf.function``
step. Prints steps/s, images/s, MB/s, the loss and the queue verdict every few seconds, and a
per-producer table at the end. Used by ``feedline demo`` when TensorFlow is installed.

Steps and batches received differ by what the queues between the socket and the model held
at the start and at the end of the timed run (the queue fills before the clock starts, so an
input-bound run steps on more batches than it receives meanwhile): ``train`` returns both
counts so the demo can say so.
"""

from __future__ import annotations

import os
import time
from typing import Any


def small_classifier(num_classes: int = 1000) -> Any:
    """uint8 NHWC images -> logits. Normalisation happens on the device, inside the model."""
    import tensorflow as tf

    L = tf.keras.layers
    return tf.keras.Sequential([
        L.Rescaling(1 / 127.5, offset=-1.0),
        L.AveragePooling2D(4),  # the demo measures the input, not the model: keep it light
        L.Conv2D(16, 3, strides=2, activation="relu"),
        L.GlobalAveragePooling2D(),
        L.Dense(num_classes),
    ])


def train(egress: str, duration: float, report_every: float = 3.0) -> dict[str, Any]:
    """Train for ``duration`` seconds from the broker at ``egress``; returns the stats."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import tensorflow as tf

    from feedline.consumer import OccupancyMonitor, QueueInput, RemoteDataZMQ, StagingInput

    remote = RemoteDataZMQ(egress, timeout=60)
    queue = QueueInput(remote, capacity=16)
    with queue:
        staged = StagingInput(queue, nr_stage=1).start()
        monitor = OccupancyMonitor(queue, every=0)
        model = small_classifier()
        optimizer = tf.keras.optimizers.SGD(0.01)

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

        step()  # trace and warm up before the clock starts
        start_stats = remote.stats()
        # Batches received and not yet stepped on: the RemoteDataZMQ window, the QueueInput
        # (its thread's hand and its FIFO) and the staging area. Every step takes one of them.
        held_start = _received(start_stats) - 1
        t0 = last = time.monotonic()
        steps = last_steps = 0
        loss = float("nan")
        while time.monotonic() - t0 < duration:
            loss = float(step())
            monitor.step()
            steps += 1
            now = time.monotonic()
            if now - last >= report_every:
                print(f"  {now - t0:5.1f}s  {(steps - last_steps) / (now - last):6.1f} steps/s"
                      f"  loss {loss:6.3f}  {monitor.summary().split(': ', 1)[1]}", flush=True)
                last, last_steps = now, steps
        elapsed = time.monotonic() - t0
        end_stats = remote.stats()
        held_end = _received(end_stats) - 1 - steps
    return {"steps": steps, "seconds": elapsed, "loss": loss, "start": start_stats,
            "end": end_stats, "verdict": monitor.summary(), "held_start": held_start,
            "held_end": held_end}


def _received(stats: dict[str, Any]) -> int:
    return sum(s.received for s in stats.values())

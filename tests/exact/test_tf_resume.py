"""Resuming mid-epoch from a model checkpoint, with a real TensorFlow model and a real kill.

A training process takes batches of an exact stream, trains on them, saves a
``tf.train.Checkpoint`` holding the model and the cursor (``consumer.CursorState``), trains on
a few more batches, and is killed (``kill -9``: what it took after the checkpoint dies with
it). A new process restores the checkpoint and finishes the epoch. The sample ids the two
processes trained on up to their checkpoints are the epoch exactly once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests.support import ROOT
from tests.support.exact_run import BATCH, N, pipeline, producer

pytestmark = pytest.mark.tf

TRAINER = textwrap.dedent("""
    import json, os, signal, sys
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    sys.path.insert(0, sys.argv[4])
    import numpy as np
    import tensorflow as tf
    from feedline.consumer import ConsumerOptions, CursorState, RemoteDataZMQ
    from feedline.transport.link import LinkConfig

    egress, ckpt_dir, phase = sys.argv[1], sys.argv[2], sys.argv[3]
    model = tf.keras.Sequential([tf.keras.layers.Dense(1)])
    opt = tf.keras.optimizers.SGD(0.01)
    state = CursorState()
    ckpt = tf.train.Checkpoint(model=model, optimizer=opt, data=state,
                               seen=tf.Variable("", dtype=tf.string))
    latest = tf.train.latest_checkpoint(ckpt_dir)
    if latest:
        ckpt.restore(latest)
    seen = json.loads(ckpt.seen.numpy().decode() or "[]")
    link = LinkConfig(heartbeat_interval=0.2, heartbeat_timeout=1.5)
    remote = RemoteDataZMQ(egress, stream="val", timeout=60, resume=state.cursor,
                           options=ConsumerOptions(link=link))
    state.track(remote)

    def step(data, meta):
        x = tf.constant(data[:, :8].astype("float32") / 255.0)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x)))
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                model.trainable_variables))
        return [int(i) for i in meta[:, 0]]

    for k, (data, meta) in enumerate(remote.epoch()):
        seen += step(data, meta)
        if phase == "first" and k == 7:
            ckpt.seen.assign(json.dumps(seen))
            ckpt.save(os.path.join(ckpt_dir, "ckpt"))
        if phase == "first" and k == 12:
            os.kill(os.getpid(), signal.SIGKILL)  # 5 batches after the checkpoint
    ckpt.seen.assign(json.dumps(seen))
    ckpt.save(os.path.join(ckpt_dir, "ckpt"))
    print("DONE", len(seen), flush=True)
""")


def test_train_checkpoint_kill_restore_finish_the_epoch_exactly_once(broker_proc, daemons,
                                                                      endpoints, tmp_path):
    broker_proc("--state-dir", str(tmp_path / "state"))
    cfg = pipeline(tmp_path, epochs=1)
    for i in range(2):
        producer(daemons, cfg, endpoints.ingress, f"p{i}")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    first = subprocess.run([sys.executable, "-c", TRAINER, endpoints.egress, str(ckpt), "first",
                            str(ROOT)], capture_output=True, text=True, timeout=240, env=env)
    assert first.returncode == -9, first.stderr[-2000:]
    second = subprocess.run([sys.executable, "-c", TRAINER, endpoints.egress, str(ckpt),
                             "second", str(ROOT)], capture_output=True, text=True, timeout=240,
                            env=env)
    assert second.returncode == 0 and "DONE" in second.stdout, second.stderr[-2000:]
    import tensorflow as tf

    seen = json.loads(tf.train.load_variable(tf.train.latest_checkpoint(str(ckpt)),
                                             "seen/.ATTRIBUTES/VARIABLE_VALUE").decode())
    assert sorted(seen) == list(range(N)), (len(seen), N)
    assert len(seen) == N and N % BATCH == 0

"""What the input costs the training step: steps/s of a small MLP from several inputs.

Model: 1024 -> Dense(1024, relu) -> Dense(1), batch 256, float32, SGD. Inputs:

- ``dummy``:    DummyConstantInput, the same tensors every step (the ceiling)
- ``fresh``:    constant tensors too, but a different batch each step: 64 batches (64 MB, more
                than the caches hold) in a variable, one gathered (copied) per step. What new
                data every step costs the step by itself, whatever brings it
- ``feedline``: producer and broker processes pinned to core 1 (``taskset``), this process on
                core 0: RemoteDataZMQ -> QueueInput -> StagingInput -> the step
- ``direct``:   the same without the broker: a producer on core 1 sends to this process,
                which serves it (``RemoteDataZMQ(addr, bind=True)``, direct mode)
- ``feed``:     a numpy batch passed into the tf.function each step (the feed_dict pattern)

Rounds alternate between the variants; the report gives medians and the ratios the issue
asks for: feedline/dummy and feedline/feed (and direct/dummy), and, with ``fresh``, the
remote inputs against it: what is left once new data's own cost is out.

    python benchmarks/input_overhead.py --rounds 5 --steps 200
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

BATCH, WIDTH = 256, 1024
VARIANTS = ("dummy", "fresh", "feedline", "direct", "feed")
FRESH = 64  # batches the fresh variant turns through


def pin(core: int) -> None:
    if hasattr(os, "sched_setaffinity") and core < (os.cpu_count() or 1):
        os.sched_setaffinity(0, {core})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds")
    ap.add_argument("--steps", type=int, default=200, help="measured steps per run")
    ap.add_argument("--capacity", type=int, default=50,
                    help="QueueInput's capacity in batches (default 50, tensorpack's)")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS),
                    help="inputs to measure (default: all)")
    args = ap.parse_args()
    pin(0)  # before TensorFlow starts its thread pools: training gets core 0 only

    import numpy as np
    import tensorflow as tf
    import yaml

    from feedline.consumer import DummyConstantInput, QueueInput, RemoteDataZMQ, StagingInput
    from feedline.procs import Child, free_port, wait_for

    L = tf.keras.layers
    model = tf.keras.Sequential([tf.keras.Input((WIDTH,)), L.Dense(1024, activation="relu"),
                                 L.Dense(1)])
    opt = tf.keras.optimizers.SGD(0.001)

    def train(x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x, training=True) - y))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return loss

    def remote_step(staged: StagingInput) -> Any:
        return tf.function(lambda: train(*staged.get()))

    dummy = DummyConstantInput([[BATCH, WIDTH], [BATCH, 1]], [tf.float32, tf.float32]).start()
    step_dummy = tf.function(lambda: train(*dummy.dequeue()))
    step_feed = tf.function(train)

    def fresh_step() -> Any:
        """The ``fresh`` variant's step (its 64 MB of batches made only when it runs)."""
        rng = np.random.default_rng(2)
        fresh_x = tf.Variable(rng.random((FRESH, BATCH, WIDTH), dtype=np.float32))
        fresh_y = tf.Variable(rng.random((FRESH, BATCH, 1), dtype=np.float32))
        turn = tf.Variable(0, dtype=tf.int64)

        @tf.function
        def step() -> tf.Tensor:
            i = turn.assign_add(1) % FRESH
            return train(tf.gather(fresh_x, i), tf.gather(fresh_y, i))
        return step

    x_np = np.random.default_rng(0).random((BATCH, WIDTH), dtype=np.float32)
    y_np = np.random.default_rng(1).random((BATCH, 1), dtype=np.float32)

    work = Path(tempfile.mkdtemp(prefix="feedline-bench-"))
    ingress, egress = f"tcp://127.0.0.1:{free_port()}", f"ipc://{work}/egress.sock"
    cfg = work / "mlp.yaml"
    cfg.write_text(yaml.safe_dump({"source": {"fake": {
        "shapes": [[BATCH, WIDTH], [BATCH, 1]], "dtypes": ["float32", "float32"],
        "random": False, "size": 10**9}}}))
    other = ["taskset", "-c", "1"] if shutil.which("taskset") and (os.cpu_count() or 1) > 1 \
        else []
    py = sys.executable
    env = {"PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    direct = f"tcp://127.0.0.1:{free_port()}"
    daemons = []
    if "feedline" in args.variants:
        daemons += [
            Child([*other, py, "-m", "feedline.broker", "--ingress", ingress, "--egress",
                   egress, "--metrics-port", "0", "--log-level", "WARNING"],
                  work / "broker.log", env),
            Child([*other, py, "-m", "feedline.producer", "--config", str(cfg), "--broker",
                   ingress, "--log-level", "WARNING"], work / "producer.log", env)]
    if "direct" in args.variants:
        daemons.append(Child([*other, py, "-m", "feedline.producer", "--config", str(cfg),
                              "--broker", direct, "--id", "direct", "--log-level", "WARNING"],
                             work / "producer-direct.log", env))
    results: dict[str, list[float]] = {name: [] for name in args.variants}
    queues = []
    try:
        runs = {"dummy": step_dummy, "feed": lambda: step_feed(x_np, y_np)}
        if "fresh" in args.variants:
            runs["fresh"] = fresh_step()
        for name, addr, bind in (("feedline", egress, False), ("direct", direct, True)):
            if name not in args.variants:
                continue
            if not bind:
                wait_for(lambda: Path(egress[6:]).exists(), 30, what="broker")
            queue = QueueInput(RemoteDataZMQ(addr, timeout=60, bind=bind),
                               capacity=args.capacity,
                               name=f"{name}_queue").start()
            queues.append(queue)
            staged = StagingInput(queue, nr_stage=1).start()
            runs[name] = remote_step(staged)
        runs = {name: runs[name] for name in VARIANTS if name in args.variants}
        for fn in runs.values():  # trace and warm up
            for _ in range(10):
                fn()
        print(f"MLP {WIDTH}->1024->1, batch {BATCH}; training on core 0"
              f"{', producers and broker on core 1' if other else ''}; "
              f"{args.rounds} rounds x {args.steps} steps")
        for r in range(args.rounds):
            for name, fn in runs.items():
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    loss = fn()
                float(loss)  # wait for the last step
                sps = args.steps / (time.perf_counter() - t0)
                results[name].append(sps)
                print(f"  round {r + 1} {name:<9} {sps:7.1f} steps/s", flush=True)
        for queue in queues:
            queue.close()
    finally:
        for d in daemons:
            d.stop()
        shutil.rmtree(work, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in results.items()}
    print(f"\n{'input':<10} {'median steps/s':>15}")
    for k, v in med.items():
        print(f"{k:<10} {v:>15.1f}")
    for name, base, target in (("feedline", "dummy", 0.97), ("feedline", "feed", 1.8),
                               ("direct", "dummy", 0.97), ("fresh", "dummy", None),
                               ("feedline", "fresh", None), ("direct", "fresh", None)):
        if name in med and base in med:
            asked = f"  (target >= {target})" if target else ""
            print(f"{name} / {base} = {med[name] / med[base]:.2f}{asked}")
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": results, "median": med}, indent=2))


if __name__ == "__main__":
    main()

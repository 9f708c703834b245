"""TensorFlow input sources on the CPU: a real TF graph fed from a real broker."""

from __future__ import annotations

import logging
import os
import threading
import time

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
tf = pytest.importorskip("tensorflow")

from feedline.consumer import (  # noqa: E402
    ConsumerOptions,
    DummyConstantInput,
    OccupancyMonitor,
    QueueInput,
    RemoteDataZMQ,
    StagingInput,
    as_dataset,
)
from feedline.producer import send_dataflow  # noqa: E402
from feedline.transport.link import LinkConfig  # noqa: E402

pytestmark = pytest.mark.tf
FAST = LinkConfig(heartbeat_interval=0.2, heartbeat_timeout=1.5)


def _numbered(pid: int, n: int, rows: int = 8) -> list:
    """Batches whose values say (producer, index): x[i] = pid * 1000 + index."""
    return [[np.full((rows, 4), pid * 1000 + i, np.float32), np.full(rows, i, np.int64)]
            for i in range(n)]


def _send_in_thread(data: list, addr: str, pid: str) -> threading.Thread:
    t = threading.Thread(target=send_dataflow, args=(data, addr),
                         kwargs={"epochs": 1, "producer_id": pid, "link": FAST}, daemon=True)
    t.start()
    return t


def test_batches_reach_the_model_unchanged_and_in_producer_order(thread_broker, endpoints):
    thread_broker()
    senders = [_send_in_thread(_numbered(p, 30), endpoints.ingress, f"p{p}") for p in (1, 2)]
    remote = RemoteDataZMQ(endpoints.egress, timeout=30, options=ConsumerOptions(link=FAST))
    with QueueInput(remote, capacity=8) as q:
        staged = StagingInput(q, nr_stage=2).start()

        @tf.function
        def model_step():
            x, y = staged.get()
            return x, y, tf.reduce_sum(x)  # what the model sees, and a use of it

        seen: dict[int, list[int]] = {1: [], 2: []}
        for _ in range(58):  # 60 sent; 2 stay staged
            x, y, total = model_step()
            x = x.numpy()
            pid, idx = int(x[0, 0]) // 1000, int(y.numpy()[0])
            np.testing.assert_array_equal(x, np.full((8, 4), pid * 1000 + idx, np.float32))
            assert float(total) == pytest.approx(32 * (pid * 1000 + idx))
            seen[pid].append(idx)
    for t in senders:
        t.join(10)
    for pid in (1, 2):
        assert seen[pid] == sorted(seen[pid]), "each producer's batches in order"
    assert len(seen[1]) + len(seen[2]) == 58


def test_keras_fit_from_a_live_broker(thread_broker, endpoints):
    thread_broker()
    rng = np.random.default_rng(0)
    data = [[rng.random((16, 8), dtype=np.float32), rng.random((16, 1), dtype=np.float32)]
            for _ in range(40)]
    sender = _send_in_thread(data, endpoints.ingress, "keras")
    remote = RemoteDataZMQ(endpoints.egress, timeout=30, options=ConsumerOptions(link=FAST))
    with QueueInput(remote, capacity=8) as q:
        monitor = OccupancyMonitor(q, every=0)
        model = tf.keras.Sequential([tf.keras.Input((8,)), tf.keras.layers.Dense(4),
                                     tf.keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
        hist = model.fit(as_dataset(q, map_fn=lambda b: (b[0], b[1])), steps_per_epoch=6,
                         epochs=2, verbose=0, callbacks=[monitor.keras_callback()])
    sender.join(10)
    assert len(hist.history["loss"]) == 2 and all(np.isfinite(hist.history["loss"]))
    assert monitor.steps == 12
    assert remote.stats()["keras"].received >= 12


class _CountingInput:
    """A queue's dequeue(), counting the batches taken from it."""

    def __init__(self, q: QueueInput) -> None:
        self.q, self.taken = q, 0
        self.dtypes = q.dtypes

    def dequeue(self):
        self.taken += 1
        return self.q.dequeue()


def test_staging_on_the_cpu_keeps_order_and_primes_ahead():
    """StagingInput holds ``nr_stage`` batches staged ahead of the one the step uses: start()
    takes nr_stage from its input before any step, and each get() unstages the oldest and
    stages one more, so after k steps k + nr_stage have been taken and nr_stage are waiting."""
    data = [[np.full((3,), i, np.int32)] for i in range(20)]
    nr_stage = 3
    with QueueInput(data, capacity=4) as q:
        src = _CountingInput(q)
        st = StagingInput(src, nr_stage=nr_stage, device="/CPU:0").start()

        def staged() -> int:
            with tf.device(st.device):
                return int(tf.raw_ops.StageSize(dtypes=src.dtypes, shared_name=st.shared_name))

        assert src.taken == nr_stage and staged() == nr_stage, "primed before the first step"
        for k in range(1, 6):
            assert int(st.get()[0][0]) == k - 1  # in order, the oldest staged batch first
            assert src.taken == k + nr_stage and staged() == nr_stage, f"after step {k}"


def test_dummy_constant_input_has_the_queue_interface():
    d = DummyConstantInput([[4, 2], [4]], [tf.float32, tf.int64]).start()
    x, y = d.dequeue()
    assert x.shape == (4, 2) and y.dtype == tf.int64 and int(d.size()) == 0


def _occupancy(source, model_seconds: float, steps: int) -> float:
    with QueueInput(source, capacity=10) as q:
        mon = OccupancyMonitor(q, every=0, alpha=0.2)
        for _ in range(steps):
            q.dequeue()
            mon.step()
            time.sleep(model_seconds)
        return mon.average or 0.0


def test_occupancy_moves_with_the_slow_side(caplog):
    fast_source = [[np.zeros(4, np.float32)] for _ in range(200)]

    def slow_source():
        for _ in range(200):
            time.sleep(0.03)
            yield [np.zeros(4, np.float32)]

    model_bound = _occupancy(fast_source, model_seconds=0.02, steps=30)
    input_bound = _occupancy(slow_source(), model_seconds=0.0, steps=30)
    assert model_bound >= 0.5 > 0.1 >= input_bound, (model_bound, input_bound)
    with QueueInput(fast_source, capacity=10) as q, caplog.at_level(logging.INFO):
        mon = OccupancyMonitor(q, every=5)
        time.sleep(0.2)
        for _ in range(5):
            mon.step()
        assert "-> model-bound" in caplog.text and "queue 10/10" in caplog.text


def test_enqueue_thread_stops_cleanly_when_the_broker_is_gone(thread_broker, endpoints):
    tb = thread_broker()
    sender = _send_in_thread(_numbered(1, 5), endpoints.ingress, "p")
    remote = RemoteDataZMQ(endpoints.egress, timeout=None, options=ConsumerOptions(link=FAST))
    q = QueueInput(remote, capacity=4).start()
    for _ in range(5):
        q.dequeue()
    sender.join(10)
    tb.close()  # the broker is gone; the enqueue thread waits on the network forever
    assert q.thread_alive
    t0 = time.monotonic()
    q.close(timeout=15)
    assert not q.thread_alive
    assert time.monotonic() - t0 < 15  # bounded: close() did not hang on the dead broker


def test_a_producer_error_surfaces_at_dequeue(thread_broker, endpoints):
    thread_broker()

    def broken():
        yield [np.zeros(2, np.float32)]
        raise ValueError("bad shard 3")

    t = threading.Thread(target=lambda: pytest.raises(ValueError, send_dataflow, broken(),
                         endpoints.ingress, epochs=1, link=FAST), daemon=True)
    t.start()
    with QueueInput(RemoteDataZMQ(endpoints.egress, timeout=30,
                                  options=ConsumerOptions(link=FAST)), capacity=4) as q:
        q.dequeue()
        with pytest.raises(Exception, match="bad shard 3"):
            q.dequeue()
    t.join(10)


def test_mirrored_strategy_takes_batches_per_replica():
    data = [[np.full((4, 3), i, np.float32)] for i in range(30)]
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    with QueueInput(data, capacity=4) as q:
        dist = strategy.distribute_datasets_from_function(lambda ctx: as_dataset(q))
        it = iter(dist)

        @tf.function
        def step(batch):
            return strategy.run(lambda b: tf.reduce_sum(b[0]), args=(batch,))

        sums = [float(strategy.reduce("SUM", step(next(it)), axis=None)) for _ in range(3)]
    assert sums == [0.0, 12.0, 24.0]  # batches 0, 1, 2 in order, 12 values each

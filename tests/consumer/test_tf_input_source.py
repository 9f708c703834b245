"""The TensorFlow input sources share one base, InputSource (issue 11, item 5): what takes an
input source calls its methods, and refuses what is not one with a clear TypeError."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
tf = pytest.importorskip("tensorflow")

from feedline.consumer import (  # noqa: E402
    DummyConstantInput,
    InputSource,
    OccupancyMonitor,
    QueueInput,
    StagingInput,
    as_dataset,
)
from feedline.errors import DataError  # noqa: E402
from feedline.procs import wait_for  # noqa: E402

pytestmark = pytest.mark.tf


def _batches(n: int) -> list[list[np.ndarray]]:
    return [[np.full((2, 3), i, np.float32), np.full((2,), i, np.int64)] for i in range(n)]


class Foreign:
    """A source with reset_state() and close() that is no DataFlow (as RemoteDataZMQ)."""

    def __init__(self, n: int) -> None:
        self.data, self.resets, self.closes = _batches(n), 0, 0

    def reset_state(self) -> None:
        self.resets += 1

    def close(self) -> None:
        self.closes += 1

    def __iter__(self) -> Iterator[Any]:
        return iter(self.data)


def test_the_three_input_sources_derive_from_the_base() -> None:
    q = QueueInput(_batches(3), capacity=2)
    staged = StagingInput(q, device="/CPU:0")
    dummy = DummyConstantInput([[2, 3]], [tf.float32])
    for source in (q, staged, dummy):
        assert isinstance(source, InputSource)
    assert q.capacity == 2 and staged.capacity == 2 and dummy.capacity == 0
    with pytest.raises(AttributeError, match="known after start"):
        q.dtypes  # noqa: B018


@pytest.mark.parametrize("user", [
    lambda x: StagingInput(x, device="/CPU:0"),
    as_dataset,
    OccupancyMonitor,
], ids=["StagingInput", "as_dataset", "OccupancyMonitor"])
def test_what_is_not_an_input_source_is_refused_with_a_type_error(user: Any) -> None:
    with pytest.raises(TypeError, match=r"needs an input source|needs an InputSource"):
        user([[1.0], [2.0]])  # batches, not a source of them


def test_queue_input_gives_its_source_the_dataflow_contract() -> None:
    src = Foreign(6)
    with QueueInput(src, capacity=4) as q:
        assert src.resets == 1
        assert [int(q.dequeue()[1][0]) for _ in range(6)] == list(range(6))
    assert src.closes == 1


def test_queue_input_reads_a_generator_and_leaves_its_closing_to_the_thread() -> None:
    def gen() -> Iterator[Any]:
        yield from _batches(4)

    with QueueInput(gen(), capacity=4) as q:
        x, y = q.dequeue()
        assert x.shape == (2, 3) and int(y[0]) == 0
        assert isinstance(q.structure, list) and len(q.dtypes) == 2
        spec = q.element_spec
        assert spec[0].shape == (2, 3) and spec[1].dtype == tf.int64


def test_staging_input_is_an_input_source_over_its_input() -> None:
    with QueueInput({"x": b[0], "y": b[1]} for b in _batches(10)) as q:
        st = StagingInput(q, nr_stage=1, device="/CPU:0").start()
        assert st.structure is q.structure and st.shapes == q.shapes
        # The feeding thread may still be filling the queue: compare once it holds all ten
        # but the one the staging area took at start.
        wait_for(lambda: int(q.size()) == 9, 30, what="the queue to take the finite input")
        assert int(st.size()) == int(q.size())
        got = st.dequeue()  # what get() returns
        assert set(got) == {"x", "y"} and int(got["y"][0]) == 0
        assert int(st.get()["y"][0]) == 1
        st.close()
        assert not q.thread_alive


def test_a_subclass_of_the_base_serves_as_dataset_and_the_monitor() -> None:
    class Ones(InputSource):
        started = 0

        def start(self) -> Ones:
            self.started += 1
            return self

        @property
        def dtypes(self) -> list[Any]:
            return [tf.float32]

        def dequeue(self) -> Any:
            return tf.ones((2,))

    src = Ones()
    batches = list(as_dataset(src, prefetch=0).take(2))
    assert src.started == 1 and [b.numpy().tolist() for b in batches] == [[1.0, 1.0]] * 2
    monitor = OccupancyMonitor(src, every=0)
    assert monitor.capacity == 1 and monitor.step() == 0, "holds none: capacity 0 counts as 1"
    assert OccupancyMonitor(DummyConstantInput([[1]], [tf.int32]), every=0).step() == 0


def test_importing_the_base_does_not_import_tensorflow() -> None:
    code = ("import sys, consumer.input_source, consumer.bottleneck; "
            "assert 'tensorflow' not in sys.modules")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr


def _through_queue_input(points: list[Any]) -> list[list[np.ndarray]]:
    """What QueueInput's fast enqueue (the raw op) gives for ``points``."""
    with QueueInput(iter(points), capacity=8) as q:
        return [[t.numpy() for t in tf.nest.flatten(q.dequeue())] for _ in points]


def _through_fifo_queue(points: list[Any], dtypes: list[Any],
                        shapes: list[Any]) -> list[list[np.ndarray]]:
    """What ``FIFOQueue.enqueue`` (its Python wrapper's conversion) gives for ``points``."""
    q = tf.queue.FIFOQueue(8, dtypes, shapes=shapes)
    for p in points:
        q.enqueue(tf.nest.flatten(p))
    return [[t.numpy() for t in tf.nest.flatten(q.dequeue())] for _ in points]


def test_the_fast_enqueue_gives_what_the_queues_own_enqueue_gives() -> None:
    """QueueInput enqueues with the raw op (FIFOQueue.enqueue's wrapper cost 693 us a 1 MB
    batch against 95): arrays of the queue's dtype go as they are, anything else is converted
    to the queue's dtype as the wrapper does; the result is the same tensors."""
    first = [np.arange(6, dtype=np.float32).reshape(2, 3), np.array([1, 2], np.int64)]
    points = [first,
              [np.arange(6, dtype=np.float64).reshape(2, 3) / 7, np.array([3, 4], np.int32)],
              [np.arange(6).reshape(2, 3), np.array([7, 8], np.int16)]]  # converted
    dtypes, shapes = [tf.float32, tf.int64], [(2, 3), (2,)]
    want = _through_fifo_queue(points, dtypes, shapes)
    got = _through_queue_input(points)
    for w, g in zip(want, got, strict=True):
        for a, b in zip(w, g, strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape
            np.testing.assert_array_equal(a, b)
    # A datapoint the queue cannot hold is an error the training side sees, not a hang.
    for bad, error in (([np.ones((3, 3), np.float32), np.array([1, 2])],  # another shape
                        tf.errors.InvalidArgumentError),
                       ([np.ones((2, 3), np.float32)], DataError)):  # another structure
        with QueueInput(iter([first, bad]), capacity=8) as q:
            q.dequeue()
            with pytest.raises(error, match=r"(?i)shape|components"):
                q.dequeue()

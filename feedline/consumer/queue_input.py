"""QueueInput: batches from any iterable into a ``tf.queue.FIFOQueue``, off the training thread.

tensorpack's QueueInput for TensorFlow 2. A background thread takes datapoints from the source
(``RemoteDataZMQ`` or any DataFlow) and enqueues them; converting the arrays into tensors (the
one copy into TensorFlow) happens there, hidden behind the model's step. The training step
dequeues, eagerly or inside ``tf.function``. The queue holds at most ``capacity`` batches.

The source gets the DataFlow contract (:func:`feedline.producer.dataflow.base.as_dataflow`): its
``reset_state()`` runs at :meth:`QueueInput.start` and its ``close()`` at
:meth:`QueueInput.close`, where it has them. Dtypes, shapes and the datapoint's structure
(list, tuple or dict of arrays) come from the first batch unless given. Errors travel: if
the source raises (a producer's failure, a timeout), the queue is closed and
:meth:`dequeue` raises that error, not a bare OutOfRange.
"""

from __future__ import annotations

import inspect
import logging
import threading
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from feedline.consumer.input_source import InputSource
from feedline.errors import ConfigError, DataError, UsageError
from feedline.producer.dataflow.base import as_dataflow

log = logging.getLogger(__name__)


def _leaf_spec(x: Any) -> tuple[tf.DType, tuple[int, ...]]:
    if isinstance(x, (str, bytes)):
        return tf.string, ()
    arr = np.asarray(x)
    return tf.as_dtype(arr.dtype), tuple(arr.shape)


class QueueInput(InputSource):
    """Feeds ``source`` into a FIFOQueue of ``capacity`` batches from a background thread.

    Use :meth:`start` (or the ``with`` block) before :meth:`dequeue`; :meth:`close` stops the
    thread within bounded time, whether the source is alive, stalled or gone.
    ``shapes=None`` fixes shapes from the first batch; pass ``dynamic_shapes=True`` when the
    batch size varies (a last partial batch), at the cost of unknown static shapes.
    """

    def __init__(
        self,
        source: Iterable[Any],
        capacity: int = 50,
        dtypes: Sequence[tf.DType] | None = None,
        shapes: Sequence[Sequence[int | None]] | None = None,
        dynamic_shapes: bool = False,
        name: str = "feedline_queue",
    ) -> None:
        if capacity < 1:
            raise ConfigError("capacity must be >= 1")
        self.source, self._capacity, self.name = source, capacity, name
        self._flow = as_dataflow(source)
        self._want_dtypes, self._want_shapes, self._dynamic = dtypes, shapes, dynamic_shapes
        self.queue: tf.queue.FIFOQueue | None = None
        self._structure: Any = None  # the first datapoint: the shape of every batch
        self._dtypes: list[tf.DType] | None = None
        self._shapes: list[tf.TensorShape] | None = None
        self._iter: Iterator[Any] | None = None
        self._first: list[Any] | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self.enqueued = 0

    # ------------------------------------------------------------------ set-up and thread
    def start(self) -> QueueInput:
        """Create the queue (reading the first batch if dtypes/shapes are not given) and
        start the enqueue thread. Idempotent."""
        if self.queue is not None:
            return self
        self._flow.reset_state()
        self._iter = iter(self._flow)
        first = next(self._iter)  # the structure, and (if not given) dtypes and shapes
        self._structure = first
        flat = tf.nest.flatten(first)
        specs = [_leaf_spec(x) for x in flat]
        dtypes = (list(self._want_dtypes) if self._want_dtypes is not None
                  else [d for d, _ in specs])
        shapes: list[tf.TensorShape] | None
        if self._dynamic:
            shapes = None
        elif self._want_shapes is not None:
            shapes = [tf.TensorShape(s) for s in self._want_shapes]
        else:
            shapes = [tf.TensorShape(s) for _, s in specs]
        if len(dtypes) != len(flat):
            raise ConfigError(f"{len(dtypes)} dtypes for a datapoint of {len(flat)} components")
        self._dtypes = dtypes
        self._shapes = shapes
        with tf.device("/CPU:0"):
            self.queue = tf.queue.FIFOQueue(self.capacity, dtypes, shapes=shapes,
                                            name=self.name)
        self._first = flat
        self._thread = threading.Thread(target=self._run, name=f"{self.name}-enqueue",
                                        daemon=True)
        self._thread.start()
        return self

    def _components(self, flat: list[Any], kinds: list[tuple[tf.DType, Any]]) -> list[Any]:
        """What the enqueue op takes: arrays of the queue's dtypes as they are (the op's own
        conversion is the one copy), anything else converted to the queue's dtype as
        ``FIFOQueue.enqueue`` would. ``kinds``: (dtype, numpy dtype) of each component."""
        if len(flat) != len(kinds):
            raise DataError(f"a datapoint of {len(flat)} components for a queue of "
                            f"{len(kinds)}: every batch must have the first one's structure")
        return [c if isinstance(c, np.ndarray) and c.dtype == nd
                else tf.convert_to_tensor(c, dtype=dt)
                for c, (dt, nd) in zip(flat, kinds, strict=True)]

    def _run(self) -> None:
        assert self.queue is not None and self._iter is not None and self._dtypes is not None
        # The raw op, not FIFOQueue.enqueue: its Python wrapper converts and checks every
        # component on its own (693 us a 1 MB batch on the development machine, against 95
        # for the op; benchmarks/input_overhead.py). The queue's kernel checks the dtypes and
        # shapes all the same.
        kinds = [(dt, dt.as_numpy_dtype) for dt in self._dtypes]
        enqueue, handle = tf.raw_ops.QueueEnqueueV2, self.queue.queue_ref
        try:
            pending = self._first
            self._first = None
            while not self._stop.is_set():
                if pending is None:
                    pending = tf.nest.flatten(next(self._iter))
                # blocks while full; close() cancels it
                enqueue(handle=handle, components=self._components(pending, kinds))
                self.enqueued += 1
                pending = None
        except StopIteration:
            log.info("%s: source exhausted after %d batches", self.name, self.enqueued)
        except (tf.errors.CancelledError, tf.errors.OutOfRangeError):
            pass  # close() cancelled a pending enqueue
        except BaseException as e:
            if not self._stop.is_set():
                self._error = e
                log.error("%s: the input source failed: %s", self.name, e)
        finally:
            try:
                self.queue.close(cancel_pending_enqueues=True)
            except Exception:  # already closed
                pass

    # ------------------------------------------------------------------ training side
    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def dtypes(self) -> list[tf.DType]:
        if self._dtypes is None:
            raise AttributeError("QueueInput.dtypes: known after start() (from the first "
                                 "batch)")
        return self._dtypes

    @property
    def shapes(self) -> list[tf.TensorShape] | None:
        return self._shapes

    @property
    def structure(self) -> Any:
        return self._structure

    def dequeue(self) -> Any:
        """One batch as tensors, in the source's structure. Works inside ``tf.function``."""
        if self.queue is None:
            raise UsageError("QueueInput.start() must be called first")
        if tf.executing_eagerly():
            try:
                flat = self.queue.dequeue()
            except tf.errors.OutOfRangeError:
                self.raise_if_failed()
                raise
        else:
            flat = self.queue.dequeue()
        if not isinstance(flat, (list, tuple)):
            flat = [flat]  # a one-component queue dequeues a bare tensor
        if self.shapes is not None and not tf.executing_eagerly():
            for t, s in zip(flat, self.shapes, strict=True):
                t.set_shape(s)
        return tf.nest.pack_sequence_as(self.structure, list(flat))

    def size(self) -> tf.Tensor:
        """Batches waiting in the queue now."""
        assert self.queue is not None
        return self.queue.size()

    def raise_if_failed(self) -> None:
        """Raise the source's error, if it failed (call after an OutOfRangeError)."""
        if self._error is not None:
            raise self._error

    @property
    def element_spec(self) -> Any:
        assert self.queue is not None
        return super().element_spec

    def close(self, timeout: float = 10.0) -> None:
        """Stop the thread: cancel a blocked enqueue, close the source, join (bounded)."""
        self._stop.set()
        if self.queue is not None:
            try:
                self.queue.close(cancel_pending_enqueues=True)
            except Exception:
                pass
        # RemoteDataZMQ.close() unblocks a thread waiting on the network. A generator cannot
        # be closed while the thread runs it; the thread sees the stop flag at its next item.
        if not inspect.isgenerator(self.source):
            self._flow.close()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("%s: enqueue thread did not stop within %.0fs", self.name, timeout)

    @property
    def thread_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def __enter__(self) -> QueueInput:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

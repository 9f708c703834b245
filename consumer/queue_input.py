"""QueueInput: batches from any iterable into a ``tf.queue.FIFOQueue``, off the training thread.

tensorpack's QueueInput for TensorFlow 2. A background thread takes datapoints from the source
(``RemoteDataZMQ`` or any DataFlow) and enqueues them; converting the arrays into tensors (the
one copy into TensorFlow) happens there, hidden behind the model's step. The training step
dequeues, eagerly or inside ``tf.function``. The queue holds at most ``capacity`` batches.

Dtypes, shapes and the datapoint's structure (list, tuple or dict of arrays) come from the
first batch unless given. Errors travel: if the source raises (a producer's failure, a
timeout), the queue is closed and :meth:`dequeue` raises that error, not a bare OutOfRange.
"""

from __future__ import annotations

import inspect
import logging
import threading
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

log = logging.getLogger(__name__)


def _leaf_spec(x: Any) -> tuple[tf.DType, tuple[int, ...]]:
    if isinstance(x, (str, bytes)):
        return tf.string, ()
    arr = np.asarray(x)
    return tf.as_dtype(arr.dtype), tuple(arr.shape)


class QueueInput:
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
            raise ValueError("capacity must be >= 1")
        self.source, self.capacity, self.name = source, capacity, name
        self._dtypes, self._shapes, self._dynamic = dtypes, shapes, dynamic_shapes
        self.queue: tf.queue.FIFOQueue | None = None
        self.structure: Any = None  # the first datapoint: the shape of every batch
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
        reset = getattr(self.source, "reset_state", None)
        if reset is not None:
            reset()
        self._iter = iter(self.source)
        first = next(self._iter)  # the structure, and (if not given) dtypes and shapes
        self.structure = first
        flat = tf.nest.flatten(first)
        specs = [_leaf_spec(x) for x in flat]
        dtypes = list(self._dtypes) if self._dtypes is not None else [d for d, _ in specs]
        if self._dynamic:
            shapes = None
        elif self._shapes is not None:
            shapes = [tf.TensorShape(s) for s in self._shapes]
        else:
            shapes = [tf.TensorShape(s) for _, s in specs]
        if len(dtypes) != len(flat):
            raise ValueError(f"{len(dtypes)} dtypes for a datapoint of {len(flat)} components")
        self.dtypes = dtypes
        self.shapes = shapes
        with tf.device("/CPU:0"):
            self.queue = tf.queue.FIFOQueue(self.capacity, dtypes, shapes=shapes,
                                            name=self.name)
        self._first = flat
        self._thread = threading.Thread(target=self._run, name=f"{self.name}-enqueue",
                                        daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        assert self.queue is not None and self._iter is not None
        try:
            pending = self._first
            self._first = None
            while not self._stop.is_set():
                if pending is None:
                    pending = tf.nest.flatten(next(self._iter))
                self.queue.enqueue(pending)  # blocks while full; close() cancels it
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
    def dequeue(self) -> Any:
        """One batch as tensors, in the source's structure. Works inside ``tf.function``."""
        if self.queue is None:
            raise RuntimeError("QueueInput.start() must be called first")
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
        shapes = self.shapes or [tf.TensorShape(None)] * len(self.dtypes)
        specs = [tf.TensorSpec(s, d) for s, d in zip(shapes, self.dtypes, strict=True)]
        return tf.nest.pack_sequence_as(self.structure, specs)

    def close(self, timeout: float = 10.0) -> None:
        """Stop the thread: cancel a blocked enqueue, close the source, join (bounded)."""
        self._stop.set()
        if self.queue is not None:
            try:
                self.queue.close(cancel_pending_enqueues=True)
            except Exception:
                pass
        close = getattr(self.source, "close", None)
        # RemoteDataZMQ.close() unblocks a thread waiting on the network. A generator cannot
        # be closed while the thread runs it; the thread sees the stop flag at its next item.
        if close is not None and not inspect.isgenerator(self.source):
            close()
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

"""The bottleneck answer: is the input or the model the slow side?

Sample the input queue's occupancy once per step. A queue that stays full means batches wait
for the model (model-bound: the input keeps up). A queue that stays empty means the model
waits for batches (input-bound: add producers or make the pipeline faster). The monitor keeps
an exponential moving average, logs a summary line at INFO every ``every`` steps (the Keras
callback prints it instead: a user who added it to ``fit`` sees it without configuring
logging), and exports the same figures as Prometheus gauges from the training process. The
verdict it gives is held until the average is clearly on another side for a few steps
(:class:`feedline.verdict.VerdictTracker`), so a steady run does not flap between input-bound
and model-bound.
"""

from __future__ import annotations

import logging
from typing import Any

from prometheus_client import CollectorRegistry

from feedline.consumer.input_source import Occupancy
from feedline.consumer.metrics import QueueMetrics
from feedline.verdict import VerdictTracker

log = logging.getLogger(__name__)


class OccupancyMonitor:
    """Call :meth:`step` once per training step (or use :meth:`keras_callback`).

    ``input`` is what holds the batches: an :class:`~feedline.consumer.input_source.InputSource`
    (a QueueInput; a StagingInput's is its input's queue), or anything with ``size()`` and
    ``capacity`` (:class:`~feedline.consumer.input_source.Occupancy`); anything else is a TypeError.
    A capacity of 0 (a source that holds none) counts as 1.
    """

    def __init__(self, input: Occupancy, every: int = 100, alpha: float = 0.05,
                 registry: CollectorRegistry | None = None, name: str = "input") -> None:
        if not isinstance(input, Occupancy):
            raise TypeError(f"OccupancyMonitor needs an input source with size() and "
                            f"capacity (a QueueInput), not {type(input).__name__}")
        self.input, self.every, self.alpha = input, every, alpha
        self.capacity = int(input.capacity) or 1
        self.metrics = QueueMetrics(registry if registry is not None else CollectorRegistry(),
                                    name)
        self.metrics.capacity.set(self.capacity)
        self.average: float | None = None  # of size / capacity
        self.steps = 0
        self.last_size = 0
        self.tracker = VerdictTracker()

    def step(self, *, echo: bool = False) -> int:
        """Sample the queue now; every ``every`` steps, the summary line: logged at INFO, or
        with ``echo`` printed to stdout instead. Returns the size."""
        size = int(self.input.size())
        ratio = size / self.capacity
        self.average = ratio if self.average is None else (
            self.alpha * ratio + (1 - self.alpha) * self.average)
        self.steps += 1
        self.last_size = size
        self.metrics.size.set(size)
        self.metrics.average.set(self.average)
        self.tracker.update(self.average)
        if self.every and self.steps % self.every == 0:
            if echo:
                # A line of its own: Keras' progress bar may be mid-line (Keras' own
                # callbacks, e.g. ModelCheckpoint, start their messages the same way).
                print(f"\n{self.summary()}", flush=True)
            else:
                log.info("%s", self.summary())
        return size

    def summary(self) -> str:
        avg = self.average or 0.0
        return (f"step {self.steps}: queue {self.last_size}/{self.capacity} "
                f"(avg {avg * self.capacity:.1f}) -> {self.verdict}")

    @property
    def verdict(self) -> str:
        """'input-bound', 'balanced' or 'model-bound' (held: see the module docstring);
        'unknown' before the first step."""
        return self.tracker.current or "unknown"

    def keras_callback(self, verbose: int = 1) -> Any:
        """A Keras callback that calls :meth:`step` after each training batch. ``verbose=1``
        (the default) prints the summary line every ``every`` steps, as Keras' own callbacks
        print theirs; ``verbose=0`` logs it at INFO, as :meth:`step` does."""
        import tensorflow as tf

        monitor, echo = self, bool(verbose)

        class _Callback(tf.keras.callbacks.Callback):
            def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
                monitor.step(echo=echo)

        return _Callback()

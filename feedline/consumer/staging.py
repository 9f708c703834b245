"""StagingInput: the copy to the accelerator overlapped with the previous step.

tensorpack's StagingInput for TensorFlow 2, with ``tf.raw_ops.Stage``/``Unstage`` on a staging
area identified by a shared name (``data_flow_ops.StagingArea`` does not work inside
``tf.function``). :meth:`prime` stages ``nr_stage`` batches; each :meth:`get` then unstages one
batch (already on the device) and stages the next. Stage is a stateful op, so inside a
``tf.function`` it runs even though nothing consumes its output, in parallel with the model's
work on the batch just unstaged: the host-to-device copy hides behind the step.

Without a GPU it stages on the CPU (still overlapping the dequeue) and says so once.
"""

from __future__ import annotations

import itertools
import logging
from typing import Any

import tensorflow as tf

from feedline.consumer.input_source import InputSource, as_input_source
from feedline.errors import ConfigError, UsageError

log = logging.getLogger(__name__)
_names = itertools.count()
_warned_cpu = False


def default_device() -> str:
    """The first GPU, or the CPU (logged once) on a machine without one."""
    global _warned_cpu
    if tf.config.list_logical_devices("GPU"):
        return "/GPU:0"
    if not _warned_cpu:
        log.warning("StagingInput: no GPU visible; staging on /CPU:0 (no device copy to hide)")
        _warned_cpu = True
    return "/CPU:0"


class StagingInput(InputSource):
    """Stages batches from ``input`` on ``device``, ``nr_stage`` ahead of the step that uses
    them.

    ``input`` is an :class:`~feedline.consumer.input_source.InputSource` (started and closed with
    this one), or anything with ``dequeue()`` and ``dtypes`` (used as it is); anything else
    is a TypeError. ``dtypes``, ``shapes``, ``structure``, ``capacity`` and ``size()`` are
    the input's (the occupancy to watch is its queue's); :meth:`dequeue` is :meth:`get`.
    """

    def __init__(self, input: Any, nr_stage: int = 1, device: str | None = None) -> None:
        if nr_stage < 1:
            raise ConfigError("nr_stage must be >= 1")
        self.input, self.nr_stage = as_input_source(input, "StagingInput"), nr_stage
        self.device = device or default_device()
        self.shared_name = f"feedline_staging_{next(_names)}"
        self._primed = False

    def start(self) -> StagingInput:
        self.input.start()
        self.prime()
        return self

    def _stage(self) -> Any:
        flat = tf.nest.flatten(self.input.dequeue())
        with tf.device(self.device):
            return tf.raw_ops.Stage(values=flat, shared_name=self.shared_name)

    def prime(self) -> None:
        """Stage the first ``nr_stage`` batches (eagerly, before the first step)."""
        if self._primed:
            return
        for _ in range(self.nr_stage):
            self._stage()
        self._primed = True

    def get(self) -> Any:
        """Unstage the oldest batch (on the device) and stage the next one.

        Call it once per step, inside the step's ``tf.function`` (or eagerly).
        """
        if not self._primed:
            raise UsageError("StagingInput.start() (or prime()) must run before get()")
        dtypes = list(self.input.dtypes)
        with tf.device(self.device):
            out = tf.raw_ops.Unstage(dtypes=dtypes, shared_name=self.shared_name)
        self._stage()  # the next batch's copy runs while the model works on `out`
        shapes = self.input.shapes
        if shapes is not None and not tf.executing_eagerly():
            for t, s in zip(out, shapes, strict=True):
                t.set_shape(s)
        structure = self.input.structure
        return tf.nest.pack_sequence_as(structure, list(out)) if structure else list(out)

    def dequeue(self) -> Any:
        """:meth:`get`: a staged batch, so that a StagingInput is an input source too."""
        return self.get()

    @property
    def dtypes(self) -> list[tf.DType]:
        return list(self.input.dtypes)

    @property
    def shapes(self) -> list[tf.TensorShape] | None:
        return self.input.shapes

    @property
    def structure(self) -> Any:
        return self.input.structure

    @property
    def capacity(self) -> int:
        return self.input.capacity

    def size(self) -> Any:
        return self.input.size()

    def close(self) -> None:
        self.input.close()

    def __enter__(self) -> StagingInput:
        return self.start()

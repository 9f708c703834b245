"""DummyConstantInput: the same constant batch every step, the speed ceiling of any input."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf


class DummyConstantInput:
    """Constant zero tensors of ``shapes`` and ``dtypes``, created once on ``device``.

    Has the interface of :class:`consumer.QueueInput` (``start``, ``dequeue``, ``size``,
    ``close``), so a training loop can swap it in to measure what the input costs.
    """

    def __init__(self, shapes: Sequence[Sequence[int]], dtypes: Sequence[Any],
                 device: str = "/CPU:0") -> None:
        if len(shapes) != len(dtypes):
            raise ValueError(f"{len(shapes)} shapes for {len(dtypes)} dtypes")
        self.shapes = [tf.TensorShape(s) for s in shapes]
        self.dtypes = [tf.as_dtype(d) for d in dtypes]
        self.device = device
        self._tensors: list[tf.Tensor] | None = None

    def start(self) -> DummyConstantInput:
        if self._tensors is None:
            with tf.device(self.device):
                self._tensors = [tf.zeros(s, d) for s, d in zip(self.shapes, self.dtypes,
                                                                 strict=True)]
        return self

    def dequeue(self) -> list[tf.Tensor]:
        if self._tensors is None:
            self.start()
        assert self._tensors is not None
        return list(self._tensors)

    def size(self) -> tf.Tensor:
        return tf.constant(0, tf.int32)

    @property
    def element_spec(self) -> list[tf.TensorSpec]:
        return [tf.TensorSpec(s, d) for s, d in zip(self.shapes, self.dtypes, strict=True)]

    def close(self) -> None:
        self._tensors = None

    def __enter__(self) -> DummyConstantInput:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

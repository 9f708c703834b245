"""DummyConstantInput: the same constant batch every step, the speed ceiling of any input."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from feedline.consumer.input_source import InputSource
from feedline.errors import ConfigError


class DummyConstantInput(InputSource):
    """Constant zero tensors of ``shapes`` and ``dtypes``, created once on ``device``.

    An :class:`~feedline.consumer.input_source.InputSource` like :class:`consumer.QueueInput`
    (``start``, ``dequeue``, ``size``, ``close``; a flat list, ``capacity`` 0), so a training
    loop can swap it in to measure what the input costs.
    """

    def __init__(self, shapes: Sequence[Sequence[int]], dtypes: Sequence[Any],
                 device: str = "/CPU:0") -> None:
        if len(shapes) != len(dtypes):
            raise ConfigError(f"{len(shapes)} shapes for {len(dtypes)} dtypes")
        self._shapes = [tf.TensorShape(s) for s in shapes]
        self._dtypes = [tf.as_dtype(d) for d in dtypes]
        self.device = device
        self._tensors: list[tf.Tensor] | None = None

    @property
    def dtypes(self) -> list[tf.DType]:
        return self._dtypes

    @property
    def shapes(self) -> list[tf.TensorShape]:
        return self._shapes

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

    def close(self) -> None:
        self._tensors = None

    def __enter__(self) -> DummyConstantInput:
        return self.start()

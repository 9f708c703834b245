"""A pipeline factory for the stream tests (tests/broker/test_broker_pipelines.py): a run that
fails.

Named in a pipeline file as ``factory: tests.support.stream_data:failing`` (the daemons fixture
puts the
repository root on the path).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np


class Failing:
    """``after`` batches of one int32 array of 8 (the batch's index), then a ``KeyError`` (a
    pipeline error that travels to the consumers as ``ProducerError``)."""

    def __init__(self, after: int) -> None:
        self.after = after

    def __iter__(self) -> Iterator[list[np.ndarray]]:
        for i in range(self.after):
            yield [np.full(8, i, np.int32)]
        raise KeyError("corrupt-record-of-the-old-run")


def failing(after: int = 3) -> Failing:
    return Failing(after)

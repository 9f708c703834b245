"""A pipeline factory for the stream tests (tests/broker/test_broker_pipelines.py): a run that
fails.

Named in a pipeline file as ``factory: tests.support.stream_data:failing`` (the daemons fixture
puts the
repository root on the path).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np


class Failing:
    """``after`` batches of one int32 array of 8 (the batch's index), then a ``KeyError`` (a
    pipeline error that travels to the consumers as ``ProducerError``). With ``fixed``: once
    that file exists, the same pipeline file runs without failing (batches forever): a
    crash, then the same pipeline started again once its data was mended."""

    def __init__(self, after: int, fixed: str | None = None) -> None:
        self.after, self.fixed = after, fixed

    def __iter__(self) -> Iterator[list[np.ndarray]]:
        mended = self.fixed is not None and os.path.exists(self.fixed)
        i = 0
        while mended or i < self.after:
            yield [np.full(8, i, np.int32)]
            i += 1
        raise KeyError("corrupt-record-of-the-old-run")


def failing(after: int = 3, fixed: str | None = None) -> Failing:
    return Failing(after, fixed)

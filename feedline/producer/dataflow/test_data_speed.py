"""TestDataSpeed: how fast a DataFlow yields, with a progress bar."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from feedline.errors import ConfigError, DataError
from feedline.producer.dataflow.base import as_dataflow


class TestDataSpeed:
    """Iterate ``ds`` for ``size`` datapoints (passes repeat as needed) after ``warmup``
    untimed ones, showing a tqdm bar; :meth:`start` returns datapoints per second.

    (Not a DataFlow; named as in tensorpack. ``__test__`` keeps pytest from collecting it.)
    """

    __test__ = False

    def __init__(self, ds: Iterable[Any], size: int = 5000, warmup: int = 0,
                 disable_progress: bool = False) -> None:
        if size < 1:
            raise ConfigError("size must be >= 1")
        self.ds, self.size, self.warmup = as_dataflow(ds), size, warmup
        self.disable_progress = disable_progress
        self.rate = 0.0

    def _stream(self) -> Any:
        empty = True
        while True:
            for dp in self.ds:
                empty = False
                yield dp
            if empty:
                raise DataError("the dataflow yielded nothing in a whole pass")

    def start(self) -> float:
        """Run the test; returns (and stores in ``rate``) datapoints per second."""
        self.ds.reset_state()
        stream = self._stream()
        for _ in range(self.warmup):
            next(stream)
        from tqdm import tqdm  # here, not at the top: every producer imports this module

        with tqdm(total=self.size, unit="dp", smoothing=0.1, dynamic_ncols=True,
                  disable=self.disable_progress) as bar:
            t0 = time.perf_counter()
            for _ in range(self.size):
                next(stream)
                bar.update(1)
            elapsed = time.perf_counter() - t0
        stream.close()
        self.rate = self.size / elapsed if elapsed > 0 else float("inf")
        return self.rate

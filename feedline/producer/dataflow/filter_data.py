"""FilterData: keep the datapoints a predicate accepts."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from feedline.producer.dataflow.base import DataFlow, ProxyDataFlow, UnknownLength


class FilterData(ProxyDataFlow):
    """Yield the datapoints for which ``func(dp)`` is true. Has no ``len``."""

    def __init__(self, ds: DataFlow, func: Callable[[Any], bool]) -> None:
        super().__init__(ds)
        self.func = func

    def __len__(self) -> int:
        raise UnknownLength("FilterData has no length")

    def __iter__(self) -> Iterator[Any]:
        for dp in self.ds:
            if self.func(dp):
                yield dp

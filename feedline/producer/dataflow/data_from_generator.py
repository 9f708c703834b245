"""DataFromGenerator: datapoints from a generator function."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from feedline.errors import UsageError
from feedline.producer.dataflow.base import DataFlow, UnknownLength


class DataFromGenerator(DataFlow):
    """Yield what ``gen()`` yields, calling it again for every pass.

    ``gen`` may also be an iterator, which then supports a single pass only (a second pass
    raises ``UsageError`` rather than silently yielding nothing). ``size``, if given, is
    what ``len`` reports.
    """

    def __init__(self, gen: Callable[[], Iterable[Any]] | Iterator[Any],
                 size: int | None = None) -> None:
        self.gen, self.size = gen, size
        self._used = False

    def __len__(self) -> int:
        if self.size is None:
            raise UnknownLength("DataFromGenerator has no size")
        return self.size

    def __iter__(self) -> Iterator[Any]:
        if callable(self.gen):
            yield from self.gen()
            return
        if self._used:
            raise UsageError("DataFromGenerator over an iterator can be iterated once; "
                               "pass a generator function to iterate again")
        self._used = True
        yield from self.gen

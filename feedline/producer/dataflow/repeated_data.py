"""RepeatedData: several passes over the input as one pass."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from feedline.errors import ConfigError
from feedline.producer.dataflow.base import DataFlow, ProxyDataFlow, UnknownLength


class RepeatedData(ProxyDataFlow):
    """Iterate the input ``num`` times per pass; ``num=-1`` repeats forever (no ``len``)."""

    def __init__(self, ds: DataFlow, num: int) -> None:
        super().__init__(ds)
        if not isinstance(num, int) or (num < 1 and num != -1):
            raise ConfigError(f"num must be an int >= 1 or -1 (forever), got {num!r}")
        self.num = num

    def __len__(self) -> int:
        if self.num == -1:
            raise UnknownLength("RepeatedData(num=-1) is infinite")
        return len(self.ds) * self.num

    def __iter__(self) -> Iterator[Any]:
        i = 0
        while self.num == -1 or i < self.num:
            yield from self.ds
            i += 1

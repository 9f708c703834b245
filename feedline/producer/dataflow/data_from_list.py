"""DataFromList: datapoints from an in-memory list."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from feedline.producer.dataflow.base import DataFlow, content_digest
from feedline.producer.dataflow.shard import check_shard, shard_positions
from feedline.producer.dataflow.worker import make_rng


class DataFromList(DataFlow):
    """Yield the items of ``lst`` (its shard), shuffled each pass when ``shuffle``.

    The shuffle order of pass ``e`` is a pure function of ``(seed, e, worker)``.
    ``len`` is the number of items in this shard.
    """

    def __init__(self, lst: Sequence[Any], shuffle: bool = True, seed: int = 0,
                 shard: tuple[int, int] = (0, 1)) -> None:
        self.lst = lst
        self.shuffle, self.seed = shuffle, seed
        self.set_shard(*shard)
        self._epoch = 0
        self._identity: str | None = None

    def set_shard(self, index: int, count: int) -> None:
        self.shard = check_shard(index, count)

    def __len__(self) -> int:
        return len(shard_positions(len(self.lst), self.shard))

    def reset_state(self) -> None:
        self._epoch = 0

    def sample(self, i: int) -> Any:
        """Item ``i`` of the whole list: exact delivery's access."""
        return self.lst[i]

    def samples(self) -> int:
        return len(self.lst)

    def identity(self) -> str:
        """The items' content (exact delivery's fingerprint: another list of the same length
        is another dataset)."""
        if self._identity is None:
            self._identity = content_digest(self.lst)
        return self._identity

    def __iter__(self) -> Iterator[Any]:
        idx = list(shard_positions(len(self.lst), self.shard))
        if self.shuffle:
            make_rng(self.seed, self._epoch).shuffle(idx)
        self._epoch += 1
        for i in idx:
            yield self.lst[i]

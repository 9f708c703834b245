"""Sharding: splitting a source's datapoints among producers or workers without overlap.

A shard ``(index, count)`` keeps the datapoints at positions ``p`` with ``p % count == index``
(positions in the source's deterministic order, before any shuffling), so the ``count``
shards cover the dataset exactly once. Sources that support it are
:class:`~feedline.producer.dataflow.base.Shardable`; :func:`source_of` finds the source under a
chain
of transforms (:func:`~feedline.producer.dataflow.base.stages`), and :func:`compose` nests a
worker's
shard inside a producer's.
"""

from __future__ import annotations

from feedline.errors import ConfigError
from feedline.producer.dataflow.base import DataFlow, stages


def check_shard(index: int, count: int) -> tuple[int, int]:
    """Validate a shard; raises ConfigError (a ValueError) naming the bad part."""
    if not isinstance(count, int) or count < 1:
        raise ConfigError(f"shard count must be an int >= 1, got {count!r}")
    if not isinstance(index, int) or not 0 <= index < count:
        raise ConfigError(f"shard index must be an int in [0, {count}), got {index!r}")
    return index, count


def compose(outer: tuple[int, int], inner: tuple[int, int]) -> tuple[int, int]:
    """Shard ``inner`` of the datapoints that shard ``outer`` keeps, as one shard."""
    (i, c), (k, n) = outer, inner
    return i + c * k, c * n


def source_of(ds: DataFlow) -> DataFlow:
    """The innermost stage under ``ds``: the last of
    :func:`~feedline.producer.dataflow.base.stages`."""
    *_, source = stages(ds)
    return source


def shard_positions(n: int, shard: tuple[int, int]) -> range:
    """Positions of ``range(n)`` that ``shard`` keeps."""
    index, count = shard
    return range(index, n, count)

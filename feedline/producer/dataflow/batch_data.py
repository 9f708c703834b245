"""BatchData: group datapoints into batches, component by component."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from feedline.errors import ConfigError, DataError
from feedline.producer.dataflow.base import DataFlow, ProxyDataFlow


class BatchData(ProxyDataFlow):
    """Yield batches of ``batch_size`` datapoints.

    Each component is stacked into one array of shape ``(batch_size, *shape)`` (scalars
    become a 1-D array); with ``use_list=True`` components are plain lists instead (for
    ragged data). With ``remainder=True`` the last, smaller batch of a pass is yielded too,
    else dropped. Datapoints may be lists/tuples (a list of components comes out) or dicts.
    """

    def __init__(self, ds: DataFlow, batch_size: int, remainder: bool = False,
                 use_list: bool = False) -> None:
        super().__init__(ds)
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ConfigError(f"batch_size must be an int >= 1, got {batch_size!r}")
        self.batch_size, self.remainder, self.use_list = batch_size, remainder, use_list
        # the last pass's datapoints, and how many of them ended in no batch (fewer than
        # batch_size left over with remainder=False): what an epoch without a batch says
        self.taken = self.dropped = 0

    def __len__(self) -> int:
        n = len(self.ds)
        return -(-n // self.batch_size) if self.remainder else n // self.batch_size

    def __iter__(self) -> Iterator[Any]:
        holder: list[Any] = []
        self.taken = self.dropped = 0
        for dp in self.ds:
            holder.append(dp)
            self.taken += 1
            if len(holder) == self.batch_size:
                yield self.aggregate(holder, self.use_list)
                holder = []
        if self.remainder and holder:
            yield self.aggregate(holder, self.use_list)
        else:
            self.dropped = len(holder)

    def why_empty(self) -> str | None:
        """Why the last pass yielded no batch, when this stage is why: it was given samples
        and dropped them as a remainder; else None."""
        if self.taken and self.dropped == self.taken:
            return (f"the source gave {self.taken} samples and batch (batch_size "
                    f"{self.batch_size}, remainder: false) dropped them: lower batch_size "
                    "or set remainder: true")
        return None

    @staticmethod
    def aggregate(dps: list[Any], use_list: bool = False) -> Any:
        """Stack a list of datapoints component-wise."""
        first = dps[0]
        if isinstance(first, dict):
            return {k: _stack([dp[k] for dp in dps], use_list, k) for k in first}
        return [_stack([dp[i] for dp in dps], use_list, i) for i in range(len(first))]


def _stack(items: list[Any], use_list: bool, which: Any) -> Any:
    if use_list:
        return items
    first = items[0]
    try:
        if isinstance(first, np.ndarray):
            return np.stack(items)
        if isinstance(first, (bool, np.bool_)):
            return np.asarray(items, dtype=bool)
        if isinstance(first, (int, np.integer)):
            return np.asarray(items, dtype=np.int32 if -2**31 <= min(items) and
                              max(items) < 2**31 else np.int64)
        if isinstance(first, (float, np.floating)):
            return np.asarray(items, dtype=np.float32)
        return np.asarray(items)
    except ValueError as e:
        raise DataError(f"BatchData: cannot stack component {which!r} ({e}); "
                         "use use_list=True for ragged data") from None

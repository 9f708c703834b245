"""MapData and MapDataComponent: apply a function to each datapoint."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

from feedline.producer.dataflow.base import DataFlow, Named, ProxyDataFlow, Reseedable
from feedline.producer.dataflow.errors import SampleError, check_policy

log = logging.getLogger(__name__)


_RESEEDABLE: dict[type, bool] = {}  # isinstance on a Protocol takes ~10 us; per sample adds up


def reseed(func: Any, epoch: int) -> None:
    """Start pass ``epoch`` for a function that draws random numbers (a
    :class:`~feedline.producer.dataflow.base.Reseedable`, decided once per type); nothing for any
    other."""
    kind = type(func)
    yes = _RESEEDABLE.get(kind)
    if yes is None:
        yes = _RESEEDABLE[kind] = isinstance(func, Reseedable)
    if yes:
        func.reseed(epoch)


def apply(func: Callable[[Any], Any], dp: Any, on_error: str) -> tuple[Any, bool]:
    """``(func(dp), skipped)``; a :class:`SampleError` is re-raised unless ``on_error='skip'``."""
    try:
        return func(dp), False
    except SampleError as e:
        if on_error != "skip":
            raise
        log.warning("skipped a datapoint: %s", e)
        return None, True


class MapData(ProxyDataFlow):
    """Yield ``func(dp)`` for each datapoint; a ``None`` result drops the datapoint.

    ``func`` must not modify ``dp`` in place. If ``func`` is
    :class:`~feedline.producer.dataflow.base.Reseedable`, its ``reseed(epoch)`` is called
    at the start of every pass (randomness is a function of seed, epoch and worker).
    ``on_error="skip"`` drops datapoints whose ``func`` raises
    :class:`~feedline.producer.dataflow.errors.SampleError` and counts them in ``skipped``.
    ``len`` is the input's (an upper bound when datapoints are dropped), as in tensorpack.
    """

    def __init__(self, ds: DataFlow, func: Callable[[Any], Any], on_error: str = "raise"):
        super().__init__(ds)
        self.func = func
        self.on_error = check_policy(on_error)
        self.skipped = 0
        self._epoch = 0

    def reset_state(self) -> None:
        super().reset_state()
        self._epoch = 0

    def __iter__(self) -> Iterator[Any]:
        reseed(self.func, self._epoch)
        self._epoch += 1
        for dp in self.ds:
            out, skipped = apply(self.func, dp, self.on_error)
            if skipped:
                self.skipped += 1
            elif out is not None:
                yield out


class ComponentFunc:
    """``dp -> dp`` with ``dp[index]`` replaced by ``func(dp[index])`` (picklable)."""

    def __init__(self, func: Callable[[Any], Any], index: int | str = 0) -> None:
        self.func, self.index = func, index

    def reseed(self, epoch: int) -> None:
        reseed(self.func, epoch)

    def __call__(self, dp: Any) -> Any:
        r = self.func(dp[self.index])
        if r is None:
            return None
        out: Any = dict(dp) if isinstance(dp, dict) else list(dp)
        out[self.index] = r
        # Where the datapoint was read goes on with it: the batch step names a sample that
        # does not stack with the others by it.
        where = getattr(dp, "where", None)
        return out if where is None else Named(out, where)


class MapDataComponent(MapData):
    """Apply ``func`` to component ``index`` of each datapoint (a copy of the list is yielded;
    the input is not modified). A ``None`` result drops the datapoint."""

    def __init__(self, ds: DataFlow, func: Callable[[Any], Any], index: int | str = 0,
                 on_error: str = "raise") -> None:
        super().__init__(ds, ComponentFunc(func, index), on_error)

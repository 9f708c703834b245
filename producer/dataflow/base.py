"""The DataFlow contract (as in tensorpack).

A DataFlow is an iterable of datapoints (lists, tuples or dicts of arrays and scalars).
``reset_state()`` is called once, in the process and thread that will iterate, before the
first ``__iter__`` (after a fork: so each worker gets its own file handles and RNG).
``__len__`` is optional and raises ``NotImplementedError`` when unknown.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol, runtime_checkable


class UnknownLength(NotImplementedError, TypeError):
    """Raised by ``len()`` of a stage whose length is unknown.

    A NotImplementedError as in tensorpack, and a TypeError so that ``list(df)`` (which asks
    for a length hint and only tolerates TypeError) still works.
    """


@runtime_checkable
class Indexable(Protocol):
    """A source exact delivery can cut into work units: it reads any sample by its index
    (``0 <= i < samples()``), the same bytes every time."""

    def samples(self) -> int: ...

    def sample(self, i: int) -> Any: ...


class DataFlow:
    """Base class of every stage."""

    def __iter__(self) -> Iterator[Any]:
        raise NotImplementedError

    def __len__(self) -> int:
        raise UnknownLength(f"{type(self).__name__} has no length")

    def reset_state(self) -> None:
        """Prepare to iterate in this process (open files, seed RNGs). Idempotent."""

    def close(self) -> None:
        """Release workers and handles (parallel stages stop their workers). Idempotent."""

    def __enter__(self) -> DataFlow:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ProxyDataFlow(DataFlow):
    """A stage that wraps another and forwards ``len`` and ``reset_state`` to it."""

    def __init__(self, ds: DataFlow) -> None:
        self.ds = ds

    def __len__(self) -> int:
        return len(self.ds)

    def reset_state(self) -> None:
        reset = getattr(self.ds, "reset_state", None)
        if reset is not None:
            reset()

    def close(self) -> None:
        close = getattr(self.ds, "close", None)
        if close is not None:
            close()

    def __iter__(self) -> Iterator[Any]:
        return iter(self.ds)

"""The DataFlow contract (as in tensorpack), and the Protocols of what some stages offer.

A DataFlow is an iterable of datapoints (lists, tuples or dicts of arrays and scalars).
``reset_state()`` is called once, in the process and thread that will iterate, before the
first ``__iter__`` (after a fork: so each worker gets its own file handles and RNG).
``close()`` releases workers and handles. Both are part of the contract, with no-op
defaults, so callers call them directly. ``__len__`` is optional and raises
:class:`UnknownLength` when unknown.

What is not a :class:`DataFlow` (a list, a generator, a ``RemoteDataZMQ``, a tensorpack
DataFlow) becomes one once, at the boundary, with :func:`as_dataflow`; every
:class:`ProxyDataFlow` does that with the stage it wraps, so ``.ds`` is always a DataFlow
and :func:`stages` walks a whole pipeline.

What some stages offer besides are Protocols, checked with ``isinstance``:
:class:`Shardable` (a source that keeps one shard), :class:`Counted` (a stage that counts
what its skip policy dropped), :class:`Reseedable` (a random map function),
:class:`Indexable` (a source exact delivery cuts into work units), :class:`UnitSource` (a
source that cuts its own units: a sharded one). An exact source may also say which dataset
it is (``identity()``: text that changes when its samples do, see :func:`content_digest`),
which goes into the pipeline's fingerprint, so that a cursor of another dataset of the same
length is refused on resume.

A datapoint may say where it was read (:class:`Named`, as the shard readers yield them), so
that a later stage that refuses it (``batch``: a sample that does not stack with the
others) names it; :func:`name_of` finds that name.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from typing import Any, Protocol, runtime_checkable

import numpy as np

from feedline.errors import FeedlineError


class UnknownLength(FeedlineError, NotImplementedError, TypeError):
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


@runtime_checkable
class UnitSource(Protocol):
    """A source exact delivery reads by units of its own, front to back (a sharded source: a
    unit is a shard or a slice of one). ``read_unit`` yields ``(sample id, datapoint)`` in
    the unit's order for the epoch (a pure function of (seed, epoch, unit)) from its
    ``skip``-th sample on; a None datapoint holds the place of one that cannot be read.
    ``set_units(n)`` cuts units of at most ``n`` samples (None: the source's own, whole
    shards); ``samples()`` counts them all."""

    def set_units(self, unit_size: int | None) -> None: ...

    def samples(self) -> int: ...

    def units(self) -> int: ...

    def unit_length(self, epoch: int, unit: int) -> int: ...

    def read_unit(self, epoch: int, unit: int, skip: int = 0,
                  shuffle: bool = True) -> Iterator[tuple[int, Any]]: ...


@runtime_checkable
class Shardable(Protocol):
    """A source that yields only the shard ``(index, count)`` of its datapoints (see
    :mod:`feedline.producer.dataflow.shard`): ``shard`` is the current one, ``set_shard`` replaces
    it (before ``reset_state``)."""

    @property
    def shard(self) -> tuple[int, int]: ...

    def set_shard(self, index: int, count: int) -> None: ...


@runtime_checkable
class Counted(Protocol):
    """A stage that counts the datapoints its skip policy dropped (``on_error="skip"``),
    over all passes; read by the producer's metrics from another thread."""

    @property
    def skipped(self) -> int: ...


@runtime_checkable
class Reseedable(Protocol):
    """A map function that draws random numbers: ``reseed(epoch)`` is called at the start
    of every pass (per sample under exact delivery), so its draws are a function of (seed,
    epoch, worker) and never of how many passes a copy made before."""

    def reseed(self, epoch: int) -> None: ...


@runtime_checkable
class _Resets(Protocol):
    def reset_state(self) -> None: ...


@runtime_checkable
class _Closes(Protocol):
    def close(self) -> None: ...


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


class DataFromIterable(DataFlow):
    """Any iterable as a DataFlow (what :func:`as_dataflow` wraps).

    ``len`` is the iterable's, or unknown. ``reset_state()`` and ``close()`` are the
    iterable's where it has them (a ``RemoteDataZMQ``, a tensorpack DataFlow, a generator's
    ``close``), decided once here; otherwise they do nothing. A generator is iterated once:
    its second pass is empty.
    """

    def __init__(self, iterable: Iterable[Any]) -> None:
        self.iterable = iterable
        self._reset = iterable.reset_state if isinstance(iterable, _Resets) else None
        self._close = iterable.close if isinstance(iterable, _Closes) else None

    def __len__(self) -> int:
        try:
            return len(self.iterable)  # type: ignore[arg-type]
        except TypeError:
            raise UnknownLength(f"{type(self.iterable).__name__} has no length") from None

    def reset_state(self) -> None:
        if self._reset is not None:
            self._reset()

    def close(self) -> None:
        if self._close is not None:
            self._close()

    def __iter__(self) -> Iterator[Any]:
        return iter(self.iterable)


def as_dataflow(obj: Iterable[Any]) -> DataFlow:
    """``obj`` if it is a DataFlow, else ``obj`` wrapped once in :class:`DataFromIterable`.

    Raises TypeError (naming the type) for what is not iterable at all.
    """
    if isinstance(obj, DataFlow):
        return obj
    if not isinstance(obj, Iterable):
        raise TypeError(f"a DataFlow or an iterable of datapoints is needed, not "
                        f"{type(obj).__name__}")
    return DataFromIterable(obj)


class ProxyDataFlow(DataFlow):
    """A stage that wraps another and forwards ``len``, ``reset_state`` and ``close`` to it.

    ``ds`` may be any iterable; it is kept as :func:`as_dataflow` of it, so ``self.ds`` is
    always a DataFlow.
    """

    def __init__(self, ds: Iterable[Any]) -> None:
        self.ds = as_dataflow(ds)

    def __len__(self) -> int:
        return len(self.ds)

    def reset_state(self) -> None:
        self.ds.reset_state()

    def close(self) -> None:
        self.ds.close()

    def __iter__(self) -> Iterator[Any]:
        return iter(self.ds)


class Named(list):  # type: ignore[type-arg]
    """A datapoint (a list of components) that remembers where it was read (``where``:
    ``shard#key``, ``file#offset``), as a corrupt record names its place. A list in every
    other respect; the map steps that replace a component keep the name
    (:class:`~feedline.producer.dataflow.map_data.ComponentFunc`); pickles with it."""

    __slots__ = ("where",)

    def __init__(self, items: Iterable[Any] = (), where: str = "") -> None:
        super().__init__(items)
        self.where = where


def name_of(dp: Any) -> str | None:
    """Where datapoint ``dp`` was read: its :class:`Named` ``where``, else the ``path`` of a
    component that carries one (an image file's bytes:
    :class:`~feedline.producer.dataflow.image_folder.FileBytes`); None if nothing says."""
    where = getattr(dp, "where", None)
    if where:
        return str(where)
    parts = dp.values() if isinstance(dp, dict) else dp if isinstance(dp, (list, tuple)) \
        else ()
    for x in parts:
        path = getattr(x, "path", None)
        if isinstance(path, str) and path:
            return path
    return None


def stages(df: DataFlow) -> Iterator[DataFlow]:
    """``df`` and every stage under it, output first, source last (following
    :attr:`ProxyDataFlow.ds`). The one way to walk a pipeline."""
    while True:
        yield df
        if not isinstance(df, ProxyDataFlow):
            return
        df = df.ds


def content_digest(items: Iterable[Any]) -> str:
    """A digest (hex) of ``items``' content: arrays by dtype, shape and bytes; lists, tuples
    and dicts by their items; anything else by its ``repr``. Equal content, equal digest, in
    any process."""
    h = hashlib.blake2b(digest_size=16)

    def feed(x: Any) -> None:
        if isinstance(x, np.ndarray):
            h.update(f"a{x.dtype.str}{x.shape}".encode())
            h.update(np.ascontiguousarray(x).tobytes())
        elif isinstance(x, (list, tuple)):
            h.update(b"[")
            for y in x:
                feed(y)
            h.update(b"]")
        elif isinstance(x, dict):
            h.update(b"{")
            for k in sorted(x, key=repr):
                feed(k)
                feed(x[k])
            h.update(b"}")
        else:
            h.update(f"{type(x).__name__}:{x!r};".encode())

    for x in items:
        feed(x)
    return h.hexdigest()

"""The input-source contract of the TensorFlow side (tensorpack's ``InputSource``).

An :class:`InputSource` hands a training step one batch as tensors. :class:`QueueInput`,
:class:`StagingInput` and :class:`DummyConstantInput` derive from it, and what takes an input
source (``StagingInput``, ``as_dataset``, ``OccupancyMonitor``) calls its methods directly:

- ``start()`` makes it ready (queues, threads, constants) and returns it; idempotent.
  ``with source:`` starts it and closes it.
- ``dequeue()`` is one batch as tensors, packed as ``structure``; eagerly or inside a
  ``tf.function``. ``get()`` is what the model step uses: the same, unless a subclass
  stages batches ahead (StagingInput).
- ``dtypes`` (one per flattened component), ``shapes`` (TensorShapes, or None when not
  static) and ``structure`` (a datapoint whose nesting the batch has, or None for a flat
  list) describe a batch; a QueueInput knows them after ``start()``.
- ``capacity`` and ``size()``: the batches it can hold ahead and holds now (0 and 0 for a
  source that holds none).
- ``close()`` stops what ``start()`` started, in bounded time; idempotent.

Anything else with ``dequeue()`` and ``dtypes`` (:class:`Dequeues`) is accepted by
:func:`as_input_source`, which wraps it once: nothing is started or closed for it (derive
from :class:`InputSource` for that). What has neither is refused with a TypeError.

This module does not import TensorFlow: ``OccupancyMonitor`` reads the contract without it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import tensorflow as tf


class InputSource(ABC):
    """Base of the TensorFlow input sources (the contract is the module docstring)."""

    def start(self) -> InputSource:
        """Make the source ready for :meth:`dequeue`; returns it. Idempotent."""
        return self

    @abstractmethod
    def dequeue(self) -> Any:
        """One batch as tensors, packed as :attr:`structure`. Works inside ``tf.function``."""

    def get(self) -> Any:
        """The batch for this step (what the model uses): :meth:`dequeue` here."""
        return self.dequeue()

    @property
    @abstractmethod
    def dtypes(self) -> list[tf.DType]:
        """The dtype of each flattened component of a batch."""

    @property
    def shapes(self) -> list[tf.TensorShape] | None:
        """The static shape of each flattened component, or None when not fixed."""
        return None

    @property
    def structure(self) -> Any:
        """A datapoint with the nesting of a batch (list, tuple or dict), or None: a flat
        list of tensors."""
        return None

    @property
    def capacity(self) -> int:
        """Batches this source can hold ahead of the step (0: it holds none)."""
        return 0

    def size(self) -> Any:
        """Batches held now (an int, or a scalar tensor)."""
        return 0

    @property
    def element_spec(self) -> Any:
        """A ``tf.TensorSpec`` per component, packed as :attr:`structure`."""
        import tensorflow as tf

        shapes = self.shapes or [tf.TensorShape(None)] * len(self.dtypes)
        specs = [tf.TensorSpec(s, d) for s, d in zip(shapes, self.dtypes, strict=True)]
        if self.structure is None:
            return specs
        return tf.nest.pack_sequence_as(self.structure, specs)

    def close(self) -> None:  # noqa: B027 - a no-op by contract, for sources that hold nothing
        """Stop what :meth:`start` started, in bounded time. Idempotent."""

    def __enter__(self) -> InputSource:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


@runtime_checkable
class Dequeues(Protocol):
    """The least an input source is: batches from ``dequeue()``, of ``dtypes``."""

    @property
    def dtypes(self) -> Sequence[tf.DType]: ...

    def dequeue(self) -> Any: ...


class _Dequeuer(InputSource):
    """A :class:`Dequeues` that is not an InputSource, as one: nothing to start or close."""

    def __init__(self, inner: Dequeues) -> None:
        self.inner = inner

    def dequeue(self) -> Any:
        return self.inner.dequeue()

    @property
    def dtypes(self) -> list[tf.DType]:
        return list(self.inner.dtypes)


def as_input_source(obj: object, user: str) -> InputSource:
    """``obj`` if it is an :class:`InputSource`, a :class:`Dequeues` wrapped once, else a
    TypeError saying that ``user`` (e.g. ``"StagingInput"``) needs one."""
    if isinstance(obj, InputSource):
        return obj
    if isinstance(obj, Dequeues):
        return _Dequeuer(obj)
    raise TypeError(f"{user} needs an InputSource (QueueInput, StagingInput, "
                    f"DummyConstantInput, or a subclass of consumer.input_source.InputSource), "
                    f"not {type(obj).__name__}: it has no dequeue() and dtypes")


@runtime_checkable
class Occupancy(Protocol):
    """What the bottleneck monitor samples: ``size()`` of ``capacity`` batches. Every
    :class:`InputSource` has both."""

    @property
    def capacity(self) -> int: ...

    def size(self) -> Any: ...

"""Every error feedline raises, in one hierarchy under :class:`FeedlineError`.

``except FeedlineError`` catches whatever feedline raises because of its input, its
configuration, its peers or the machine; each class keeps the builtin base that code written
before the hierarchy catches (a :class:`ConfigError` is a ``ValueError``, a
:class:`ReceiveTimeout` a ``TimeoutError``). What stays a builtin is a programming error: a
``TypeError`` for an argument of the wrong type, ``NotImplementedError`` from an abstract
method. ``tests/protocol/test_errors.py`` checks that every exception class of the package is a
FeedlineError and that no product module raises a builtin error beyond those.

::

    FeedlineError
    +-- Refusal                   a peer's message is refused; .reason is the metric label
    |   +-- DecodeError           ... because it is malformed or exceeds a limit (ValueError)
    +-- EncodeError               a datapoint the protocol cannot carry (TypeError)
    +-- ConfigError               a setting can never work: argument, flag, YAML (ValueError)
    |   +-- AddressError          an address cannot be bound or reached
    |   +-- KeyFileError          a CURVE key file is missing, malformed or readable by others
    +-- DataError                 the data a pipeline reads cannot be used (ValueError)
    |   +-- DataNotFound          ... because it is not there (FileNotFoundError)
    +-- OutputExists              a file would be overwritten (FileExistsError)
    +-- SampleError               one datapoint cannot be processed (skippable)
    |   +-- CorruptImage          ... its bytes are not a decodable image
    +-- WorkerError               a parallel worker failed; carries its traceback (RuntimeError)
    +-- ProducerError             a producer's pipeline failed; carries its traceback
    +-- BatchTooLarge             a batch no broker can take
    +-- Unavailable               something this machine lacks (RuntimeError)
    |   +-- CurveUnavailable      ... libzmq without CURVE
    +-- UsageError                a call in the wrong state or order (RuntimeError)
    +-- Timeout                   something awaited did not happen in time (TimeoutError)
    |   +-- ReceiveTimeout        ... no batch within the consumer's timeout
    +-- Stopped                   a blocking call gave up because its stop event was set

Two more live next to the code whose protocol they are part of: ``UnknownLength``
(``len()`` of a DataFlow stage without one: a TypeError, so ``list()`` works;
:mod:`feedline.producer.dataflow.base`) and ``Unsupported`` (a JPEG the fused decoder leaves
to OpenCV; :mod:`feedline.producer.image.turbo`).

Kernel module: it imports nothing, so every component can raise these (the components' own
modules re-export the ones they raise under their old names, e.g.
``feedline.protocol.codec.DecodeError``).
"""

from __future__ import annotations


class FeedlineError(Exception):
    """Base class of every error feedline raises on purpose."""


class Refusal(FeedlineError):
    """A peer's message is refused: it breaks the protocol (wrong port, unknown peer, beyond
    its credit, a stream it may not use) or does not decode (:class:`DecodeError`).

    ``reason`` is the metric label the refusal is counted under; hosts catch ``Refusal`` to
    count every refusal, decoding or not.
    """

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason, self.detail = reason, detail


class DecodeError(Refusal, ValueError):
    """A received message is malformed or exceeds a limit. ``reason`` is a metric label."""


class EncodeError(FeedlineError, TypeError):
    """A datapoint or message holds something the protocol cannot carry, or exceeds a limit
    every receiver enforces (the message names the limit)."""


class ConfigError(FeedlineError, ValueError):
    """A setting can never work: an argument, a command-line flag, a field of a pipeline file.
    The message names the setting and what it takes."""


class AddressError(ConfigError):
    """An address an operator gave cannot be used; the message says which, why and what to do."""


class KeyFileError(ConfigError):
    """A key file or directory is missing, malformed or readable by others."""


class DataError(FeedlineError, ValueError):
    """The data a pipeline reads cannot be used as a whole (an empty folder, a malformed list
    file, a dataflow that yields nothing, components that do not stack)."""


class DataNotFound(DataError, FileNotFoundError):
    """A dataset's file or folder is not there."""


class OutputExists(FeedlineError, FileExistsError):
    """Writing would replace an existing file; the message says how to allow it."""


class SampleError(FeedlineError):
    """One datapoint cannot be processed (a corrupt or unreadable input).

    Map stages with ``on_error="skip"`` drop such a datapoint and count it; every other
    exception is a bug and always propagates.
    """


class CorruptImage(SampleError):
    """The bytes are not a decodable image; the message starts with the file's path when the
    data came from a file (see :func:`feedline.producer.image.decode.name_of`)."""


class WorkerError(FeedlineError, RuntimeError):
    """A parallel worker failed; the message carries the worker's own traceback."""

    def __init__(self, message: str, remote_traceback: str = "") -> None:
        super().__init__(f"{message}\n--- worker traceback ---\n{remote_traceback}"
                         if remote_traceback else message)
        self.remote_traceback = remote_traceback


class ProducerError(FeedlineError):
    """A producer's pipeline raised; carries the remote traceback text."""

    def __init__(self, producer: str, message: str, remote_traceback: str = "") -> None:
        text = f"producer {producer!r} failed: {message}"
        if remote_traceback:
            text += "\n--- remote traceback ---\n" + remote_traceback.rstrip()
        super().__init__(text)
        self.producer = producer
        self.remote_traceback = remote_traceback


class BatchTooLarge(FeedlineError):
    """A batch no broker can take: larger than every broker's memory budget or limit."""


class Unavailable(FeedlineError, RuntimeError):
    """Something this machine lacks (a library, a device, a build option); the message says
    what to install or pass instead."""


class CurveUnavailable(Unavailable):
    """libzmq was built without CURVE (libsodium/tweetnacl)."""


class UsageError(FeedlineError, RuntimeError):
    """A call made in the wrong state or order (``get()`` before ``start()``, a one-pass
    source iterated twice); the message says what to call first."""


class Timeout(FeedlineError, TimeoutError):
    """Something awaited did not happen in time."""


class ReceiveTimeout(Timeout):
    """Nothing arrived from the broker within the consumer's timeout."""


class Stopped(FeedlineError):
    """A blocking call gave up because its stop event was set."""


__all__ = [
    "AddressError", "BatchTooLarge", "ConfigError", "CorruptImage", "CurveUnavailable",
    "DataError", "DataNotFound", "DecodeError", "EncodeError", "FeedlineError", "KeyFileError",
    "OutputExists", "ProducerError", "ReceiveTimeout", "Refusal", "SampleError", "Stopped",
    "Timeout", "Unavailable", "UsageError", "WorkerError",
]

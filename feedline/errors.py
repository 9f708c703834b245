"""Exceptions that cross component boundaries."""

from __future__ import annotations


class FeedlineError(Exception):
    """Base class of feedline's own errors."""


class ProducerError(FeedlineError):
    """A producer's pipeline raised; carries the remote traceback text."""

    def __init__(self, producer: str, message: str, remote_traceback: str = "") -> None:
        text = f"producer {producer!r} failed: {message}"
        if remote_traceback:
            text += "\n--- remote traceback ---\n" + remote_traceback.rstrip()
        super().__init__(text)
        self.producer = producer
        self.remote_traceback = remote_traceback


class ReceiveTimeout(FeedlineError, TimeoutError):
    """Nothing arrived from the broker within the consumer's timeout."""


class Stopped(FeedlineError):
    """A blocking call gave up because its stop event was set."""

"""Errors of the DataFlow library."""

from __future__ import annotations


class SampleError(Exception):
    """One datapoint cannot be processed (a corrupt or unreadable input).

    Map stages with ``on_error="skip"`` drop such a datapoint and count it; every other
    exception is a bug and always propagates.
    """


class WorkerError(RuntimeError):
    """A parallel worker failed; the message carries the worker's own traceback."""

    def __init__(self, message: str, remote_traceback: str = "") -> None:
        super().__init__(f"{message}\n--- worker traceback ---\n{remote_traceback}"
                         if remote_traceback else message)
        self.remote_traceback = remote_traceback


ERROR_POLICIES = ("raise", "skip")


def check_policy(on_error: str) -> str:
    if on_error not in ERROR_POLICIES:
        raise ValueError(f"on_error must be one of {ERROR_POLICIES}, got {on_error!r}")
    return on_error

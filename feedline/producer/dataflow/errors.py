"""Errors of the DataFlow library (defined in :mod:`feedline.errors`), and the ``on_error``
policy of the map stages."""

from __future__ import annotations

from feedline.errors import ConfigError
from feedline.errors import SampleError as SampleError
from feedline.errors import WorkerError as WorkerError

ERROR_POLICIES = ("raise", "skip")


def check_policy(on_error: str) -> str:
    if on_error not in ERROR_POLICIES:
        raise ConfigError(f"on_error must be one of {ERROR_POLICIES}, got {on_error!r}")
    return on_error

"""Which read failures are worth another try, and how long to wait before it.

A transient failure is one the same request may not hit again: a connection reset or refused,
a timeout, a 5xx (or 408/429) answer, a body cut short. A missing object, a refused
permission or any other 4xx is not: retrying it only delays the error.
"""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass

from feedline.errors import ConfigError, DataError, FeedlineError

# Libraries whose exceptions are I/O failures of a request (their 4xx arrive with a status).
_IO_MODULES = ("aiohttp", "botocore", "aiobotocore", "urllib3", "requests", "http")


class ShardError(DataError):
    """A shard could not be read after every retry; ``name`` says which."""

    def __init__(self, name: str, why: str) -> None:
        super().__init__(f"shard {name}: {why}")
        self.name, self.why = name, why


class ShortRead(FeedlineError, ConnectionError):
    """A read returned fewer bytes than the object holds before its end: a cut body."""


def status_of(exc: BaseException) -> int | None:
    """The HTTP status an exception carries (aiohttp ``status``, botocore's response), if any."""
    for attr in ("status", "status_code", "code"):
        v = getattr(exc, attr, None)
        if isinstance(v, int) and 100 <= v < 600:
            return v
    resp = getattr(exc, "response", None)
    if isinstance(resp, dict):
        v = resp.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if isinstance(v, int):
            return v
    return None


def is_transient(exc: BaseException) -> bool:
    """True for a failure worth retrying (see the module docstring)."""
    if isinstance(exc, (FileNotFoundError, PermissionError, IsADirectoryError,
                        NotADirectoryError)):
        return False
    status = status_of(exc)
    if status is not None:
        return status >= 500 or status in (408, 429)
    if isinstance(exc, (ConnectionError, TimeoutError, OSError)):
        return True
    return type(exc).__module__.split(".")[0] in _IO_MODULES


@dataclass(frozen=True)
class RetryPolicy:
    """``attempts`` tries of one request in all, waiting ``base * 2**k`` seconds (at most
    ``cap``, with +-50% jitter so that producers do not retry in step) between them."""

    attempts: int = 6
    base: float = 0.1
    cap: float = 5.0

    def __post_init__(self) -> None:
        if self.attempts < 1 or self.base < 0 or self.cap < 0:
            raise ConfigError(f"retry: attempts >= 1 and non-negative delays, got {self}")

    def delay(self, failures: int) -> float:
        return min(self.cap, self.base * 2 ** max(0, failures - 1)) * random.uniform(0.5, 1.5)

    def wait(self, failures: int, stop: threading.Event | None) -> bool:
        """Sleep before try ``failures + 1``; False if ``stop`` was set meanwhile."""
        d = self.delay(failures)
        if stop is None:
            threading.Event().wait(d)
            return True
        return not stop.wait(d)

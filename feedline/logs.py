"""Logging helpers: one format for every daemon, and rate-limited warnings."""

from __future__ import annotations

import logging
import time
from typing import Any


def setup_logging(level: str = "INFO") -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


class RateLimitedLog:
    """Logs at most one line per ``interval`` seconds, then says how many were suppressed.

    A peer sending garbage must not be able to fill the disk through our logs.
    """

    def __init__(self, logger: logging.Logger, interval: float = 5.0) -> None:
        self.logger, self.interval = logger, interval
        self._next = 0.0
        self._suppressed = 0

    def warning(self, msg: str, *args: Any) -> None:
        now = time.monotonic()
        if now < self._next:
            self._suppressed += 1
            return
        if self._suppressed:
            msg += f" (and {self._suppressed} more since the last report)"
            self._suppressed = 0
        self._next = now + self.interval
        self.logger.warning(msg, *args)

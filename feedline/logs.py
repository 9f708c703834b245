"""Logging helpers: one format for every daemon, and rate-limited log lines."""

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
    """Logs at most ``burst`` lines per ``interval`` seconds; the next line that gets through
    says how many were suppressed.

    A peer sending garbage, or a flood of registrations, must not be able to fill the disk
    through our logs.
    """

    def __init__(self, logger: logging.Logger, interval: float = 5.0, burst: int = 1) -> None:
        self.logger, self.interval, self.burst = logger, interval, burst
        self._window = -interval
        self._count = 0
        self._suppressed = 0

    def log(self, level: int, msg: str, *args: Any) -> None:
        if not self.logger.isEnabledFor(level):
            return
        now = time.monotonic()
        if now - self._window >= self.interval:
            self._window, self._count = now, 0
        if self._count >= self.burst:
            self._suppressed += 1
            return
        self._count += 1
        if self._suppressed:
            msg += f" (and {self._suppressed} more since the last report)"
            self._suppressed = 0
        self.logger.log(level, msg, *args)

    def warning(self, msg: str, *args: Any) -> None:
        self.log(logging.WARNING, msg, *args)

    def info(self, msg: str, *args: Any) -> None:
        self.log(logging.INFO, msg, *args)

"""Metric helpers shared by every component."""

from __future__ import annotations

import logging
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server

log = logging.getLogger(__name__)


class BoundedLabel:
    """Maps unbounded values (producer ids) onto at most ``limit`` label values.

    The first ``limit - 1`` distinct values keep their name; later ones share ``"other"``,
    so a fleet of restarting producers cannot grow a time series per restart forever.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._seen: set[str] = set()

    def __call__(self, value: str) -> str:
        if value in self._seen:
            return value
        if len(self._seen) < self.limit - 1:
            self._seen.add(value)
            return value
        return "other"


def serve_metrics(
    registry: CollectorRegistry, port: int | None, addr: str = "0.0.0.0"
) -> Any | None:
    """Serve ``registry`` on http://addr:port/metrics from a daemon thread (None: don't).

    Returns the HTTP server (call ``.shutdown()`` and ``.server_close()`` to stop it), or
    None. A training process serves its consumer metrics this way: pass the same registry to
    ``RemoteDataZMQ(registry=...)`` and ``serve_metrics(registry, 9400)``.
    """
    if port is None:
        return None
    server, _thread = start_http_server(port, addr=addr, registry=registry)
    log.info("metrics on http://%s:%d/metrics", addr, port)
    return server

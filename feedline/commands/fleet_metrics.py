"""``feedline fleet``'s own metrics (``--metrics-port``): what it runs and what it was told."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from feedline import endpoints
from feedline.metrics import serve_metrics


def serve(port: int, addr: str) -> CollectorRegistry:
    """A registry served on ``port``; SystemExit with one line if the port cannot be had."""
    registry = CollectorRegistry()
    try:
        serve_metrics(registry, port, addr)
    except endpoints.AddressError as e:
        raise SystemExit(f"feedline fleet: {e}") from None
    return registry


class FleetMetrics:
    """Gauges read from a :class:`feedline.commands.fleet.Supervisor` after each step."""

    def __init__(self, registry: CollectorRegistry, sup: Any) -> None:
        self.sup = sup
        self.producers = Gauge(
            "feedline_fleet_producers", "Producer processes of this supervisor, by state "
            "(running, stopping: SIGTERM sent).", ["state"], registry=registry)
        self.target = Gauge(
            "feedline_fleet_target_producers",
            "Producers this supervisor runs now: its share of the broker's number, within "
            "--min and --max.", registry=registry)
        self.exits = Counter(
            "feedline_fleet_producer_exits", "Producers that exited without being asked: "
            "failed (started again) or finished (exit status 0).", ["how"], registry=registry)
        self._seen = {"failed": 0, "finished": 0}
        for how in self._seen:
            self.exits.labels(how)

    def update(self) -> None:
        pool = self.sup.pool
        self.producers.labels("running").set(len(pool.running))
        self.producers.labels("stopping").set(len(pool.stopping))
        self.target.set(max(self.sup.cfg.min, min(self.sup.cfg.max,
                                                  self.sup.target.count or len(pool.running))))
        for how, now in (("failed", pool.crashed), ("finished", pool.finished)):
            self.exits.labels(how).inc(now - self._seen[how])
            self._seen[how] = now

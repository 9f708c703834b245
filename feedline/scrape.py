"""Reading Prometheus metrics endpoints: fetch, parse, look samples up.

One parser for everything that reads feedline's /metrics: ``feedline top``, the tests and the
benchmarks. :func:`scrape` never raises for an unreachable endpoint: the :class:`Scrape` it
returns has ``error`` set instead.
"""

from __future__ import annotations

import time
import urllib.request
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

Labels = tuple[tuple[str, str], ...]
_MAX_BYTES = 16 << 20  # an exposition larger than this is not one of ours


@dataclass
class Scrape:
    """One scrape of one endpoint: sample name and sorted labels -> value, at ``time``."""

    url: str
    time: float
    samples: dict[tuple[str, Labels], float] = field(default_factory=dict)
    error: str | None = None

    def get(self, name: str, **labels: str) -> float | None:
        """The sample with exactly these labels, or None."""
        return self.samples.get((name, tuple(sorted(labels.items()))))

    def series(self, name: str) -> dict[Labels, float]:
        return {lab: v for (n, lab), v in self.samples.items() if n == name}

    def total(self, name: str, **labels: str) -> float:
        """Sum of the samples of ``name`` whose labels include ``labels``."""
        want = labels.items()
        return sum(v for lab, v in self.series(name).items() if want <= dict(lab).items())

    def by_label(self, name: str, label: str) -> dict[str, float]:
        """``{value of label: sample}`` for the samples of ``name`` that carry ``label``."""
        return {dict(lab)[label]: v for lab, v in self.series(name).items()
                if label in dict(lab)}

    @property
    def role(self) -> str:
        """'broker', 'producer', 'consumer' or 'unknown', from the metric names served."""
        names = {n for n, _ in self.samples}
        for role in ("broker", "producer", "consumer"):
            if any(n.startswith(f"feedline_{role}_") for n in names):
                return role
        return "unknown"


def normalize_url(target: str) -> str:
    """'host:9500' -> 'http://host:9500/metrics'; 9500 -> the same on 127.0.0.1; full URLs
    are kept."""
    if isinstance(target, int) or str(target).isdigit():
        target = f"127.0.0.1:{target}"
    url = target if "://" in target else f"http://{target}"
    if url.rstrip("/").count("/") < 3:  # no path given
        url = url.rstrip("/") + "/metrics"
    return url


def parse(url: str, text: str, at: float) -> Scrape:
    """Parse Prometheus text exposition into a :class:`Scrape`."""
    s = Scrape(url, at)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            s.samples[(sample.name, tuple(sorted(sample.labels.items())))] = float(sample.value)
    return s


def scrape(target: str | int, timeout: float = 2.0) -> Scrape:
    """Fetch and parse one endpoint (a URL, host:port, or a port on 127.0.0.1)."""
    url = normalize_url(str(target))
    at = time.monotonic()
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 (http only)
            text = resp.read(_MAX_BYTES).decode("utf-8", "replace")
    except OSError as e:
        return Scrape(url, at, error=str(getattr(e, "reason", e)))
    return parse(url, text, at)

"""Test support for the operations tests: a real Prometheus server and /metrics helpers.

The server is Debian's ``prometheus`` binary (``.ci/run`` installs it), started on
127.0.0.1 with an ephemeral port, its own storage directory and a generated configuration.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from feedline.procs import Child, free_port, wait_for

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
COMPOSE_PRODUCERS = ROOT / "docker-compose.producers.yml"
COMPOSE_DIRECT = ROOT / "docker-compose.direct.yml"  # a training host in direct mode
COMPOSE_TWO_HOSTS = ROOT / "docker-compose.producers-two-hosts.yml"  # a data machine, 2 hosts
DOCKER_COMPOSE = shutil.which("docker-compose")
needs_compose = pytest.mark.skipif(
    DOCKER_COMPOSE is None, reason="docker-compose is missing (apt-get install docker-compose; "
    ".ci/run installs it)")
PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")
needs_prometheus = pytest.mark.skipif(
    PROMETHEUS is None, reason="the prometheus binary is missing (apt-get install prometheus; "
    ".ci/run installs it)")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool is missing (apt-get install prometheus; .ci/run "
    "installs it)")

# Short enough for a test to see several scrapes within seconds; bounded, not zero.
SCRAPE_INTERVAL = "500ms"


def http_get(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.read().decode()


def http_ok(url: str) -> bool:
    try:
        http_get(url, timeout=1.0)
        return True
    except OSError:
        return False


class Prometheus:
    """A Prometheus server on 127.0.0.1 running ``config`` (a dict), stopped by :meth:`stop`."""

    def __init__(self, config: dict[str, Any], workdir: Path) -> None:
        assert PROMETHEUS is not None
        workdir.mkdir(parents=True, exist_ok=True)
        self.config_path = workdir / "prometheus.yml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.child = Child([
            PROMETHEUS,
            f"--config.file={self.config_path}",
            f"--storage.tsdb.path={workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--log.level=warn",
        ], workdir / "prometheus.log")
        try:
            wait_for(lambda: http_ok(self.url + "/-/ready") or not self.child.alive(), 60,
                     what="prometheus ready")
            assert self.child.alive(), self.child.log_text()
        except BaseException:
            self.stop()
            raise

    def api(self, path: str, **params: Any) -> Any:
        url = f"{self.url}/api/v1/{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        body = json.loads(http_get(url))
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        """An instant query; the result vector (``[{metric, value: [t, "v"]}, ...]``)."""
        params: dict[str, Any] = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        data = self.api("query", **params)
        assert data["resultType"] in ("vector", "scalar"), data
        return data["result"] if data["resultType"] == "vector" else [{"value": data["result"]}]

    def value(self, expr: str, at: float | None = None) -> float | None:
        """The single value of ``expr`` (None when the vector is empty)."""
        result = self.query(expr, at)
        assert len(result) <= 1, f"{expr}: more than one series: {result}"
        return float(result[0]["value"][1]) if result else None

    def targets_up(self) -> dict[str, str]:
        """scrape URL -> health ('up', 'down', 'unknown') of every active target."""
        return {t["scrapeUrl"]: t["health"] for t in self.api("targets")["activeTargets"]}

    def wait_all_up(self, count: int, timeout: float = 60) -> None:
        def ok() -> bool:
            health = self.targets_up()
            return len(health) == count and all(h == "up" for h in health.values())
        wait_for(ok, timeout, interval=0.2, what=f"{count} targets up")

    def stop(self) -> None:
        self.child.stop(timeout=10)


def scrape_config(jobs: dict[str, list[str]]) -> dict[str, Any]:
    """A Prometheus configuration scraping ``job -> [host:port, ...]`` every 500 ms."""
    return {
        "global": {"scrape_interval": SCRAPE_INTERVAL, "scrape_timeout": SCRAPE_INTERVAL},
        "scrape_configs": [
            {"job_name": job, "static_configs": [{"targets": targets}]}
            for job, targets in jobs.items()
        ],
    }


def promtool_check(text: str) -> subprocess.CompletedProcess[str]:
    """``promtool check metrics`` on an exposition (its lint: names, units, help, types)."""
    assert PROMTOOL is not None
    return subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True,
                          text=True, timeout=60)



def compose_config(*files: Path, profile: str | None = None,
                   env: dict[str, str] | None = None) -> dict[str, Any]:
    """The resolved configuration, as ``docker-compose config`` prints it."""
    assert DOCKER_COMPOSE is not None
    argv = [DOCKER_COMPOSE, "--project-directory", str(ROOT)]
    for f in files:
        argv += ["-f", str(f)]
    if profile:
        argv += ["--profile", profile]
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("FEEDLINE_",
                                                                         "COMPOSE_"))}
    out = subprocess.run([*argv, "config"], capture_output=True, text=True, timeout=60,
                         env={**full_env, **(env or {})}, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    return yaml.safe_load(out.stdout)


def option(command: list[str], flag: str) -> str:
    return command[command.index(flag) + 1]


def healthcheck_port(service: dict[str, Any]) -> int:
    probe = " ".join(service["healthcheck"]["test"])
    m = re.search(r"http://127\.0\.0\.1:(\d+)/", probe)
    assert m, probe
    return int(m.group(1))

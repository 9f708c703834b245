"""docker-compose's file run natively: each service's command as a process on 127.0.0.1."""


from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from feedline import security
from feedline.procs import Daemon, free_port, wait_for
from tests.support.ops_support import (
    ROOT,
    Prometheus,
)

DEPLOY = ROOT / "deploy"
_TCP = re.compile(r"tcp://([^:/]+):(\d+)")
_URL = re.compile(r"http://127\.0\.0\.1:(\d+)/")


@dataclass
class Replica:
    service: str
    index: int
    metrics_port: int
    daemon: Daemon | None = None

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"


@dataclass
class NativeCompose:
    """The feedline services of a resolved compose configuration, as local processes."""

    config: dict[str, Any]
    workdir: Path
    ports: dict[tuple[str, int], int] = field(default_factory=dict)  # (service, port) -> port
    replicas: dict[str, list[Replica]] = field(default_factory=dict)
    prometheus: Prometheus | None = None

    def feedline_services(self) -> list[str]:
        names = [n for n, s in self.config["services"].items()
                 if s.get("build", {}).get("dockerfile") == "deploy/Dockerfile"]
        return sorted(names, key=self._depth)

    def _depth(self, name: str) -> int:
        deps = self.config["services"][name].get("depends_on", {})
        return 1 + max((self._depth(d) for d in deps), default=0)

    def binds(self, service: str) -> dict[str, str]:
        """container path -> host path, for this service's volumes (named ones: a dir) and
        its file secrets (bind mounts at /run/secrets/TARGET, as compose makes them)."""
        out = {}
        svc = self.config["services"][service]
        for vol in svc.get("volumes", []):
            if isinstance(vol, dict):  # the long syntax (a bind whose source must exist)
                src, dst = vol["source"], vol["target"]
            else:
                src, dst = vol.split(":")[:2]
            if not src.startswith("/"):
                src = str(self.workdir / "volumes" / src)
                Path(src).mkdir(parents=True, exist_ok=True)
            out[dst] = src
        for sec in svc.get("secrets", []):
            source = sec if isinstance(sec, str) else sec["source"]
            target = source if isinstance(sec, str) else sec.get("target", source)
            out[f"/run/secrets/{target}"] = self.config["secrets"][source]["file"]
        return out

    def port(self, owner: str, port: int) -> int:
        return self.ports.setdefault((owner, port), free_port())

    def translate(self, args: list[str], replica: Replica) -> list[str]:
        binds = self.binds(replica.service)
        out = []
        for i, arg in enumerate(args):
            m = _TCP.fullmatch(arg)
            if i > 0 and args[i - 1] == "--metrics-port":
                arg = str(replica.metrics_port)
            elif m:
                host, port = m.group(1), int(m.group(2))
                owner = replica.service if host == "0.0.0.0" else host
                assert owner in self.config["services"], f"{arg}: no service {owner!r}"
                arg = f"tcp://127.0.0.1:{self.port(owner, port)}"
            else:
                for dst, src in binds.items():
                    if arg == dst or arg.startswith(dst + "/"):
                        arg = src + arg[len(dst):]
            out.append(arg)
        # Metrics on loopback only (in a container they listen on its own address).
        return [*out, "--metrics-addr", "127.0.0.1"]

    def healthcheck(self, replica: Replica) -> list[str]:
        test = self.config["services"][replica.service]["healthcheck"]["test"]
        assert test[0] == "CMD" and test[1] == "python", test
        return [sys.executable, *(_URL.sub(f"http://127.0.0.1:{replica.metrics_port}/", a)
                                  for a in test[2:])]

    def healthy(self, replica: Replica) -> bool:
        return subprocess.run(self.healthcheck(replica), capture_output=True,
                              timeout=30).returncode == 0

    def start(self) -> None:
        for name in self.feedline_services():
            svc = self.config["services"][name]
            for dep, cond in svc.get("depends_on", {}).items():
                if cond.get("condition") == "service_healthy":
                    for r in self.replicas[dep]:
                        d = r.daemon
                        assert d is not None
                        wait_for(lambda r=r, d=d: self.healthy(r) or not d.alive(), 60,
                                 interval=0.2, what=f"{dep} healthy")
                        assert d.alive(), d.log_text()
            count = int(svc.get("deploy", {}).get("replicas", 1))
            self.replicas[name] = []
            for i in range(count):
                r = Replica(name, i, free_port())
                args = self.translate(list(svc["command"]), r)
                r.daemon = Daemon("feedline.commands", args, self.workdir / f"{name}-{i}.log",
                                  env={"PYTHONPATH": str(ROOT)})
                self.replicas[name].append(r)

    def all_replicas(self) -> list[Replica]:
        return [r for rs in self.replicas.values() for r in rs]

    def prometheus_config(self) -> dict[str, Any]:
        """deploy/prometheus/prometheus.yml with compose names answered natively."""
        cfg = yaml.safe_load((DEPLOY / "prometheus/prometheus.yml").read_text())
        binds = self.binds("prometheus")

        def host_path(p: str) -> str:
            for dst, src in binds.items():
                if p == dst or p.startswith(dst + "/"):
                    return src + p[len(dst):]
            raise AssertionError(f"{p} is not mounted into the prometheus service")

        cfg["global"].update(scrape_interval="500ms", scrape_timeout="500ms",
                             evaluation_interval="1s")
        cfg["rule_files"] = [host_path(p) for p in cfg.get("rule_files", [])]
        for job in cfg["scrape_configs"]:
            targets: list[str] = []
            for sc in job.pop("static_configs", []):
                for t in sc["targets"]:
                    host, port = t.rsplit(":", 1)
                    if host == "host.docker.internal":
                        continue  # a trainer outside compose: the `trainer` service plays it
                    targets += self.native_targets(host, int(port))
            for dns in job.pop("dns_sd_configs", []):
                # Docker's DNS answers a service name with every replica's address.
                for name in dns["names"]:
                    targets += self.native_targets(name, int(dns["port"]))
            for fsd in job.get("file_sd_configs", []):
                fsd["files"] = [host_path(f) for f in fsd["files"]]
            if targets:
                job["static_configs"] = [{"targets": targets}]
        return cfg

    def native_targets(self, service: str, port: int) -> list[str]:
        svc = self.config["services"][service]
        assert str(port) in svc["command"], f"{service} does not serve metrics on {port}"
        return [f"127.0.0.1:{r.metrics_port}" for r in self.replicas[service]]

    def stop(self) -> None:
        if self.prometheus is not None:
            self.prometheus.stop()
        for name in reversed(list(self.replicas)):
            for r in self.replicas[name]:
                if r.daemon is not None:
                    r.daemon.stop(timeout=10)


def make_compose_keys(keys: Path) -> Path:
    """The FEEDLINE_KEYS layout docs/security.md tells an operator to make."""
    for name in ("broker", "producer", "trainer"):
        security.generate_keypair(keys, name)
    (keys / "allowed").mkdir()
    for name in ("producer", "trainer"):
        (keys / f"{name}.key").rename(keys / "allowed" / f"{name}.key")
    return keys







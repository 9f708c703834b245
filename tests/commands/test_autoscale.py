"""deploy/k8s/autoscale: the producers' replicas from the broker's number, by the cluster's own
tools. Checked offline, then the queries they run are run for real.

- The HorizontalPodAutoscaler (autoscaling/v2) against the Kubernetes schemas
  (kubernetes-validate, strict); the KEDA ScaledObject against KEDA's CRD schema (vendored in
  tests/support/schemas, keda.sh/v1alpha1), strict as an API server's field validation is (an
  unknown field is refused). Both kustomizations build (``kubectl kustomize``, no cluster).
- They fit the base: they scale the producers' Deployment of deploy/k8s, the HPA's external
  metric is the one prometheus-adapter's rule names, and both select the stream the
  pipeline ConfigMap declares.
- Live: a real Prometheus scrapes a real broker fed by ``feedline fleet`` and read by
  ``feedline drain``. prometheus-adapter's metricsQuery (its template filled in as the adapter
  does for the HPA's selector) and KEDA's query both return the number the broker serves,
  so both autoscalers set ``ceil(number / 1)`` replicas; the dashboard's sizing panels
  return series too.
"""

from __future__ import annotations

import copy
import json
import math
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from feedline.procs import free_port, wait_for
from feedline.scrape import scrape
from tests.support import ROOT, tcp_ready
from tests.support.ops_support import Prometheus, needs_prometheus, scrape_config

AUTO = ROOT / "deploy" / "k8s" / "autoscale"
K8S_VERSION = "1.30.0"
KUBECTL = shutil.which("kubectl")
KEDA_SCHEMA = ROOT / "tests" / "support" / "schemas" / "keda-scaledobject-v1alpha1.json"


def load(path: Path) -> dict[str, Any]:
    (doc,) = [d for d in yaml.safe_load_all(path.read_text()) if d]
    return dict(doc)


def strict(schema: Any) -> Any:
    """The schema with unknown fields refused in every object that lists its fields (what
    ``kubectl apply`` does with field validation Strict, the default since Kubernetes 1.27)."""
    if isinstance(schema, dict):
        out = {k: strict(v) for k, v in schema.items()}
        if out.get("type") == "object" and "properties" in out \
                and "additionalProperties" not in out:
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [strict(v) for v in schema]
    return schema


def keda_validator() -> Any:
    jsonschema = pytest.importorskip("jsonschema")
    return jsonschema.Draft7Validator(strict(json.loads(KEDA_SCHEMA.read_text())))


def test_hpa_validates_against_the_kubernetes_schemas() -> None:
    kv = pytest.importorskip("kubernetes_validate")
    hpa = load(AUTO / "hpa" / "hpa.yaml")
    adapter = load(AUTO / "hpa" / "prometheus-adapter-config.yaml")
    for doc in (hpa, adapter):
        kv.validate(doc, K8S_VERSION, strict=True)
    for broken in ({"minReplicas": "one"}, {"maxReplicass": 4}):
        bad = copy.deepcopy(hpa)
        bad["spec"].update(broken)
        with pytest.raises(kv.ValidationError):
            kv.validate(bad, K8S_VERSION, strict=True)


def test_scaledobject_validates_against_kedas_crd_schema() -> None:
    v = keda_validator()
    so = load(AUTO / "keda" / "scaledobject.yaml")
    errors = [e.message for e in v.iter_errors(so)]
    assert not errors, errors
    assert (so["apiVersion"], so["kind"]) == ("keda.sh/v1alpha1", "ScaledObject")
    bad_type = copy.deepcopy(so)
    bad_type["spec"]["maxReplicaCount"] = "16"
    typo = copy.deepcopy(so)
    typo["spec"]["triger"] = typo["spec"].pop("triggers")
    no_metadata = copy.deepcopy(so)
    del no_metadata["spec"]["triggers"][0]["metadata"]
    number_in_metadata = copy.deepcopy(so)
    number_in_metadata["spec"]["triggers"][0]["metadata"]["threshold"] = 1
    for bad in (bad_type, typo, no_metadata, number_in_metadata):
        assert list(v.iter_errors(bad)), bad["spec"]


@pytest.mark.skipif(KUBECTL is None, reason="kubectl is missing (kustomize is built into it)")
def test_the_kustomizations_build_and_fit_the_base() -> None:
    assert KUBECTL is not None
    built = {}
    for name in ("hpa", "keda"):
        out = subprocess.run([KUBECTL, "kustomize", str(AUTO / name)], capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        (built[name],) = [d for d in yaml.safe_load_all(out.stdout) if d]
    base = [d for p in (ROOT / "deploy/k8s").glob("*.yaml") if p.name != "kustomization.yaml"
            for d in yaml.safe_load_all(p.read_text()) if d]
    producers = next(d for d in base if d["kind"] == "Deployment"
                     and d["metadata"]["name"] == "feedline-producer")
    pipeline = next(d for d in base if d["kind"] == "ConfigMap")
    stream = yaml.safe_load(pipeline["data"]["pipeline.yaml"]).get("stream", "default")
    hpa, so = built["hpa"], built["keda"]
    for obj, ref in ((hpa, hpa["spec"]["scaleTargetRef"]), (so, so["spec"]["scaleTargetRef"])):
        assert obj["metadata"]["namespace"] == producers["metadata"]["namespace"]
        assert (ref["kind"], ref["name"]) == ("Deployment", producers["metadata"]["name"])
        assert ref["apiVersion"] == producers["apiVersion"]
    (metric,) = hpa["spec"]["metrics"]
    assert metric["external"]["metric"]["selector"]["matchLabels"] == {"stream": stream}
    assert metric["external"]["target"] == {"type": "AverageValue", "averageValue": "1"}
    (rule,) = adapter_rules()
    assert rule["name"]["as"] == metric["external"]["metric"]["name"]
    (trigger,) = so["spec"]["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metadata"]["threshold"] == "1"
    assert f'stream="{stream}"' in trigger["metadata"]["query"]


def adapter_rules() -> list[dict[str, Any]]:
    cm = load(AUTO / "hpa" / "prometheus-adapter-config.yaml")
    return list(yaml.safe_load(cm["data"]["config.yaml"])["externalRules"])


def adapter_query(rule: dict[str, Any], selector: dict[str, str]) -> str:
    """The PromQL prometheus-adapter runs for an external metric request: its template with
    the series (the metric the rule's seriesQuery names) and the HPA selector's matchers."""
    series = rule["seriesQuery"].split("{")[0]
    matchers = ",".join(f'{k}="{v}"' for k, v in selector.items())
    return str(rule["metricsQuery"]).replace("<<.Series>>", series) \
        .replace("<<.LabelMatchers>>", matchers)


@pytest.mark.slow
@needs_prometheus
def test_both_autoscalers_read_the_brokers_number_live(daemons, tmp_path: Path) -> None:
    port, metrics = free_port(), free_port()
    ingress, egress = f"tcp://127.0.0.1:{port}", f"ipc://{tmp_path}/e.sock"
    daemons("feedline.broker", "--ingress", ingress, "--egress", egress, "--metrics-port",
            metrics, "--sizing-window", "4", name="broker")
    wait_for(lambda: tcp_ready(port), 20, what="broker port")
    cfg = tmp_path / "paced.yaml"
    cfg.write_text(yaml.safe_dump({
        "source": {"fake": {"shapes": [[64]], "size": 10**9, "delay": 0.01}},
        "steps": [{"batch": {"batch_size": 10}}]}))
    daemons("feedline.commands", "fleet", "--config", cfg, "--broker", ingress,
            "--broker-metrics", f"127.0.0.1:{metrics}", "--min", "1", "--max", "4", "--id", "a",
            "--interval", "0.5", "--", "--log-level", "WARNING", name="fleet")
    # 22 batches/s against 10 per producer: the broker wants ceil(22 x 1.1 / 10) = 3, with
    # room either side (a producer 19% slower, or a trainer 17% slower, moves it).
    daemons("feedline.commands", "drain", "--broker", egress, "--window", "8",
            "--step-seconds", "0.045", name="trainer")
    prom = Prometheus(scrape_config({"broker": [f"127.0.0.1:{metrics}"]}), tmp_path / "prom")
    try:
        url = f"http://127.0.0.1:{metrics}/metrics"

        def served() -> float | None:
            return scrape(url).get("feedline_broker_stream_producers_wanted", stream="default")

        # On a loaded machine the measured rates may put the number at 2 or 4: what this test
        # checks is that both autoscalers' queries return the broker's number, whatever it is,
        # once the stream is input-bound (a second producer wanted).
        wait_for(lambda: (served() or 0) >= 2, 40, interval=0.5,
                 what="the broker to want more than one producer")
        hpa = load(AUTO / "hpa" / "hpa.yaml")
        selector = hpa["spec"]["metrics"][0]["external"]["metric"]["selector"]["matchLabels"]
        (rule,) = adapter_rules()
        so = load(AUTO / "keda" / "scaledobject.yaml")
        keda_query = so["spec"]["triggers"][0]["metadata"]["query"]

        def agree() -> float | None:
            want = served()
            if want is not None and want >= 2 and \
                    prom.value(adapter_query(rule, selector)) == want == prom.value(keda_query):
                return want
            return None
        want = wait_for(agree, 20, interval=0.5, what="both queries to return the broker's number")
        # What each autoscaler then asks for: ceil(value / target), the target being 1.
        target = float(hpa["spec"]["metrics"][0]["external"]["target"]["averageValue"])
        assert math.ceil(want / target) == want
        assert math.ceil(want / float(so["spec"]["triggers"][0]["metadata"]["threshold"])) == want
        dash = json.loads((ROOT / "deploy/grafana/dashboards/feedline.json").read_text())
        sizing = [t["expr"] for p in dash["panels"] if p["id"] in (23, 24, 25, 26)
                  for t in p["targets"]]
        assert len(sizing) == 7
        for expr in sizing:
            assert prom.query(expr.replace("$stream", ".*")), expr
    finally:
        prom.stop()

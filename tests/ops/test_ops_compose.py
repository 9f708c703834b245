"""Run what docker-compose.yml starts, natively on this host, and prove it works together.

There is no Docker engine here, so each service's *resolved* compose configuration
(``docker-compose --profile demo config``) is run as a process: the same command and flags,
the same replicas, the bind-mounted files at their host paths, addresses mapped to
127.0.0.1 and ports to free ones (every replica has its own metrics port, as every container
has its own address). Prometheus runs deploy/prometheus/prometheus.yml with the DNS discovery
of the producers answered by the native replicas. Healthchecks are the compose ones, run
natively. On this live system the tests check the dashboard's queries, promtool's lint and
``feedline top``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
import zmq

from feedline import security
from feedline.commands import top
from feedline.procs import free_port, wait_for
from feedline.protocol import messages as m
from feedline.scrape import Scrape, parse
from feedline.serving.budget import DEPTH
from tests.support.compose import DEPLOY, NativeCompose, Replica, make_compose_keys
from tests.support.ops_support import (
    COMPOSE,
    PROMETHEUS,
    ROOT,
    Prometheus,
    compose_config,
    http_get,
    http_ok,
    needs_compose,
    needs_prometheus,
    needs_promtool,
    promtool_check,
)

pytestmark = [needs_compose, needs_prometheus]

# A map step (the identity on the images) under the skip policy, so that the producers
# export skipped-sample series (one per map stage) for the dashboard's panel to query.
PIPELINE = {"source": {"fake": {"shapes": [[8, 16, 16, 3], [8]], "dtypes": ["uint8", "int32"],
                                "random": False, "size": 50}},
            "on_error": "skip", "steps": [{"map": {"function": "numpy:asarray"}}]}








@pytest.fixture(scope="module")
def native(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NativeCompose]:
    work = tmp_path_factory.mktemp("compose")
    pipeline = work / "pipeline.yaml"
    pipeline.write_text(yaml.safe_dump(PIPELINE))
    keys = make_compose_keys(work / "keys")
    # Small batches through the compose file's own variables (what a .env would set).
    config = compose_config(COMPOSE, profile="demo", env={
        "FEEDLINE_PIPELINE": str(pipeline), "FEEDLINE_DEMO_STEP_SECONDS": "0.02",
        "FEEDLINE_KEYS": str(keys)})
    system = NativeCompose(config, work)
    try:
        system.start()
        assert PROMETHEUS is not None
        system.prometheus = Prometheus(system.prometheus_config(), work / "prometheus")
        yield system
    finally:
        system.stop()


def test_compose_services_work_together(native: NativeCompose) -> None:
    prom = native.prometheus
    assert prom is not None
    assert {n: len(rs) for n, rs in native.replicas.items()} == {
        "broker": 1, "producer": 2, "trainer": 1}
    prom.wait_all_up(4)
    jobs = {t["labels"]["job"] for t in prom.api("targets")["activeTargets"]}
    assert jobs == {"broker", "producer", "trainer"}
    # Both producer replicas and the trainer are registered with the broker, and batches
    # flow from each producer through the broker into the trainer.
    wait_for(lambda: prom.value('feedline_broker_peers{role="producer"}') == 2
             and prom.value('feedline_broker_peers{role="consumer"}') == 1, 30, interval=0.2,
             what="peers registered")
    wait_for(lambda: len(prom.query(
        "rate(feedline_broker_received_batches_total[2s]) > 0")) == 2, 30, interval=0.2,
        what="both producers sending")
    wait_for(lambda: (prom.value("rate(feedline_consumer_received_batches_total[2s])") or 0) > 0,
             30, interval=0.2, what="the trainer receiving")
    # Every compose healthcheck passes natively; and fails where nothing serves.
    for r in native.all_replicas():
        assert native.healthy(r), r
    dead = Replica("broker", 9, free_port())
    assert not native.healthy(dead)


def test_dockerfile_healthcheck_probes_the_metrics_port(native: NativeCompose) -> None:
    DockerfileParser = pytest.importorskip(
        "dockerfile_parse", reason="pip install dockerfile-parse (the test extra has it)"
    ).DockerfileParser

    (health,) = [i["value"] for i in DockerfileParser(str(DEPLOY / "Dockerfile")).structure
                 if i["instruction"] == "HEALTHCHECK"]
    cmd = json.loads(health.split("CMD", 1)[1])
    assert cmd[0] == "python"
    broker = native.replicas["broker"][0]
    ok = subprocess.run([sys.executable, *cmd[1:]], capture_output=True, timeout=30,
                        env={"FEEDLINE_METRICS_PORT": str(broker.metrics_port)})
    assert ok.returncode == 0, ok.stderr
    bad = subprocess.run([sys.executable, *cmd[1:]], capture_output=True, timeout=30,
                         env={"FEEDLINE_METRICS_PORT": str(free_port())})
    assert bad.returncode != 0


@needs_promtool
def test_promtool_check_metrics_on_every_component(native: NativeCompose) -> None:
    roles = set()
    for r in native.all_replicas():
        wait_for(lambda r=r: http_ok(r.metrics_url), 30, what=f"{r.service}'s metrics")
        text = http_get(r.metrics_url)
        out = promtool_check(text)
        assert out.returncode == 0, (r.service, out.stdout, out.stderr)
        roles |= {m for m in ("broker", "producer", "consumer") if f"feedline_{m}_" in text}
    assert roles == {"broker", "producer", "consumer"}


def _provoke_reject_and_drop(ingress: str, curve: security.ClientKeys) -> None:
    """A garbage message (refused) and a producer that says HELLO then BYE (dropped), both
    with an allowed key (without one, libzmq refuses them before the broker sees a byte)."""
    ctx = zmq.Context()
    try:
        for frames in ([b"\x00garbage"], None):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 1000)
            curve.apply(s)
            s.connect(ingress)
            if frames:
                s.send_multipart(frames)
            else:
                s.send(m.encode(m.ProducerHello(producer="probe", session=7, registration=1)))
                s.poll(5000)  # its WELCOME: registered
                s.send(m.encode(m.Bye()))
            s.close()
    finally:
        ctx.term()


def test_every_dashboard_query_works_on_live_metrics(native: NativeCompose) -> None:
    prom = native.prometheus
    assert prom is not None
    prom.wait_all_up(4)
    ingress = f"tcp://127.0.0.1:{native.ports[('broker', 7878)]}"
    keys = native.workdir / "keys"
    _provoke_reject_and_drop(ingress, security.ClientKeys.load(keys / "producer.key_secret",
                                                               keys / "broker.key"))
    # Scraped at least twice (a rate needs two samples of the new series).
    wait_for(lambda: prom.query("increase(feedline_broker_rejected_messages_total[2s])")
             and prom.query("increase(feedline_broker_dropped_peers_total[2s])"), 30,
             interval=0.2, what="reject and drop scraped")
    dashboard = json.loads((DEPLOY / "grafana/dashboards/feedline.json").read_text())
    # Let every rate() window hold samples of the running system.
    wait_for(lambda: prom.value("sum(rate(feedline_broker_forwarded_batches_total[2s]))"),
             30, interval=0.2, what="throughput in Prometheus")
    # The broker gives a stream's sizing verdict once it has settled (twice its heartbeat
    # timeout after it started: its peers are back) and holds half a sizing window of samples
    # (5 s after its first producer; no sizing series before): on a loaded host the tests
    # above can take less.
    wait_for(lambda: prom.query("feedline_broker_stream_bottleneck == 1"), 60, interval=0.2,
             what="the sizing verdict in Prometheus")
    # What the replicas expose, read after the verdict: the sizing series appear with it.
    exposed: set[str] = set()
    for r in native.all_replicas():
        for line in http_get(r.metrics_url).splitlines():
            if line and not line.startswith("#"):
                exposed.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    checked = 0
    for panel in dashboard["panels"]:
        for t in panel["targets"]:
            expr = t["expr"]
            names = set(re.findall(r"\bfeedline_[a-z_]+\b", expr))
            assert names or expr.startswith("count(up{"), expr  # `up`: Prometheus's own
            if any(n.startswith(("feedline_broker_exact_", "feedline_broker_fleet_"))
                   for n in names):
                # The compose demo's stream is not exact and no supervisor runs its
                # producers: tests/ops/test_ops_streams.py and tests/commands/test_autoscale.py run
                # these
                # against a live exact stream and live supervisors.
                continue
            assert names <= exposed, (panel["title"], names - exposed)
            # Grafana's $__rate_interval is >= 4 scrapes: 2 s at this test's 500 ms; the
            # stream variable with All selected is ".*".
            live = expr.replace("$__rate_interval", "2s").replace("$stream", ".*")
            result = prom.query(live)
            assert result, (panel["title"], live)
            checked += 1
    assert checked >= 30
    verdict = prom.value(next(t["expr"] for p in dashboard["panels"] if p["title"] == "Verdict"
                              for t in p["targets"]))
    assert verdict is not None and 0 <= verdict <= 1


def test_recording_rules_evaluate_on_live_metrics(native: NativeCompose) -> None:
    prom = native.prometheus
    assert prom is not None
    groups = prom.api("rules")["groups"]
    rules = {r["name"]: r for g in groups for r in g["rules"]}
    assert "feedline:consumer_queue_occupancy:ratio" in rules
    assert all(r["health"] != "err" for r in rules.values()), rules
    wait_for(lambda: prom.value("feedline:consumer_queue_occupancy:ratio") is not None
             and prom.value("feedline:throughput_bytes:rate1m"), 30, interval=0.2,
             what="recording rules evaluated")
    occupancy = prom.value("feedline:consumer_queue_occupancy:ratio")
    assert occupancy is not None and 0 <= occupancy <= 1


def test_feedline_top_renders_the_live_system(native: NativeCompose) -> None:
    urls = [r.metrics_url for r in native.all_replicas()]
    broker_url = native.replicas["broker"][0].metrics_url

    def forwarded(snap: dict[str, Scrape]) -> float:
        return snap[broker_url].total("feedline_broker_forwarded_batches_total")

    first: dict[str, Scrape] = {}

    def all_answer() -> bool:  # run alone, this test may come before a replica serves
        first.update(top.snapshot(urls))
        return all(s.error is None for s in first.values())
    wait_for(all_answer, 30, interval=0.2, what="every replica's metrics")
    second: dict[str, Scrape] = {}

    def moved_on() -> bool:  # and half a second apart: rates over no time read 0
        second.update(top.snapshot(urls))
        return forwarded(second) >= forwarded(first) + 20 and \
            min(s.time for s in second.values()) - max(s.time for s in first.values()) >= 0.5
    wait_for(moved_on, 30, interval=0.2, what="20 more batches")
    screen = top.render(first, second)

    producer_rows = [line for line in screen.splitlines()
                     if re.match(r"\s+\S+-\d+\s+[\d.]+\s+[\d.]+\s+\d+$", line)]
    ids = {line.split()[0] for line in producer_rows}
    assert len(ids) == 2, screen  # the two replicas, by their producer ids (host-pid)
    total = next(line for line in screen.splitlines() if line.strip().startswith("total"))
    assert float(total.split()[1]) > 0, screen
    endpoints = [line for line in screen.splitlines() if line.strip().startswith("127.0.0.1:")]
    assert len(endpoints) == 3, screen  # two producer endpoints and the trainer
    # The trainer's queue: "n.n/W", W the compose demo's window of 4 in force (its batches
    # of 6 KB count by their bytes: DEPTH x 4), and its rate.
    (consumer,) = [line for line in endpoints if re.search(rf"\d\.\d/{DEPTH * 4} ", line)]
    assert float(consumer.split()[1]) > 0, screen
    assert "VERDICT" in screen and "unknown" not in screen

    # The command itself, as a user runs it.
    out = subprocess.run(
        [sys.executable, "-m", "feedline.commands", "top", "--once", "--interval", "0.5",
         *(u.removeprefix("http://").removesuffix("/metrics") for u in urls)],
        capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "VERDICT" in out.stdout and "PRODUCERS" in out.stdout, out.stdout


@pytest.mark.skipif(shutil.which("tmux") is None,
                    reason="tmux is missing (apt-get install tmux; .ci/run installs it)")
def test_feedline_top_live_in_a_terminal(native: NativeCompose, tmp_path: Path) -> None:
    """The live view, as a person sees it: `feedline top` in a real terminal (tmux)."""
    socket_name = f"feedline-top-{os.getpid()}"
    tmux = ["tmux", "-L", socket_name]
    targets = [f"127.0.0.1:{r.metrics_port}" for r in native.all_replicas()]
    cmd = " ".join([sys.executable, "-m", "feedline.commands", "top", "--interval", "0.5",
                    *targets])
    subprocess.run([*tmux, "new-session", "-d", "-x", "130", "-y", "40", "-c", str(ROOT),
                    f"PYTHONPATH={ROOT} {cmd}"], check=True, timeout=30)
    try:
        screen: list[str] = []

        def shows_figures() -> bool:
            out = subprocess.run([*tmux, "capture-pane", "-p"], capture_output=True,
                                 text=True, timeout=10)
            screen[:] = [out.stdout]
            # Two refreshes in: rates are non-zero (the total line has a positive rate).
            m = re.search(r"^\s+total\s+([\d.]+)", out.stdout, re.M)
            return bool(m and float(m.group(1)) > 0 and "VERDICT" in out.stdout)
        wait_for(shows_figures, 30, interval=0.3, what="feedline top figures on screen")
        text = screen[0]
        assert "PRODUCERS" in text and "BROKER" in text and "CONSUMERS" in text, text
        (tmp_path / "top-screen.txt").write_text(text)
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True, timeout=10)


def _seconds(duration: str) -> float:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(ms|s|m)", duration)
    assert m, duration
    return float(m.group(1)) * {"ms": 0.001, "s": 1.0, "m": 60.0}[m.group(2)]


def test_services_stop_cleanly_on_sigterm(native: NativeCompose) -> None:
    """What `docker compose stop` does: SIGTERM, SIGKILL after stop_grace_period.

    Runs last in this module (it stops the system). Every daemon exits 0 on SIGTERM, and
    producers say BYE, so the broker frees their credit at once instead of timing out.
    """
    broker = native.replicas["broker"][0]

    def dropped_by_bye() -> float:
        text = http_get(broker.metrics_url)
        scrape = parse(broker.metrics_url, text, 0.0)
        return scrape.get("feedline_broker_dropped_peers_total", role="producer",
                          reason="bye") or 0.0

    before = dropped_by_bye()  # (another test's probe may have said BYE already)
    for name in ("trainer", "producer"):
        grace = _seconds(native.config["services"][name]["stop_grace_period"])
        for r in native.replicas[name]:
            assert r.daemon is not None
            assert r.daemon.stop(timeout=grace) == 0, r.daemon.log_text()
    wait_for(lambda: dropped_by_bye() >= before + 2, 20, what="producers' BYE at the broker")
    assert broker.daemon is not None
    grace = _seconds(native.config["services"]["broker"]["stop_grace_period"])
    assert broker.daemon.stop(timeout=grace) == 0, broker.daemon.log_text()

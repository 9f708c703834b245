"""Answers that add up: `feedline top --once` fails when what it watches is down, the
bottleneck verdict holds steady on a steady run, the demo's steps and batches reconcile, and
the processes say what they are (`--version`, the producer's start-up line)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
import pytest

from feedline.procs import free_port, wait_for
from feedline.scrape import Scrape
from tests.support.operator_support import feedline


def test_top_once_exits_non_zero_naming_each_endpoint_down():
    ports = [free_port(), free_port()]
    r = feedline("top", "--once", "--interval", "0.2", *(f"127.0.0.1:{p}" for p in ports))
    assert r.returncode == 1, r.stdout + r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "2 of 2 endpoints down" in lines[0], r.stderr
    for p in ports:
        assert f"http://127.0.0.1:{p}/metrics" in lines[0]


def test_top_once_exits_zero_when_every_endpoint_answers(broker_proc):
    metrics = free_port()
    broker_proc("--metrics-port", str(metrics))
    r = feedline("top", "--once", "--interval", "0.2", f"127.0.0.1:{metrics}")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "BROKER" in r.stdout


# A steady run as `feedline top` scrapes it: a drain with a window of 4 batches whose queue
# is full one scrape and half empty the next, and whose waits for data come in bursts (12%
# of one interval, 2% of the next). Over any minute: occupancy 0.75-0.8, waiting 7%.
_QUEUE = [4, 2, 4, 4, 2, 4, 4, 3, 4, 4, 2, 4, 4, 4, 3, 4, 4, 2, 4, 4, 4, 3, 4, 4, 2, 4, 4, 3]
_WAIT = [0.24, 0.04] * 14  # seconds waited per 2-second interval


def _snapshots() -> list[dict[str, Scrape]]:
    url = "http://trainer:9400/metrics"
    snaps, waited = [], 0.0
    for i, (q, w) in enumerate(zip(_QUEUE, _WAIT, strict=True)):
        waited += w
        s = Scrape(url, 2.0 * i, {
            ("feedline_consumer_local_queue_batches", ()): float(q),
            ("feedline_consumer_window_batches", ()): 4.0,
            ("feedline_consumer_wait_seconds_sum", ()): waited,
            ("feedline_consumer_received_batches_total", ()): 10.0 * i,
        })
        snaps.append({url: s})
    return snaps


def _verdicts(screens: list[str]) -> list[str]:
    return [re.search(r"VERDICT  (\S+)", s).group(1) for s in screens]  # type: ignore[union-attr]


def test_top_verdict_does_not_flap_on_a_steady_run():
    from feedline.commands.top import render
    from feedline.verdict import VerdictTracker

    snaps = _snapshots()
    tracker = VerdictTracker()
    steady = [render(snaps[i - 1], snaps[i], history=snaps[max(0, i - 30):i], tracker=tracker)
              for i in range(1, len(snaps))]
    words = _verdicts(steady)
    assert len(set(words[3:])) == 1, words  # after the first few scrapes: one answer
    # What a two-scrape verdict without memory says of the same run: it flaps.
    naive = _verdicts([render(snaps[i - 1], snaps[i]) for i in range(1, len(snaps))])
    assert {"INPUT-BOUND:", "MODEL-BOUND:"} <= set(naive), naive


def test_verdict_tracker_moves_only_on_clear_repeated_evidence():
    from feedline.verdict import HOLD, VerdictTracker

    t = VerdictTracker()
    assert t.update(0.9) == "model-bound"
    assert t.update(0.72) == "model-bound"  # inside the margin: still model-bound
    for _ in range(HOLD - 1):
        assert t.update(0.1) == "model-bound"  # clear, but not yet repeated enough
    assert t.update(0.1) == "input-bound"
    assert t.update(0.28, 0.0) == "input-bound"  # above 0.25 but within the margin


def test_occupancy_monitor_verdict_holds_through_a_noisy_queue():
    """The training loop's monitor, fed a queue whose size jumps between full and a third
    half full every other step, around the model-bound threshold."""
    from feedline.consumer import OccupancyMonitor

    class Queue:  # a queue whose size() is what the step loop samples
        capacity = 16
        sizes = iter([16, 8] * 150)

        def size(self) -> int:
            return next(self.sizes)

    m = OccupancyMonitor(Queue(), every=0, alpha=0.3)
    seen = []
    for _ in range(300):
        m.step()
        seen.append(m.verdict)
    assert len(set(seen[20:])) == 1, sorted(set(seen[20:]))


def test_version_names_the_jpeg_decoder():
    r = feedline("--version")
    assert r.returncode == 0
    assert re.fullmatch(r"feedline \S+ \(JPEG decoder: (libjpeg-turbo|OpenCV) .*\)\n", r.stdout), \
        r.stdout


def test_a_command_loads_its_own_module_alone(tmp_path):
    """``feedline keys generate`` runs without importing the producer's, the broker's or the
    image libraries (a daemon starts sooner); ``--help`` still lists every command, and each
    name in the table is the one its module adds."""
    code = ("import json, sys\n"
            "from feedline.commands.main import COMMANDS, build_parser, main\n"
            f"rc = main(['keys', 'generate', {str(tmp_path)!r}, '--name', 'k'])\n"
            "loaded = sorted(m for m in ('cv2', 'feedline.producer.cli', 'feedline.broker.cli',"
            " 'feedline.commands.demo') if m in sys.modules)\n"
            "sub = next(a for a in build_parser()._actions if a.dest == 'command')\n"
            "print(json.dumps([rc, loaded, list(sub.choices) == list(COMMANDS)]))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    rc, loaded, same = json.loads(r.stdout.splitlines()[-1])
    assert rc == 0 and (tmp_path / "k.key_secret").exists()
    assert loaded == [], f"feedline keys imported {loaded}"
    assert same, "COMMANDS names a command its module does not add (or in another order)"


@pytest.mark.parametrize("module", ["feedline.producer.cli", "feedline.broker.cli",
                                    "feedline.consumer.remote"])
def test_a_daemon_or_trainer_starts_without_what_only_some_of_them_use(module):
    """A producer, a broker and a trainer import asyncio (pyzmq's monitor and ZAP helpers,
    wanted only with CURVE keys), fsspec (remote shards), tqdm (progress bars) and OpenCV
    (image steps) when they use them, not at start: together about a fifth of a producer's
    start-up CPU."""
    code = (f"import json, sys, {module}\n"
            "print(json.dumps(sorted(m for m in ('asyncio', 'fsspec', 'tqdm', 'cv2')"
            " if m in sys.modules)))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.splitlines()[-1]) == [], f"{module} imported them at start"


def test_producer_logs_a_start_up_line_that_log_level_turns_off(daemons, broker_proc,
                                                                endpoints, tmp_path):
    from feedline.consumer import RemoteDataZMQ

    cfg = tmp_path / "p.yaml"
    cfg.write_text("source: {fake: {shapes: [[2]], size: 3}}\nepochs: 1\n")
    broker_proc()
    loud = daemons("feedline.producer", "--config", cfg, "--broker", endpoints.ingress, "--id",
                   "p-1",
                   name="loud")
    quiet = daemons("feedline.producer", "--config", cfg, "--broker", endpoints.ingress, "--id",
                    "p-2",
                    "--log-level", "WARNING", name="quiet")
    with RemoteDataZMQ(endpoints.egress, timeout=30) as src:
        got = [dp for _, dp in zip(range(6), src, strict=False)]
    assert len(got) == 6 and all(isinstance(dp[0], np.ndarray) for dp in got)
    wait_for(lambda: not loud.alive() and not quiet.alive(), 30, what="producers done")
    start = [line for line in loud.log_text().splitlines() if "producer p-1:" in line]
    assert len(start) == 1, loud.log_text()
    for part in ("feedline ", f"broker {endpoints.ingress}", f"pipeline {cfg}", "decoder ",
                 "stream default"):
        assert part in start[0], (part, start[0])
    assert quiet.log_text().strip() == "", quiet.log_text()


@pytest.mark.slow
@pytest.mark.tf
def test_demo_steps_and_batches_add_up(tmp_path):
    pytest.importorskip("tensorflow")
    r = feedline("demo", "--duration", "3", "--producers", "1", "--batch-size", "16",
                 "--image-size", "64", "--workdir", str(tmp_path), timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    steps = int(re.search(r"^(\d+) steps in", r.stdout, re.M).group(1))  # type: ignore[union-attr]
    total = int(re.search(r"^total\s+(\d+)", r.stdout, re.M).group(1))  # type: ignore[union-attr]
    m = re.search(r"^(\d+) steps = (\d+) batches received \+ (\d+) held in the queues at the "
                  r"start - (\d+) held at the end", r.stdout, re.M)
    assert m, r.stdout
    s, received, start, end = (int(g) for g in m.groups())
    assert s == steps and received == total
    assert steps == received + start - end

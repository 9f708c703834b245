"""``feedline fleet``'s own behaviour, quickly: its flags (one-line errors), reading its share
from a broker's metrics text, starting a failed producer again, and stopping gracefully."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import yaml

from feedline.commands.fleet import target_from
from feedline.procs import free_port, wait_for
from feedline.scrape import parse, scrape
from tests.conftest import ROOT, tcp_ready

BROKER_TEXT = """
feedline_broker_stream_producers_wanted{stream="default"} 5
feedline_broker_stream_bottleneck{stream="default",verdict="input-bound"} 1
feedline_broker_stream_bottleneck{stream="default",verdict="model-bound"} 0
feedline_broker_stream_demand_batches_per_second{stream="default"} 40
feedline_broker_stream_supply_batches_per_second{stream="default"} 20
feedline_broker_stream_peers{stream="default",role="producer"} 3
feedline_broker_fleet_producers{stream="default",fleet="b"} 2
feedline_broker_fleet_producers_wanted{stream="default",fleet="b"} 3
feedline_broker_fleet_producers_max{stream="default",fleet="b"} 8
"""


def test_the_share_is_read_or_else_computed_as_the_broker_will() -> None:
    s = parse("http://broker/metrics", BROKER_TEXT, 0.0)
    b = target_from(s, "default", "b", 8)
    assert (b.count, b.share_known, b.verdict, b.wanted) == (3, True, "input-bound", 5)
    # "a" has nothing connected yet: 1 unmanaged producer, then a and b share 4 (a first).
    a = target_from(s, "default", "a", 8)
    assert (a.count, a.share_known, a.supervisors) == (2, False, 2)
    capped = target_from(s, "default", "a", 1)
    assert capped.count == 1
    assert target_from(s, "other", "a", 8).count is None  # no number for that stream
    down = target_from(parse("u", "", 0.0), "default", "a", 8)
    assert down.count is None
    gone = target_from(scrape(f"127.0.0.1:{free_port()}", 0.5), "default", "a", 8)
    assert gone.count is None and "unreachable" in gone.why


def fleet(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "feedline.commands", "fleet", *args],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def test_bad_flags_are_one_line_errors(tmp_path: Path) -> None:
    cfg = tmp_path / "p.yaml"
    cfg.write_text(yaml.safe_dump({"source": {"fake": {"shapes": [[2]]}}}))
    base = ["--config", str(cfg), "--broker", "tcp://127.0.0.1:7878",
            "--broker-metrics", "127.0.0.1:9500"]
    cases = [
        ([*base, "--min", "3", "--max", "2"], "--min 3 --max 2: need 0 <= --min <= --max"),
        (["--config", str(tmp_path / "nope.yaml"), *base[2:], "--max", "2"], "cannot read"),
        ([*base[:2], "--broker", "127.0.0.1:7878", *base[4:], "--max", "2"], "no scheme"),
        ([*base, "--max", "2", "--", "--id", "x"], "--id after --: the supervisor sets it"),
        ([*base, "--max", "2", "--interval", "0"], "--interval and --stop-timeout"),
    ]
    for argv, needle in cases:
        r = fleet(*argv)
        assert r.returncode == 1, (argv, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("feedline fleet: ") and needle in lines[0], \
            (argv, r.stderr)
    r = fleet("--help")
    assert r.returncode == 0 and "--broker-metrics" in r.stdout and "share" in r.stdout


def test_a_failed_producer_is_started_again_and_sigterm_stops_all(daemons, tmp_path: Path) -> None:
    cfg = tmp_path / "p.yaml"
    cfg.write_text(yaml.safe_dump({"source": {"fake": {"shapes": [[16]], "size": 10**9,
                                                       "delay": 0.01}}}))
    port, metrics = free_port(), free_port()
    ingress = f"tcp://127.0.0.1:{port}"
    daemons("feedline.broker", "--ingress", ingress, "--egress", f"ipc://{tmp_path}/e.sock",
            "--metrics-port", metrics, name="broker")
    wait_for(lambda: tcp_ready(port), 20, what="broker port")
    # No consumer: the broker wants none, so the fleet runs its --min.
    sup = daemons("feedline.commands", "fleet", "--config", cfg, "--broker", ingress,
                  "--broker-metrics", f"127.0.0.1:{metrics}", "--min", "2", "--max", "4",
                  "--id", "x", "--interval", "0.3", "--", "--log-level", "WARNING",
                  name="fleet")

    def producers() -> dict[str, int]:
        import psutil

        out = {}
        for p in psutil.Process(sup.pid).children():
            try:
                cmd = p.cmdline()
            except psutil.Error:  # exited meanwhile (a zombie until the fleet reaps it)
                continue
            if "feedline.producer" in cmd:
                out[cmd[cmd.index("--id") + 1]] = p.pid
        return out

    wait_for(lambda: len(producers()) == 2, 20, what="2 producers")
    first = producers()
    victim = first["x-1"]
    import os

    os.kill(victim, signal.SIGKILL)
    wait_for(lambda: len(producers()) == 2 and "x-2" in producers(), 20,
             what="a producer started again")
    assert "exited with status -9" in sup.log_text()
    running = list(producers().values())
    sup.signal(signal.SIGTERM)
    assert sup.proc.wait(30) == 0
    import psutil

    assert not [p for p in running if psutil.pid_exists(p)
                and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]

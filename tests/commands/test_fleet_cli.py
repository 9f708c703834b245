"""``feedline fleet``'s own behaviour, quickly: its flags (one-line errors), reading its share
from a broker's metrics text, starting a failed producer again, and stopping gracefully."""

from __future__ import annotations

import math
import signal
import subprocess
import sys
from pathlib import Path

import yaml

from feedline.commands.fleet import target_from
from feedline.procs import free_port, wait_for
from feedline.scrape import parse, scrape
from tests.support import ROOT, tcp_ready

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


def test_top_shows_each_streams_number_and_its_reason(daemons, tmp_path: Path) -> None:
    """One broker, two streams: "starved" (a producer paced at 10 batches/s, a trainer that
    takes all it gets) is input-bound and wants more producers; "fed" (a free-running
    producer, a trainer of 20 steps/s) is model-bound and wants one. `feedline top` shows
    both numbers with their reasons, as the broker exports them."""
    paced = tmp_path / "paced.yaml"
    paced.write_text(yaml.safe_dump({"source": {"fake": {"shapes": [[16]], "size": 10**9,
                                                         "delay": 0.01}},
                                     "steps": [{"batch": {"batch_size": 10}}]}))
    free = tmp_path / "free.yaml"
    free.write_text(yaml.safe_dump({"source": {"fake": {"shapes": [[16]], "size": 10**9}},
                                    "steps": [{"batch": {"batch_size": 10}}]}))
    port, metrics = free_port(), free_port()
    ingress, egress = f"tcp://127.0.0.1:{port}", f"ipc://{tmp_path}/e.sock"
    daemons("feedline.broker", "--ingress", ingress, "--egress", egress, "--metrics-port",
            metrics, "--sizing-window", "2", name="broker")
    wait_for(lambda: tcp_ready(port), 20, what="broker port")
    for stream, cfg, step in (("starved", paced, "0"), ("fed", free, "0.05")):
        daemons("feedline.producer", "--config", cfg, "--broker", ingress, "--stream", stream,
                "--log-level", "WARNING", name=f"producer-{stream}")
        daemons("feedline.commands", "drain", "--broker", egress, "--stream", stream,
                "--step-seconds", step, "--window", "8", "--log-level", "WARNING",
                name=f"trainer-{stream}")
    url = f"127.0.0.1:{metrics}"

    def judged() -> bool:
        b = scrape(url, 1.0)
        return (b.get("feedline_broker_stream_bottleneck", stream="starved",
                      verdict="input-bound") == 1
                and (b.get("feedline_broker_stream_producers_wanted", stream="starved")
                     or 0) >= 2
                and b.get("feedline_broker_stream_bottleneck", stream="fed",
                          verdict="model-bound") == 1
                # One producer's capacity is learnt apart from the verdict (which alone may
                # raise the number before it is known); the row's each/s needs it.
                and not math.isnan(b.get("feedline_broker_stream_producer_capacity_batches_"
                                         "per_second", stream="starved") or math.nan))
    wait_for(judged, 40, interval=0.5, what="both streams judged, starved's capacity learnt")
    out = subprocess.run([sys.executable, "-m", "feedline.commands", "top", "--once",
                          "--interval", "0.5", url],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("SIZING"))
    rows = {}
    for line in lines[start + 2:]:
        if not line.strip():
            break
        name, *fields = line.split()
        rows[name] = fields
    # demand/s, supply/s, each/s, producers, wanted, waiting, reason
    assert set(rows) == {"starved", "fed"}, out.stdout
    starved, fed = rows["starved"], rows["fed"]
    assert starved[-1] == "input-bound" and int(starved[4]) >= 2, out.stdout
    assert float(starved[0]) > float(starved[2]), out.stdout  # demand above one's capacity
    assert fed[-1] == "model-bound" and (fed[3], fed[4]) == ("1", "1"), out.stdout

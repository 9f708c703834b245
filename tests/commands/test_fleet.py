"""``feedline fleet`` against a real broker, real producer processes and a real trainer process
(``feedline drain --schedule``: a model whose step goes fast, slow, fast).

The producers run a paced pipeline (``fake: {delay}``: 10 batches/s each, whatever the CPU),
so supply grows with their number on a 2-core machine too. The broker's sizing window is 4 s
(``--sizing-window 4``: the number rises after 0.8 s of evidence, falls after 4 s). What is
stated, and checked:

- each way, the fleet runs the producers the demand needs within FOLLOW_UP (up) or
  FOLLOW_DOWN (down) seconds of the demand's change (producers start in ~2 s on this
  machine; the estimate averages over the window);
- once it has, the trainer waits for data less than WAIT_BOUND of its time, to the phase's
  end;
- training: scaling down loses nothing (the broker counts no loss and no unconfirmed credit:
  every stopped producer said BYE); exact delivery across scale-up and scale-down: every
  sample of every epoch taken once (0 lost, 0 duplicated, bytes as a clean run's);
- two supervisors share one stream's number: each runs its share (3 and 2 of 5; 3 and 3
  when a loaded machine makes the broker ask for 6), and the counts then move only when the
  number does (no fight).
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path

import psutil
import pytest
import yaml

from feedline.errors import Timeout
from feedline.procs import Daemon, free_port, wait_for
from feedline.scrape import scrape
from feedline.serving.sizing import fleet_shares
from tests.support import tcp_ready

PER_PRODUCER = 10.0  # batches/s: 0.01 s a datapoint, 10 a batch
FAST, SLOW = 0.025, 0.08  # model steps: 40 and 12.5 batches/s
NEED_FAST = math.ceil(1 / FAST * 1.1 / PER_PRODUCER)  # 5, with the default 10% headroom
NEED_SLOW = math.ceil(1 / SLOW * 1.1 / PER_PRODUCER)  # 2
FOLLOW_UP = 20.0
FOLLOW_DOWN = 20.0
WAIT_BOUND = 0.10
PACED = {"source": {"fake": {"shapes": [[256]], "dtypes": ["float32"], "random": False,
                             "size": 10**9, "delay": 0.01}},
         "steps": [{"batch": {"batch_size": 10}}]}

pytestmark = pytest.mark.slow


@dataclass
class Sample:
    t: float
    producers: float
    wanted: float | None
    taken: float | None = None  # the trainer's batches received (cumulative)
    waited: float | None = None  # the trainer's wait seconds (cumulative)


@dataclass
class Watch:
    """Scrapes the broker (and the trainer) every 0.5 s in a thread."""

    broker: str
    trainer: str | None = None
    stream: str = "default"
    samples: list[Sample] = field(default_factory=list)
    fleets: list[dict[str, float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self.t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            b = scrape(self.broker, 1.0)
            if b.error:
                continue
            s = Sample(b.time - self.t0,
                       b.get("feedline_broker_stream_peers", stream=self.stream,
                             role="producer") or 0,
                       b.get("feedline_broker_stream_producers_wanted", stream=self.stream))
            if self.trainer:
                c = scrape(self.trainer, 1.0)
                s.taken = c.get("feedline_consumer_received_batches_total")
                s.waited = c.get("feedline_consumer_wait_seconds_sum")
            self.samples.append(s)
            self.fleets.append({dict(lab)["fleet"]: v for lab, v in
                                b.series("feedline_broker_fleet_producers").items()})
            self.last = b

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def first(self, since: float, until: float, ok) -> Sample | None:
        return next((s for s in self.samples if since <= s.t <= until and ok(s)), None)

    def wait_share(self, start: float, end: float) -> float:
        a = next(s for s in self.samples if s.t >= start and s.waited is not None)
        b = [s for s in self.samples if s.t <= end and s.waited is not None][-1]
        assert b.t - a.t > 3, "too short a stretch to judge"
        return (b.waited - a.waited) / (b.t - a.t)  # type: ignore[operator]


def start_broker(daemons, tmp_path: Path, *extra: str) -> tuple[str, str, str, Daemon]:
    port, metrics = free_port(), free_port()
    ingress, egress = f"tcp://127.0.0.1:{port}", f"ipc://{tmp_path}/egress.sock"
    d = daemons("feedline.broker", "--ingress", ingress, "--egress", egress, "--metrics-port",
                metrics, "--sizing-window", "4", "--heartbeat-interval", "0.2",
                "--heartbeat-timeout", "1.5", *extra, name="broker")
    wait_for(lambda: tcp_ready(port) or not d.alive(), 20, what="broker port")
    assert d.alive(), d.log_text()
    return ingress, egress, f"http://127.0.0.1:{metrics}/metrics", d


def start_fleet(daemons, cfg: Path, ingress: str, metrics: str, fleet: str, lo: int, hi: int,
                *extra: str) -> Daemon:
    return daemons("feedline.commands", "fleet", "--config", cfg, "--broker", ingress,
                   "--broker-metrics", metrics, "--min", lo, "--max", hi, "--id", fleet,
                   "--interval", "0.5", "--stop-timeout", "10", *extra, "--",
                   "--heartbeat-interval", "0.2", "--heartbeat-timeout", "1.5",
                   "--log-level", "WARNING", name=f"fleet-{fleet}")


def test_fleet_follows_fast_slow_fast_demand(daemons, tmp_path: Path) -> None:
    cfg = tmp_path / "paced.yaml"
    cfg.write_text(yaml.safe_dump(PACED))
    # The broker's budget of 4 holds 512 of these 10 KB batches and the trainer's window of 1
    # holds 128 (counted by bytes: budget.depth): what 32 and 8 held before the count went
    # to 128 per batch of a window. What is buffered hides a rise in demand from the broker's
    # sizer until the trainer has drained it (32 and 8 hold 4,096 and 1,024 of them now:
    # with the broker's default budget the fleet followed 21-24 s into the fast phase, past
    # the 20 s asked).
    ingress, egress, metrics, _ = start_broker(daemons, tmp_path, "--max-batches", "4")
    fleet = start_fleet(daemons, cfg, ingress, metrics, "A", 1, 6)
    trainer_port = free_port()
    phase = 35.0
    daemons("feedline.commands", "drain", "--broker", egress, "--window", "1",
            "--schedule", f"{phase}:{FAST},{phase}:{SLOW},{phase}:{FAST}",
            "--metrics-port", trainer_port, "--log-interval", "5", name="trainer")
    watch = Watch(metrics, f"http://127.0.0.1:{trainer_port}/metrics")
    try:
        wait_for(lambda: watch.samples and watch.samples[-1].taken, 30, what="first batches")
        t0 = next(s.t for s in watch.samples if s.taken) - 1  # the schedule's start (about)
        time.sleep(max(0.0, t0 + 3 * phase - (time.monotonic() - watch.t0)))
    finally:
        watch.close()
    report = [(round(s.t - t0, 1), s.producers, s.wanted) for s in watch.samples]
    for i, (need, bound, up) in enumerate([(NEED_FAST, FOLLOW_UP, True),
                                           (NEED_SLOW, FOLLOW_DOWN, False),
                                           (NEED_FAST, FOLLOW_UP, True)]):
        start, end = t0 + i * phase, t0 + (i + 1) * phase
        got = watch.first(start, start + bound,
                          (lambda s, n=need: s.producers >= n) if up else
                          (lambda s, n=need: s.producers <= n))
        assert got is not None, f"phase {i}: not {need} producers within {bound}s: {report}"
        share = watch.wait_share(got.t, end - 1)
        assert share < WAIT_BOUND, (f"phase {i}: the trainer waited {share:.0%} after the "
                                    f"fleet followed at {got.t - start:.1f}s: {report}")
    # Scaling down lost nothing: each producer stopped said BYE (no unconfirmed credit).
    b = watch.last
    assert b.total("feedline_broker_dropped_peers_total", role="producer", reason="bye") >= 2
    assert b.total("feedline_broker_lost_batches_total") == 0
    assert b.get("feedline_broker_unconfirmed_batches_total", role="producer") == 0
    assert fleet.alive()
    fleet.stop()
    text = fleet.log_text()
    assert "stopping A-" in text and "broker wants" in text, text[-3000:]


def test_exact_delivery_across_scale_up_and_down_loses_nothing(daemons, tmp_path: Path) -> None:
    from tests.support.exact_ledger import audit, clean_run, exact_config, read_exact_ledger

    # 800 batches in 2 epochs; units of 5 batches (0.5 s each): stops land mid-unit.
    pipe = exact_config(4000, unit_size=50, batch_size=10, epochs=2, nbytes=256,
                        rate=100.0, stream="val")
    cfg = tmp_path / "exact.yaml"
    cfg.write_text(yaml.safe_dump(pipe))
    ingress, egress, metrics, _ = start_broker(daemons, tmp_path, "--state-dir",
                                                  str(tmp_path / "state"))
    fleet = start_fleet(daemons, cfg, ingress, metrics, "A", 1, 6)
    ledger = tmp_path / "ledger.txt"
    daemons("tests.support.exact_ledger_consumer", "--broker", egress, "--ledger", ledger,
            "--stream", "val", "--window", "8", "--schedule", f"14:{FAST},16:{SLOW},60:{FAST}",
            "--heartbeat-interval", "0.2", "--heartbeat-timeout", "1.5", name="trainer")
    watch = Watch(metrics, stream="val")
    try:
        wait_for(lambda: not fleet.alive(), 150, interval=0.5,
                 what="the fleet to finish both epochs")
    finally:
        watch.close()
    assert fleet.proc.returncode == 0, fleet.log_text()[-3000:]
    log = fleet.log_text()
    assert "started A-" in log and "stopping A-" in log, log[-3000:]
    peak = max(s.producers for s in watch.samples)
    assert peak >= 4, [s.producers for s in watch.samples]
    led = read_exact_ledger(ledger)
    assert [sorted(e) for _, e in led.ends] == [[0], [1]], led.ends
    a = audit({"trainer": led.entries}, clean_run(pipe))
    assert a.summary() == {"lost": 0, "duplicated": 0, "foreign": 0, "mismatched": 0}
    assert a.clean() and a.taken == 2 * 4000


def test_two_supervisors_share_the_number_without_fighting(daemons, tmp_path: Path) -> None:
    cfg = tmp_path / "paced.yaml"
    cfg.write_text(yaml.safe_dump(PACED))
    ingress, egress, metrics, _ = start_broker(daemons, tmp_path)
    start_fleet(daemons, cfg, ingress, metrics, "a-host", 1, 4)
    start_fleet(daemons, cfg, ingress, metrics, "b-host", 1, 4)
    daemons("feedline.commands", "drain", "--broker", egress, "--window", "8",
            "--step-seconds", str(FAST), name="trainer")
    watch = Watch(metrics)
    # The broker's number is 5 on a quiet machine (3 + 2: in sorted order the first takes the
    # rest); on a loaded one the producers' measured rate drops and it may ask for 6 (3 + 3).
    # Either way each supervisor must run its share of the number the broker states.
    tops = {"a-host": 4, "b-host": 4}

    def history() -> str:  # a string: pytest shortens a list's repr
        return str([(round(s.t, 1), s.wanted, f)
                    for s, f in zip(watch.samples, watch.fleets, strict=False)])

    def settled() -> bool:
        last = list(zip(watch.samples, watch.fleets, strict=False))[-3:]
        # The number first follows the trainer's demand (2 while only the fleets' minimum
        # runs): settled is near the demand's number, each supervisor at its share of it.
        return len(last) == 3 and all(
            s.wanted and abs(s.wanted - NEED_FAST) <= 1
            and f == fleet_shares(int(s.wanted), tops) for s, f in last)

    try:
        try:
            wait_for(settled, 40, interval=0.5, what="each supervisor at its share")
        except Timeout as e:
            raise AssertionError(f"{e}: {history()}") from None
        since = len(watch.fleets)
        time.sleep(12)
    finally:
        watch.close()
    rows = list(zip(watch.samples, watch.fleets, strict=False))[since - 1:]
    assert len(rows) >= 15, history()
    wanted = [int(s.wanted or 0) for s, _ in rows]
    assert all(abs(w - NEED_FAST) <= 1 for w in wanted), history()
    # No fight: every count is the supervisor's share of a number the broker stated in the
    # last 5 s (starting a producer takes ~2 s), and the counts move only when the number does.
    lag = 10
    for i, (_, f) in enumerate(rows):
        recent = [fleet_shares(w, tops) for w in wanted[max(0, i - lag):i + 1]]
        assert all(any(f[k] == r[k] for r in recent) for k in tops), f"{i}: {history()}"
    moves = sum(a != b for (_, a), (_, b) in pairwise(rows))
    changes = sum(a != b for a, b in pairwise(wanted))
    assert moves <= 2 * changes, history()


def test_producers_added_to_a_running_fleet_join_its_run(daemons, tmp_path: Path) -> None:
    """The producers a supervisor starts before the broker lists any of them may begin the
    stream's run; those it starts once it does (more wanted, a restart) carry ``--join-run``:
    on an exact stream whose run was served before they connect, they end instead of starting
    the next run (tests/exact/test_exact_jobs.py checks that side)."""
    from feedline.commands.fleet import FleetConfig, Supervisor

    cfg = tmp_path / "paced.yaml"
    cfg.write_text(yaml.safe_dump(PACED))
    ingress, _, metrics, _ = start_broker(daemons, tmp_path)
    sup = Supervisor(FleetConfig(str(cfg), (ingress,), metrics, "A", 1, 3, "default",
                                 interval=0.5, stop_timeout=10,
                                 producer_args=("--heartbeat-interval", "0.2",
                                                "--heartbeat-timeout", "1.5")))
    try:
        assert "--join-run" not in sup._argv("A-1")
        sup.step(time.monotonic())  # starts --min: the broker lists none of ours yet
        assert len(sup.pool.running) == 1 and "--join-run" not in sup.pool.running[0].child.argv

        def listed() -> bool:
            sup.step(time.monotonic())
            return sup.target.share_known

        wait_for(listed, 30, interval=0.5, what="the broker to list the fleet's producer")
        assert "--join-run" in sup._argv("A-2")
    finally:
        sup.close()


def test_a_broker_restart_leaves_the_fleet_its_producers(daemons, tmp_path: Path) -> None:
    """Issue 53 finding 15: a broker killed with ``kill -9`` and back 3 s later, under
    ``feedline fleet --max 4`` and an unchanged trainer (one that wants more than 4 producers
    bring, so the fleet runs its --max), exported at once a number held from the producers
    that had reconnected so far ("wanted 1"): the fleet stopped 3 of its 4 producers and
    started 3 new ones seconds later. Producers come back one by one (their heartbeats and
    backoffs differ); here 3 of the 4 are held (SIGSTOP) while the broker is away and let go
    1 s after it is back, so that they reconnect a second after the first, every run. Now a
    broker says no number until its peers had time to reconnect (``SizingConfig.settle``:
    twice its heartbeat timeout), the fleet keeps what runs while there is none, the first
    number counts the 4 that came back, and the trainer's demand is its own (its first TAKEN
    to the new broker carries its whole life's wait: read as this window's, 20x the demand).
    """
    cfg = tmp_path / "paced.yaml"
    cfg.write_text(yaml.safe_dump(PACED))
    port, metrics_port = free_port(), free_port()
    ingress, egress = f"tcp://127.0.0.1:{port}", f"ipc://{tmp_path}/egress.sock"
    metrics = f"http://127.0.0.1:{metrics_port}/metrics"
    argv = ("--ingress", ingress, "--egress", egress, "--metrics-port", metrics_port,
            "--sizing-window", "4", "--heartbeat-interval", "0.2", "--heartbeat-timeout", "1.5")

    def broker() -> Daemon:
        d = daemons("feedline.broker", *argv, name="broker")
        wait_for(lambda: tcp_ready(port) or not d.alive(), 20, what="broker port")
        assert d.alive(), d.log_text()
        return d

    first = broker()
    fleet = start_fleet(daemons, cfg, ingress, metrics, "A", 1, 4)
    step = 0.02  # 50 batches/s wanted, 10 per producer: the number is above --max 4
    daemons("feedline.commands", "drain", "--broker", egress, "--step-seconds", step,
            name="trainer")

    def fleet_runs(n: int) -> bool:
        s = scrape(metrics, 1.0)
        return (not s.error and s.get("feedline_broker_fleet_producers", stream="default",
                                      fleet="A") == n
                and (s.get("feedline_broker_stream_producers_wanted", stream="default")
                     or 0) >= n)

    wait_for(lambda: fleet_runs(4), 90, interval=0.5, what="the fleet at its --max of 4")
    producers = psutil.Process(fleet.pid).children()
    assert len(producers) == 4, producers
    held = producers[1:]
    before = len(fleet.log_text())
    first.kill9()
    try:
        for p in held:
            p.suspend()
        time.sleep(3.0)  # the scenario: the broker is away 3 s (not a wait for a connection)
        broker()
        time.sleep(1.0)  # the scenario: 3 producers come back 1 s after the first
    finally:
        for p in held:
            p.resume()
    wanted: list[float] = []  # the restarted broker's numbers, in order
    demand: list[float] = []

    def watched_two_windows() -> bool:
        s = scrape(metrics, 1.0)
        if not s.error:
            w = s.get("feedline_broker_stream_producers_wanted", stream="default")
            d = s.get("feedline_broker_stream_demand_batches_per_second", stream="default")
            wanted.extend([] if w is None else [w])
            demand.extend([] if d is None or math.isnan(d) else [d])
        return len(wanted) >= 16  # scraped every 0.5 s: two sizing windows of numbers

    wait_for(watched_two_windows, 60, interval=0.5, what="the restarted broker's numbers")
    after = fleet.log_text()[before:]
    assert wanted[0] >= 4, f"the restarted broker's first number {wanted[0]}: {wanted}"
    assert max(demand, default=0.0) <= 2 / step, f"demand {demand}, a trainer of {1 / step}/s"
    assert "stopping A-" not in after and "started A-" not in after, after[-3000:]
    wait_for(lambda: fleet_runs(4), 10, interval=0.5, what="the fleet's 4, reconnected")

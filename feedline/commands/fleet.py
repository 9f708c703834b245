"""``feedline fleet``: run between --min and --max producers of one pipeline on this machine, as
many as the broker says the stream needs.

The broker derives the number (``feedline_broker_stream_producers_wanted``, from what its
trainers take when they do not wait and what a producer delivers when credit does not hold it
back: docs/operations.md, "Sizing the fleet") and each supervisor's share of it
(``feedline_broker_fleet_producers_wanted``). This command reads its share from the broker's
/metrics every ``--interval`` seconds and starts or stops producers to match; nothing is
guessed locally. Producers it starts carry ``--fleet ID --fleet-max MAX`` in their HELLO,
which is how the broker knows the supervisors of a stream and splits the number among them:
equal shares in the order of their ids, a supervisor at its ``--max`` leaving the rest to the
others (:func:`feedline.serving.sizing.fleet_shares`). Before any producer of ours is
connected the broker cannot list us; we then take the share the broker will give us once it
does, computed from the same figures.

Scaling down is graceful (:mod:`feedline.commands.fleet_pool`). A producer that exits with a
failure is started again (the log says so; at most one restart per ``--interval``, backing off
when they keep failing); one that exits 0 finished its epochs and is not. SIGTERM or Ctrl-C
stops every producer gracefully and exits.

While the broker says no number (its metrics unreachable, or a broker that just started and
exports none until its producers had time to reconnect: ``SizingConfig.settle``) the fleet
keeps the producers it runs, so a broker restart leaves them running.
"""

from __future__ import annotations

import argparse
import logging
import socket
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from feedline import endpoints
from feedline.flags import HelpFormatter, add_log_flags, add_metrics_flags, stop_on_signals
from feedline.logs import setup_logging
from feedline.scrape import Scrape, normalize_url, scrape
from feedline.serving.sizing import fleet_shares

log = logging.getLogger("feedline.fleet")
STATUS_EVERY = 30.0  # seconds between status lines when nothing changes


@dataclass(frozen=True)
class FleetConfig:
    config: str
    brokers: tuple[str, ...]
    metrics_url: str
    fleet_id: str
    min: int
    max: int
    stream: str
    interval: float = 2.0
    stop_timeout: float = 30.0
    producer_args: tuple[str, ...] = ()
    log_dir: str | None = None


@dataclass(frozen=True)
class Target:
    """What the broker says this supervisor should run (``count`` None: it said nothing)."""

    count: int | None
    wanted: float | None = None  # the stream's number
    share_known: bool = False  # the broker listed us (else: the share it will give us)
    verdict: str = ""
    demand: float | None = None
    supply: float | None = None
    supervisors: int = 0
    why: str = ""


def target_from(s: Scrape, stream: str, me: str, my_max: int) -> Target:
    """This supervisor's share of the stream's producers, read from one broker scrape."""
    if s.error:
        return Target(None, why=f"broker metrics at {s.url} unreachable ({s.error})")
    wanted = s.get("feedline_broker_stream_producers_wanted", stream=stream)
    if wanted is None:
        return Target(None, why=f"the broker has no number for stream {stream!r} yet (a "
                      "broker that just started waits for its producers to reconnect, or "
                      "nothing is connected to the stream): keeping what runs")
    limits = {f: int(v) for f, v in _of_stream(s, "feedline_broker_fleet_producers_max",
                                               stream).items()}
    verdict = next((dict(lab)["verdict"] for lab, v in
                    s.series("feedline_broker_stream_bottleneck").items()
                    if v == 1 and dict(lab).get("stream") == stream), "measuring")
    info = Target(None, wanted=wanted, verdict=verdict,
                  demand=s.get("feedline_broker_stream_demand_batches_per_second", stream=stream),
                  supply=s.get("feedline_broker_stream_supply_batches_per_second", stream=stream))
    share = s.get("feedline_broker_fleet_producers_wanted", stream=stream, fleet=me)
    if share is not None:
        return replace(info, count=int(share), share_known=True, supervisors=len(limits))
    # None of ours is connected: the split the broker makes once one is.
    connected = s.get("feedline_broker_stream_peers", stream=stream, role="producer") or 0
    managed = sum(_of_stream(s, "feedline_broker_fleet_producers", stream).values())
    shares = fleet_shares(int(wanted), {**limits, me: my_max},
                          max(0, int(connected - managed)))
    return replace(info, count=shares[me], supervisors=len(limits) + 1)


def _of_stream(s: Scrape, name: str, stream: str) -> dict[str, float]:
    return {dict(lab)["fleet"]: v for lab, v in s.series(name).items()
            if dict(lab).get("stream") == stream and "fleet" in dict(lab)}


class Supervisor:
    """The loop: read the share, start or stop producers, say what it did."""

    def __init__(self, cfg: FleetConfig) -> None:
        from feedline.commands.fleet_pool import Pool

        self.cfg = cfg
        self.pool = Pool(self._argv, cfg.fleet_id, cfg.stop_timeout,
                         Path(cfg.log_dir) if cfg.log_dir else None)
        self.target = Target(None)
        self._failures = 0  # consecutive producer failures: restarts back off
        self._hold_until = 0.0
        self._said: tuple[tuple, float] = ((), 0.0)
        # Once the broker lists our producers, their stream's run is under way: producers
        # started after that (more wanted, a restart) join it, and never start the next run
        # if it ends before they connect (a scale-up racing the last units).
        self._joined = False

    def _argv(self, name: str) -> list[str]:
        cfg = self.cfg
        argv = [sys.executable, "-m", "feedline.producer", "--config", cfg.config,
                "--id", name, "--stream", cfg.stream, "--fleet", cfg.fleet_id,
                "--fleet-max", str(cfg.max)]
        if self._joined:
            argv.append("--join-run")
        for b in cfg.brokers:
            argv += ["--broker", b]
        return argv + list(cfg.producer_args)

    def step(self, now: float) -> None:
        cfg, pool = self.cfg, self.pool
        for name, code in pool.reap(now):
            if code == 0:
                log.info("producer %s finished (exit status 0): not started again", name)
                continue
            self._failures += 1
            backoff = min(60.0, cfg.interval * 2 ** min(self._failures, 6))
            self._hold_until = now + backoff
            log.warning("producer %s exited with status %d; starting producers again in %.0fs "
                        "(%d failures in a row)", name, code, backoff, self._failures)
        self.target = target_from(scrape(cfg.metrics_url, timeout=min(2.0, cfg.interval)),
                                  cfg.stream, cfg.fleet_id, cfg.max)
        self._joined = self._joined or self.target.share_known
        have = len(pool.running)
        want = have if self.target.count is None else self.target.count
        want = max(cfg.min, min(cfg.max, want))
        if pool.finished:
            want = min(want, have)  # a producer finished its epochs: the run is ending
        if want > have and now >= self._hold_until:
            names = pool.start(want - have, now)
            log.info("started %s", ", ".join(names))
        elif want < have:
            names = pool.stop(have - want, now)
            log.info("stopping %s (SIGTERM: they finish what they hold credit for)",
                     ", ".join(names))
        if pool.running and all(now - m.started > 3 * cfg.interval for m in pool.running):
            self._failures = 0
        self._status(now, want)

    def _status(self, now: float, want: int) -> None:
        t, pool = self.target, self.pool
        line = (f"fleet {self.cfg.fleet_id}, stream {self.cfg.stream}: {len(pool.running)} "
                f"running, {len(pool.stopping)} stopping, target {want} (--min {self.cfg.min}, "
                f"--max {self.cfg.max})")
        if t.count is None:
            line += f"; {t.why}"
        else:
            line += (f"; broker wants {t.wanted:.0f} for the stream ({t.verdict}: demand "
                     f"{_rate(t.demand)}, supply {_rate(t.supply)}), our share "
                     f"{t.count}{'' if t.share_known else ' (expected)'} of "
                     f"{t.supervisors} supervisor{'s' if t.supervisors != 1 else ''}")
        # A line when what we run or were told changes, else every STATUS_EVERY seconds.
        key = (len(pool.running), len(pool.stopping), want, t.count, t.wanted, t.verdict)
        if key != self._said[0] or now - self._said[1] >= STATUS_EVERY:
            log.info("%s", line)
            self._said = (key, now)

    def finished(self) -> bool:
        return self.pool.finished > 0 and not self.pool.running and not self.pool.stopping

    def close(self) -> None:
        n = len(self.pool.running) + len(self.pool.stopping)
        if n:
            log.info("stopping %d producers", n)
        self.pool.close(self.cfg.stop_timeout)


def _rate(x: float | None) -> str:
    return "?" if x is None or x != x else f"{x:.1f} batches/s"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "fleet",
        help="run as many producers of a pipeline as the broker says its stream needs",
        description="Run between --min and --max `feedline producer` processes of one pipeline "
        "on this machine,\nas many as the broker says the stream needs "
        "(feedline_broker_stream_producers_wanted, read\nfrom --broker-metrics every "
        "--interval seconds). Several supervisors, one per machine, share\na stream: each "
        "runs its share (give each its own --id). Scaling down stops the newest\nproducers "
        "with SIGTERM: they send what they hold credit for (exact delivery: hand their\nunit "
        "back) and leave. Arguments after -- go to every producer, e.g.\n"
        "  feedline fleet --config train.yaml --broker tcp://trainer:7878 \\\n"
        "      --broker-metrics trainer:9500 --min 1 --max 8 -- --data /data/train",
        formatter_class=HelpFormatter,
    )
    p.add_argument("--config", required=True, metavar="PIPELINE.yaml",
                   help="the pipeline file every producer runs")
    p.add_argument("--broker", action="append", required=True, metavar="ADDR",
                   help="the broker's ingress, as `feedline producer --broker`")
    p.add_argument("--broker-metrics", required=True, metavar="HOST:PORT",
                   help="the broker's metrics endpoint (its --metrics-port), where the number "
                   "is read")
    p.add_argument("--min", type=int, default=1, help="producers to run at least")
    p.add_argument("--max", type=int, required=True, help="producers to run at most (the "
                   "cores or memory of this machine)")
    p.add_argument("--id", default=None, help="this supervisor's id, unique among the "
                   "supervisors of the stream (default: the host name); producers are ID-0, "
                   "ID-1, ...")
    p.add_argument("--stream", default=None,
                   help="the stream (default: the pipeline file's 'stream', else 'default')")
    p.add_argument("--interval", type=float, default=2.0,
                   help="seconds between reading the broker's number")
    p.add_argument("--stop-timeout", type=float, default=30.0,
                   help="seconds a producer gets to stop after SIGTERM before it is killed")
    p.add_argument("--log-dir", default=None, metavar="DIR",
                   help="each producer's output in DIR/ID-N.log (default: ours)")
    add_metrics_flags(p, 0)
    add_log_flags(p)
    p.add_argument("producer_args", nargs=argparse.REMAINDER, metavar="-- PRODUCER-ARGS",
                   help="flags for every producer (after --)")
    p.set_defaults(func=run)


def config_from_args(args: argparse.Namespace) -> FleetConfig:
    """The flags, checked; SystemExit with one line naming what is wrong."""
    from feedline.producer.pipeline import ConfigError, load_config

    def fail(msg: str) -> SystemExit:
        return SystemExit(f"feedline fleet: {msg}")

    if not 0 <= args.min <= args.max or args.max < 1:
        raise fail(f"--min {args.min} --max {args.max}: need 0 <= --min <= --max and --max >= 1")
    if args.interval <= 0 or args.stop_timeout <= 0:
        raise fail("--interval and --stop-timeout must be > 0")
    try:
        for addr in args.broker:
            endpoints.check_connect(addr, "--broker")
        pipeline = load_config(args.config)
    except endpoints.AddressError as e:
        raise fail(str(e)) from None
    except ConfigError as e:
        raise fail(f"{args.config}: {e}") from None
    extra = list(args.producer_args)
    if extra and extra[0] == "--":
        extra = extra[1:]
    for flag in ("--config", "--broker", "--id", "--stream", "--fleet", "--fleet-max",
                 "--join-run"):
        if flag in extra:
            raise fail(f"{flag} after --: the supervisor sets it for every producer; give "
                       "it to feedline fleet instead")
    fleet_id = args.id or socket.gethostname()
    if not fleet_id or len(fleet_id) > 128:
        raise fail("--id must be 1 to 128 characters")
    stream = args.stream or str(pipeline.get("stream") or "default")
    log_dir = args.log_dir
    if log_dir is not None:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
    return FleetConfig(args.config, tuple(args.broker), normalize_url(args.broker_metrics),
                       fleet_id, args.min, args.max, stream, args.interval, args.stop_timeout,
                       tuple(extra), log_dir)


def run(args: argparse.Namespace) -> int:
    setup_logging(args.log_level)
    cfg = config_from_args(args)
    from feedline.commands.fleet_metrics import FleetMetrics, serve

    stop = stop_on_signals()
    sup = Supervisor(cfg)
    metrics = FleetMetrics(serve(args.metrics_port, args.metrics_addr), sup) \
        if args.metrics_port else None
    log.info("fleet %s: pipeline %s, stream %s, broker %s (number read from %s every %.0fs), "
             "%d to %d producers", cfg.fleet_id, cfg.config, cfg.stream, ", ".join(cfg.brokers),
             cfg.metrics_url, cfg.interval, cfg.min, cfg.max)
    try:
        while True:
            t0 = time.monotonic()
            sup.step(t0)
            if metrics is not None:
                metrics.update()
            if sup.finished():
                log.info("every producer finished its epochs; exiting")
                return 0
            if stop.wait(max(0.0, cfg.interval - (time.monotonic() - t0))):
                return 0
    finally:
        sup.close()

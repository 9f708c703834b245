"""``feedline producer``: run a pipeline from a YAML file and send its batches to a broker."""

from __future__ import annotations

import argparse
import logging
import os
import socket
import time

from feedline import endpoints
from feedline.errors import FeedlineError
from feedline.flags import (
    HelpFormatter,
    add_client_curve_flags,
    add_liveness_flags,
    add_log_flags,
    add_metrics_flags,
    client_keys,
    stop_on_signals,
)
from feedline.heap import keep_freed_memory
from feedline.logs import setup_logging
from feedline.metrics import serve_metrics
from feedline.producer.dataflow.base import DataFlow
from feedline.producer.dataflow.base import stages as all_stages
from feedline.producer.dataflow.sharded import ShardedSource
from feedline.producer.exact import ExactPipeline, build_exact, is_exact, send_exact
from feedline.producer.metrics import ShardMetrics, StageMetrics
from feedline.producer.pipeline import (
    ConfigError,
    build_pipeline,
    load_config,
    parallel_summary,
    pipeline_stages,
    training_fingerprint,
)
from feedline.producer.sender import SendStats, send_dataflow
from feedline.protocol.codec import DEFAULT_LIMITS
from feedline.transport.link import LinkConfig
from feedline.version import __version__

log = logging.getLogger(__name__)
DEFAULT_BROKER = "tcp://127.0.0.1:7878"
MAX_ID = DEFAULT_LIMITS.max_id_len


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "producer",
        help="run a preprocessing pipeline and send its batches to a broker",
        description="Build the pipeline described by --config and send its batches to the "
        "broker.\nWaits for the broker if it is not up yet and reconnects when it restarts.",
        formatter_class=HelpFormatter,
    )
    p.add_argument("--config", required=True, metavar="PIPELINE.yaml",
                   help="pipeline file (see examples/)")
    p.add_argument("--data", default=None, metavar="PATH",
                   help="the dataset: replaces the pipeline's image_folder root or lmdb path "
                   "(default: the path in the pipeline file)")
    p.add_argument("--broker", action="append", default=None, metavar="ADDR",
                   help="the broker's ingress, or a direct-mode trainer's address (default: "
                   f"{DEFAULT_BROKER}); repeat it to serve several training hosts, or give a "
                   "DNS name that resolves to several (resolved again every 30 s): each batch "
                   "goes to one of them, by credit")
    p.add_argument("--id", default=None, help="producer id (default: hostname-pid)")
    p.add_argument("--stream", default=None,
                   help="the stream these batches belong to; consumers receive one stream "
                   "(default: the config's 'stream', else 'default')")
    p.add_argument("--epochs", type=int, default=None,
                   help="passes over the dataset, then exit (default: forever, or the "
                   "config's 'epochs')")
    p.add_argument("--fleet", default=None, metavar="ID",
                   help="the supervisor that started this producer (set by `feedline fleet`): "
                   "the broker gives each supervisor its share of the stream's producers "
                   "(default: none)")
    p.add_argument("--fleet-max", type=int, default=0, metavar="N",
                   help="that supervisor's --max (set by `feedline fleet`; 0: no limit)")
    p.add_argument("--join-run", action="store_true",
                   help="units from the broker (exact delivery, claimed shards): join the run "
                   "under way; if the stream's run is already served, end (exit 0) instead of "
                   "starting the next run (set by `feedline fleet` on producers it adds to a "
                   "running fleet)")
    add_liveness_flags(p, "seconds of broker silence before reconnecting")
    add_metrics_flags(p, 0)
    p.add_argument("--log-interval", type=float, default=30.0,
                   help="seconds between rate lines in the log")
    add_client_curve_flags(p, "producer")
    add_log_flags(p)
    p.set_defaults(func=run)


def decoder_info() -> str:
    """Which JPEG decoder the image steps run, in words (the start-up line, --version)."""
    try:
        from feedline.producer.image import decoder_info as info

        return str(info())
    except Exception:  # an optional extension that does not load: the presets use OpenCV
        try:
            import cv2

            return f"OpenCV {cv2.__version__}"
        except ImportError:
            return "OpenCV"


# The sources that read a dataset, and the argument naming where.
DATA_ARGS = {"image_folder": "root", "lmdb": "path", "webdataset": "urls", "tfrecord": "urls",
             "parquet": "urls"}


def with_data(cfg: dict, data: str | None) -> dict:
    """The pipeline map with its source reading ``data`` (``--data``); as is for None."""
    if data is None:
        return cfg
    source = cfg.get("source")
    if not (isinstance(source, dict) and len(source) == 1 and next(iter(source)) in DATA_ARGS):
        kind = ", ".join(source) if isinstance(source, dict) else "factory"
        raise ConfigError(f"--data {data}: the pipeline's source ({kind}) reads no dataset "
                          f"path; --data works with {' and '.join(DATA_ARGS)} sources")
    kind = next(iter(source))
    return {**cfg, "source": {kind: {**(source[kind] or {}), DATA_ARGS[kind]: data}}}


def run(args: argparse.Namespace) -> int:
    """Check the flags, build the pipeline, send until done or SIGTERM/SIGINT. A failure to
    start is one line on stderr and exit status 1; the pipeline's workers and their
    temporary directories are gone when this returns, whatever ended it."""
    setup_logging(args.log_level)
    log.debug("%s", keep_freed_memory())  # batches of megabytes: feedline.heap
    try:
        args.broker = args.broker or [DEFAULT_BROKER]
        for addr in args.broker:
            endpoints.check_connect(addr, "--broker")
        if args.metrics_port:
            endpoints.check_port(args.metrics_port, args.metrics_addr)
    except endpoints.AddressError as e:
        raise SystemExit(f"feedline producer: {e}") from None
    args.fleet = args.fleet or ""
    if len(args.fleet) > MAX_ID or args.fleet_max < 0:
        raise SystemExit(f"feedline producer: --fleet must be at most {MAX_ID} characters "
                         "and --fleet-max >= 0")
    try:
        cfg = with_data(load_config(args.config), args.data)
        if args.stream is not None:
            cfg = {**cfg, "stream": args.stream}
        if is_exact(cfg):
            return _run_exact(args, cfg, build_exact(cfg))
        df = build_pipeline(cfg)
    except ConfigError as e:
        raise SystemExit(f"feedline producer: {args.config}: {e}") from None
    try:
        return _run(args, cfg, df)
    finally:
        df.close()  # stops worker processes, removes their ipc directory


def _run_exact(args: argparse.Namespace, cfg: dict, pipe: ExactPipeline) -> int:
    """Exact delivery: serve the units the broker hands out (docs/pipelines.md)."""
    try:
        curve = client_keys(args)
    except FeedlineError as e:  # a key file, CURVE
        raise SystemExit(f"feedline producer: {e}") from None
    if args.epochs is not None:
        pipe.epochs = args.epochs
    stop = stop_on_signals()
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    if isinstance(pipe.source, ShardedSource):
        ShardMetrics(registry, [pipe.source])
    try:
        serve_metrics(registry, args.metrics_port or None, args.metrics_addr)
    except endpoints.AddressError as e:
        raise SystemExit(f"feedline producer: {e}") from None
    producer_id = args.id or f"{socket.gethostname()}-{os.getpid()}"
    log.info("feedline %s producer %s: broker %s, pipeline %s, decoder %s, stream %s, exact "
             "delivery over %d samples in %d units, %s", __version__, producer_id,
             ", ".join(args.broker), args.config, decoder_info(), pipe.stream,
             pipe.source.samples(), -(-pipe.spec.dataset_size // max(1, pipe.spec.unit_size)),
             f"{pipe.epochs} epoch(s)" if pipe.epochs else "epochs forever")
    link = LinkConfig(heartbeat_interval=args.heartbeat_interval,
                      heartbeat_timeout=args.heartbeat_timeout)
    try:
        stats = send_exact(pipe, args.broker, producer_id=producer_id, link=link,
                           curve=curve, stop=stop, registry=registry,
                           fleet=(args.fleet, args.fleet_max, args.join_run),
                           started=process_started())
    except FeedlineError as e:
        raise SystemExit(f"feedline producer {producer_id}: {e}") from None
    log_summary(stats, args.broker)
    return 0


def _run(args: argparse.Namespace, cfg: dict, df: DataFlow) -> int:
    stages = pipeline_stages(df)
    try:
        curve = client_keys(args)
    except FeedlineError as e:  # a key file, CURVE
        raise SystemExit(f"feedline producer: {e}") from None
    epochs = args.epochs if args.epochs is not None else cfg.get("epochs")
    stop = stop_on_signals()
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    StageMetrics(registry, stages)
    ShardMetrics(registry, [s for s in all_stages(df) if isinstance(s, ShardedSource)])
    try:
        serve_metrics(registry, args.metrics_port or None, args.metrics_addr)
    except endpoints.AddressError as e:
        raise SystemExit(f"feedline producer: {e}") from None
    producer_id = args.id or f"{socket.gethostname()}-{os.getpid()}"
    # The start-up line: what this process is and where it sends (off with --log-level
    # WARNING).
    parallel = parallel_summary(df)
    log.info("feedline %s producer %s: broker %s, pipeline %s, decoder %s, stream %s, "
             "%s%s", __version__, producer_id, ", ".join(args.broker), args.config,
             decoder_info(), cfg.get("stream", "default"),
             "epochs forever" if epochs is None else f"{epochs} epoch(s)",
             f", workers {parallel}" if parallel else "")
    link = LinkConfig(heartbeat_interval=args.heartbeat_interval,
                      heartbeat_timeout=args.heartbeat_timeout)
    try:
        stats = send_dataflow(df, args.broker, epochs=epochs, producer_id=producer_id,
                              link=link, curve=curve, stop=stop, registry=registry,
                              stream=cfg.get("stream", "default"),
                              log_interval=args.log_interval,
                              skipped=lambda: sum(s.skipped for s in stages),
                              fleet=(args.fleet, args.fleet_max, args.join_run),
                              pipeline=training_fingerprint(cfg), started=process_started(),
                              skip_unsendable=cfg.get("on_error") == "skip")
    except FeedlineError as e:
        # What the operator must change (a batch larger than the broker's --max-bytes, a
        # datapoint over the protocol's limits): one line, not a traceback.
        raise SystemExit(f"feedline producer {producer_id}: {e}") from None
    log_summary(stats, args.broker)
    return 0


def process_started() -> float | None:
    """When this process started, as a ``time.monotonic()`` reading (Linux: its start time in
    /proc/self/stat against CLOCK_BOOTTIME, the clock that start time is on); None where that
    is not known (the producer's HELLO then counts from when it began sending). Measured
    from the process, not from the pipeline's build: a producer started with the others of
    its job but slow to come up (imports, a loaded machine) is still of that job's run."""
    try:
        with open("/proc/self/stat", "rb") as f:
            stat = f.read()
        ticks = int(stat[stat.rindex(b")") + 2:].split()[19])  # field 22, starttime
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    return time.monotonic() - max(0.0, age)


def log_summary(stats: SendStats, brokers: list[str]) -> None:
    """The producer's last line: what brokers took (not what the dataflow made), and, if
    none ever did, why (a WARNING: the run did nothing)."""
    if stats.sent == 0 and stats.unreached:
        log.warning("sent 0 batches in %.1fs: never connected to a broker (%s); %d batches "
                    "made were not sent", stats.seconds, "; ".join(stats.unreached),
                    stats.batches)
        return
    left = stats.batches - stats.sent
    log.info("sent %d batches (%.1f MB) in %.1fs%s%s%s", stats.sent, stats.sent_bytes / 1e6,
             stats.seconds,
             f"; {left} more made that no broker took" if left > 0 else "",
             f"; {stats.unsendable} skipped that the wire cannot carry" if stats.unsendable
             else "",
             f"; {stats.bye_unanswered} broker(s) of {', '.join(brokers)} did not answer our "
             "BYE: what went there last may not have arrived" if stats.bye_unanswered else "")


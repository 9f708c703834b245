"""``feedline coordinator``: the job's coordinator for exact streams served by several
training hosts (each broker started with ``--coordinator`` this address)."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import zmq

from feedline import endpoints, security
from feedline.errors import FeedlineError
from feedline.flags import HelpFormatter, add_log_flags, add_metrics_flags, stop_on_signals
from feedline.liveness import HEARTBEAT_TIMEOUT
from feedline.logs import setup_logging
from feedline.metrics import serve_metrics
from feedline.serving.job_server import MAX_STREAMS, JobServer

log = logging.getLogger(__name__)
PORT = 7900


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "coordinator",
        help="coordinate exact streams served by several training hosts (one per job)",
        description="Hand out each exact stream's units once per epoch for a whole job whose\n"
        "training hosts each run a broker with --coordinator ADDR, and end each epoch once\n"
        "every host's trainers took every batch. Its state survives a restart (--state-dir).\n"
        "One job, one coordinator: a second one for the same hosts is refused by them.",
        formatter_class=HelpFormatter,
    )
    p.add_argument("--bind", default=f"tcp://127.0.0.1:{PORT}",
                   help="address the brokers connect to (their --coordinator)")
    p.add_argument("--state-dir", required=True, metavar="DIR",
                   help="where each stream's job journal is kept (fsync'd): the coordinator "
                   "restarts from it; a coordinator started without its journal makes the "
                   "hosts resume the job from its checkpoint")
    p.add_argument("--heartbeat-timeout", type=float, default=HEARTBEAT_TIMEOUT,
                   help="seconds of silence after which a host counts as silent (it keeps "
                   "its open units)")
    p.add_argument("--max-streams", type=int, default=MAX_STREAMS,
                   help="streams coordinated at once, at most")
    p.add_argument("--insecure", action="store_true",
                   help="listen on a non-loopback address: the job's messages are not "
                   "encrypted, so only on a network you trust")
    add_metrics_flags(p, 9502)
    add_log_flags(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    setup_logging(args.log_level)
    try:
        endpoints.check_bind(args.bind, "--bind")
        exposed = security.exposed([args.bind])
        if exposed and not args.insecure:
            raise FeedlineError(f"refusing to listen on {', '.join(exposed)}: the job's messages "
                                "are not encrypted; bind 127.0.0.1, or pass --insecure on a "
                                "network you trust")
        if args.max_streams < 1:
            raise FeedlineError("--max-streams must be >= 1")
    except FeedlineError as e:
        raise SystemExit(f"feedline coordinator: {e}") from None
    stop = stop_on_signals()
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    try:
        metrics = serve_metrics(registry, args.metrics_port or None, args.metrics_addr)
    except endpoints.AddressError as e:
        raise SystemExit(f"feedline coordinator: {e}") from None
    try:
        server = JobServer(zmq.Context.instance(), args.bind, Path(args.state_dir), registry,
                           args.heartbeat_timeout, args.max_streams)
    except zmq.ZMQError as e:
        if metrics is not None:
            metrics.shutdown()
            metrics.server_close()
        raise SystemExit(f"feedline coordinator: cannot bind {args.bind}: {e.strerror}; "
                         "check the address") from None
    server.run(stop)
    log.info("coordinator stopped by %s", stop.signame)
    return 0

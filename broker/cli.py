"""``feedline broker``: run the broker on the training host."""

from __future__ import annotations

import argparse

from broker.config import BrokerConfig
from broker.core import Broker
from feedline import security, wire
from feedline.flags import (
    HelpFormatter,
    add_liveness_flags,
    add_log_flags,
    add_metrics_flags,
    add_server_curve_flags,
    parse_size,
    server_keys,
    stop_on_signals,
)
from feedline.logs import setup_logging
from feedline.metrics import serve_metrics


def add_parser(sub: argparse._SubParsersAction) -> None:
    d = BrokerConfig()
    p = sub.add_parser(
        "broker",
        help="run the broker (fan-in from producers, fan-out to training processes)",
        description="Receive batches from producers and hand each to one training process.\n"
        "Memory is bounded by --max-batches and --max-bytes; producers wait for credit.",
        formatter_class=HelpFormatter,
    )
    p.add_argument("--ingress", default=d.ingress, help="address producers connect to")
    p.add_argument("--egress", default=d.egress,
                   help="address training processes connect to (ipc:// or tcp://)")
    p.add_argument("--tensorpack-ingress", default=None, metavar="ADDR",
                   help="also accept tensorpack send_dataflow_zmq (TENSORPACK_SERIALIZE="
                   "msgpack) on this address; off when not given")
    p.add_argument("--max-batches", type=int, default=d.max_batches,
                   help="batches buffered plus credit granted, at most")
    p.add_argument("--max-bytes", type=parse_size, default=d.max_bytes,
                   help="bytes buffered (plus expected bytes of granted credit), at most")
    p.add_argument("--producer-window", type=int, default=d.producer_window,
                   help="most credit one producer holds (its batches in flight)")
    add_liveness_flags(p, "seconds of silence after which a peer is dropped")
    p.add_argument("--max-message-bytes", type=parse_size,
                   default=wire.DEFAULT_LIMITS.max_message_bytes,
                   help="largest batch accepted (array bytes); larger ones are refused")
    p.add_argument("--io-threads", type=int, default=d.io_threads,
                   help="libzmq I/O threads (they do the socket copies); more can help on "
                   "hosts with many cores and several GB/s")
    add_metrics_flags(p, 9500, d.metrics_addr)
    add_server_curve_flags(p)
    p.add_argument("--insecure", action="store_true",
                   help="allow listening on a non-loopback address without CURVE keys "
                   "(anyone who reaches the port can inject and read data)")
    add_log_flags(p)
    p.set_defaults(func=run)


def config_from_args(args: argparse.Namespace) -> BrokerConfig:
    return BrokerConfig(
        ingress=args.ingress,
        egress=args.egress,
        tensorpack_ingress=args.tensorpack_ingress,
        max_batches=args.max_batches,
        max_bytes=args.max_bytes,
        producer_window=args.producer_window,
        heartbeat_interval=args.heartbeat_interval,
        heartbeat_timeout=args.heartbeat_timeout,
        limits=wire.Limits(max_message_bytes=args.max_message_bytes),
        io_threads=args.io_threads,
        metrics_port=args.metrics_port or None,
        metrics_addr=args.metrics_addr,
        curve=_curve_from_args(args),
    )


def _curve_from_args(args: argparse.Namespace) -> security.ServerKeys | None:
    """Keys from flags (else environment); refuse an exposed address without them.

    Raises ValueError (KeyFileError, CurveUnavailable) with a message for the operator.
    """
    keys = server_keys(args)
    insecure = args.insecure
    # tensorpack producers cannot speak CURVE: that port is plain even when keys are given.
    exposed = security.exposed([args.tensorpack_ingress])
    if keys is None:
        exposed = security.exposed([args.ingress, args.egress, args.tensorpack_ingress])
    if exposed and not insecure:
        raise ValueError(
            f"refusing to listen on {', '.join(exposed)} without CURVE keys: anyone who "
            "reaches it could inject or read training data. Give --curve-secret and "
            "--curve-allowed (see `feedline keys generate` and docs/security.md), bind "
            "127.0.0.1 / ipc://, or pass --insecure on a network you trust"
        )
    return keys


def run(args: argparse.Namespace) -> int:
    setup_logging(args.log_level)
    try:
        config = config_from_args(args)
    except (ValueError, security.CurveUnavailable) as e:
        raise SystemExit(f"feedline broker: {e}") from None
    stop = stop_on_signals()
    broker = Broker(config)
    serve_metrics(broker.registry, config.metrics_port, config.metrics_addr)
    broker.run(stop)
    return 0

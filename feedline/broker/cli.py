"""``feedline broker``: run the broker on the training host."""

from __future__ import annotations

import argparse
import logging

import zmq

from feedline import endpoints, security
from feedline.broker.config import BrokerConfig
from feedline.broker.core import Broker
from feedline.errors import FeedlineError
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
from feedline.heap import keep_freed_memory
from feedline.logs import setup_logging
from feedline.metrics import serve_metrics
from feedline.protocol import wire
from feedline.serving.server import check_exposure

log = logging.getLogger(__name__)


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
                   help="batches buffered, in flight to consumers and granted to producers "
                   "together, at most, counted for batches of 8 MiB or more: smaller ones count "
                   "by their bytes, up to 128 per batch given (32 holds 32 batches of 8 MiB, "
                   "111 of 2.4 MB, 4,096 of 64 KiB or less); a bundle counts as its batches. "
                   "feedline_broker_buffer_capacity_batches is the count in force "
                   "(docs/architecture.md, flow control)")
    p.add_argument("--max-bytes", type=parse_size, default=d.max_bytes,
                   help="the broker's memory budget: bytes buffered, in flight to consumers "
                   "and granted to producers, at most (docs/architecture.md)")
    p.add_argument("--credit-lease", type=float, default=d.credit_lease,
                   help="seconds a producer may hold credit unused while another waits, "
                   "before it is asked back")
    p.add_argument("--max-peers", type=int, default=d.max_peers,
                   help="registered producers (and, apart, consumers) at most")
    p.add_argument("--state-dir", default=None, metavar="DIR",
                   help="where exact-delivery streams keep their progress (fsync'd), so that "
                   "it survives a broker restart; without it exact producers are refused "
                   "(docs/reliability.md)")
    p.add_argument("--exact-ephemeral", action="store_true",
                   help="without --state-dir, serve exact streams from memory only: a "
                   "restart loses their position (consumers mid-epoch are told so)")
    p.add_argument("--coordinator", default=None, metavar="ADDR",
                   help="serve exact streams as one host of a job served by several training "
                   "hosts: the address of the job's `feedline coordinator` (e.g. "
                   "tcp://10.0.0.5:7900); every host of the job gives the same one "
                   "(docs/tensorflow.md, \"Exact delivery across several hosts\")")
    p.add_argument("--host-name", default=None, metavar="NAME",
                   help="with --coordinator: this host's name in the job, unique and the same "
                   "across restarts (default: the machine's name and the ingress port)")
    p.add_argument("--max-streams", type=int, default=d.max_streams,
                   help="streams the broker keeps state for at once (named by a registered "
                   "peer, or exact streams in use); registrations of more are refused")
    p.add_argument("--producer-window", type=int, default=d.producer_window,
                   help="most credit one producer holds (its batches in flight)")
    p.add_argument("--sizing-window", type=float, default=d.sizing_window, metavar="SECONDS",
                   help="what feedline_broker_stream_producers_wanted averages over: it rises "
                   "after a fifth of this, falls after all of it (docs/operations.md)")
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
        credit_lease=args.credit_lease,
        max_peers=args.max_peers,
        state_dir=args.state_dir,
        sizing_window=args.sizing_window,
        exact_ephemeral=args.exact_ephemeral,
        max_streams=args.max_streams,
        heartbeat_interval=args.heartbeat_interval,
        heartbeat_timeout=args.heartbeat_timeout,
        limits=wire.Limits(max_message_bytes=args.max_message_bytes),
        io_threads=args.io_threads,
        metrics_port=args.metrics_port or None,
        metrics_addr=args.metrics_addr,
        curve=_curve_from_args(args),
        insecure=args.insecure,
        coordinator=args.coordinator,
        host_name=args.host_name,
    )


def _curve_from_args(args: argparse.Namespace) -> security.ServerKeys | None:
    """Keys from flags (else environment); refuse an exposed address without them, and an
    exposed tensorpack ingress with or without them (the serving core's rule, checked here
    too so that nothing starts: :func:`feedline.serving.server.check_exposure`).

    Raises ConfigError (KeyFileError) or CurveUnavailable with a message for the operator.
    """
    keys = server_keys(args)
    # Warned about (with --insecure) by the core when it binds.
    check_exposure([args.ingress, args.egress], args.tensorpack_ingress, keys is not None,
                   args.insecure)
    return keys


def check_addresses(args: argparse.Namespace) -> None:
    """Every address the broker will bind, checked before it binds any (a second broker
    started with the same ipc:// egress would otherwise take it over from the first), and
    against each other. Raises :class:`feedline.endpoints.AddressError` (one line)."""
    seen: list[tuple[str, endpoints.Endpoint]] = []
    for flag, addr in (("--ingress", args.ingress), ("--egress", args.egress),
                       ("--tensorpack-ingress", args.tensorpack_ingress)):
        if addr is None:
            continue
        ep = endpoints.check_bind(addr, flag)
        for other_flag, other in seen:
            if _overlap(ep, other):
                raise endpoints.AddressError(
                    f"{flag} {addr}: {other_flag} {other.addr} binds the same "
                    f"{'path' if ep.path else 'port'}; give each address its own")
        seen.append((flag, ep))
    if args.metrics_port:
        mine = endpoints.Endpoint(f"tcp://{args.metrics_addr}:{args.metrics_port}", "tcp",
                                  args.metrics_addr, args.metrics_port)
        for other_flag, other in seen:
            if _overlap(mine, other):
                raise endpoints.AddressError(
                    f"--metrics-port {args.metrics_port}: {other_flag} {other.addr} binds the "
                    "same port; give the metrics another port")
        endpoints.check_port(args.metrics_port, args.metrics_addr)


def _overlap(a: endpoints.Endpoint, b: endpoints.Endpoint) -> bool:
    if a.scheme != b.scheme:
        return False
    if a.scheme == "ipc":
        return a.path == b.path
    return (a.port is not None and a.port == b.port
            and (a.host == b.host or a.wildcard or b.wildcard))


def run(args: argparse.Namespace) -> int:
    """Check every address, then the keys; serve metrics, bind, run until SIGTERM/SIGINT.
    Any failure to start is one line on stderr and exit status 1, with nothing bound."""
    setup_logging(args.log_level)
    log.debug("%s", keep_freed_memory())  # batches of megabytes: feedline.heap
    try:
        check_addresses(args)
        config = config_from_args(args)
    except FeedlineError as e:  # a setting, an address, a key file, CURVE: one line
        raise SystemExit(f"feedline broker: {e}") from None
    stop = stop_on_signals()
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    try:
        # Metrics first: an HTTP server that fails to start leaves no ZeroMQ socket bound.
        server = serve_metrics(registry, config.metrics_port, config.metrics_addr)
    except endpoints.AddressError as e:
        raise SystemExit(f"feedline broker: {e}") from None
    try:
        broker = Broker(config, registry=registry)
    except (zmq.ZMQError, ValueError) as e:  # ValueError: AddressError (a race with another)
        if server is not None:
            server.shutdown()
            server.server_close()
        if isinstance(e, ValueError):
            raise SystemExit(f"feedline broker: {e}") from None
        raise SystemExit(f"feedline broker: cannot bind {config.ingress} / {config.egress}: "
                         f"{e.strerror}; check the addresses") from None
    broker.run(stop)
    # One line, so that a stop is told from a crash and its cost is known (before: silence).
    log.info("broker stopped by %s: %s", stop.signame, broker.summary())
    return 0

"""``feedline drain``: a stand-in training loop that takes batches from a broker.

It iterates :class:`consumer.RemoteDataZMQ` as a training job would, optionally sleeping
``--step-seconds`` per batch to play a model of that speed (or, with ``--schedule``, a model
whose speed changes over time: the load a self-sizing fleet follows), and serves the consumer
metrics
(``--metrics-port``). Use it to smoke-test a deployment, to size producers before the real
job exists, or as the ``trainer`` service of the compose demo. It needs no TensorFlow.

``--bind ADDR`` plays a trainer in direct mode instead (``RemoteDataZMQ(ADDR, bind=True)``):
it serves the producers itself, with server CURVE keys (``--curve-secret``, ``--curve-allowed``)
and the broker's metrics beside the consumer's: the training pods and hosts of
docker-compose.direct.yml and deploy/k8s/two-hosts/.
"""

from __future__ import annotations

import argparse
import logging
import time
from typing import Any

from feedline import endpoints, security
from feedline.consumer.remote import WINDOW
from feedline.errors import FeedlineError
from feedline.flags import (
    HelpFormatter,
    add_client_curve_flags,
    add_log_flags,
    add_metrics_flags,
    client_keys,
    server_keys,
    stop_on_signals,
)
from feedline.heap import keep_freed_memory
from feedline.logs import setup_logging
from feedline.protocol.messages import DEFAULT_STREAM
from feedline.serving.server import Remedy, check_exposure

log = logging.getLogger(__name__)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "drain",
        help="consume batches like a training loop (no TensorFlow), serving consumer metrics",
        description="Take batches from the broker's egress (or with --bind, straight from the "
        "producers: direct mode)\nas a training job would, sleeping --step-seconds per batch "
        "to stand in for a model.\nLogs batches/s and MB/s.",
        formatter_class=HelpFormatter,
    )
    where = p.add_mutually_exclusive_group()
    where.add_argument("--broker", default="ipc:///tmp/feedline.sock",
                       help="the broker's egress (ipc:// or tcp://)")
    where.add_argument("--bind", default=None, metavar="ADDR",
                       help="direct mode: no broker, serve the producers at ADDR (e.g. "
                       "tcp://0.0.0.0:7878; producers give it as their --broker)")
    p.add_argument("--window", type=int, default=WINDOW,
                   help="batches this process may hold ahead of the model")
    p.add_argument("--stream", default=DEFAULT_STREAM,
                   help="the stream to receive (producers declare theirs)")
    p.add_argument("--step-seconds", type=float, default=0.0,
                   help="simulated model step per batch (0: as fast as batches come)")
    p.add_argument("--schedule", type=parse_schedule, default=None, metavar="S:STEP,...",
                   help="a model whose step changes: SECONDS:STEP_SECONDS phases in turn, "
                   "e.g. 60:0.025,60:0.08 (then the last step goes on); instead of "
                   "--step-seconds")
    p.add_argument("--duration", type=float, default=None,
                   help="seconds to run, then exit (default: until SIGTERM)")
    p.add_argument("--id", default=None, help="consumer id (default: hostname-pid)")
    add_metrics_flags(p, 0)
    p.add_argument("--log-interval", type=float, default=10.0,
                   help="seconds between rate lines in the log")
    add_client_curve_flags(p, "consumer")
    # With --bind this process is the server: --curve-secret is its key (the one producers
    # know as the broker's), and these are the server flags (feedline.flags) it adds.
    p.add_argument("--curve-allowed", default=None, metavar="DIR",
                   help="with --bind: directory of the producer public keys (*.key) allowed to "
                   f"connect; env {security.ENV_ALLOWED}")
    p.add_argument("--insecure", action="store_true",
                   help="with --bind: allow a non-loopback address without CURVE keys (anyone "
                   "who reaches the port can inject training data)")
    add_log_flags(p)
    p.set_defaults(func=run)


def parse_schedule(text: str) -> list[tuple[float, float]]:
    """'60:0.025,60:0.08' -> [(60.0, 0.025), (60.0, 0.08)] (seconds, step seconds)."""
    phases = []
    for part in text.split(","):
        try:
            seconds, step = (float(x) for x in part.split(":"))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{part!r} is not SECONDS:STEP (e.g. 60:0.025)") from None
        if seconds <= 0 or step < 0:
            raise argparse.ArgumentTypeError(f"{part!r}: seconds must be > 0 and step >= 0")
        phases.append((seconds, step))
    return phases


def step_at(schedule: list[tuple[float, float]], elapsed: float) -> float:
    """The step of the phase ``elapsed`` seconds into the schedule (the last one after)."""
    for seconds, step in schedule:
        if elapsed < seconds:
            return step
        elapsed -= seconds
    return schedule[-1][1]


def run(args: argparse.Namespace) -> int:
    from prometheus_client import CollectorRegistry

    from feedline.metrics import serve_metrics

    setup_logging(args.log_level)
    log.debug("%s", keep_freed_memory())  # batches of megabytes: feedline.heap
    if args.step_seconds < 0:
        raise SystemExit("feedline drain: --step-seconds must be >= 0")
    if args.schedule and args.step_seconds:
        raise SystemExit("feedline drain: --schedule or --step-seconds, not both")
    schedule = args.schedule or [(1.0, args.step_seconds)]
    try:
        addr, curve = _where(args)
        registry = CollectorRegistry()
        serve_metrics(registry, args.metrics_port or None, args.metrics_addr)
    except FeedlineError as e:  # an address, a key file, CURVE: one line
        raise SystemExit(f"feedline drain: {e}") from None
    stop = stop_on_signals()
    t0 = time.monotonic()
    try:
        count, nbytes, answered = _drain(args, addr, curve, registry, schedule, stop)
    except FeedlineError as e:  # refused (the ingress given as --broker, a cursor): one line
        raise SystemExit(f"feedline drain: {e}") from None
    log.info("drained %d batches (%.1f MB) in %.1fs", count, nbytes / 1e6,
             time.monotonic() - t0)
    if not answered:
        # Nothing to drain is no success: no broker (or trainer) ever accepted us.
        raise SystemExit(f"feedline drain: no broker at {addr} accepted this consumer in "
                         f"{time.monotonic() - t0:.0f}s (is it running, and is this its "
                         "egress?)")
    return 0


def _drain(args: argparse.Namespace, addr: str, curve: Any, registry: Any,
           schedule: list[tuple[float, float]], stop: Any) -> tuple[int, int, bool]:
    """Read until the duration ends or a signal; (batches, bytes, whether a broker accepted
    us)."""
    from feedline.consumer import ConsumerOptions, RemoteDataZMQ
    from feedline.errors import ReceiveTimeout

    t0 = last = time.monotonic()
    end = None if args.duration is None else t0 + args.duration
    count = nbytes = last_count = last_bytes = 0
    # A short receive timeout only so that SIGTERM is noticed while no batch comes.
    with RemoteDataZMQ(addr, timeout=0.5, return_meta=True, curve=curve,
                       bind=args.bind is not None, stream=args.stream,
                       options=ConsumerOptions(window=args.window, consumer_id=args.id,
                                               registry=registry,
                                               insecure=args.insecure)) as source:
        while not stop.is_set() and (end is None or time.monotonic() < end):
            try:
                for batch in source:
                    count += 1
                    nbytes += batch.nbytes
                    step = step_at(schedule, time.monotonic() - t0)
                    if step:
                        stop.wait(step)
                    now = time.monotonic()
                    if now - last >= args.log_interval:
                        log.info("%d batches, %.1f batches/s, %.1f MB/s", count,
                                 (count - last_count) / (now - last),
                                 (nbytes - last_bytes) / (now - last) / 1e6)
                        last, last_count, last_bytes = now, count, nbytes
                    if stop.is_set() or (end is not None and now >= end):
                        break
            except ReceiveTimeout:
                continue  # no batch for a while: check stop and the deadline, wait again
        answered = source._shared.io.answered or bool(args.bind)
    return count, nbytes, answered


def _where(args: argparse.Namespace) -> tuple[str, security.ClientKeys | security.ServerKeys
                                               | None]:
    """The address and keys: a broker's egress and client keys, or with --bind the address
    to serve producers at and server keys. Raises AddressError or KeyFileError (one line)."""
    if args.bind is None:
        if args.curve_allowed or args.insecure:
            raise SystemExit("feedline drain: --curve-allowed and --insecure go with --bind "
                             "(a trainer that serves its producers)")
        endpoints.check_connect(args.broker, "--broker")
        return args.broker, client_keys(args)
    if args.curve_broker_key:
        raise SystemExit("feedline drain: --curve-broker-key is a broker client's flag; with "
                         "--bind this process is the server: give --curve-secret and "
                         "--curve-allowed")
    endpoints.check_bind(args.bind, "--bind")
    keys = server_keys(args)
    try:  # the serving core's rule (it checks again, and warns, when it binds)
        check_exposure([args.bind], None, keys is not None, args.insecure,
                       Remedy(ingress="--bind"))
    except ValueError as e:
        raise endpoints.AddressError(str(e)) from None
    return args.bind, keys

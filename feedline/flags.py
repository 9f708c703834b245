"""Command-line building blocks shared by every ``feedline`` subcommand.

Each component's command module (``feedline/broker/cli.py``, ``feedline/producer/cli.py``, ...) has
``add_parser(subparsers)``, which adds its subcommand and sets ``func`` (taking the parsed
arguments, returning an exit code), and builds its flags from the helpers here, so a flag that
several daemons share is defined once. Flags and environment variables are read in those
modules only; everything below them takes config objects. The ``feedline`` command itself
(the table of subcommands) is ``feedline/commands/main.py``.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
import threading
from collections.abc import Callable, Sequence

from feedline import security
from feedline.liveness import HEARTBEAT_INTERVAL, HEARTBEAT_TIMEOUT

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)


METRICS_PORT_ENV = "FEEDLINE_METRICS_PORT"


def add_metrics_flags(p: argparse.ArgumentParser, port: int, addr: str = "0.0.0.0") -> None:
    """``--metrics-port`` (its default from $FEEDLINE_METRICS_PORT when set, so a container
    image can say once which port its healthcheck probes) and ``--metrics-addr``."""
    env = os.environ.get(METRICS_PORT_ENV)
    if env:
        try:
            port = int(env)
        except ValueError:
            raise SystemExit(f"feedline: {METRICS_PORT_ENV}={env!r} is not a port number") \
                from None
    p.add_argument("--metrics-port", type=int, default=port,
                   help=f"serve Prometheus metrics on this port; 0 turns them off; env "
                   f"{METRICS_PORT_ENV}")
    p.add_argument("--metrics-addr", default=addr, help="address for the metrics")


def parse_size(text: str) -> int:
    """'512MiB', '1G', '4096' -> bytes (K/M/G/T are powers of 1024)."""
    m = _SIZE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 512MiB or 2G)")
    power = " kmgt".index(m.group(2).lower() or " ")
    return int(float(m.group(1)) * 1024**power)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Shows each option's default once, keeps description paragraphs as written.

    ``(default: VALUE)`` is appended to an option's help unless the option is required (it
    has none), is a flag that takes no value and is off unless given, has ``None`` for
    default (nothing to show: its help says in words what happens without it), or its help
    already writes its own ``(default: ...)`` (a default that is computed, like
    hostname-pid, or is a behaviour rather than a value).
    """

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if (action.required or action.default is None
                or (action.nargs == 0 and action.default is False)
                or "(default:" in text):
            return action.help
        return super()._get_help_string(action)


class StopEvent(threading.Event):
    """Set by a signal: ``signum`` says which (None until then), for the daemon's last line."""

    signum: int | None = None

    @property
    def signame(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else "its caller"


def stop_on_signals() -> StopEvent:
    """An event set by SIGTERM or SIGINT (a second SIGINT raises KeyboardInterrupt)."""
    stop = StopEvent()

    def handler(signum: int, _frame: object) -> None:
        if stop.is_set() and signum == signal.SIGINT:
            raise KeyboardInterrupt
        if stop.signum is None:
            stop.signum = signum
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    return stop


def standalone(add_parser: Callable[[argparse._SubParsersAction], None], name: str,
               argv: Sequence[str]) -> int:
    """Run one subcommand by itself (``python -m feedline.broker ARGS`` is ``feedline broker
    ARGS``):
    the same flags, help and defaults as under ``feedline``, without loading the others."""
    parser = argparse.ArgumentParser(prog="feedline", formatter_class=HelpFormatter)
    add_parser(parser.add_subparsers(dest="command", metavar="COMMAND"))
    args = parser.parse_args([name, *argv])
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        # A second Ctrl-C (stop_on_signals): the user wants it gone now, not a traceback.
        print(f"feedline {name}: interrupted again while stopping; stopped at once, without "
              "finishing its shutdown", file=sys.stderr)
        return 130


# ---------------------------------------------------------------- flags several daemons share


def add_log_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")


def add_liveness_flags(p: argparse.ArgumentParser, timeout_help: str) -> None:
    """``--heartbeat-interval`` and ``--heartbeat-timeout``, defaults from feedline.liveness."""
    p.add_argument("--heartbeat-interval", type=float, default=HEARTBEAT_INTERVAL,
                   help="seconds between heartbeats to an idle peer")
    p.add_argument("--heartbeat-timeout", type=float, default=HEARTBEAT_TIMEOUT,
                   help=timeout_help)


def add_client_curve_flags(p: argparse.ArgumentParser, who: str) -> None:
    """The CURVE flags of a broker's client (a producer or a consumer)."""
    p.add_argument("--curve-secret", default=None, metavar="FILE",
                   help=f"this {who}'s CURVE secret key file (feedline keys generate); "
                   f"env {security.ENV_SECRET}")
    p.add_argument("--curve-broker-key", default=None, metavar="FILE",
                   help=f"the broker's CURVE public key file; env {security.ENV_BROKER_KEY}")


def add_server_curve_flags(p: argparse.ArgumentParser) -> None:
    """The CURVE flags of a server (the broker, a direct-mode trainer)."""
    p.add_argument("--curve-secret", default=None, metavar="FILE",
                   help="the server's CURVE secret key file (feedline keys generate); "
                   f"env {security.ENV_SECRET}")
    p.add_argument("--curve-allowed", default=None, metavar="DIR",
                   help="directory of the client public keys (*.key) allowed to connect; "
                   f"env {security.ENV_ALLOWED}")


def client_keys(args: argparse.Namespace) -> security.ClientKeys | None:
    """Client keys from the flags, else the environment (flags win); None when neither names
    any. Raises KeyFileError or CurveUnavailable with a message for the operator."""
    env = security.ClientKeys.from_env()
    if args.curve_secret is None and args.curve_broker_key is None:
        return env
    return security.client_keys(
        args.curve_secret or os.environ.get(security.ENV_SECRET),
        args.curve_broker_key or os.environ.get(security.ENV_BROKER_KEY),
    )


def server_keys(args: argparse.Namespace) -> security.ServerKeys | None:
    """Server keys from the flags, else the environment (flags win); None when neither."""
    return security.server_keys(
        args.curve_secret or os.environ.get(security.ENV_SECRET),
        args.curve_allowed or os.environ.get(security.ENV_ALLOWED),
    )

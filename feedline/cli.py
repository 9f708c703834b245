"""The ``feedline`` command line: one entry point, a subcommand per module.

Each module in ``COMMANDS`` has ``add_parser(subparsers)``, which adds its subcommand and sets
``func`` (taking the parsed arguments, returning an exit code). Flags and environment
variables are read here and in those functions only; everything below takes config objects.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import signal
import sys
import threading
from collections.abc import Sequence

from feedline import __version__

COMMANDS = [
    "broker.cli",
    "producer.cli",
    "feedline.demo",
    "producer.lmdb_cli",
    "feedline.drain",
    "feedline.top",
    "feedline.keys",
]

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


def stop_on_signals() -> threading.Event:
    """An event set by SIGTERM or SIGINT (a second SIGINT raises KeyboardInterrupt)."""
    stop = threading.Event()

    def handler(signum: int, _frame: object) -> None:
        if stop.is_set() and signum == signal.SIGINT:
            raise KeyboardInterrupt
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    return stop


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="feedline",
        description="Serve preprocessed training batches from data machines to trainers.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"feedline {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(name).add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())

"""``feedline``: one entry point, a subcommand per module.

Each module in the table has ``add_parser(subparsers)``, which adds its subcommand and sets
``func`` (taking the parsed arguments, returning an exit code). ``feedline COMMAND ARGS``
imports COMMAND's module alone (a broker or ``feedline keys`` does not load the producer's
image and dataset libraries); ``feedline --help`` and a mistyped command load them all.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from types import ModuleType

from feedline.flags import HelpFormatter, standalone
from feedline.version import __version__

# Each subcommand and the module whose add_parser adds it, in --help's order.
COMMANDS = {
    "broker": "feedline.broker.cli",
    "producer": "feedline.producer.cli",
    "coordinator": "feedline.commands.coordinator",
    "fleet": "feedline.commands.fleet",
    "demo": "feedline.commands.demo",
    "lmdb": "feedline.producer.lmdb_cli",
    "convert": "feedline.producer.convert_cli",
    "index": "feedline.producer.index_cli",
    "info": "feedline.producer.info_cli",
    "drain": "feedline.consumer.drain",
    "replay": "feedline.commands.replay",
    "diff": "feedline.commands.diff",
    "top": "feedline.commands.top",
    "keys": "feedline.keys",
}


def command_module(name: str) -> ModuleType:
    return importlib.import_module(COMMANDS[name])


def version_text() -> str:
    """The version line, and which JPEG decoder this install runs."""
    return f"feedline {__version__} (JPEG decoder: {command_module('producer').decoder_info()})"


class _Version(argparse.Action):
    """``--version``: the text is made when asked for (finding the decoder imports it)."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS,
                 **kwargs: object) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS,
                         help="print the version and the JPEG decoder, and exit")

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: object, option_string: str | None = None) -> None:
        print(version_text())
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="feedline",
        description="Serve preprocessed training batches from data machines to trainers.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--version", action=_Version)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        command_module(name).add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in COMMANDS:
        return standalone(command_module(argv[0]).add_parser, argv[0], argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())

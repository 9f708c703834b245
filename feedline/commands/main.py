"""``feedline``: one entry point, a subcommand per module.

Each module in the table has ``add_parser(subparsers)``, which adds its subcommand and sets
``func`` (taking the parsed arguments, returning an exit code).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from feedline import keys
from feedline.broker import cli as broker_cli
from feedline.commands import demo, fleet, top
from feedline.consumer import drain
from feedline.flags import HelpFormatter
from feedline.producer import cli as producer_cli
from feedline.producer import convert_cli, info_cli, lmdb_cli
from feedline.version import __version__

COMMANDS = [broker_cli, producer_cli, fleet, demo, lmdb_cli, convert_cli, info_cli, drain, top,
            keys]


def version_text() -> str:
    """The version line, and which JPEG decoder this install runs."""
    return f"feedline {__version__} (JPEG decoder: {producer_cli.decoder_info()})"


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
    for module in COMMANDS:
        module.add_parser(sub)
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

"""``feedline keys``: create and inspect CURVE key pairs (see docs/security.md)."""

from __future__ import annotations

import argparse
import sys

from feedline.flags import HelpFormatter


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "keys",
        help="create CURVE key pairs (authentication and encryption)",
        description="Create and inspect CURVE keys. The broker needs a key pair and a directory "
        "of the public keys\nit accepts; each producer and consumer needs a key pair and the "
        "broker's public key.",
        formatter_class=HelpFormatter,
    )
    ks = p.add_subparsers(dest="keys_command", metavar="ACTION", required=True)
    g = ks.add_parser("generate", help="write DIR/NAME.key and DIR/NAME.key_secret (0600)",
                      formatter_class=HelpFormatter,
                      description="Create a CURVE key pair: DIR/NAME.key (the public key, to "
                      "share) and DIR/NAME.key_secret\n(mode 0600, to keep on this machine).")
    g.add_argument("dir", metavar="DIR", help="directory to write into (created if missing)")
    g.add_argument("--name", default="feedline",
                   help="file name stem, e.g. broker or producer-1")
    g.set_defaults(func=_generate)
    s = ks.add_parser("show", help="print the public key of a key file",
                      formatter_class=HelpFormatter,
                      description="Print the Z85 public key of FILE (a public or a secret key "
                      "file), e.g. to compare it\nwith what a peer was given.")
    s.add_argument("file", metavar="FILE", help="a NAME.key or NAME.key_secret file")
    s.set_defaults(func=_show)


def _generate(args: argparse.Namespace) -> int:
    from feedline.errors import FeedlineError
    from feedline.security import generate_keypair

    try:
        pub, sec = generate_keypair(args.dir, args.name)
    except (FeedlineError, OSError) as e:
        print(f"feedline keys: {e}", file=sys.stderr)
        return 1
    print(f"public key: {pub} (give it to the broker's allowed-keys directory, or to clients "
          f"if this is the broker's)")
    print(f"secret key: {sec} (mode 0600; keep it on this machine)")
    return 0


def _show(args: argparse.Namespace) -> int:
    from feedline.security import KeyFileError, load_public

    try:
        print(load_public(args.file).decode())
    except KeyFileError as e:
        print(f"feedline keys: {e}", file=sys.stderr)
        return 1
    return 0

"""``feedline diff``: where two runs' data first differ, and why, from their ledgers.

Two ledgers (``ConsumerOptions(ledger=...)``, :mod:`feedline.exact.lineage`) hold the same data
when each epoch holds the same batches, by place ``(epoch, unit, index)``, each with the same
pipeline, pipeline-file and code fingerprints: the batches are then the same bytes
(``feedline replay`` makes any of them again). The order within an epoch is not compared
(it follows which producer finished which unit first), and a batch taken twice (a resumed
run re-takes what its checkpoint did not hold) counts once. Exit status 0: the same data;
1: they differ (the first difference is printed: the line in each ledger and why); 2: a
ledger could not be read, or holds training-mode batches (which have no place to compare).

    feedline diff run-a.jsonl run-b.jsonl
"""

from __future__ import annotations

import argparse

from feedline.errors import DataError
from feedline.exact import diff, read_ledger
from feedline.flags import HelpFormatter


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("diff", help="where two runs' data first differ, from their ledgers",
                       description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("a", metavar="LEDGER_A")
    p.add_argument("b", metavar="LEDGER_B")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        result = diff(read_ledger(args.a), read_ledger(args.b))
    except (DataError, OSError) as e:
        print(f"feedline diff: {e}")
        return 2
    first = result.first
    if first is None:
        again = [f"{name} took {n} batch(es) twice (counted once)"
                 for name, n in zip((args.a, args.b), result.repeated, strict=True) if n]
        print(f"identical: the same {result.batches} batches"
              + (f"; {', '.join(again)}" if again else ""))
        return 0
    where = [f"{name} line {n}" for name, n in ((args.a, first.line_a), (args.b, first.line_b))
             if n]
    print(f"differ at {', '.join(where)}: {first.why}")
    return 1

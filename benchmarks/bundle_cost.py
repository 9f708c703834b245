"""What a bundle's arrival costs a direct-mode trainer's I/O thread, per batch, hot.

Times ``ProducerSide.on_message`` for one bundle (decoded, checked, charged to its producer's
credit, its batches queued for the model) with the trainer's own sink
(``feedline.consumer.direct``), in the process: no sockets, no other thread, the same bundle
layout every time, so the caches are warm (benchmarks/cache_cost.py measures what cold ones
add). Bundles as a producer makes them: 64 batches of 16 KB (joined: one frame per array of
the layout), 26 and 4 of 150 KB (joined too since ``JOIN_BYTES`` is 192 KiB; a frame per
array of each batch in a checkout from before). Each ``--tree`` (another
checkout) runs in its own process, in turn with this one, for ``--rounds`` rounds; medians,
in microseconds per batch.

    python benchmarks/bundle_cost.py --rounds 5 --tree before=/path/to/another/checkout
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CASES = [(16_000, 64), (150_528, 26), (150_528, 4)]  # (image bytes, batches in a bundle)

ONE = """
import sys, time
import numpy as np, zmq
from prometheus_client import CollectorRegistry
from feedline.protocol import messages as m
from feedline.protocol.bundle import bundle_frames
from feedline.protocol.codec import DEFAULT_LIMITS, packb
from feedline.consumer.direct import _LocalSink
from feedline.consumer.io import Shared
from feedline.protocol.encode import prepare_batch
from feedline.serving.budget import Budget
from feedline.serving.metrics import BrokerMetrics
from feedline.serving.producers import IngressConfig, ProducerSide

size, n, rounds = map(int, sys.argv[1:4])
shared = Shared("c", 1, 8, 1 << 40, "default", "raise", CollectorRegistry(), slots=1 << 16)
side = ProducerSide(lambda ident, frames: 0, _LocalSink(shared),
                    BrokerMetrics(CollectorRegistry()), DEFAULT_LIMITS,
                    IngressConfig(Budget(1 << 20, 1 << 40), 1 << 20, 2.0, 16,
                                  stream="default", by_bytes=True, bundle=64),
                    1, lambda *_: None)
prepared = [prepare_batch([np.zeros(size, np.uint8), np.zeros(1, np.int32)], DEFAULT_LIMITS, 2)
            for _ in range(n)]
hello = m.ProducerHello(producer="p", session=7, max_batch_bytes=prepared[0].wire_bytes)
side.on_message(b"p", [zmq.Frame(m.encode(hello))], -1, 0.0)
credit = side.planner.producers[b"p"]
seq, spent = 0, 0.0
for _ in range(rounds):
    credit.granted += n  # what the plans would grant: the bundle is within its credit
    credit.granted_bytes += n * prepared[0].wire_bytes + 4096
    frames = [zmq.Frame(f) for f in bundle_frames(prepared, producer=packb("p"), session=7,
                                                   seq=seq, epoch=0)]
    seq += n
    t = time.perf_counter()
    side.on_message(b"p", frames, -1, 0.0)
    spent += time.perf_counter() - t
    while shared.queue:  # the model takes them
        shared.queue.get_nowait()
    shared.queued_bytes = 0
print(spent / (rounds * n) * 1e6)
"""


def one(tree: Path, size: int, n: int, bundles: int) -> float:
    out = subprocess.run([sys.executable, "-c", ONE, str(size), str(n), str(bundles)],
                         env={**os.environ, "PYTHONPATH": str(tree)}, cwd=tree,
                         capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise SystemExit(f"{tree}: {out.stderr[-2000:]}")
    return float(out.stdout.split()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds")
    ap.add_argument("--batches", type=int, default=64_000, help="batches timed per run")
    ap.add_argument("--tree", action="append", default=[], metavar="NAME=DIR",
                    help="another checkout, measured beside this one (repeatable)")
    args = ap.parse_args()
    trees = {"this": ROOT}
    for spec in args.tree:
        name, _, path = spec.partition("=")
        trees[name] = Path(path).resolve()
    got: dict[tuple[str, int, int], list[float]] = {}
    total = args.rounds * len(CASES) * len(trees)
    done = 0
    for r in range(args.rounds):
        for size, n in CASES:
            for name, tree in trees.items():
                us = one(tree, size, n, max(1, args.batches // n))
                got.setdefault((name, size, n), []).append(us)
                done += 1
                print(f"  [{done}/{total}] round {r + 1} {name:<8} {size:>7} B x{n:<3} "
                      f"{us:6.2f} us/batch", flush=True)
    print(f"\n{'tree':<8} {'batch':>9} {'bundle':>7} {'us/batch (median)':>18}")
    for (name, size, n), v in got.items():
        print(f"{name:<8} {size:>9} {n:>7} {statistics.median(v):>18.2f}")


if __name__ == "__main__":
    main()

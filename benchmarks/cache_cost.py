"""What a batch's Python costs once the batch's bytes have been through the caches.

In a running transport the kernel copies every batch twice on its way (into the sender's
socket buffers, out of the receiver's): for a 9.6 MB batch ~38 MB of memory traffic between
two batches, more than this machine's 32 MiB L3. What the Python code of the next batch
touches (its bytecode, objects, dicts) comes from memory again. This times one batch's
per-batch Python, the same code and data every time, with N MB copied between two calls
(``np.copyto``, standing in for the kernel's copies), against none:

- ``prepare``: a producer's :func:`feedline.protocol.wire.prepare_batch` and the batch's frames;
- ``decode``: a consumer's :func:`feedline.protocol.wire.decode_batch` of those frames;
- ``raw``: what the raw PULL consumer of benchmarks/transport.py does with a message (two
  ``np.frombuffer`` views and a reshape).

Medians of ``--rounds`` alternating rounds, in microseconds per call; the ratio is to the
call with nothing copied between.

    python benchmarks/cache_cost.py --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from feedline.protocol import wire  # noqa: E402
from feedline.protocol.codec import packb  # noqa: E402

BATCH = [np.zeros((7, 224, 224, 3), np.uint8), np.zeros(7, np.int32)]  # 1 MB, as transport's
PRODUCER = packb("producer-0")


def prepare() -> None:
    wire.prepare_batch(BATCH, wire.DEFAULT_LIMITS, 10).frames(
        producer=PRODUCER, session=1, seq=5, epoch=0)


FRAMES = [f if isinstance(f, bytes) else f.tobytes()
          for f in wire.prepare_batch(BATCH).frames(producer=PRODUCER, session=1, seq=5,
                                                    epoch=0)]


def decode() -> None:
    wire.decode_batch(FRAMES)


def raw() -> None:
    np.frombuffer(FRAMES[1], np.uint8).reshape(7, 224, 224, 3)
    np.frombuffer(FRAMES[2], np.int32)


STEPS: dict[str, Callable[[], None]] = {"prepare": prepare, "decode": decode, "raw": raw}


def timed(step: Callable[[], None], between: int, calls: int) -> float:
    """Microseconds per ``step()``, with ``between`` bytes copied before each (not timed)."""
    src, dst = np.ones(max(between, 1), np.uint8), np.empty(max(between, 1), np.uint8)
    total = 0.0
    for _ in range(calls):
        if between:
            np.copyto(dst, src)
        t0 = time.perf_counter()
        step()
        total += time.perf_counter() - t0
    return total / calls * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds (default 5)")
    ap.add_argument("--calls", type=int, default=300, help="calls per measurement")
    ap.add_argument("--mb", type=float, nargs="+", default=[0, 1, 4, 9.6, 38],
                    help="MB copied between two calls (default 0 1 4 9.6 38)")
    args = ap.parse_args()
    sizes = [int(mb * 1e6) for mb in args.mb]
    runs: dict[tuple[str, int], list[float]] = {(s, b): [] for s in STEPS for b in sizes}
    for r in range(args.rounds):
        order = list(runs)
        for name, between in (order[::-1] if r % 2 else order):
            runs[name, between].append(timed(STEPS[name], between, args.calls))
        print(f"  round {r + 1}/{args.rounds} done", flush=True)
    print(f"\n{'step':<8} " + " ".join(f"{mb:>12g} MB" for mb in args.mb))
    for name in STEPS:
        med = [statistics.median(runs[name, b]) for b in sizes]
        cells = " ".join(f"{m:7.1f} ({m / med[0]:3.1f}x)" for m in med)
        print(f"{name:<8} {cells}")


if __name__ == "__main__":
    main()

"""The serving side's per-batch steps, each alone (timeit, best of 7): what a change to one
of them buys, before it is measured in a running transport (benchmarks/transport.py,
benchmarks/message_cost.py).

- ``plan``: one batch's accounting and a credit plan (``CreditPlanner.batch`` + ``plan``), with
  1 and 8 producers, in this checkout and in each ``--tree NAME=DIR`` (run in a child process
  of its own, rounds alternating);
- ``envelope``: a DELIVER envelope encoded per batch, against the one a broker keeps per
  consumer registration;
- ``labels``: a producer's received-batch counters looked up by label per batch, against the
  series looked up once.

    python benchmarks/serving_costs.py --tree before=/tmp/feedline-before
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import timeit
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
N = 20000

PLAN = """
import sys, time, timeit
from feedline.serving.budget import Budget
from feedline.serving.credit import CreditPlanner
out = []
for n in (1, 8):
    cp = CreditPlanner(Budget(1000, 2 << 30), 4, 2.0)
    keys = [bytes([i]) for i in range(n)]
    for k in keys:
        cp.join(k, 16000, "default")
        cp.want(k, 0, 0, 16000)
    now = time.monotonic()
    cp.plan(now, 0, 0)
    for k in keys:
        cp.batch(k, 16000, now)
    i = [0]
    def step():
        k = keys[i[0] % n]
        i[0] += 1
        cp.batch(k, 16000, now)
        cp.plan(now, 10, 160000, {"default": (10, 160000)}, set())
    out.append(min(timeit.repeat(step, number=N, repeat=7)) / N * 1e6)
print(*out)
"""


def plan_cost(tree: Path) -> list[float]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run([sys.executable, "-c", f"N = {N}\n{PLAN}"], env=env, cwd=tree,
                         capture_output=True, text=True, timeout=300, check=True).stdout
    return [float(x) for x in out.split()]


def pairs() -> list[tuple[str, float, float]]:
    """(step, us per batch the general way, us the way the hot path does it)."""
    sys.path.insert(0, str(ROOT))
    from prometheus_client import CollectorRegistry

    from feedline.protocol import messages as m
    from feedline.serving.metrics import BrokerMetrics

    def best(f: Callable[[], object]) -> float:
        return min(timeit.repeat(f, number=N, repeat=7)) / N * 1e6

    kept = m.encode(m.Deliver(broker=123456789, gap=0, registration=3))
    gap = 0
    bm = BrokerMetrics(CollectorRegistry())
    label = bm.producer_label.acquire("p")
    bm.init_producer(label)
    batches, nbytes = bm.received_batches.labels(label), bm.received_bytes.labels(label)

    def labels() -> None:
        bm.received_batches.labels(label).inc()
        bm.received_bytes.labels(label).inc(16000)

    def series() -> None:
        batches.inc()
        nbytes.inc(16000)

    return [
        ("envelope", best(lambda: m.encode(m.Deliver(broker=123456789, gap=gap,
                                                     registration=3))),
         best(lambda: kept if not gap else None)),
        ("labels", best(labels), best(series)),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", action="append", default=[], metavar="NAME=DIR",
                    help="another checkout whose plan is timed beside this one's")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds (default 3)")
    args = ap.parse_args()
    trees = {"this": ROOT}
    for spec in args.tree:
        name, sep, path = spec.partition("=")
        if not sep or not Path(path, "feedline").is_dir():
            raise SystemExit(f"--tree {spec}: give NAME=DIR, DIR a feedline checkout")
        trees[name] = Path(path).resolve()
    got: dict[str, list[list[float]]] = {k: [] for k in trees}
    for r in range(args.rounds):
        for name, tree in trees.items():
            got[name].append(plan_cost(tree))
            print(f"  round {r + 1} {name}: plan {got[name][-1]}", flush=True)
    print(f"\n{'plan, us per batch (median of rounds)':<40} {'1 producer':>11} {'8 producers':>12}")
    for name, runs in got.items():
        one = statistics.median(x[0] for x in runs)
        eight = statistics.median(x[1] for x in runs)
        print(f"{name:<40} {one:>11.2f} {eight:>12.2f}")
    print(f"\n{'step, us per batch':<40} {'general':>11} {'hot path':>12}")
    for step, general, fast in pairs():
        print(f"{step:<40} {general:>11.2f} {fast:>12.2f}")


if __name__ == "__main__":
    main()

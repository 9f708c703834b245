"""What a process costs to start: the CPU of importing a producer's, a broker's or a
training process's module in a fresh Python, against another checkout's.

Each measurement is one ``python -c "import MODULE"`` in a new process, its CPU (user +
system) read from ``RUSAGE_CHILDREN``. Rounds alternate between the trees (this checkout and
``--before``), so a change in the machine's speed falls on both; the report gives the medians
and the ratio. ``OPENBLAS_NUM_THREADS`` is 1 unless the environment sets it (NumPy's OpenBLAS
otherwise starts a thread per core that spins while the process goes on importing: a large,
noisy share of the total on a small machine).

    git worktree add /tmp/fl-before HEAD~1
    python benchmarks/startup.py --before /tmp/fl-before --rounds 9
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODULES = {"producer": "feedline.producer.cli", "broker": "feedline.broker.cli",
           "trainer": "feedline.consumer.remote"}


def start_cpu(module: str, tree: Path, env: dict[str, str]) -> float:
    """CPU-seconds of one fresh ``python -c "import module"`` run in ``tree`` (its
    directory comes first on ``sys.path``, before an installed feedline)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([sys.executable, "-c", f"import {module}"], cwd=tree, env=env, check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", type=Path, help="another checkout to compare with")
    ap.add_argument("--rounds", type=int, default=9, help="alternating rounds (default 9)")
    ap.add_argument("--only", nargs="+", choices=sorted(MODULES), default=list(MODULES),
                    help="which processes (default: all)")
    args = ap.parse_args()
    trees = {"now": ROOT}
    if args.before is not None:
        if not (args.before / "feedline" / "__init__.py").exists():
            ap.error(f"--before {args.before}: not a feedline checkout (no feedline/__init__.py)")
        trees = {"before": args.before.resolve(), "now": ROOT}
    env = {**os.environ}
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    for tree in trees.values():  # bytecode first: the first import would pay the compile
        subprocess.run([sys.executable, "-m", "compileall", "-q", str(tree / "feedline")],
                       check=True, stdout=subprocess.DEVNULL)
    cpu: dict[tuple[str, str], list[float]] = {}
    for r in range(args.rounds):
        for name in args.only:
            for label, tree in trees.items():
                cpu.setdefault((name, label), []).append(start_cpu(MODULES[name], tree, env))
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    print(f"start-up CPU-s, medians of {args.rounds} rounds "
          f"(OPENBLAS_NUM_THREADS={env['OPENBLAS_NUM_THREADS']})")
    for name in args.only:
        med = {label: statistics.median(cpu[(name, label)]) for label in trees}
        cells = "  ".join(f"{label} {v:.3f}" for label, v in med.items())
        ratio = f"  ({med['now'] / med['before'] - 1:+.0%})" if "before" in med else ""
        print(f"{name:9s} {MODULES[name]:26s} {cells}{ratio}")


if __name__ == "__main__":
    main()

"""A long run of exact delivery's coordinator model (``tests/exact/test_coordinator_model.py``).

CI runs the Hypothesis state machine with 200 examples (seconds). This runs it for a given
time instead: rounds of ``--round`` examples of up to ``--steps`` steps each, every round
with fresh random choices (no example database: nothing is replayed), until ``--minutes``
have passed. It prints a rate line after every round and, at the end, one line: examples,
steps at most, minutes, and whether every invariant held. A failure prints Hypothesis'
falsifying example (the rules in order, shrunk) and exits 1.

    python fuzz/model_soak.py --minutes 30
    # on a machine others are measuring on: only idle CPU, 30 minutes of it
    chrt --idle 0 python fuzz/model_soak.py --minutes 30 --cpu --max-wall 60

Run it from the repository root (it imports the model from ``tests/``).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.support.exact_model import ExactModel  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--steps", type=int, default=120, help="steps per example, at most")
    p.add_argument("--round", type=int, default=500, help="examples per round")
    p.add_argument("--cpu", action="store_true",
                   help="count --minutes in this process's CPU time, not the clock's")
    p.add_argument("--max-wall", type=float, default=None,
                   help="with --cpu: stop after this many minutes of the clock regardless")
    a = p.parse_args(argv)
    if a.minutes <= 0 or a.steps < 1 or a.round < 1:
        p.error("--minutes, --steps and --round must be positive")
    cfg = settings(max_examples=a.round, stateful_step_count=a.steps, deadline=None,
                   database=None, print_blob=True,
                   suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    # The coordinator's warnings (torn records, restarts) are what the model provokes.
    logging.disable(logging.CRITICAL)
    clock = time.process_time if a.cpu else time.monotonic
    t0, w0 = clock(), time.monotonic()
    wall_end = w0 + a.max_wall * 60 if a.cpu and a.max_wall else float("inf")
    examples = rounds = 0
    while clock() - t0 < a.minutes * 60 and time.monotonic() < wall_end:
        try:
            run_state_machine_as_test(ExactModel, settings=cfg)
        except BaseException:
            print(f"FAILED after {examples} examples in {(clock() - t0) / 60:.1f} min "
                  "(the falsifying example is above)", flush=True)
            raise
        rounds += 1
        examples += a.round
        took = clock() - t0
        print(f"round {rounds}: {examples} examples in {took / 60:.1f} min"
              f"{' of CPU' if a.cpu else ''} ({examples / took:.1f}/s; "
              f"{(time.monotonic() - w0) / 60:.1f} min of the clock)", flush=True)
    took = (clock() - t0) / 60
    print(f"{examples} examples of up to {a.steps} steps in {took:.1f} min"
          f"{' of CPU' if a.cpu else ''} ({(time.monotonic() - w0) / 60:.1f} min of the "
          "clock): every invariant held, every epoch ended", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A long run of exact delivery's coordinator model (``tests/test_coordinator_model.py``).

CI runs the Hypothesis state machine with 200 examples (seconds). This runs it for a given
time instead: rounds of ``--round`` examples of up to ``--steps`` steps each, every round
with fresh random choices (no example database: nothing is replayed), until ``--minutes``
have passed. It prints a rate line after every round and, at the end, one line: examples,
steps at most, minutes, and whether every invariant held. A failure prints Hypothesis'
falsifying example (the rules in order, shrunk) and exits 1.

    python fuzz/model_soak.py --minutes 30

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

from tests.test_coordinator_model import ExactModel  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--steps", type=int, default=120, help="steps per example, at most")
    p.add_argument("--round", type=int, default=500, help="examples per round")
    a = p.parse_args(argv)
    if a.minutes <= 0 or a.steps < 1 or a.round < 1:
        p.error("--minutes, --steps and --round must be positive")
    cfg = settings(max_examples=a.round, stateful_step_count=a.steps, deadline=None,
                   database=None, print_blob=True,
                   suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    # The coordinator's warnings (torn records, restarts) are what the model provokes.
    logging.disable(logging.CRITICAL)
    t0 = time.monotonic()
    end = t0 + a.minutes * 60
    examples = rounds = 0
    while time.monotonic() < end:
        try:
            run_state_machine_as_test(ExactModel, settings=cfg)
        except BaseException:
            print(f"FAILED after {examples} examples in {(time.monotonic() - t0) / 60:.1f} "
                  "min (the falsifying example is above)", flush=True)
            raise
        rounds += 1
        examples += a.round
        took = time.monotonic() - t0
        print(f"round {rounds}: {examples} examples in {took / 60:.1f} min "
              f"({examples / took:.1f}/s)", flush=True)
    took = (time.monotonic() - t0) / 60
    print(f"{examples} examples of up to {a.steps} steps in {took:.1f} min: every invariant "
          "held, every epoch ended", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

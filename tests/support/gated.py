"""``python -m tests.support.gated GATE MODULE ARGS...``: wait until the file GATE exists (at most
:data:`WAIT` seconds), then run MODULE in this same process as ``python -m MODULE ARGS`` would.

A daemon started now that does nothing until the test lets it: the race of a producer that
was started with the others of its job and is slow to come up (imports, a loaded machine),
made certain. Its process started before the wait, as that slow producer's did.
"""

from __future__ import annotations

import runpy
import sys
import time
from pathlib import Path

WAIT = 120.0
_POLL = 0.05


def main() -> None:
    gate, module, *args = sys.argv[1:]
    deadline = time.monotonic() + WAIT
    while not Path(gate).exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"tests.support.gated: {gate} did not appear within {WAIT:.0f}s")
        time.sleep(_POLL)
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()

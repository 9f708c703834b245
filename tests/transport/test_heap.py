"""feedline.heap: a daemon keeps freed batch memory instead of faulting it in again. Measured
in real processes (page faults from /proc/self/stat), the pattern exact delivery has: several
batches of megabytes freed together, then made again."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from feedline.procs import free_port

pytestmark = pytest.mark.skipif(not hasattr(os, "confstr")
                                or not os.confstr("CS_GNU_LIBC_VERSION"),
                                reason="glibc's malloc only")

PATTERN = """
import sys
import numpy as np
from feedline.heap import keep_freed_memory

if sys.argv[1] == "keep":
    print(keep_freed_memory(), file=sys.stderr)
elif sys.argv[1] in ("direct", "reader"):  # a trainer: its I/O thread sets it on start
    import logging
    from feedline import RemoteDataZMQ
    from feedline.errors import ReceiveTimeout
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    trainer = RemoteDataZMQ(sys.argv[2], bind=sys.argv[1] == "direct", timeout=0.5)
    try:
        next(iter(trainer))
    except ReceiveTimeout:
        pass  # no producer (no broker): it served (connected), and waited
    trainer.close()

def faults():
    return int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[7])

def rounds(n):
    for _ in range(n):
        batches = [np.ones(10 << 20, np.uint8) for _ in range(4)]  # 4 batches of 10 MiB
        del batches  # freed together: 40 MiB at the heap's top

rounds(2)  # glibc's thresholds settle on the block size
before = faults()
rounds(20)
print(faults() - before)
"""


def faults(mode: str, env: dict[str, str] | None = None, *args: str) -> tuple[int, str]:
    out = subprocess.run([sys.executable, "-c", PATTERN, mode, *args], capture_output=True,
                         text=True,
                         timeout=120, env={**os.environ, **(env or {})}, check=True)
    return int(out.stdout), out.stderr.strip()


def test_freed_batches_are_kept_for_the_next_ones() -> None:
    default, _ = faults("default")
    kept, said = faults("keep")
    assert said == "malloc keeps up to 256 MiB freed"
    # 20 rounds of 40 MiB (~200,000 pages): glibc's default gives a part back every round
    # (about 2,000 pages a round here), kept memory is faulted in once.
    assert default > 20_000, default
    assert kept < default / 20, (kept, default)


def test_the_operators_malloc_settings_stand() -> None:
    n, said = faults("keep", {"MALLOC_TRIM_THRESHOLD_": str(1 << 20)})
    assert said == "malloc as the environment sets it (MALLOC_TRIM_THRESHOLD_)"
    assert n > 20_000, n  # a 1 MiB trim threshold: the pages go back every round


def test_a_direct_mode_trainer_keeps_freed_batches_as_the_daemons_do() -> None:
    """A trainer that serves its producers receives batches in libzmq's I/O thread as a
    broker does (transport at 1 MB: that thread's CPU per batch 251 -> 134 us with the
    thresholds, benchmarks/NOTES.md); its serving core sets them when it starts, says so in
    its log line, and leaves the environment's settings alone."""
    addr = f"tcp://127.0.0.1:{free_port()}"
    n, said = faults("direct", None, addr)
    assert "serving producers directly on" in said and "malloc keeps up to 256 MiB freed" in said
    assert n < 1_000, (n, said)  # as "keep" above; glibc's default faults > 20,000 pages
    n, said = faults("direct", {"MALLOC_TRIM_THRESHOLD_": str(1 << 20)}, addr)
    assert "malloc as the environment sets it (MALLOC_TRIM_THRESHOLD_)" in said
    assert n > 20_000, n


def test_a_trainer_that_reads_from_a_broker_keeps_freed_batches_too() -> None:
    """Its batches arrive in memory libzmq's I/O thread allocates, as a direct-mode
    trainer's do (through a broker at 1 MB: 17-29 page faults a batch without the thresholds,
    none with them, and the training process's CPU per GB -16%, benchmarks/NOTES.md)."""
    addr = f"tcp://127.0.0.1:{free_port()}"  # no broker there: the reader waits, and times out
    n, said = faults("reader", None, addr)
    assert f"reading from {addr}" in said and "malloc keeps up to 256 MiB freed" in said
    assert n < 1_000, (n, said)
    n, said = faults("reader", {"MALLOC_TRIM_THRESHOLD_": str(1 << 20)}, addr)
    assert "malloc as the environment sets it (MALLOC_TRIM_THRESHOLD_)" in said
    assert n > 20_000, n

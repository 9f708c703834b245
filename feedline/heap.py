"""Large batches and glibc's heap: keep freed memory for the next batch instead of giving it
back to the kernel and faulting it in again.

A daemon that makes or forwards batches of megabytes allocates and frees one per batch. glibc
serves such a block from the heap once one was freed (its mmap threshold rises to the block's
size), but gives the heap's free top back to the kernel whenever more than twice that is free
at once; the next batch then faults every page in again (4 KiB each, zeroed). Exact delivery
frees several batches together (a unit's, an epoch's end), and `benchmarks/exact.py` counted
5x the page faults of training mode in its producers and 14x in its broker, which cost the
fake pipeline about a tenth of its rate; with the thresholds below they are gone from the
producers. The broker keeps some (what libzmq's I/O thread receives comes from that thread's
own heap, which glibc hands back whole when it empties): one arena for every thread removed
those too, but made the broker's training path 4-6% slower, so it is not used
(docs/performance.md).

:func:`keep_freed_memory` sets the mmap threshold to glibc's largest (32 MiB: blocks up to
it come from the heap) and the trim threshold to :data:`TRIM_THRESHOLD` (the free top a
process keeps, at most). It does nothing if the environment sets glibc's malloc already
(``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``, ``GLIBC_TUNABLES``: the operator's
choice stands) or on another C library. Daemons call it at start (broker, producer, drain),
and so does a training process's I/O thread when it starts: a direct-mode trainer's serving
core (``RemoteDataZMQ(bind=True)``: it receives batches in libzmq's I/O thread as a broker
does; at 1 MB that thread's CPU per batch went from 251 to 134 us, docs/performance.md), and
a trainer that reads from a broker (its batches arrive the same way: 17-29 page faults a
1 MB batch without the thresholds, none with them; its CPU per GB -16%).
"""

from __future__ import annotations

import ctypes
import os

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # the largest glibc accepts on 64-bit
TRIM_THRESHOLD = 256 << 20  # freed heap a process keeps for its next batches, at most
_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")


def keep_freed_memory() -> str:
    """Set glibc's thresholds (see the module); returns what was done, in words."""
    given = [k for k in _ENV if k in os.environ]
    if given:
        return f"malloc as the environment sets it ({', '.join(given)})"
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION"):
            return "malloc unchanged (not glibc)"
        libc = ctypes.CDLL(None)
        ok = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 \
            and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    except (AttributeError, OSError, ValueError):
        return "malloc unchanged (not glibc)"
    if not ok:
        return "malloc unchanged (mallopt refused)"
    return f"malloc keeps up to {TRIM_THRESHOLD >> 20} MiB freed"


__all__ = ["TRIM_THRESHOLD", "keep_freed_memory"]

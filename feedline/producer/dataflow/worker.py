"""Who is iterating: the worker identity and the seeding rule shared by every random stage.

Randomness in feedline is a pure function of ``(seed, epoch, worker)``: a stage that draws
random numbers makes a fresh generator with :func:`make_rng` at the start of each pass. The
worker index is set by the parallel stages in the process or thread that runs the work
(:func:`set_worker`), before ``reset_state()``, so two runs with the same seed and the same
worker layout produce the same datapoints.

The identity lives in a ``threading.local``: threads of a :class:`MultiThreadMapData` each
see their own index; a forked process starts with the parent's and overwrites it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class WorkerInfo:
    """This worker's position among ``count`` workers (0 of 1 when not parallel)."""

    index: int = 0
    count: int = 1


_local = threading.local()


def get_worker() -> WorkerInfo:
    """The worker identity of the calling thread (0 of 1 outside any parallel stage)."""
    return getattr(_local, "info", None) or WorkerInfo()


def set_worker(info: WorkerInfo) -> None:
    """Set the calling thread's worker identity (parallel stages call this in their workers)."""
    _local.info = info


def make_rng(seed: int, epoch: int, worker: int | None = None) -> np.random.Generator:
    """The generator for one pass: a pure function of ``(seed, epoch, worker)``."""
    w = get_worker().index if worker is None else worker
    return np.random.default_rng([int(seed) & 0xFFFFFFFF, int(epoch), int(w)])

"""AutoMapData: a map function run by threads or processes, as many as measurement says.

What ``parallel: auto`` builds (docs/pipelines.md). It starts ``threads`` threads and
``procs`` forked processes (processes first: a fork never copies a running thread), and a
:class:`~feedline.producer.dataflow.autotune.ModeTuner` decides from measured periods which
kind runs the datapoints and how many of them: the others stay idle (a parked thread, a
process blocked on its socket). Switching kinds loses nothing: results of datapoints already
sent to the other kind are still collected.

Unordered only (results come out as they finish): a stage whose workers change cannot give
a reproducible order; ``parallel.strict`` needs a fixed ``workers``.

:class:`InlineMapData` is what ``parallel: auto`` builds on a budget of one CPU: the map
steps are CPU work (decode, augment), and with one CPU no worker runs beside the producer's
own thread, so a worker only adds its hand-over (measured: 0.89x of the pipeline run in the
producer's thread, docs/performance.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from feedline.producer.dataflow.autotune import AutoWorkers
from feedline.producer.dataflow.base import DataFlow
from feedline.producer.dataflow.map_data import MapData
from feedline.producer.dataflow.multi_process_map_data import MultiProcessMapData
from feedline.producer.dataflow.multi_thread_map_data import MultiThreadMapData
from feedline.producer.dataflow.parallel_map import ParallelMapBase


class AutoMapData(ParallelMapBase):
    """``MapData(ds, func)`` on up to ``threads`` threads or ``procs`` processes, chosen and
    counted by ``autotune``. Workers ``0 .. threads-1`` are the threads, the next ``procs``
    the processes. ``on_error`` and ``buffer_size`` as in the other parallel maps."""

    def __init__(self, ds: DataFlow, func: Callable[[Any], Any], threads: int, procs: int,
                 autotune: AutoWorkers, buffer_size: int = 64, on_error: str = "raise") -> None:
        super().__init__(ds, threads + procs, buffer_size, False, on_error, autotune)
        self.threads = MultiThreadMapData(ds, threads, func, buffer_size, False, on_error)
        self.procs = MultiProcessMapData(ds, procs, func, buffer_size, False, on_error)
        self._pending = [0, 0]  # datapoints sent to the threads / processes, not back yet
        self.mode = ""
        self._apply(*autotune.setting)

    def _pool(self, worker: int) -> tuple[int, ParallelMapBase, int]:
        n = self.threads.num_workers
        return (0, self.threads, worker) if worker < n else (1, self.procs, worker - n)

    def _apply(self, mode: str, workers: int) -> None:
        self.mode = mode
        if mode == "thread":
            self.first, self.active = 0, max(1, min(self.threads.num_workers, workers))
            self.threads.active = self.active
        else:
            self.first = self.threads.num_workers
            self.active = max(1, min(self.procs.num_workers, workers))
            self.threads.active = 0  # threads park; thread 0 first finishes what is queued

    def _start(self) -> None:
        for pool in (self.procs, self.threads):  # fork first: before our threads exist
            pool._start()
            pool._started = True
        self._pending = [0, 0]

    def _send(self, worker: int, job: tuple) -> None:
        i, pool, w = self._pool(worker)
        self._pending[i] += 1
        pool._send(w, job)

    def _recv(self, timeout: float) -> tuple | None:
        cur = 0 if self.mode == "thread" else 1
        order = [(1 - cur, 0.0), (cur, timeout)] if self._pending[1 - cur] else [(cur, timeout)]
        for i, wait in order:
            res = (self.threads, self.procs)[i]._recv(wait)
            if res is not None:
                self._pending[i] -= 1
                return res
        return None

    def _flush(self) -> None:
        self.procs._flush()

    def _check_alive(self) -> None:
        self.procs._check_alive()

    def close(self) -> None:
        self.threads.close()
        self.procs.close()
        self._started = False
        super().close()


class InlineMapData(MapData):
    """``MapData`` that ``parallel: auto`` chose (one CPU): no workers, and why (``note``,
    for the start-up line); ``mode`` and ``active`` as the parallel maps report them."""

    mode = "none"
    active = 0

    def __init__(self, ds: DataFlow, func: Callable[[Any], Any], note: str,
                 on_error: str = "raise") -> None:
        super().__init__(ds, func, on_error)
        self.note = note

"""MultiThreadMapData: a map function run by a pool of threads (for I/O or GIL-free work)."""

from __future__ import annotations

import copy
import queue
import threading
import traceback
from collections.abc import Callable
from typing import Any

from feedline.producer.dataflow.autotune import AutoWorkers
from feedline.producer.dataflow.base import DataFlow
from feedline.producer.dataflow.map_data import apply, reseed
from feedline.producer.dataflow.parallel_map import ERR, OK, SKIP, ParallelMapBase
from feedline.producer.dataflow.worker import WorkerInfo, set_worker


class MultiThreadMapData(ParallelMapBase):
    """``MapData(ds, func)`` with ``num_thread`` threads; see :mod:`.parallel_map` for
    ``strict`` (ordered, exactly once) vs unordered, and ``buffer_size`` (the bound on
    datapoints in flight). Each thread gets its own deep copy of ``func`` (its own random
    state, seeded by (seed, epoch, thread index)). ``on_error`` as in :class:`MapData`.
    Worth it when ``func`` releases the GIL (OpenCV, file reads); call :meth:`close` (or use
    ``with``) to stop the threads.
    """

    mode = "thread"

    def __init__(self, ds: DataFlow, num_thread: int, func: Callable[[Any], Any],
                 buffer_size: int = 64, strict: bool = False, on_error: str = "raise",
                 autotune: AutoWorkers | None = None) -> None:
        super().__init__(ds, num_thread, buffer_size, strict, on_error, autotune)
        self.func = func
        self._threads: list[threading.Thread] = []
        self._stop = threading.Event()

    def _start(self) -> None:
        self._stop = threading.Event()
        cap = -(-self.buffer_size // self.num_workers)
        # Strict: one queue per thread (datapoint i -> thread i % n); else one shared queue.
        nq = self.num_workers if self.strict else 1
        size = self.buffer_size if nq == 1 else cap
        self._in: list[queue.Queue] = [queue.Queue(maxsize=size) for _ in range(nq)]
        self._out: queue.Queue = queue.Queue(maxsize=self.buffer_size)
        self._threads = [
            threading.Thread(target=self._run, args=(k,), daemon=True, name=f"map-thread-{k}")
            for k in range(self.num_workers)
        ]
        for t in self._threads:
            t.start()

    def _run(self, k: int) -> None:
        set_worker(WorkerInfo(k, self.num_workers))
        func = copy.deepcopy(self.func)
        inq = self._in[k if self.strict else 0]
        epoch = None
        while not self._stop.is_set():
            # Parked by the tuner (parallel: auto); thread 0 never is: with the datapoints
            # going to processes it finishes those that were queued for threads.
            if k >= max(1, self.active):
                self._stop.wait(0.05)
                continue
            try:
                gen, ep, i, dp = inq.get(timeout=0.2)
            except queue.Empty:
                continue
            if ep != epoch:
                reseed(func, ep)
                epoch = ep
            try:
                out, skipped = apply(func, dp, self.on_error)
                res = (SKIP if skipped else OK, gen, i, k, out)
            except Exception:
                res = (ERR, gen, i, k, traceback.format_exc())
            while not self._stop.is_set():
                try:
                    self._out.put(res, timeout=0.2)
                    break
                except queue.Full:
                    continue

    def _send(self, worker: int, job: tuple) -> None:
        self._in[worker if self.strict else 0].put(job)

    def _recv(self, timeout: float) -> tuple | None:
        try:
            return self._out.get(timeout=timeout)  # type: ignore[no-any-return]
        except queue.Empty:
            return None

    def close(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(5)
        self._threads = []
        self._started = False
        super().close()

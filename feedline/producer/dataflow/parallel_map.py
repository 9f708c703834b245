"""The dispatch loop shared by MultiThreadMapData and MultiProcessMapData.

The iterating thread reads the input, hands each datapoint (with its index and the pass
number) to a worker, and collects results. At most ``buffer_size`` datapoints are in flight,
so every queue between the stage and its workers is bounded.

- ``strict=True`` (ordered): datapoint ``i`` goes to worker ``i % n`` and results come out in
  input order, every input exactly once (a dropped/skipped one leaves no gap). Which worker
  saw what is fixed, so with a fixed seed the output is reproducible: use it for validation.
- ``strict=False`` (unordered, the default): a datapoint goes to the least busy worker and
  results come out as they finish: the fastest mode, for training.

Unordered stages can tune their worker count (``parallel: auto``): with ``autotune``
(:class:`~feedline.producer.dataflow.autotune.AutoWorkers`) all ``num_workers`` workers start,
and datapoints go to the first :attr:`active` of them, a number the tuner sets from measured
periods (the others idle: a thread waits, a process blocks on its socket).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

from feedline.errors import ConfigError
from feedline.producer.dataflow.autotune import AutoWorkers
from feedline.producer.dataflow.base import DataFlow, ProxyDataFlow
from feedline.producer.dataflow.errors import WorkerError, check_policy

log = logging.getLogger(__name__)
# Result kinds sent back by workers: (kind, generation, index, worker, payload).
OK, SKIP, ERR = "ok", "skip", "err"
DRAIN_SECONDS = 30.0


class ParallelMapBase(ProxyDataFlow):
    """Subclasses start workers and implement ``_start``, ``_send``, ``_recv``, ``close``."""

    mode = ""  # "thread" or "process": what a worker is (the metrics' label)

    def __init__(self, ds: DataFlow, num_workers: int, buffer_size: int, strict: bool,
                 on_error: str, autotune: AutoWorkers | None = None) -> None:
        super().__init__(ds)
        if not isinstance(num_workers, int) or num_workers < 1:
            raise ConfigError(f"num_workers must be an int >= 1, got {num_workers!r}")
        if not isinstance(buffer_size, int) or buffer_size < num_workers:
            raise ConfigError(f"buffer_size must be an int >= num_workers ({num_workers}), "
                             f"got {buffer_size!r}")
        self.num_workers, self.buffer_size, self.strict = num_workers, buffer_size, strict
        if autotune is not None and strict:
            raise ConfigError("autotune changes the workers a datapoint goes to: not with "
                             "strict (ordered, reproducible) output")
        self.auto = autotune
        # Datapoints go to workers first .. first + active - 1 (all of them unless tuned).
        self.first = 0
        self.active = min(num_workers, autotune.setting[1]) if autotune else num_workers
        self.name = ""  # the stage's label, for the tuner's log lines
        self.on_error = check_policy(on_error)
        self.skipped = 0
        self._epoch = 0
        self._generation = 0
        self._started = False
        self._refill = 1

    # -- for subclasses --------------------------------------------------------------
    def _start(self) -> None:
        raise NotImplementedError

    def _send(self, worker: int, job: tuple) -> None:
        raise NotImplementedError

    def _recv(self, timeout: float) -> tuple | None:
        """The next result, or None after ``timeout`` seconds (then liveness is checked)."""
        raise NotImplementedError

    def _check_alive(self) -> None:
        """Raise WorkerError if a worker is gone."""

    def _flush(self) -> None:
        """Send jobs a subclass may have held back to batch them (called before waiting)."""

    # -- the contract ------------------------------------------------------------------
    def reset_state(self) -> None:
        super().reset_state()
        self._epoch = 0
        if not self._started:
            self._start()
            self._started = True

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: S110 - interpreter shutdown: nothing left to report to
            pass

    def _wait(self) -> tuple:
        self._flush()
        t0 = time.monotonic()
        while True:
            res = self._recv(0.2)
            if res is not None:
                break
            self._check_alive()
        if self.auto is not None:
            now = time.monotonic()
            self.auto.waited(now - t0)
            self._apply(*self.auto.result(now))
            for change in self.auto.changes:
                log.info("%s: %s", self.name or type(self).__name__, change)
            self.auto.changes.clear()
        return res

    def _apply(self, mode: str, workers: int) -> None:
        """Use ``workers`` workers from now on (a stage of one mode ignores ``mode``)."""
        self.active = max(1, min(self.num_workers, workers))

    def __iter__(self) -> Iterator[Any]:
        if not self._started:
            self.reset_state()
        self._generation += 1
        gen, epoch = self._generation, self._epoch
        self._epoch += 1
        n, cap = self.num_workers, -(-self.buffer_size // self.num_workers)
        inflight = [0] * n
        total = 0
        pending: dict[int, Any] = {}
        assigned: dict[int, int] = {}  # index -> the worker it was counted against
        next_out = 0
        it = iter(self.ds)
        idx = 0
        exhausted = False
        try:
            while True:
                # Refill in runs of `_refill` (a subclass's message size), not one by one
                # as results trickle in: one message per datapoint costs wake-ups.
                room = self.buffer_size - total
                while not exhausted and total < self.buffer_size and \
                        (room >= self._refill or total == 0):
                    if self.strict:
                        w = idx % n
                    else:
                        w = min(range(self.first, self.first + self.active),
                                key=inflight.__getitem__)
                    if inflight[w] >= cap:
                        break
                    try:
                        dp = next(it)
                    except StopIteration:
                        exhausted = True
                        break
                    self._send(w, (gen, epoch, idx, dp))
                    assigned[idx] = w
                    inflight[w] += 1
                    total += 1
                    idx += 1
                if exhausted and total == 0:
                    break
                kind, g, i, w, payload = self._wait()
                if g != gen:
                    continue  # a result of an abandoned pass (already drained): ignore
                # A shared thread queue may hand a job to another worker than the one it
                # was counted against: uncount it where it was counted.
                inflight[assigned.pop(i)] -= 1
                total -= 1
                if kind == ERR:
                    raise WorkerError(f"worker {w} failed on datapoint {i}", payload)
                if kind == SKIP:
                    self.skipped += 1
                    payload = None
                if not self.strict:
                    if payload is not None:
                        yield payload
                    continue
                pending[i] = payload
                while next_out in pending:
                    out = pending.pop(next_out)
                    next_out += 1
                    if out is not None:
                        yield out
        finally:
            if total and self._started and gen == self._generation:
                self._drain(gen, total)

    def _drain(self, gen: int, total: int) -> None:
        """Collect the results still in flight of an abandoned pass, so queues stay bounded."""
        import time

        deadline = time.monotonic() + DRAIN_SECONDS
        while total and time.monotonic() < deadline:
            res = self._recv(0.2)
            if res is None:
                if self._dead():
                    break
                continue
            if res[1] == gen:
                total -= 1
        if total:  # workers stuck or dead: start afresh on the next pass
            self.close()

    def _dead(self) -> bool:
        try:
            self._check_alive()
        except WorkerError:
            return True
        return False

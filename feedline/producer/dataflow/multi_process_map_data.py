"""MultiProcessMapData: a map function run by forked worker processes over ZeroMQ IPC."""

from __future__ import annotations

import collections
import os
import traceback
from collections.abc import Callable
from typing import Any

import zmq

from feedline.errors import ConfigError
from feedline.producer.dataflow import ipc
from feedline.producer.dataflow.autotune import AutoWorkers
from feedline.producer.dataflow.base import DataFlow
from feedline.producer.dataflow.errors import WorkerError
from feedline.producer.dataflow.map_data import apply, reseed
from feedline.producer.dataflow.parallel_map import ERR, OK, SKIP, ParallelMapBase
from feedline.producer.dataflow.worker import WorkerInfo, set_worker

STOP = "stop"


def _worker(k: int, n: int, func: Callable[[Any], Any], on_error: str, in_ep: str,
            out_ep: str, hwm: int, parent_pid: int) -> None:
    """Worker ``k``: receive jobs on ``in_ep``, send results to ``out_ep`` until told to stop
    or until the parent is gone. Runs in a forked child: a fresh context."""
    set_worker(WorkerInfo(k, n))
    ctx = zmq.Context()
    inq = ipc.socket(ctx, zmq.PULL, hwm)
    out = ipc.socket(ctx, zmq.PUSH, hwm)
    inq.connect(in_ep)
    out.connect(out_ep)
    epoch = None
    try:
        while True:
            if not inq.poll(ipc.POLL_MS):
                if ipc.parent_gone(parent_pid):
                    return
                continue
            jobs = ipc.recv(inq)
            if jobs == STOP:
                return
            results = []
            for gen, ep, i, dp in jobs:
                if ep != epoch:
                    reseed(func, ep)
                    epoch = ep
                try:
                    res, skipped = apply(func, dp, on_error)
                    results.append((SKIP if skipped else OK, gen, i, k, res))
                except Exception:
                    results.append((ERR, gen, i, k, traceback.format_exc()))
            while not ipc.offer(out, results):
                if not out.poll(ipc.POLL_MS, zmq.POLLOUT) and ipc.parent_gone(parent_pid):
                    return
    finally:
        inq.close()
        out.close()
        ctx.term()


class MultiProcessMapData(ParallelMapBase):

    """``MapData(ds, func)`` with ``num_proc`` forked processes.

    The input is read in this process; datapoints and results travel over ZeroMQ ``ipc://``
    sockets (arrays without a copy into the message). At most ``buffer_size`` datapoints
    are in flight. See :mod:`.parallel_map` for ``strict`` (ordered, exactly once,
    reproducible) vs unordered (fastest). Worker ``k`` seeds ``func`` (if it has
    ``reseed``) with (seed, epoch, k). A worker's exception is raised here as
    :class:`~feedline.producer.dataflow.errors.WorkerError` carrying its traceback; a worker that
    dies
    is reported the same way. ``func`` is inherited through ``fork``, not pickled (lambdas
    work), but results must be picklable. Workers start in ``reset_state()``; :meth:`close`
    (or ``with``) stops them, and they exit by themselves if this process dies.
    """

    mode = "process"

    def __init__(self, ds: DataFlow, num_proc: int, func: Callable[[Any], Any],
                 buffer_size: int = 64, strict: bool = False, on_error: str = "raise",
                 chunk: int = 8, autotune: AutoWorkers | None = None) -> None:
        super().__init__(ds, num_proc, buffer_size, strict, on_error, autotune)
        if not isinstance(chunk, int) or chunk < 1:
            raise ConfigError(f"chunk must be an int >= 1, got {chunk!r}")
        self.func = func
        # Datapoints travel in messages of up to `chunk` (and results likewise): each
        # message costs wake-ups and context switches in both processes, so fewer is faster.
        self.chunk = chunk
        self._refill = min(chunk, max(1, buffer_size // 2))
        self._held: list[list[tuple]] = []
        self._results: collections.deque = collections.deque()
        self._procs: list[Any] = []
        self._ctx: zmq.Context | None = None
        self._pid = os.getpid()

    def _start(self) -> None:
        self._pid = os.getpid()
        self._eps = ipc.Endpoints()
        hwm = -(-self.buffer_size // self.num_workers) + 1
        ins = [self._eps(f"in-{k}") for k in range(self.num_workers)]
        out = self._eps("out")
        # Fork first: the children must not inherit a live context of ours.
        self._procs = ipc.fork_workers(
            _worker,
            lambda k: (k, self.num_workers, self.func, self.on_error, ins[k], out, hwm,
                       self._pid),
            self.num_workers, "map-worker",
        )
        self._ctx = zmq.Context()
        self._ins = []
        for ep in ins:
            s = ipc.socket(self._ctx, zmq.PUSH, hwm)
            s.bind(ep)
            self._ins.append(s)
        self._out = ipc.socket(self._ctx, zmq.PULL, self.buffer_size + 1)
        self._out.bind(out)
        self._held = [[] for _ in range(self.num_workers)]
        self._results.clear()

    def _check_alive(self) -> None:
        dead = ipc.dead_worker(self._procs)
        if dead:
            raise WorkerError(f"map worker died: {dead}")

    def _send(self, worker: int, job: tuple) -> None:
        held = self._held[worker]
        held.append(job)
        if len(held) >= self.chunk:
            self._send_held(worker)

    def _send_held(self, worker: int) -> None:
        sock = self._ins[worker]
        while not ipc.offer(sock, self._held[worker]):
            if not sock.poll(ipc.POLL_MS, zmq.POLLOUT):  # not yet connected, or gone
                self._check_alive()
        self._held[worker] = []

    def _flush(self) -> None:
        for w, held in enumerate(self._held):
            if held:
                self._send_held(w)

    def _recv(self, timeout: float) -> tuple | None:
        if not self._results:
            if not self._out.poll(int(timeout * 1000)):
                return None
            self._results.extend(ipc.recv(self._out))
        return self._results.popleft()  # type: ignore[no-any-return]

    def close(self) -> None:
        """Stop the workers and close the sockets (idempotent; only in the owning process)."""
        if not self._started or os.getpid() != self._pid:
            super().close()
            return
        self._started = False
        for s in self._ins:
            ipc.offer(s, STOP)
        ipc.stop_workers(self._procs, timeout=2.0)
        for s in [*self._ins, self._out]:
            s.close(linger=0)
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        self._eps.close()
        self._procs = []
        super().close()

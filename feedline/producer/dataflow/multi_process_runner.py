"""MultiProcessRunner: whole copies of a pipeline in forked processes, results gathered here."""

from __future__ import annotations

import os
import traceback
from collections.abc import Iterator
from typing import Any

import zmq

from feedline.errors import ConfigError
from feedline.producer.dataflow import ipc
from feedline.producer.dataflow.base import DataFlow, ProxyDataFlow, Shardable, stages
from feedline.producer.dataflow.errors import WorkerError
from feedline.producer.dataflow.shard import compose, source_of
from feedline.producer.dataflow.worker import WorkerInfo, set_worker

DATA, END, ERR = "data", "end", "err"
# Int attributes of the stages under a runner that count what happened (CountData.count, the
# map stages' skipped). The copies count in their processes; each message carries what they
# counted since the last one, and the runner adds it to its own stages (see _Counters).
COUNTERS = ("count", "skipped")


class _Counters:
    """The counters of the stages in ``ds``'s chain
    (:func:`~feedline.producer.dataflow.base.stages`),
    in chain order: the same list in the parent and in a forked copy, so deltas line up by
    position. A counter is an int instance attribute named in COUNTERS (not a property
    such as CountData's ``skipped``, which sums other stages'): read and written by name.
    Deltas start from the values at construction (a copy forked after earlier counts sends
    only its own)."""

    def __init__(self, ds: DataFlow) -> None:
        self.slots: list[tuple[DataFlow, str]] = []
        for s in stages(ds):
            attrs = vars(s)
            self.slots += [(s, a) for a in COUNTERS if isinstance(attrs.get(a), int)]
        self.last = [getattr(s, a) for s, a in self.slots]

    def deltas(self) -> tuple[int, ...] | None:
        """What was counted since the previous call (None: nothing)."""
        now = [getattr(s, a) for s, a in self.slots]
        if now == self.last:
            return None
        d = tuple(n - o for n, o in zip(now, self.last, strict=True))
        self.last = now
        return d

    def add(self, deltas: tuple[int, ...] | None) -> None:
        if deltas:
            for (s, a), d in zip(self.slots, deltas, strict=True):
                if d:
                    setattr(s, a, getattr(s, a) + d)


def _runner(k: int, n: int, ds: DataFlow, strict: bool, ctl_ep: str, out_ep: str, hwm: int,
            parent_pid: int) -> None:
    """Worker ``k``: strict: one pass over shard k of n per ``go``; else passes forever."""
    set_worker(WorkerInfo(k, n))
    counters = _Counters(ds)
    ctx = zmq.Context()
    ctl = ipc.socket(ctx, zmq.PULL, 4)
    out = ipc.socket(ctx, zmq.PUSH, hwm)
    ctl.connect(ctl_ep)
    out.connect(out_ep)

    def put(msg: tuple) -> bool:
        deltas = counters.deltas()
        while not ipc.offer(out, (*msg, deltas)):
            if out.poll(ipc.POLL_MS, zmq.POLLOUT):
                continue
            if ipc.parent_gone(parent_pid):
                return False
            if ctl.poll(0) and ipc.recv(ctl)[0] == "stop":
                return False
        return True

    try:
        if strict:
            src = source_of(ds)
            assert isinstance(src, Shardable)  # checked by MultiProcessRunner.__init__
            src.set_shard(*compose(src.shard, (k, n)))
        ds.reset_state()
        while True:
            if strict:
                while not ctl.poll(ipc.POLL_MS):
                    if ipc.parent_gone(parent_pid):
                        return
                cmd, gen = ipc.recv(ctl)
                if cmd == "stop":
                    return
            else:
                gen = 0
            for dp in ds:
                if not put((DATA, gen, k, dp)):
                    return
            if strict and not put((END, gen, k, None)):
                return
    except Exception:
        put((ERR, 0, k, traceback.format_exc()))
    finally:
        ctl.close()
        out.close()
        ctx.term()


class MultiProcessRunner(ProxyDataFlow):
    """Run ``num_proc`` forked copies of ``ds`` and yield what they produce, in any order.

    - ``strict=False`` (training): every worker iterates its own copy of ``ds`` again and
      again (give it a shuffling source: copies are seeded by worker index); one pass here
      is ``len(ds)`` datapoints, so ``ds`` must have a length. Workers never idle at pass
      boundaries.
    - ``strict=True`` (validation): worker ``k`` iterates shard ``k`` of ``num_proc`` of the
      source under ``ds`` (which must be :class:`~feedline.producer.dataflow.base.Shardable`:
      DataFromList, ImageFolder, LMDB), once per pass; a pass ends when every worker has
      finished, so every datapoint comes exactly once.

    Queues are bounded by ``queue_size`` (ZeroMQ high-water marks). A worker's exception is
    raised here as :class:`~feedline.producer.dataflow.errors.WorkerError` with its traceback.
    What the copies count in the stages of ``ds`` (their ``skipped``, a
    :class:`~feedline.producer.dataflow.CountData`'s ``count``) travels with their results and is
    added to those stages here: ``ds``'s counters read the sum over the workers of what
    has arrived.
    """

    def __init__(self, ds: DataFlow, num_proc: int, queue_size: int = 32,
                 strict: bool = False) -> None:
        super().__init__(ds)
        if not isinstance(num_proc, int) or num_proc < 1:
            raise ConfigError(f"num_proc must be an int >= 1, got {num_proc!r}")
        source = source_of(self.ds)
        if strict and not isinstance(source, Shardable):
            raise ConfigError(f"strict MultiProcessRunner needs a shardable source, not "
                             f"{type(source).__name__}")
        self.num_proc, self.queue_size, self.strict = num_proc, queue_size, strict
        self._procs: list[Any] = []
        self._started = False
        self._gen = 0
        self._pid = os.getpid()
        self._counters = _Counters(self.ds)

    def __len__(self) -> int:
        return len(self.ds)

    def reset_state(self) -> None:
        # The copies are reset in their own processes; nothing of ds is used here.
        if self._started:
            return
        if not self.strict:
            len(self.ds)  # fail early: a non-strict pass is len(ds) datapoints
        self._pid = os.getpid()
        self._eps = ipc.Endpoints()
        ctls = [self._eps(f"ctl-{k}") for k in range(self.num_proc)]
        out = self._eps("out")
        hwm = max(1, self.queue_size // self.num_proc)
        self._procs = ipc.fork_workers(
            _runner,
            lambda k: (k, self.num_proc, self.ds, self.strict, ctls[k], out, hwm, self._pid),
            self.num_proc, "runner",
        )
        self._ctx = zmq.Context()
        self._ctls = []
        for ep in ctls:
            s = ipc.socket(self._ctx, zmq.PUSH, 4)
            s.bind(ep)
            self._ctls.append(s)
        self._out = ipc.socket(self._ctx, zmq.PULL, self.queue_size)
        self._out.bind(out)
        self._started = True

    def _next(self) -> tuple:
        while not self._out.poll(ipc.POLL_MS):
            dead = ipc.dead_worker(self._procs)
            if dead:
                raise WorkerError(f"runner worker died: {dead}")
        kind, gen, k, payload, deltas = ipc.recv(self._out)
        self._counters.add(deltas)
        if kind == ERR:
            raise WorkerError(f"runner worker {k} failed", payload)
        return kind, gen, k, payload

    def __iter__(self) -> Iterator[Any]:
        if not self._started:
            self.reset_state()
        if not self.strict:
            for _ in range(len(self.ds)):
                yield self._next()[3]
            return
        self._gen += 1
        for s in self._ctls:
            while not ipc.offer(s, ("go", self._gen)):
                if not s.poll(ipc.POLL_MS, zmq.POLLOUT) and ipc.dead_worker(self._procs):
                    self._next()  # raises
        ended = 0
        while ended < self.num_proc:
            kind, gen, _, payload = self._next()
            if gen != self._gen:
                continue  # left over from an abandoned pass
            if kind == END:
                ended += 1
            else:
                yield payload

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: S110 - interpreter shutdown
            pass

    def close(self) -> None:
        """Stop the workers (idempotent; only in the owning process)."""
        if not self._started or os.getpid() != self._pid:
            super().close()
            return
        self._started = False
        for s in self._ctls:
            ipc.offer(s, ("stop", 0))
        ipc.stop_workers(self._procs, timeout=2.0)
        for s in [*self._ctls, self._out]:
            s.close(linger=0)
        self._ctx.term()
        self._eps.close()
        self._procs = []
        super().close()

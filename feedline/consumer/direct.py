"""Direct mode: the training process serves its producers itself, no broker in between.

``RemoteDataZMQ("tcp://0.0.0.0:7878", bind=True, curve=server_keys)`` runs the broker's
serving core (:class:`feedline.serving.server.Server`: the same endpoint, address checks,
protocol, registrations, credit in batches and bytes, leases, liveness, limits, refusals,
cut-offs, metrics, tensorpack ingress) in the consumer's I/O thread, with one difference:
accepted batches go straight into this process's queue. The budget is the consumer's own
(a :class:`~feedline.serving.budget.Budget` of ``window`` batches and ``max_bytes`` bytes,
queued here plus granted to producers). The same producers and pipeline files work
unchanged; ``--tensorpack-ingress``'s equivalent is ``DirectConfig(tensorpack=ADDR)``.

Use a broker instead to share one host between several training processes or to buffer
across trainer restarts (docs/tensorflow.md says when to use which).
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass

import zmq

from feedline.consumer.io import EpochMark, Marker, Shared
from feedline.errors import FeedlineError, ProducerError
from feedline.heap import keep_freed_memory
from feedline.protocol import messages as m
from feedline.protocol import wire
from feedline.protocol.bundle import MAX_BUNDLE
from feedline.security import ServerKeys
from feedline.serving.budget import Budget
from feedline.serving.held import Held
from feedline.serving.metrics import BrokerMetrics
from feedline.serving.server import (
    CREDIT_LEASE,
    DIRECT,
    MAX_PEERS,
    PRODUCER_WINDOW,
    Server,
    ServingConfig,
)
from feedline.transport.link import LinkConfig

log = logging.getLogger(__name__)
_PLAN_EVERY = 0.05  # seconds: the longest a credit plan waits when nothing was taken
_STREAMING = 0.02  # seconds since the last batch arrived: more are on the way


@dataclass(frozen=True)
class DirectConfig:
    """How a trainer in direct mode
    (``RemoteDataZMQ(addr, bind=True, options=ConsumerOptions(direct=...))``) serves its
    producers; the defaults are a broker's."""

    producer_window: int = PRODUCER_WINDOW  # most credit one producer holds at once
    credit_lease: float = CREDIT_LEASE  # credit unused this long is asked back when others wait
    max_producers: int = MAX_PEERS  # registered producers, at most
    tensorpack: str | None = None  # also accept tensorpack's send_dataflow_zmq here

    def serving(self, addr: str, budget: Budget, stream: str, link: LinkConfig,
                keys: ServerKeys | None, insecure: bool = False) -> ServingConfig:
        """The serving core's configuration of a trainer serving ``stream`` at ``addr`` (the
        one place it is derived): the budget is the consumer's own (``window`` batches and
        ``max_bytes`` bytes, queued here or granted), small batches counted by their bytes
        (``Setup.slots`` has room for them); liveness and limits are the consumer's link's;
        nothing lingers at close (the trainer is leaving)."""
        return ServingConfig(
            addr, budget, producer_window=self.producer_window, credit_lease=self.credit_lease,
            max_peers=self.max_producers, heartbeat_interval=link.heartbeat_interval,
            heartbeat_timeout=link.heartbeat_timeout, linger_ms=0, limits=link.limits,
            curve=keys, tensorpack=self.tensorpack, stream=stream, insecure=insecure,
            how=DIRECT, by_bytes=True, bundle=MAX_BUNDLE)


class _LocalSink:
    """Accepted batches go into the consumer's queue; what it holds is what it queued."""

    def __init__(self, shared: Shared) -> None:
        self.shared = shared

    def held(self) -> tuple[int, int]:
        s = self.shared
        with s.lock:
            return s.queue.qsize(), s.queued_bytes

    def read(self, stream: str) -> bool:
        return True  # the trainer itself

    def held_by_stream(self) -> dict[str, tuple[int, int]]:
        return {self.shared.setup.stream: self.held()}

    def accept(self, stream: str, item: Held) -> bool:
        if item.broadcast:
            self._control(m.decode(item.frames[0]))
            return True
        # Every ingress hands over the batch it decoded; one that did not is decoded here.
        # It weighs what the ingress weighed (item.nbytes); credit made the room.
        self.shared.deliver([item.batch if item.batch is not None
                             else wire.decode_batch(item.frames)], item.gap, 0, item.nbytes)
        return True

    def accept_batches(self, stream: str, batches: list[wire.Batch], gap: int) -> None:
        """A bundle's batches: counted and queued as :meth:`accept` would each, at once."""
        self.shared.deliver(batches, gap, 0)

    def epoch_end(self, stream: str, epoch: int) -> None:
        self.shared.queue.put_nowait(EpochMark(epoch))

    def producer_joined(self, stream: str, producer: str) -> None:
        pass  # an ERROR went to the trainer as it came: nothing is held for later

    def keys(self, stream: str) -> set[tuple[int, int, int]]:
        raise NotImplementedError("a direct-mode trainer is no host of a job served by several "
                                  "hosts (no --coordinator): nothing asks what it holds")

    def refused(self, detail: str) -> None:
        """Our own resume= was refused (another pipeline's cursor): the iterator raises it."""
        self.shared.queue.put_nowait(Marker(FeedlineError(f"resume= refused: {detail}")))

    def _control(self, msg: m.Message) -> None:
        s = self.shared
        if isinstance(msg, m.Eos):
            with s.lock:
                s.producer(msg.producer).finished = True
        elif isinstance(msg, m.Error):
            err = ProducerError(msg.producer, msg.message, msg.traceback)
            if s.setup.on_error == "raise":
                s.queue.put_nowait(Marker(err))
            else:
                log.error("%s", err)


class DirectIO:
    """The client loop's role for a trainer that serves its producers (I/O thread only):
    the serving core (:class:`feedline.serving.server.Server`) with this process's queue as
    its sink, its steps run by the consumer's client loop."""

    def __init__(self, ctx: zmq.Context, addr: str, link: LinkConfig, keys: ServerKeys | None,
                 shared: Shared, cfg: DirectConfig, metrics: BrokerMetrics,
                 insecure: bool = False) -> None:
        self.shared, self.link_cfg = shared, link
        self.metrics = metrics
        self._sink = _LocalSink(shared)
        setup = shared.setup
        self.server = Server(ctx, cfg.serving(addr, Budget(setup.window, setup.max_bytes),
                                              setup.stream, link, keys, insecure),
                             self._sink, metrics, random.getrandbits(62), log)
        self.ingress = self.server.producers
        self.endpoint = self.server.ingress.endpoint
        shared.io.collect_keys = True  # exact streams settle here as the model takes batches
        if shared.exact.resume is not None:  # set when the stream's first producer registers
            sink = self._sink
            self.ingress.exact.refuse = lambda _ident, reason, detail: sink.refused(detail)
            self.ingress.exact.cursor(b"", setup.stream, shared.exact.resume.encode(),
                                    time.monotonic())
        self._next_tick = 0.0
        self._next_plan = 0.0
        self._arrived = 0.0  # when a batch last arrived
        self._planned_taken = -1
        shared.io.answered = True  # nobody to answer us: we serve
        # As the broker does: batches of a megabyte or more reuse freed memory instead of
        # faulting pages in again (feedline.heap; the environment's MALLOC_* settings win).
        heap = keep_freed_memory()
        log.info("serving producers directly on %s%s; %s", self.endpoint,
                 f", tensorpack on {cfg.tensorpack}" if cfg.tensorpack else "", heap)

    # -- the loop's callbacks -----------------------------------------------------------
    def links(self) -> list:
        return []

    def sockets(self) -> list[zmq.Socket]:
        return self.server.sockets()

    def on_ready(self, ready: list[zmq.Socket]) -> None:
        if self.server.on_ready(ready):
            self._arrived = time.monotonic()

    def on_wake(self) -> None:
        pass  # on_tick follows in the same turn of the loop: one plan per turn is enough

    def _settle(self) -> None:
        s = self.shared
        with s.lock:
            keys, s.taken_keys = s.taken_keys, []
        coord = self.ingress.exact.get(s.setup.stream)
        if coord is None:
            return
        for key in keys:
            for epoch in coord.settle(key):
                self._sink.epoch_end(s.setup.stream, epoch)

    def on_tick(self) -> None:
        now = time.monotonic()
        self.server.awake(now)
        if now >= self._next_tick:
            self.server.tick(now)
            self._next_tick = now + self.link_cfg.heartbeat_interval / 4
            # The window in force: small batches count by their bytes.
            budget = self.ingress.planner.budget
            self.shared.setup.metrics.window.set(budget.max_batches)
            self.metrics.buffer_capacity_batches.set(budget.max_batches)
            self.metrics.buffer_capacity_bytes.set(budget.max_bytes)
        # Plan when it may grant more (feedline.serving.credit): an arrival left a producer
        # room for a top-up (``due``), or the model took ``wake`` batches (room freed) while
        # the last plan left one short (``blocked``); when something else happened; and every
        # 50 ms (credit leases run on the clock). Not after every batch that arrives or is
        # taken.
        s, planner = self.shared, self.ingress.planner
        io, model, stream = s.io, s.model, s.setup.stream
        while True:
            taken = model.taken
            if taken != self._planned_taken:
                self._settle()
            if self.ingress.dirty or planner.due or now >= self._next_plan or \
                    self.ingress.units.waiting() or \
                    (planner.blocked and taken - self._planned_taken >= planner.wake):
                self.ingress.dirty = False
                self._planned_taken = taken
                self._next_plan = now + _PLAN_EVERY
                self.ingress.plan(now)
            # Takes need not wake us while batches stream in (IOState.expecting), nor before
            # the one that makes a plan worth it (``wake`` after the last: the takes between
            # change nothing here) unless an exact stream settles each (IOState.wake_at); a
            # take that read the old values is seen here, as ``taken`` has grown since.
            io.expecting = (now - self._arrived < _STREAMING
                            and self.ingress.outstanding()[0] > 0)
            io.wake_at = 0 if self.ingress.exact.get(stream) is not None else \
                self._planned_taken + planner.wake
            if model.taken == taken:
                break

    def on_close(self) -> None:
        self.server.close()


"""The consumer's side of the client loop: what the I/O thread does with the broker's
messages, and the state it shares with the iterating thread.

:class:`Shared` is the only object both threads touch, in parts of one writer each: the
consumer's fixed setup, what the I/O thread writes (the link's state, per-producer
statistics), what the iterating thread writes (the batches the model took), and, under a
lock, a bounded queue of deliveries between them. :class:`ConsumerIO` runs in the I/O
thread: it decodes deliveries into the queue, returns credit (TAKEN) as the model takes
batches, and counts what it refuses. A delivery it refuses (malformed, or over this
process's limits) is counted as taken, so its credit returns to the broker instead of
shrinking the window for good.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import zmq
from prometheus_client import CollectorRegistry

from feedline.consumer.metrics import ConsumerMetrics
from feedline.errors import AddressError, FeedlineError, ProducerError
from feedline.exact import CursorKeeper
from feedline.heap import keep_freed_memory
from feedline.logs import RateLimitedLog
from feedline.protocol import bundle, wire
from feedline.protocol import messages as m
from feedline.protocol.bundle import MAX_BUNDLE
from feedline.protocol.refusals import CONSUMER_FATAL, Reason
from feedline.security import ClientKeys
from feedline.serving.budget import depth, report_after
from feedline.transport.client import ClientLoop, Waker
from feedline.transport.handover import Inbox
from feedline.transport.link import KeysHint, Link, LinkConfig, Reach

log = logging.getLogger(__name__)


@dataclass
class ProducerStats:
    """What this consumer saw of one producer."""

    received: int = 0
    bytes: int = 0
    lost: int = 0  # batches the broker saw missing from this producer's sequence
    finished: bool = False  # the producer sent end-of-stream


@dataclass(slots=True)  # not frozen: a frozen __init__ cost 1.0 us a batch, this 0.2
class Delivery:
    registration: int  # the registration it was delivered under (credit counts per one)
    batch: wire.Batch
    nbytes: int = 0  # its wire size: what this process's byte budget counts


@dataclass(frozen=True)
class Marker:
    """An exception to raise in the iterating thread, in order with the batches."""

    exc: BaseException


@dataclass(frozen=True)
class EpochMark:
    """Exact delivery: every batch of ``epoch`` was taken (by some consumer of the stream)."""

    epoch: int


_MAX_PRODUCERS = 4096  # per-producer statistics kept, at most
_STREAMING = 0.02  # seconds since the last delivery arrived: more are on the way
_EXPECTING_POLL_MS = 5  # the loop's longest sleep while takes are left for arrivals to report
# What a consumer is told to give a broker with CURVE keys (Link.explain).
KEYS_HINT = KeysHint("CURVE keys (curve=ClientKeys.load(secret, broker_key), on ipc:// too; "
                     "feedline keys generate makes them)", "the broker_key of ClientKeys.load")


@dataclass(frozen=True)
class Setup:
    """Who this consumer is and what it registers with: fixed when its RemoteDataZMQ is made
    (and kept by :meth:`Shared.fresh`), so either thread reads it without the lock."""

    consumer_id: str
    session: int
    window: int
    max_bytes: int
    stream: str
    on_error: str
    registry: CollectorRegistry
    metrics: ConsumerMetrics
    # The most batches the window lets in: ``window``; in direct mode more, when they are
    # small (the budget counts them by bytes: feedline.serving.budget.depth).
    slots: int


class IOState:
    """What the I/O thread writes, and no other: the link's state, for the iterating thread
    to read (for a timeout's message, or to know whether a take wakes the I/O thread)."""

    def __init__(self) -> None:
        self.registration = 0  # the current one (written under Shared.lock: took reads it)
        self.answered = False  # a broker has accepted a registration of ours
        self.refusal: m.Refused | None = None
        self.fatal: tuple[str, str] | None = None  # a refusal raised to the iterator
        # What the link knows of the broker (read by the iterating thread for a timeout's
        # message): None in direct mode, or before the I/O thread started.
        self.reach: Reach | None = None
        self.explain: Callable[[], str] | None = None  # Link.explain (plain reads only)
        # Per producer (written under Shared.lock: the iterating thread copies them there).
        self.stats: dict[str, ProducerStats] = {}
        # Direct mode: the iterating thread keeps the keys of the exact batches it takes in
        # Shared.taken_keys, for the I/O thread to settle (set before the first take).
        self.collect_keys = False
        # A take needs no turn of the I/O thread's loop while batches are on their way (granted,
        # or room at the broker), ``expecting``, nor before ModelState.taken reaches ``wake_at``
        # (the take that makes a credit plan or a report worth it: plenty is still queued
        # here). Written by the I/O thread before it reads ``taken`` again; read by
        # Shared.took after ``taken`` grew, so that a take that read the old values is seen
        # by the I/O thread's next read.
        self.expecting = False
        self.wake_at = 0


class ModelState:
    """What the iterating thread writes (as the model takes batches), and no other; the I/O
    thread reads it to report takes (TAKEN) and to plan credit."""

    def __init__(self, waited: float = 0.0) -> None:
        # Batches the model took in this run, each of the registration current when it was
        # taken (written under Shared.lock; the I/O thread counts a registration's from where
        # this stood when it registered).
        self.taken = 0
        self.waited = waited  # seconds the model waited for data, ever: reported with TAKEN


class Shared:
    """State shared by the iterating thread and the I/O thread, in parts of one owner each:

    - ``setup`` (:class:`Setup`): fixed;
    - ``io`` (:class:`IOState`): written by the I/O thread;
    - ``model`` (:class:`ModelState`): written by the iterating thread;
    - ``exact`` (:class:`~feedline.exact.CursorKeeper`), and the hand-over between the two
      (``queue``, the bytes it holds, the exact keys taken): used under ``lock``;
    - ``waker``, ``loop``, ``closed``: the handles of its
      :class:`~feedline.consumer.remote.RemoteDataZMQ`.
    """

    def __init__(self, consumer_id: str, session: int, window: int, max_bytes: int,
                 stream: str, on_error: str, registry: CollectorRegistry,
                 metrics: ConsumerMetrics | None = None, slots: int | None = None) -> None:
        self.setup = setup = Setup(consumer_id, session, window, max_bytes, stream, on_error,
                                   registry, metrics or ConsumerMetrics(registry),
                                   slots or window)
        self.io = IOState()
        self.model = ModelState()
        self.lock = threading.Lock()
        # Exact delivery: what this process took of the current epoch, the last of it and the
        # checkpoint it resumes from (feedline.exact.keeper; under the lock).
        self.exact = CursorKeeper(stream, setup.slots)
        # The hand-over. 2 windows: old registrations' batches may sit here after a broker
        # restart. The I/O thread wakes the iterating thread once per loop turn (Inbox.flush).
        self.queue: Inbox[Any] = Inbox(maxsize=2 * setup.slots + 64)
        setup.metrics.local_queue.set_function(self.queue.qsize)
        setup.metrics.window.set(window)
        # Under the lock, from both threads: the wire bytes of the deliveries waiting in the
        # queue, and (direct mode) the keys of the exact batches taken since the I/O thread
        # last settled them.
        self.queued_bytes = 0
        self.taken_keys: list[tuple[int, int, int]] = []
        # The RemoteDataZMQ's: set before the I/O thread starts; ``closed`` by close() (any
        # thread) or its finalizer.
        self.waker: Waker | None = None
        self.loop: ClientLoop | None = None
        self.closed = False

    def fresh(self) -> Shared:
        """A new run (iterating again after close): same setup and metrics, new state; the
        cursor goes on (what was taken stays taken), and so does the time waited."""
        s = self.setup
        out = Shared(s.consumer_id, s.session, s.window, s.max_bytes, s.stream, s.on_error,
                     s.registry, s.metrics, s.slots)
        out.exact = self.exact
        out.model = ModelState(self.model.waited)
        return out

    def took(self, item: Delivery) -> bool:
        """Called by the iterating thread for each batch the model takes; False (not to be
        given to the model) for an exact batch delivered under a registration the broker
        has dropped: it serves that batch again, and taking it would count it twice."""
        b, io, model = item.batch, self.io, self.model
        with self.lock:
            self.queued_bytes -= item.nbytes
            if b.unit >= 0 and not io.collect_keys and item.registration != io.registration:
                return False
            if b.unit >= 0:
                # Before it is counted: a batch of another pipeline than the one this process
                # took from raises here, and, not reported taken, is served again to a
                # consumer of the new pipeline once this one closes (before, it was settled:
                # lost to the new job's epoch).
                self.exact.check(b.pipeline)
            if item.registration == io.registration:
                model.taken += 1
            if b.unit >= 0 and self.exact.seen(b.epoch, b.unit, b.index):
                # Exact: we took this one before (served again after a broker restart, before
                # our report reached it): acknowledged, not given to the model twice.
                if self.waker is not None:
                    self.waker.wake()
                return False
            if b.unit >= 0:
                self.exact.take(b.epoch, b.unit, b.index, b.pipeline)
                if io.collect_keys:
                    self.taken_keys.append(b.key)
        if self.waker is not None and not io.expecting and model.taken >= io.wake_at:
            self.waker.wake()  # the I/O thread reports it taken (TAKEN) now
        return True

    def stats_copy(self) -> dict[str, ProducerStats]:
        with self.lock:
            return {k: replace(v) for k, v in self.io.stats.items()}

    def deliver(self, batches: list[wire.Batch], gap: int, registration: int,
                weighed: int = 0) -> None:
        """Count one producer's ``batches`` (``gap`` lost before the first) and queue them
        for the model, tagged with the registration they came under (0: direct mode), each
        weighing its wire bytes or ``weighed`` (one batch as its ingress weighed it: a
        tensorpack message's). The I/O thread calls it, having made sure the queue has
        room."""
        nbytes = sum([b.nbytes for b in batches])
        with self.lock:
            st = self.producer(batches[0].producer)
            st.received += len(batches)
            st.bytes += nbytes
            st.lost += gap
            self.queued_bytes += weighed or sum([b.wire_bytes for b in batches])
        metrics = self.setup.metrics
        metrics.received_batches.inc(len(batches))
        metrics.received_bytes.inc(nbytes)
        if gap:
            metrics.lost_batches.inc(gap)
        put = self.queue.put_nowait
        for b in batches:
            put(Delivery(registration, b, weighed or b.wire_bytes))

    def producer(self, pid: str) -> ProducerStats:
        """The stats entry of ``pid`` (the I/O thread, with the lock held); bounded in
        number."""
        stats = self.io.stats
        st = stats.get(pid)
        if st is None:
            if len(stats) >= _MAX_PRODUCERS:
                stats.pop(next(iter(stats)))
            st = stats[pid] = ProducerStats()
        return st


class ConsumerIO:
    """The consumer's role in the client loop (runs in the I/O thread only)."""

    def __init__(self, ctx: zmq.Context, addr: str, cfg: LinkConfig,
                 curve: ClientKeys | None, shared: Shared) -> None:
        self.shared, self.limits = shared, cfg.limits
        self._reject_log = RateLimitedLog(log)
        self._base = 0  # ModelState.taken when this registration began: its takes are past it
        self._refused = 0  # deliveries of this registration refused here: taken, for credit
        self._reported = 0  # the last TAKEN total sent
        self._arrived = 0  # deliveries of this registration that arrived (refused included)
        self._largest = 0  # wire bytes of its largest delivery: the broker's unit for it
        self._arrived_at = 0.0  # when the last one did
        self.link = Link(ctx, addr, self._hello, cfg, curve=curve,
                         on_register=self._on_register, on_reject=self._count_reject,
                         rcvhwm=2 * shared.setup.slots + 64,
                         what=f"consumer {shared.setup.consumer_id}", keys_hint=KEYS_HINT)
        shared.io.reach, shared.io.explain = self.link.reach, self.link.explain
        # libzmq receives into glibc's heap, which gave its free top back and faulted it in
        # again (17-29 page faults a 1 MB batch): keep it, as the daemons do (feedline.heap).
        log.info("reading from %s; %s", addr, keep_freed_memory())

    def _hello(self, registration: int) -> m.ConsumerHello:
        s = self.shared
        with s.lock:
            # Exact delivery: the checkpoint to resume from (until a broker took it), else
            # what we took last of this epoch, so that a restarted broker knows it too.
            cursor = s.exact.hello_cursor()
        me = s.setup
        return m.ConsumerHello(consumer=me.consumer_id, session=me.session, window=me.window,
                               max_bytes=me.max_bytes, stream=me.stream,
                               registration=registration, cursor=cursor, bundle=MAX_BUNDLE)

    def _on_register(self, registration: int) -> None:
        s = self.shared
        with s.lock:
            s.io.registration = registration
            self._base = s.model.taken  # its takes are counted from here
            s.io.wake_at = 0
        self._refused = self._reported = self._arrived = self._largest = 0
        s.setup.metrics.window.set(s.setup.window)

    def _count_reject(self, reason: str) -> None:
        self.shared.setup.metrics.rejected.labels(reason).inc()

    # -- the loop's callbacks -----------------------------------------------------------
    def sockets(self) -> list[zmq.Socket]:
        return []

    def on_ready(self, ready: list[zmq.Socket]) -> None:
        pass

    def links(self) -> list[Link]:
        return [self.link]

    def on_message(self, link: Link, msg: m.Message, frames: list[zmq.Frame]) -> None:
        s, io = self.shared, self.shared.io
        if isinstance(msg, m.Welcome):
            io.answered, io.refusal = True, None
        elif isinstance(msg, m.EpochEnd):
            self._put(EpochMark(msg.epoch))
        elif isinstance(msg, m.Deliver):
            self._deliver(msg, frames)
        elif isinstance(msg, m.Eos):
            with s.lock:
                s.producer(msg.producer).finished = True
        elif isinstance(msg, m.Error):
            err = ProducerError(msg.producer, msg.message, msg.traceback)
            if s.setup.on_error == "raise":
                self._put(Marker(err))
            else:
                log.error("%s", err)
        elif isinstance(msg, m.Refused):
            if not link.welcomed:
                io.refusal = msg
            self._reject_log.warning("the broker refused a message of ours: %s %s",
                                     msg.reason, msg.detail)
            if msg.reason in CONSUMER_FATAL and io.fatal != (msg.reason, msg.detail):
                io.fatal = (msg.reason, msg.detail)
                text = f"the broker at {link.addr} refused this consumer ({msg.reason}): " \
                    f"{msg.detail}"
                # wrong_port: a producers' address (a broker's ingress, a direct-mode trainer):
                # the address is the mistake, as a ConfigError (ValueError) says.
                self._put(Marker(AddressError(text) if msg.reason == Reason.WRONG_PORT
                                 else FeedlineError(text)))
        else:
            self._count_reject("unexpected_kind")

    def _deliver(self, env: m.Deliver, frames: list[zmq.Frame]) -> None:
        s = self.shared
        registration = env.registration or self.link.registration
        n = 1
        try:
            header = wire.header_map(frames[0], self.limits)
            if header["k"] == wire.Kind.BUNDLE:  # several batches (feedline.protocol.bundle)
                count = header.get("n")
                n = count if type(count) is int and 1 <= count <= MAX_BUNDLE else 1
                batches = bundle.decode_bundle(frames, self.limits, header, MAX_BUNDLE)
            else:
                batches = [wire.decode_batch(frames, self.limits, header=header)]
        except wire.DecodeError as e:
            self._count_reject(e.reason)
            self._reject_log.warning("refused a batch from the broker: %s", e)
            batches = []
        finally:
            if registration == self.link.registration:
                self._arrived += n
                self._arrived_at = time.monotonic()
        if not batches:
            self._refused += n  # its credit returns all the same
            return
        # The window in force, as the broker counts it (Consumer.in_force): small batches by
        # their bytes, an exact stream's one each. A bundle's first batch is its largest.
        first = batches[0]
        if first.wire_bytes > self._largest and first.unit < 0:
            self._largest = first.wire_bytes
            s.setup.metrics.window.set(depth(s.setup.window, self._largest))
        q = s.queue
        if len(q) + len(batches) > q.maxsize:  # only if the broker ignored our window
            self._count_reject("over_window")
            self._refused += len(batches)
            return
        # Tagged with the registration it came under: an earlier one's batch (in the pipe when
        # we registered again) is data, but its credit is of a registration no longer counted.
        s.deliver(batches, env.gap, registration)

    def _put(self, item: Any) -> None:
        """A marker (an epoch's end, a producer's error), in order with the batches."""
        q = self.shared.queue
        if len(q) >= q.maxsize:
            self._count_reject("over_window")
            return
        q.put_nowait(item)

    def on_wake(self) -> None:
        self._report()

    def on_tick(self) -> None:
        self._report()

    def _report(self) -> None:
        """Return credit: TAKEN with the batches taken (or refused) under this registration,
        one cumulative total for every take since the last report.

        Takes do not wake this thread while more deliveries are expected (``expecting``): the
        broker has room for more by our count (arrived and not reported is under the window),
        and one arrived within ``_STREAMING``. The next arrival then reports them all; if none
        comes (the broker's byte budget stopped it), :meth:`poll_timeout_ms` keeps the wait
        short. Nor while the queue is over three quarters full (the model is the slower
        side): a report waits for :func:`~feedline.serving.budget.report_after` takes, every
        take for an exact stream (no ``_largest``: its epoch ends on reports)."""
        s, io, model = self.shared, self.shared.io, self.shared.model
        if not self.link.welcomed:
            io.expecting = False
            io.wake_at = 0
            return
        while True:
            taken = model.taken
            total = taken - self._base + self._refused
            if total != self._reported and self.link.send_msg(
                    m.Taken(taken=total, registration=self.link.registration,
                            waited=int(model.waited * 1e6))):
                self._reported = total
            window = depth(s.setup.window, self._largest)
            io.expecting = (self._arrived - self._reported < window
                            and time.monotonic() - self._arrived_at < _STREAMING)
            io.wake_at = taken + (report_after(len(s.queue), window) if self._largest else 1)
            if model.taken == taken:  # a take that read the old flag is seen here
                return

    def poll_timeout_ms(self) -> int | None:
        """The loop's longest sleep: short while takes may wait for an arrival to report."""
        return _EXPECTING_POLL_MS if self.shared.io.expecting else None

    def on_close(self) -> None:
        self.link.send_msg(m.Bye())

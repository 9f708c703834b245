"""Sending datapoints to brokers under their credit (the producer half of the data path).

A :class:`Sender` checks and flattens each datapoint in the calling thread and hands it to its
I/O thread (:mod:`feedline.producer.channel`), which sends it when a broker has granted credit for
it.
So a slow trainer makes producers wait (that wait is
``feedline_producer_credit_wait_seconds``) instead of filling anybody's memory, and a slow
pipeline never looks like a dead peer: the I/O thread heartbeats while the pipeline computes.
Arrays are sent zero-copy: the caller must not modify an array after handing it to
:meth:`Sender.send`.
"""

from __future__ import annotations

import logging
import os
import queue
import random
import socket
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry

from feedline import endpoints
from feedline.errors import ConfigError, DataError, EncodeError, FeedlineError, Stopped
from feedline.logs import RateLimitedLog
from feedline.producer.channel import ProducerIO
from feedline.producer.claims import SenderClaims, claim_spec, claiming_source
from feedline.producer.dataflow.base import DataFlow, as_dataflow, stages
from feedline.producer.metrics import ProducerMetrics
from feedline.producer.outbox import (
    BatchItem,
    ControlItem,
    ExactSpec,
    Fleet,
    Item,
    Outbox,
    SkipItem,
    UnitAsk,
    UnitEnd,
    item_bytes,
)
from feedline.producer.targets import Targets
from feedline.protocol import messages as m
from feedline.protocol import wire
from feedline.security import ClientKeys
from feedline.transport.client import ClientLoop, Waker
from feedline.transport.link import LinkConfig

log = logging.getLogger(__name__)
_POLL = 0.1  # seconds between stop/error checks while waiting for credit
_UNIT_RETRY = 1.0  # seconds without an answer before a unit request is sent again
_STOP_GRACE = 0.5  # a stop waits this long for a batch it cannot send


def default_producer_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


@dataclass
class SendStats:
    """What a :func:`send_dataflow` call did.

    ``batches``/``bytes``: the datapoints the dataflow made and handed to the sender (array
    bytes); ``sent``/``sent_bytes``: those that went to a broker, onto the connection of a
    broker that had welcomed this producer and granted credit for them (a batch handed over
    waits for that, in a bounded backlog; one no broker took is not sent). ``unreached``:
    for each broker address that never welcomed us, why (in words, :meth:`Link.explain`);
    ``bye_unanswered``: brokers that did not answer the closing BYE (what went there last
    may not have arrived; with an answer, everything sent there did)."""

    batches: int = 0
    bytes: int = 0
    epochs: int = 0
    seconds: float = 0.0
    credit_wait_seconds: float = 0.0
    sent: int = 0
    sent_bytes: int = 0
    unsendable: int = 0  # batches the wire could not carry, skipped (``skip_unsendable``)
    unreached: list[str] = field(default_factory=list)
    bye_unanswered: int = 0

    @property
    def batches_per_second(self) -> float:
        return self.batches / self.seconds if self.seconds > 0 else 0.0

    @property
    def bytes_per_second(self) -> float:
        return self.bytes / self.seconds if self.seconds > 0 else 0.0


class Sender:
    """A producer's connection to one broker, or to several (``addr`` a list, or a DNS name
    that resolves to several hosts, resolved again every 30 s: each batch goes to one of
    them, by credit, so a faster host gets more and one that dies or restarts does not stop
    the others being served). Use it from one thread; it runs its own I/O thread.

    ``pipeline``: a fingerprint of what makes the batches (1 .. 2**63 - 1; 0: not said),
    declared in HELLO. A broker drops what a departed producer left on the stream once a
    producer of another fingerprint produces it (docs/architecture.md, "Streams");
    ``feedline producer`` passes its pipeline file's. ``started``: when this producer started
    (a ``time.monotonic()`` reading; default: now), said in every HELLO as an age: on an exact
    stream, a producer started before its run was served is of that run, however late it
    registers (``feedline producer`` passes its process's start)."""

    def __init__(
        self,
        addr: str | Sequence[str],
        *,
        producer_id: str | None = None,
        link: LinkConfig | None = None,
        registry: CollectorRegistry | None = None,
        curve: ClientKeys | None = None,
        stream: str = m.DEFAULT_STREAM,
        exact: ExactSpec | None = None,
        fleet: tuple[str, int] | tuple[str, int, bool] = ("", 0),
        pipeline: int = 0,
        started: float | None = None,
    ) -> None:
        cfg = link or LinkConfig()
        self.limits = cfg.limits
        self.producer_id = producer_id or default_producer_id()
        if not 0 < len(self.producer_id) <= self.limits.max_id_len:
            raise ConfigError(f"producer_id must be 1..{self.limits.max_id_len} characters")
        m.check_stream(stream, self.limits)
        self.addrs = [addr] if isinstance(addr, str) else list(addr)
        if not self.addrs:
            raise ConfigError("no broker address")
        for a in self.addrs:  # one line here, not libzmq's ZMQError from the I/O thread
            endpoints.check_connect(a, "broker address", resolve=False)
        self.targets = Targets(self.addrs)
        self.session = random.getrandbits(62)
        self.metrics = ProducerMetrics(registry if registry is not None else CollectorRegistry())
        self.credit_wait_seconds = 0.0
        self._seq = 0  # batches handed over, plus skips: the next sequence number (one broker)
        self._units_given = 0  # exact delivery: work units the broker gave us
        self._ask = 0  # ... and the number of our last request for one
        self._closed = False
        self.stopped = False  # set when told to stop (not at the dataflow's end): see flush
        if not 0 <= pipeline < 1 << 63:
            raise ConfigError(f"pipeline must be a fingerprint in 0 .. 2**63 - 1, not {pipeline}")
        out = self._out = Outbox(self.producer_id, self.session, stream, self.metrics,
                                 exact=exact, fleet=Fleet(*fleet), pipeline=pipeline)
        if started is not None:
            out.started = started
        out.waker = Waker()
        targets = self.targets
        out.loop = ClientLoop("feedline-producer-io",
                              lambda ctx: ProducerIO(ctx, targets, cfg, curve, out), out.waker)
        self._link_cfg = cfg
        out.loop.start()
        targets.start()

    @property
    def credit(self) -> int:
        """Batches the brokers would take now (as last seen by the I/O thread)."""
        return self._out.credit

    @property
    def sent(self) -> tuple[int, int]:
        """Batches, and their array bytes, that went to a broker that granted credit for
        them (:class:`SendStats`); final once :meth:`close` returned."""
        return self._out.sent, self._out.sent_bytes

    @property
    def seq(self) -> int:
        """The next batch's sequence number (with one broker). Setting it forward skips
        numbers: to a broker, that looks like batches lost on the way (tests use it)."""
        return self._seq

    @seq.setter
    def seq(self, value: int) -> None:
        if value < self._seq:
            raise ConfigError("sequence numbers only move forward")
        if value > self._seq:
            self._hand_over(SkipItem(value - self._seq), None)
            self._seq = value

    # -------------------------------------------------------------------------- send
    def send(self, datapoint: Any, epoch: int = 0, stop: threading.Event | None = None, *,
             unit: int = -1, index: int = 0, last: bool = False, pipeline: int = 0,
             lineage: bytes = b"") -> int:
        """Send one datapoint when credit allows; returns its array bytes. ``lineage``
        (exact delivery): :func:`feedline.protocol.wire.lineage_fields`, packed once.

        Raises :class:`feedline.protocol.wire.EncodeError` (naming the limit) for a datapoint no
        broker would accept, :class:`feedline.producer.channel.BatchTooLarge` for one larger than
        every broker's memory budget. Blocks while no broker grants credit or none is
        reachable (reconnecting with backoff). Raises :class:`Stopped` if ``stop`` is set
        meanwhile.
        """
        prepared = wire.prepare_batch(datapoint, self.limits, len(self.producer_id))
        if lineage:  # its header holds these bytes too: credit must cover them
            prepared.wire_bytes += len(lineage)
        if prepared.wire_bytes > self._out.largest:
            self._out.largest = prepared.wire_bytes
        self._hand_over(BatchItem(prepared, epoch, unit, index, last, pipeline, lineage), stop)
        self._seq += 1
        return prepared.nbytes

    # --------------------------------------------------------------- exact delivery
    def next_unit(self, stop: threading.Event | None = None) -> m.Unit | None:
        """Exact delivery: the next work unit the broker hands us (blocks while the epoch's
        last units are in progress elsewhere); None once every epoch is served.

        Each request has a number its answer echoes, so that an answer to an earlier one (a
        request sent again) is never taken for this one's. After ``busy`` the broker sends a
        unit as soon as there is one (the next epoch starts); asking again with backoff
        covers that message being lost."""
        delay = 0.05
        while True:
            self._ask += 1
            ask, first = self._ask, not self._units_given and not self._out.fleet.join
            self._hand_over(UnitAsk(first, ask), stop)
            got = self._answer(ask, first, stop, _UNIT_RETRY)
            if isinstance(got, m.UnitWait) and got.reason == "busy":
                # Wait for the unit the broker sends when there is one, or ask again.
                got = self._answer(ask, first, stop, delay, resend=False)
                # At most a quarter of a second: a message lost costs no more than that.
                delay = min(0.25, delay * 2)
            if isinstance(got, m.Unit):
                self._units_given += 1
                return got
            if isinstance(got, m.UnitWait) and got.reason == "finished":
                return None

    def _answer(self, ask: int, first: bool, stop: threading.Event | None, wait: float,
                resend: bool = True) -> m.Unit | m.UnitWait | None:
        """The broker's answer to request ``ask`` (answers to others are dropped); without
        one within ``wait`` s, the request is sent again (``resend``: it was lost with a
        connection or a broker; asking again is safe: the broker gives an owner the unit it
        holds) or None."""
        asked = time.monotonic()
        while True:
            self._raise_pending()
            if stop is not None and stop.is_set():
                raise Stopped("stopped while waiting for a unit")
            try:
                got = self._out.units.get(timeout=min(_POLL, wait))
            except queue.Empty:
                if time.monotonic() - asked > wait:
                    if not resend:
                        return None
                    self._hand_over(UnitAsk(first, ask), stop)
                    asked = time.monotonic()
                continue
            if got.ask in (ask, 0):  # 0: a broker that does not number its answers
                return got

    def unit_done(self, epoch: int, unit: int, batches: int, empty: tuple[int, ...] = (),
                  stop: threading.Event | None = None) -> None:
        """Exact delivery: every batch of the unit was handed over (UNIT_DONE goes after);
        ``empty``: indices of batches not sent because every sample of them was skipped.
        ``stop`` ends a wait for room (:class:`Stopped`)."""
        self._hand_over(UnitEnd(epoch, unit, batches, tuple(empty)), stop)

    def _hand_over(self, item: Item, stop: threading.Event | None) -> None:
        out = self._out
        assert out.loop is not None and out.waker is not None
        self._raise_pending()
        nbytes = item_bytes(item)
        if not out.items.put(item, nbytes, 0):
            # The backlog is full: the I/O thread waits for credit (it wakes us when half of
            # the backlog has left), or for the broker.
            t0 = time.monotonic()
            while not out.items.put(item, nbytes, _POLL):
                self._raise_pending()
                if stop is not None and stop.is_set():
                    raise Stopped("stopped while waiting for credit")
            waited = time.monotonic() - t0
            self.credit_wait_seconds += waited
            self.metrics.credit_wait.observe(waited)
        out.handed += 1
        out.nudge()

    def _raise_pending(self) -> None:
        out = self._out
        if out.error is not None:
            err, out.error = out.error, None
            raise err
        if out.loop is not None and not out.loop.alive():
            raise FeedlineError(f"producer I/O thread is not running: {out.loop.error!r}")

    def end(self, epochs: int, stop: threading.Event | None = None) -> None:
        """Tell consumers this producer's dataflow ended (EOS), after its batches (``stop``
        ends a wait for room: :class:`Stopped`)."""
        self._hand_over(ControlItem(m.Eos(producer=self.producer_id, seq=self._seq,
                                          epochs=epochs)), stop)

    def error(self, exc: BaseException) -> None:
        """Send a pipeline failure with its traceback to the consumers."""
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        text = f"{type(exc).__name__}: {exc}"
        if self._out.refused:
            return  # the broker refused us: there is nobody to tell (the caller says it)
        msg = m.Error(producer=self.producer_id, message=text[: self.limits.max_text_len],
                      traceback=tb[-self.limits.max_traceback_len:])
        try:
            self._hand_over(ControlItem(msg), None)
        except FeedlineError:
            log.warning("could not tell the broker about the failure: %s", text)

    def flush(self, timeout: float, stopping: bool = False) -> bool:
        """Wait until everything handed over was sent (bounded); True if it was. When
        ``stopping`` (SIGTERM, a scale-down), give up once the I/O thread holds a batch it
        could not send for ``_STOP_GRACE`` s (no broker has credit for it, or, with
        credit, none is connected: a send fails only then, the pipe holds far more than a
        credit window): nothing of it reached a broker (an exact unit is made again
        elsewhere). At a dataflow's end wait the whole ``timeout``: its last batches and
        EOS may still get credit, or a broker come back."""
        out = self._out
        target, deadline = out.handed, time.monotonic() + timeout
        done, moved = out.done, time.monotonic()
        while out.done < target:
            now = time.monotonic()
            if out.done != done:
                done, moved = out.done, now
            if now >= deadline or (stopping and out.holding
                                   and now - moved >= _STOP_GRACE):
                return False
            out.idle.clear()  # set again by the I/O thread once it sent all it was handed
            if out.done >= target:
                break
            if out.waker is not None:
                out.waker.wake()
            out.idle.wait(min(deadline - now, 0.05))
        return True

    def close(self) -> None:
        """Let what was handed over leave (up to ``flush_ms``), say BYE (frees our credit at
        the broker at once) and stop the I/O thread. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self.targets.stop()
        out = self._out
        if out.loop is not None and out.loop.alive():
            if not out.refused:  # else no broker takes what is left: end at once
                self.flush(self._link_cfg.flush_ms / 1000, stopping=self.stopped)
            out.loop.stop(timeout=self._link_cfg.flush_ms / 1000 + 5)

    def __enter__(self) -> Sender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_UNSENDABLE = RateLimitedLog(log, interval=10.0, burst=4)


def _nothing_in_an_epoch(df: DataFlow) -> str:
    """The error of an epoch without a batch, with its cause where a stage knows it (a
    batch step that dropped, as its remainder, every sample the source gave)."""
    msg = "the dataflow yielded nothing in a whole epoch"
    for stage in stages(df):
        why = getattr(stage, "why_empty", None)
        said = why() if callable(why) else None
        if said:
            return f"{msg}: {said}"
    return msg


class _RateLog:
    """The producer's periodic rate line: batches, batches/s, MB/s, credit waits."""

    def __init__(self, sender: Sender, interval: float, skipped: Callable[[], int] | None):
        self.sender, self.interval, self.skipped = sender, interval, skipped
        self.last = time.monotonic()
        self.batches = self.bytes = 0
        self.wait = 0.0

    def maybe(self, stats: SendStats) -> None:
        now = time.monotonic()
        dt = now - self.last
        if dt < self.interval:
            return
        waited = self.sender.credit_wait_seconds - self.wait
        log.info("%s: %d batches, %.1f batches/s, %.1f MB/s, waited for credit %.0f%% of the "
                 "time%s", self.sender.producer_id, stats.batches,
                 (stats.batches - self.batches) / dt, (stats.bytes - self.bytes) / dt / 1e6,
                 100 * waited / dt,
                 "" if self.skipped is None else f", {self.skipped()} skipped")
        self.last, self.batches, self.bytes = now, stats.batches, stats.bytes
        self.wait = self.sender.credit_wait_seconds


def send_dataflow(
    df: Iterable[Any],
    addr: str | Sequence[str],
    *,
    epochs: int | None = None,
    producer_id: str | None = None,
    link: LinkConfig | None = None,
    stop: threading.Event | None = None,
    registry: CollectorRegistry | None = None,
    log_interval: float = 30.0,
    skipped: Callable[[], int] | None = None,
    curve: ClientKeys | None = None,
    stream: str = m.DEFAULT_STREAM,
    fleet: tuple[str, int] | tuple[str, int, bool] = ("", 0),
    pipeline: int = 0,
    started: float | None = None,
    skip_unsendable: bool = False,
) -> SendStats:
    """Send every datapoint of ``df`` to the broker at ``addr`` (or to several), ``epochs``
    times.

    ``epochs=None`` sends forever (the training default, as tensorpack's
    ``send_dataflow_zmq``). Calls ``df.reset_state()`` first (``df`` is taken as
    :func:`~feedline.producer.dataflow.base.as_dataflow` of it: a list or a generator works too).
    Logs a rate line every ``log_interval`` seconds (with ``skipped()``, the datapoints the
    pipeline skipped so far, when given). A pipeline exception is sent to the consumers (with
    its traceback) and re-raised. Returns when done, or when ``stop`` is set. ``fleet``:
    the id and ``--max`` of the supervisor that started this producer, and whether it joins
    a run under way (``feedline fleet``; :class:`~feedline.producer.outbox.Fleet`).
    ``pipeline``: its fingerprint, and ``started``: when this producer started, as
    :class:`Sender` takes them. ``skip_unsendable`` (a pipeline's ``on_error: skip``): a
    batch the wire cannot carry (an :class:`~feedline.errors.EncodeError`: a header over
    its limit, of long strings batched with ``use_list``) is skipped, logged and counted
    (``unsendable``), not the end of the producer.
    """
    df = as_dataflow(df)
    df.reset_state()
    stats = SendStats()
    shards = claiming_source(df)  # a sharded source reads the shards the broker hands out
    spec = None if shards is None else claim_spec(shards, epochs)
    with Sender(addr, producer_id=producer_id, link=link, registry=registry, curve=curve,
                stream=stream, exact=spec, fleet=fleet, pipeline=pipeline,
                started=started) as sender:
        if shards is not None:
            shards.attach(SenderClaims(sender, stop))
        rate = _RateLog(sender, log_interval, skipped)
        t0 = time.monotonic()
        try:
            epoch = 0
            while epochs is None or epoch < epochs:
                before = stats.batches
                ready = time.monotonic()  # when we started waiting for the pipeline
                for dp in df:
                    sender.metrics.pipeline_seconds.inc(time.monotonic() - ready)
                    try:
                        stats.bytes += sender.send(dp, epoch=epoch, stop=stop)
                    except EncodeError as e:
                        if not skip_unsendable:
                            raise
                        stats.unsendable += 1
                        _UNSENDABLE.warning("skipped batch %d of epoch %d, which the wire "
                                            "cannot carry (%s); %d skipped so far "
                                            "(on_error: skip)", stats.batches, epoch, e,
                                            stats.unsendable)
                        ready = time.monotonic()
                        continue
                    stats.batches += 1
                    rate.maybe(stats)
                    ready = time.monotonic()
                    if stop is not None and stop.is_set():
                        raise Stopped
                if shards is not None and shards.finished:
                    break  # the broker handed out every epoch's shards
                if stats.batches == before and shards is None:
                    raise DataError(_nothing_in_an_epoch(df))
                epoch += 1
                stats.epochs = epoch
            sender.end(epoch, stop)
        except Stopped:
            sender.stopped = True
        except Exception as e:
            sender.error(e)
            raise
        finally:
            stats.seconds = time.monotonic() - t0
            stats.credit_wait_seconds = sender.credit_wait_seconds
    # After the close: the I/O thread has sent what it could and said why it could not.
    stats.sent, stats.sent_bytes = sender.sent
    stats.unreached = list(sender._out.unreached)
    stats.bye_unanswered = sender._out.bye_unanswered
    return stats


# tensorpack's name for the same call (docs/tensorpack.md): `send_dataflow_zmq(df, addr)` of a
# tensorpack program runs as it is. Its `hwm=` and `format=` have no counterpart (credit bounds
# what is in flight, and the wire format is feedline's), so they are refused as unknown.
send_dataflow_zmq = send_dataflow

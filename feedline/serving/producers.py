"""The producer side of a host: registrations, credit, batches, losses.

Producers register (HELLO) with their session, the next sequence number they will send and
the largest batch they expect; the host welcomes them and grants credit as the credit
planner says (:mod:`feedline.serving.credit`). Every batch is checked whole (the same decoder
the consumers run: a batch they would refuse must not cost them a credit) and goes to the
sink (the broker's buffer, or a direct-mode trainer's queue). A refused batch is counted for
its producer and answered with REFUSED (it logs why); its credit comes back with the next
plan. A producer that sends beyond its grant, or keeps credit it was asked to return, is cut
off: its connection is closed, its registration dropped and counted, and nobody else
notices.

The same class serves a broker and a direct-mode trainer (``feedline.consumer.direct``), both
through :class:`feedline.serving.server.Server`: only the sink differs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from feedline.errors import Refusal
from feedline.exact import ExactStreams, Succession
from feedline.liveness import HEARTBEAT_TIMEOUT
from feedline.logs import RateLimitedLog
from feedline.protocol import bundle, wire
from feedline.protocol import messages as m
from feedline.protocol.codec import DecodeError, Limits
from feedline.serving.budget import Budget
from feedline.serving.credit import CreditPlanner
from feedline.serving.gaps import GapTracker
from feedline.serving.handout import ClaimStreams, Units, admit
from feedline.serving.held import Held, Send, Sink
from feedline.serving.metrics import DEPARTED, BrokerMetrics
from feedline.serving.peers import HELLO_RATE, HelloRate, PeerTable, Producer, connection

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class IngressConfig:
    budget: Budget
    producer_window: int
    credit_lease: float
    capacity: int  # registered producers, at most
    stream: str | None = None  # the only stream accepted (a direct-mode trainer), or any
    by_bytes: bool = False  # windows count small batches by their bytes (CreditPlanner)
    bundle: int = 0  # the most batches in one message (feedline.protocol.bundle)
    join: int = 0  # the largest batch (array bytes) sent joined in one (0: JOIN_BYTES)
    whole: bool = False  # a bundle goes to the sink as one item (a broker), not batch by batch
    heartbeat_timeout: float = HEARTBEAT_TIMEOUT  # a producer silent this long is dropped


class ProducerSide:
    """Everything done with messages arriving on an ingress socket."""

    def __init__(self, send: Send, sink: Sink, metrics: BrokerMetrics, limits: Limits,
                 cfg: IngressConfig, instance: int,
                 cut_off: Callable[[int, int, str, str], None],
                 exact: ExactStreams | None = None) -> None:
        self._send, self.sink, self.metrics, self.limits = send, sink, metrics, limits
        self.cfg, self.instance, self._cut_off = cfg, instance, cut_off
        self.max_batch_bytes = cfg.budget.max_message(limits)
        self.producers: PeerTable[Producer] = PeerTable("producer", cfg.capacity)
        # A stream's dataset changed while its old producers are registered: killed ones
        # (silent since) are waited for, running ones keep the stream.
        succession = Succession(self._heard, cfg.heartbeat_timeout)
        self.exact = exact if exact is not None else ExactStreams()
        self.exact.succession = succession
        # Training streams whose producers claim shards.
        self.claims = ClaimStreams(succession=succession)
        self.planner = CreditPlanner(cfg.budget, cfg.producer_window, cfg.credit_lease,
                                     by_bytes=cfg.by_bytes)
        self.gaps = GapTracker(4 * cfg.capacity)
        self._info = RateLimitedLog(log, interval=10.0, burst=20)
        self._hellos = HelloRate(HELLO_RATE, 4 * cfg.capacity)
        self.units = Units(self.exact, self._control, instance, sink.epoch_end, self.claims)
        self._warn = RateLimitedLog(log, interval=10.0, burst=5)
        # Something happened that a plan may answer with credit (a control message, a refused
        # or duplicate batch, a producer's first batch, a departure). An accepted batch of a
        # running producer only moves a credit from granted to held: it frees no room, so a
        # caller may skip planning after one (direct mode does, once per batch).
        self.dirty = True

    @property
    def peers(self) -> PeerTable[Producer]:
        return self.producers

    def _control(self, ident: bytes, msg: m.Message) -> int:
        return self._send(ident, [m.encode(msg)])

    def _heard(self, ident: bytes) -> float | None:
        """When registered producer ``ident`` was last heard from (None: not registered)."""
        p = self.producers.get(ident)
        return None if p is None else p.last_seen

    # -- messages -----------------------------------------------------------------------
    def on_message(self, ident: bytes, frames: list[zmq.Frame], fd: int, now: float) -> None:
        try:
            header = wire.header_map(frames[0], self.limits)
        except DecodeError as e:
            p = self.producers.get(ident)
            if p is not None:
                # A registered producer's message we cannot even read the header of is a
                # batch it counted against its credit (control messages are ours to write):
                # count it too, so that both sides agree and its credit comes back.
                p.last_seen = now
                self._charge(p, sum(len(f) for f in frames), now)
                self._refuse(p, e, -1)
            raise
        if header["k"] == wire.Kind.BATCH:
            self._batch(ident, header, frames, now)
            return
        if header["k"] == wire.Kind.BUNDLE:
            self._bundle(ident, header, frames, now)
            return
        self.dirty = True
        if len(frames) != 1:
            raise DecodeError("bad_envelope", "a control message with payload frames")
        msg = m.from_map(header, self.limits)
        p = self.producers.get(ident)
        if isinstance(msg, m.ProducerHello):
            self._hello(ident, msg, fd, now)
        elif isinstance(msg, m.ConsumerHello):
            self._control(ident, m.Refused(broker=self.instance, reason="wrong_port",
                                           detail="this is a broker's ingress (or a trainer "
                                           "serving producers): consumers connect to the "
                                           "broker's --egress address"))
            raise Refusal("wrong_port", f"consumer {msg.consumer} at the ingress")
        elif p is None:
            if isinstance(msg, m.Bye):  # gone already (dropped): answered all the same
                self._control(ident, m.Bye())
            else:
                self._control(ident, m.Reset(broker=self.instance))
                raise Refusal("unknown_peer", type(msg).__name__)
        else:
            p.last_seen = now
            self._registered(p, msg, now)

    def _registered(self, p: Producer, msg: m.Message, now: float) -> None:
        if isinstance(msg, m.Want):
            if msg.registration != p.registration:
                return  # about an earlier registration on this connection
            if self.planner.want(p.ident, msg.sent, msg.sent_bytes, msg.size):
                self._control(p.ident, m.Refused(
                    broker=self.instance, reason="batch_too_large", limit=self.max_batch_bytes,
                    detail=f"a batch of {msg.size} bytes; this broker holds at most "
                    f"{self.max_batch_bytes} (--max-bytes)"))
                self.metrics.refused.labels(p.label, "batch_too_large").inc()
        elif isinstance(msg, m.Returned):
            if msg.registration == p.registration:
                self.planner.returned(p.ident, msg.sent, msg.sent_bytes)
        elif isinstance(msg, (m.Eos, m.Error)):
            # Queued, not sent now: it must not overtake the batches sent before it.
            item = Held([m.encode(msg)], 0, 0, p.session, 0, broadcast=True)
            if not self.sink.accept(p.stream, item):
                raise Refusal("buffer_full", type(msg).__name__)
        elif isinstance(msg, m.Bye):
            self.drop(p.ident, "bye")
            # The answer, the last message on this connection: the producer closes once it
            # has it, with nothing unread (feedline.producer.leaving says why).
            self._control(p.ident, m.Bye())
        elif isinstance(msg, (m.UnitRequest, m.UnitDone)):
            self.units.route(p, msg)
        elif not isinstance(msg, m.Heartbeat):
            raise Refusal("bad_kind", f"{type(msg).__name__} from a producer")

    def _hello(self, ident: bytes, msg: m.ProducerHello, fd: int, now: float) -> None:
        old = self.producers.get(ident)
        if old is not None and (old.session, old.registration) == (msg.session,
                                                                    msg.registration):
            self._welcome(old)  # a repeated HELLO of a registration we know: a no-op
            self._grant(old, now)
            return
        if self._hellos.too_often(ident, now):
            # An honest peer registers again after a restart or a reconnect, not ten times a
            # second: a flood would cost the broker a registration each (tables, metric
            # series). The HELLO is refused and counted; what is registered stays.
            raise Refusal("hello_flood", f"producer {msg.producer}")
        if old is not None:
            self.drop(ident, "registered_again")
        if self.producers.full():
            self._control(ident, m.Refused(broker=self.instance, reason="too_many_peers",
                                           limit=self.producers.capacity))
            raise Refusal("too_many_peers", f"producer {msg.producer}")
        if self.cfg.stream is not None and msg.stream != self.cfg.stream:
            self._control(ident, m.Refused(
                broker=self.instance, reason="wrong_stream",
                detail=f"this trainer takes stream {self.cfg.stream!r}, not {msg.stream!r}"))
            raise Refusal("wrong_stream", f"producer {msg.producer}: {msg.stream}")
        self._check_delivery(ident, msg)
        label = self.metrics.producer_label.acquire(msg.producer)
        fd, ino = connection(fd)
        p = Producer(ident=ident, name=msg.producer, session=msg.session,
                     registration=msg.registration, stream=msg.stream, last_seen=now,
                     fd=fd, fd_ino=ino, label=label, exact=msg.delivery == m.EXACT,
                     fleet=(msg.fleet, msg.fleet_max), pipeline=msg.pipeline)
        self.producers.add(p)
        self.exact.attach(p.stream, p.exact)
        self.metrics.init_producer(label)
        p.counted = (self.metrics.received_batches.labels(label),
                     self.metrics.received_bytes.labels(label))
        lost = self.gaps.hello(msg.session, msg.next_seq)
        if lost:
            p.pending_gap = lost
            self.metrics.lost_batches.labels(label).inc(lost)
            self._warn.warning("producer %s registered again: %d batches it sent never "
                               "arrived (counted as lost)", msg.producer, lost)
        self.planner.join(ident, msg.max_batch_bytes, msg.stream)
        self.sink.producer_joined(msg.stream, msg.producer)
        self._info.info("producer %s joined stream %s (%d connected)", msg.producer,
                        msg.stream, len(self.producers))
        self._welcome(p)

    def _check_delivery(self, ident: bytes, msg: m.ProducerHello) -> None:
        """:func:`~feedline.serving.handout.admit`, its refusal told to the producer."""
        try:
            admit(self.exact, self.claims, ident, msg)
        except Refusal as e:
            self._control(ident, m.Refused(broker=self.instance, reason=e.reason,
                                           detail=e.detail[: self.limits.max_text_len]))
            raise Refusal(e.reason, f"producer {msg.producer}: {e.detail}") from None

    def _welcome(self, p: Producer) -> None:
        self._control(p.ident, m.Welcome(self.instance, p.registration, self.max_batch_bytes,
                                         bundle=self.cfg.bundle, join=self.cfg.join))

    def _sender(self, ident: bytes, what: str, now: float) -> Producer:
        p = self.producers.get(ident)
        if p is None:
            self._control(ident, m.Reset(broker=self.instance))
            raise Refusal("unknown_peer", what)
        p.last_seen = now
        return p

    def _bundle(self, ident: bytes, header: dict, frames: list[zmq.Frame], now: float) -> None:
        """Several batches in one message (feedline.protocol.bundle), each counted as if alone."""
        p, most = self._sender(ident, "BUNDLE", now), self.cfg.bundle
        try:
            if most < 2 or self.exact.get(p.stream) is not None:
                raise DecodeError("bad_kind", "a bundle, which this host did not offer")
            # A broker forwards it: checked as consumers will read it, the batches not built.
            n, per = bundle.check_bundle(frames, self.limits, header, most) \
                if self.cfg.whole else (0, 0)
            batches = [] if n else bundle.decode_bundle(frames, self.limits, header, most)
            if header["q"] != p.session:
                raise Refusal("bad_header", "session changed without HELLO")
        except Refusal as e:
            # Counted as the batches it says it holds, as its producer counted them.
            said = header.get("n")
            for i in range(said if type(said) is int and 1 <= said <= most else 1):
                self._charge(p, 0 if i else sum(len(f) for f in frames), now)
            s = header.get("s")
            self._refuse(p, e, s if type(s) is int and s >= 0 else -1)
            raise
        sizes = [b.wire_bytes for b in batches] or [len(frames[0]) + per] + [per] * (n - 1)
        c, total = self.planner.producers[ident], sum(sizes)
        if c.covers(len(sizes), total):
            self.planner.batch(ident, total, now, len(sizes), max(sizes))  # all at once
        else:  # one by one: the breach found at the batch where it lies
            for size in sizes:
                self._charge(p, size, now)
        self.dirty = self.dirty or c.received == len(sizes)
        if n:  # a broker: one item, forwarded whole (or split) to consumers
            self._accept(p, Held(list(frames), total, n * per, p.session, 0, count=n),
                         header["s"], header["s"] + n - 1)
        elif batches:  # a direct-mode trainer: each batch holds views of the frames
            gap = self._gap(p, batches[0].seq, batches[-1].seq)
            p.counted[0].inc(len(batches))
            p.counted[1].inc(sum([b.nbytes for b in batches]))
            self.sink.accept_batches(p.stream, batches, gap)

    def _batch(self, ident: bytes, header: dict, frames: list[zmq.Frame], now: float) -> None:
        p = self._sender(ident, "BATCH", now)
        nbytes = sum(len(f) for f in frames)
        self._charge(p, nbytes, now)
        if self.planner.producers[ident].received == 1:
            self.dirty = True  # its first: slow start is over, it may get more credit
        seq = header.get("s")
        try:
            # The whole decoder, structure included (array views only, no payload read): a
            # batch every consumer would refuse must not be forwarded.
            batch = wire.decode_batch(frames, self.limits, header=header)
            if batch.session != p.session:
                raise Refusal("bad_header", "session changed without HELLO")
        except Refusal as e:
            self._refuse(p, e, seq if isinstance(seq, int) and seq >= 0 else -1)
            raise
        self._take(p, batch, frames, nbytes)

    def _take(self, p: Producer, batch: wire.Batch, frames: list[zmq.Frame],
              nbytes: int) -> None:
        exact = self.exact.get(p.stream)
        if exact is not None:
            if batch.unit < 0 or batch.pipeline != exact.plan.fingerprint:
                why = "a batch without its unit" if batch.unit < 0 else "of another pipeline"
                self._refuse(p, Refusal("not_exact", why), batch.seq)
                raise Refusal("not_exact", f"producer {p.name}: {why}")
            if not exact.accept(batch.key):
                # Already here or settled (a re-run unit), or of another epoch: dropped; it
                # was charged to its credit, which the next plan gives back.
                self.metrics.duplicates.labels(p.stream).inc()
                self.dirty = True
                self.gaps.batch(p.session, batch.seq)
                return
        self._accept(p, Held(list(frames), nbytes, batch.nbytes, p.session, 0, batch=batch),
                     batch.seq, batch.seq)

    def _accept(self, p: Producer, item: Held, first: int, last: int) -> None:
        """``item`` (batches ``first``..``last`` of its session) to the sink, gap included."""
        item.gap = self._gap(p, first, last)
        p.counted[0].inc(item.count)
        p.counted[1].inc(item.array_bytes)
        self.sink.accept(p.stream, item)

    def _gap(self, p: Producer, first: int, last: int) -> int:
        """The batches lost before ``first`` (counted), and those a new registration said
        were lost: what the first of batches ``first``..``last`` carries."""
        gap = self.gaps.batch(p.session, first)
        if last != first:
            self.gaps.batch(p.session, last)
        if gap:
            self.metrics.lost_batches.labels(p.label).inc(gap)
        gap, p.pending_gap = gap + p.pending_gap, 0
        return gap

    def _charge(self, p: Producer, nbytes: int, now: float) -> None:
        """Count a batch against its producer's credit; cut off one that had none left."""
        breach = self.planner.batch(p.ident, nbytes, now)
        if breach is not None:
            # A producer that ignores flow control is cut off: it cannot grow our memory.
            self._control(p.ident, m.Refused(broker=self.instance, reason=breach,
                                             detail="sent beyond its credit: cut off"))
            self._cut_off(p.fd, p.fd_ino, "producer", breach)
            c = self.planner.producers[p.ident]
            detail = (f"producer {p.name} (registration {p.registration}): {c.received} "
                      f"batches, {c.received_bytes} bytes of {c.granted}, {c.granted_bytes}")
            self.drop(p.ident, breach)
            raise Refusal(breach, detail)

    def _refuse(self, p: Producer, e: Refusal, seq: int) -> None:
        self.dirty = True  # its room is planned anew with the next plan
        self.planner.refused(p.ident)  # ... and it gets more credit when it asks
        self.metrics.refused.labels(p.label, e.reason).inc()
        self._control(p.ident, m.Refused(broker=self.instance, reason=e.reason, seq=seq,
                                         detail=str(e)[: self.limits.max_text_len]))

    # -- credit and liveness ------------------------------------------------------------
    def plan(self, now: float) -> None:
        if self.units.waiting():
            self.units.push(now, self.producers.get)
        held_b, held_y = self.sink.held()
        streams = {p.stream for p in self.producers}
        plan = self.planner.plan(now, held_b, held_y, self.sink.held_by_stream(),
                                 {s for s in streams if not self.sink.read(s)})
        for ident in plan.grants:
            p = self.producers.get(ident)
            if p is not None:
                self._grant(p, now)
        for ident in plan.revokes:
            p = self.producers.get(ident)
            if p is not None and self._control(ident, m.Revoke(
                    broker=self.instance, registration=p.registration)) == 0:
                p.last_sent = now

    def _grant(self, p: Producer, now: float) -> None:
        c = self.planner.producers[p.ident]
        if self._control(p.ident, m.Grant(broker=self.instance, batches=c.granted,
                                          nbytes=c.granted_bytes,
                                          registration=p.registration)) == 0:
            p.last_sent = now

    def liveness(self, now: float, interval: float, timeout: float) -> None:
        for p in self.producers.expired(now, timeout):
            self.drop(p.ident, "timeout")
        for ident in self.planner.unanswered(now, timeout):
            peer = self.producers.get(ident)
            if peer is not None:
                self._cut_off(peer.fd, peer.fd_ino, "producer", "revoke_unanswered")
                self.drop(ident, "revoke_unanswered")
        for p in self.producers.due(now, interval):
            if self._control(p.ident, m.Heartbeat(broker=self.instance)) == 0:
                p.last_sent = now

    def drop(self, ident: bytes, reason: str) -> None:
        p = self.producers.remove(ident)
        if p is None:
            return
        self.dirty = True
        credit = self.planner.leave(ident)
        self.units.forget([ident])
        self.exact.detach(p.stream, p.exact)
        c = self.exact.get(p.stream)
        if c is not None:
            c.release(ident)  # its unit goes to another producer
        self.claims.leave(p.stream, ident)
        self.metrics.producer_label.release(p.label)
        if reason == "timeout":  # silent past the timeout: a stopped or cut-off producer
            self._info.warning("producer %s dropped (timeout: silent past the heartbeat "
                               "timeout); what it had in flight is counted lost if it comes "
                               "back", p.name)
        else:
            self._info.info("producer %s %s (%s)", p.name,
                            "left" if reason in DEPARTED else "dropped", reason)
        self.metrics.dropped_peers.labels("producer", reason).inc()
        if reason not in DEPARTED and credit is not None:
            # What it may have sent that will never arrive here.
            self.metrics.unconfirmed.labels("producer").inc(credit.outstanding)

    def outstanding(self) -> tuple[int, int]:
        return self.planner.outstanding()

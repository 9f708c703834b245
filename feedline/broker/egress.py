"""The broker's consumer side: registrations, windows, dispatch, and bytes in flight.

A consumer registers with a window (batches) and a byte budget. The broker sends it buffered
batches of its stream while both allow, round-robin among the stream's consumers, each behind
an envelope (:class:`feedline.protocol.messages.Deliver`). Every byte delivered and not yet reported
taken (TAKEN) is *in flight* and counts against the broker's ``max_bytes``: it sits in this
process's socket queue or in the network until the consumer has it. One consumer holds at most
the budget's per-consumer share in flight (half), so the rest stays for the buffer and the
other consumers.

In-flight bytes of a consumer that is gone (dropped, or registered again on its connection)
become *orphans*: still counted until its connection is known to be closed (a probe to it
fails) or it shows it reads again (a TAKEN of its new registration, which arrives only after
everything sent before it). So a consumer that never reads cannot grow the broker by
registering again, and a paused one loses nothing. An exact stream's batches in an orphan are
served again (those not settled meanwhile) once its connection is closed, or as soon as the
consumer registers again: it drops what it was sent under a registration it no longer has,
and its HELLO reports what it took of it.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from typing import Any

import zmq

from feedline.broker import parts
from feedline.broker.buffer import Buffer
from feedline.broker.consumers import Consumer, Orphan
from feedline.errors import Refusal
from feedline.exact import Applied, ExactStreams
from feedline.logs import RateLimitedLog
from feedline.protocol import messages as m
from feedline.protocol.codec import DecodeError, Limits
from feedline.serving.budget import Budget
from feedline.serving.held import Held
from feedline.serving.metrics import DEPARTED, BrokerMetrics
from feedline.serving.peers import HELLO_RATE, HelloRate, PeerTable, connection, cut_off

log = logging.getLogger(__name__)

Send = Callable[[bytes, list[Any]], int]  # 0 sent, zmq.EAGAIN full, zmq.EHOSTUNREACH gone


class ConsumerSide:
    """Everything the broker does on its egress socket (the socket itself is the loop's)."""

    def __init__(self, send: Send, buffer: Buffer, metrics: BrokerMetrics, limits: Limits,
                 budget: Budget, capacity: int, instance: int,
                 cut_off: Callable[[int, int, str, str], None],
                 exact: ExactStreams | None = None) -> None:
        self._send, self.buffer, self.metrics, self.limits = send, buffer, metrics, limits
        self.exact = exact if exact is not None else ExactStreams()
        # What one consumer may hold in flight (the budget's per-consumer share), so that one
        # that never reads leaves the rest to the buffer and the other consumers.
        self.cap = budget.per_consumer.nbytes
        self.cap_batches = budget.per_consumer.batches
        self.instance, self._cut_off = instance, cut_off
        self.consumers: PeerTable[Consumer] = PeerTable("consumer", capacity)
        self.orphans: dict[bytes, Orphan] = {}
        self._rr: dict[str, deque[bytes]] = {}
        self._log = RateLimitedLog(log, interval=5.0)
        self._info = RateLimitedLog(log, interval=10.0, burst=20)
        self._hellos = HelloRate(HELLO_RATE, 4 * capacity)
        # A consumer came or left since the loop last planned (room freed, a stream read or
        # no longer); batches taken since (a plan short of room is made again once enough
        # of it was freed: feedline.broker.core).
        self.freed = True
        self.taken_since = 0
        self.exact.refuse = self._refuse_cursor
        self.exact.applied = self._applied
        self.exact.probe = self._alive
        self.exact.void = self._void

    # -- accounting ---------------------------------------------------------------------
    def inflight(self) -> tuple[int, int]:
        """(batches, bytes) delivered and not known taken, orphans included."""
        b = sum(c.delivered - c.taken for c in self.consumers)
        y = sum(c.inflight_bytes for c in self.consumers)
        # An exact orphan's batches count here until they are back in the buffer.
        return (b + sum(o.batches for o in self.orphans.values()),
                y + sum(o.nbytes for o in self.orphans.values()))

    def inflight_by_stream(self) -> dict[str, tuple[int, int]]:
        out: dict[str, tuple[int, int]] = {}
        for c in self.consumers:
            b, y = out.get(c.stream, (0, 0))
            out[c.stream] = (b + c.delivered - c.taken, y + c.inflight_bytes)
        for o in self.orphans.values():
            b, y = out.get(o.stream, (0, 0))
            out[o.stream] = (b + o.batches, y + o.nbytes)
        return out

    @property
    def peers(self) -> PeerTable[Consumer]:
        return self.consumers

    def demand(self, stream: str) -> bool:
        return any(c.stream == stream for c in self.consumers)

    def _control(self, ident: bytes, msg: m.Message) -> int:
        return self._send(ident, [m.encode(msg)])

    # -- messages -----------------------------------------------------------------------
    def on_message(self, ident: bytes, frames: list[zmq.Frame], fd: int, now: float) -> None:
        if len(frames) != 1:
            raise DecodeError("bad_envelope", "a consumer message with payload frames")
        msg = m.decode(frames[0], self.limits)
        cons = self.consumers.get(ident)
        if cons is not None and isinstance(msg, m.Taken):  # the message of every delivery
            cons.last_seen = now
            self._taken(cons, msg)
            return
        self.freed = True
        if isinstance(msg, m.ConsumerHello):
            self._hello(ident, msg, fd, now)
        elif isinstance(msg, m.ProducerHello):
            self._control(ident, m.Refused(broker=self.instance, reason="wrong_port",
                                           detail="this is a broker's egress: producers "
                                           "connect to its --ingress address"))
            raise Refusal("wrong_port", f"producer {msg.producer} at the egress")
        elif cons is None:
            if not isinstance(msg, m.Bye):
                self._control(ident, m.Reset(broker=self.instance))
                raise Refusal("unknown_peer", type(msg).__name__)
        else:
            cons.last_seen = now
            if isinstance(msg, m.Bye):
                self.drop(ident, "bye")
            elif not isinstance(msg, m.Heartbeat):
                raise Refusal("bad_kind", f"{type(msg).__name__} from a consumer")

    def _hello(self, ident: bytes, msg: m.ConsumerHello, fd: int, now: float) -> None:
        old = self.consumers.get(ident)
        if old is not None and (old.session, old.registration) == (msg.session,
                                                                    msg.registration):
            self._welcome(old)  # a repeated HELLO of a registration we know: a no-op
            return
        if self._hellos.too_often(ident, now):
            # As for producers (what a HELLO carries, a cursor, costs to read): refused and
            # counted; what is registered stays.
            raise Refusal("hello_flood", f"consumer {msg.consumer}")
        if old is not None:
            self.drop(ident, "registered_again")
        if self.consumers.full():
            self._control(ident, m.Refused(broker=self.instance, reason="too_many_peers",
                                           limit=self.consumers.capacity))
            raise Refusal("too_many_peers", f"consumer {msg.consumer}")
        applied = None
        try:
            self.exact.admit(msg.stream)
            if msg.cursor:
                applied = self.exact.cursor(ident, msg.stream, msg.cursor, now, self._alive)
        except Refusal as e:
            self._refuse_cursor(ident, e.reason, e.detail)
            raise
        fd, ino = connection(fd)
        c = Consumer(ident=ident, name=msg.consumer, session=msg.session,
                     registration=msg.registration, stream=msg.stream, last_seen=now,
                     fd=fd, fd_ino=ino, window=msg.window, max_bytes=msg.max_bytes,
                     bundle=msg.bundle)
        c.envelope = self._envelope(c, 0)
        self.consumers.add(c)
        self.exact.reader(c.stream, ident, c.session)
        self._rr.setdefault(c.stream, deque()).append(ident)
        self._info.info("consumer %s joined stream %s (%d connected)", c.name, c.stream,
                        len(self.consumers))
        self._welcome(c)
        if applied is not None:
            self._applied(ident, msg.stream, applied)
        o = self.orphans.get(ident)
        if o is not None and o.items:
            # Its earlier registration's batches: it drops them (that registration is gone),
            # and its HELLO reported what it took of them. Served again, what is not settled.
            items, o.items = o.items, []
            self._requeue(o.stream, items)

    def _refuse_cursor(self, ident: bytes, reason: str, detail: str) -> None:
        """A registration or its cursor is refused: say so, and end it if it was welcomed (a
        cursor that waited for its stream's first producer: the consumer registers again
        with it, and is refused at once)."""
        self._control(ident, m.Refused(broker=self.instance, reason=reason,
                                       detail=detail[: self.limits.max_text_len]))
        self.drop(ident, "refused")

    def _alive(self, idents: list[bytes]) -> list[bytes]:
        """Those of ``idents`` whose connection is open (a probe to a closed one fails)."""
        out = []
        for ident in idents:
            if self._control(ident, m.Heartbeat(broker=self.instance)) == zmq.EHOSTUNREACH:
                self._gone(ident)
            else:
                out.append(ident)
        return out

    def _gone(self, ident: bytes) -> None:
        """``ident``'s connection is closed: whatever of it is left goes."""
        self.freed = True
        self.drop(ident, "unreachable")
        o = self.orphans.pop(ident, None)
        if o is not None:
            self._release(o)
        self.exact.forget(ident, gone=True)

    def _applied(self, ident: bytes, stream: str, a: Applied) -> None:
        """A consumer's cursor was applied: what is buffered that it settled (a report, a
        resume) or that is of another epoch (a resume) must not be served; and if its epoch
        ended while it was away, it hears so (it missed that EPOCH_END)."""
        coord = a.coordinator
        if a.resumed or a.settled is not None:
            self.buffer.discard(stream, lambda h: h.batch is not None
                                and not coord.servable(h.batch.key, h.batch.pipeline))
        if a.resumed:
            coord.holding(self.held_keys(stream))
        for epoch in a.ended:
            self.epoch_end(stream, epoch)
        if coord.complete(a.epoch) and a.epoch not in a.ended:
            self._control(ident, m.EpochEnd(broker=self.instance, epoch=a.epoch))

    def _void(self, stream: str) -> None:
        """What is buffered of ``stream`` that its coordinator would not serve now goes (a
        job's new launch voided the older one's units); what is still here counts as
        accepted, so that it is not made again.

        An EPOCH_END still queued goes too: it is of the older launch (a new launch's ends
        are queued after the view that brought it), and the consumers served after this are
        the new launch's (the older one's are refused), whose epoch is the checkpoint's: one
        that waited for its resume's answer, admitted now, would take it for the end of its
        own epoch and miss the rest of it. (It waits in the buffer behind batches, or while a
        restarted host recovers and serves nothing.)"""
        coord = self.exact.get(stream)
        if coord is None:
            return
        self.buffer.discard(stream, lambda h: isinstance(m.decode(h.frames[0]), m.EpochEnd)
                            if h.broadcast else h.batch is not None
                            and not coord.servable(h.batch.key, h.batch.pipeline))
        coord.holding(self.held_keys(stream))

    def held_keys(self, stream: str) -> set[tuple[int, int, int]]:
        items = list(self.buffer.items(stream))
        for c in self.consumers:
            if c.stream == stream:
                items += c.inflight
        for o in self.orphans.values():
            if o.stream == stream:
                items += o.items
        return {h.batch.key for h in items if h.batch is not None}

    def epoch_end(self, stream: str, epoch: int) -> None:
        """Tell every consumer of the stream, behind what is queued for it."""
        frame = m.encode(m.EpochEnd(broker=self.instance, epoch=epoch))
        self.buffer.push(stream, Held([frame], 0, 0, 0, 0, broadcast=True))

    def _welcome(self, c: Consumer) -> None:
        self._control(c.ident, m.Welcome(broker=self.instance, registration=c.registration))

    def _taken(self, c: Consumer, msg: m.Taken) -> None:
        if msg.registration != c.registration:
            return  # about a registration of this connection we no longer count
        c.waited = msg.waited / 1e6
        # Never more than was delivered: a consumer that counts a batch of an earlier
        # registration as taken is ahead of us. Refusing it would stall both sides; clamping
        # keeps its room within its window all the same.
        taken = max(c.taken, min(msg.taken, c.delivered))
        self.taken_since += taken - c.taken
        coord = self.exact.get(c.stream)
        # A bundle leaves ``inflight`` (and its bytes the count) once all of it was taken.
        left = taken - c.taken + c.head_taken
        while c.inflight and left >= c.inflight[0].count:
            item = c.inflight.popleft()
            left -= item.count
            c.inflight_bytes -= item.nbytes
            if coord is not None and item.batch is not None:
                for epoch in coord.settle(item.batch.key):
                    self.epoch_end(c.stream, epoch)
        c.taken, c.head_taken = taken, left
        if taken and c.ident in self.orphans:
            # It reads again: what it was sent before has left (and, exact, was dropped by
            # it as belonging to a registration it no longer has).
            self._release(self.orphans.pop(c.ident))

    # -- dispatch -----------------------------------------------------------------------
    def dispatch(self, now: float) -> int:
        """Send buffered items to consumers with room; returns the batches sent."""
        sent = 0
        for stream in self.buffer.streams():
            ring = self._rr.get(stream)
            if not ring:
                continue
            coord = self.exact.get(stream)
            if coord is not None and coord.recovering(now):
                continue
            while True:
                item = self.buffer.peek(stream)
                if item is None:
                    break
                if item.broadcast:
                    self.buffer.pop(stream)
                    for ident in list(ring):
                        if coord is None or not self.exact.waits(ident, stream):
                            self._send(ident, [item.frames[0]])
                    continue
                if coord is not None and item.batch is not None \
                        and not coord.of_plan(item.batch.pipeline):
                    # A replaced pipeline's batch (buffered, or served again from a consumer
                    # that had it): never a trainer's of the new one. Dropped, counted.
                    self.buffer.pop(stream)
                    self.metrics.replaced.labels(self.metrics.stream_label.label(stream)).inc(
                        item.count)
                    continue
                unit = item.nbytes - item.array_bytes + item.array_bytes // item.count
                if item.count > 1 and self._split(stream, ring, item, unit, True):
                    continue
                c = self._next(ring, item, unit, coord is None, stream)
                if c is None:
                    if item.count > 1 and self._split(stream, ring, item, unit, False):
                        continue
                    break
                self.buffer.pop(stream)
                env = self._envelope(c, item.gap) if item.gap else c.envelope
                status = self._send(c.ident, [env, *item.frames])
                if status:
                    self.buffer.requeue(stream, item)
                    if status == zmq.EHOSTUNREACH:
                        self.drop(c.ident, "unreachable")
                        continue
                    break  # its pipe is full: try again next round
                self._delivered(c, item, unit, now, coord is None)
                sent += item.count
        return sent

    def _split(self, stream: str, ring: deque[bytes], item: Held, unit: int,
               whole: bool) -> bool:
        """A bundle some consumer cannot be sent whole (``whole``), or else the part of it
        that fills one (:mod:`feedline.broker.parts`), in parts at the front of the buffer;
        True if split."""
        consumers = [c for c in map(self.consumers.get, ring)
                     if c is not None and not self.exact.waits(c.ident, stream)]
        sizes = parts.split_for(consumers, item, unit, self.cap_batches) if whole else \
            parts.fill_for([c for c in consumers if c.ident not in self.orphans], item, unit)
        if sizes is None:
            return False
        self.buffer.pop(stream)
        for part in reversed(parts.split(item, sizes, self.limits)):
            self.buffer.requeue(stream, part)
        self.metrics.split_bundles.inc()
        return True

    def _envelope(self, c: Consumer, gap: int) -> bytes:
        """The DELIVER frame in front of a batch to ``c`` that follows ``gap`` lost ones."""
        return m.encode(m.Deliver(broker=self.instance, gap=gap, registration=c.registration))

    def _next(self, ring: deque[bytes], item: Held, unit: int, deep: bool,
              stream: str) -> Consumer | None:
        for _ in range(len(ring)):
            ident = ring[0]
            ring.rotate(-1)
            c = self.consumers.get(ident)
            if c is None or (not deep and self.exact.waits(ident, stream)):
                continue  # a job's resume not answered yet: nothing for it
            if c.room(item.nbytes, self.cap, self.cap_batches, self.orphans.get(ident), deep,
                      item.count, unit):
                return c
        return None

    def _delivered(self, c: Consumer, item: Held, unit: int, now: float, deep: bool) -> None:
        c.delivered += item.count
        c.inflight.append(item)
        c.inflight_bytes += item.nbytes
        if deep and unit > c.largest:
            c.largest = unit
        c.last_sent = now
        self.metrics.forwarded_batches.inc(item.count)
        self.metrics.forwarded_bytes.inc(item.array_bytes)
        self.metrics.stream_batches.labels(self.metrics.stream_label.label(c.stream)).inc(
            item.count)

    # -- liveness -----------------------------------------------------------------------
    def liveness(self, now: float, interval: float, timeout: float) -> None:
        for c in self.consumers.expired(now, timeout):
            self.drop(c.ident, "timeout")
        for c in self.consumers.due(now, interval):
            if self._control(c.ident, m.Heartbeat(broker=self.instance)) == 0:
                c.last_sent = now
        for ident in list(self.orphans):
            # A probe: sending to a connection that is gone fails at once (ROUTER_MANDATORY).
            if self._control(ident, m.Heartbeat(broker=self.instance)) == zmq.EHOSTUNREACH:
                self._release(self.orphans.pop(ident))
                self.exact.forget(ident, gone=True)

    def _reclaimable(self) -> list[tuple[bytes, Orphan]]:
        """Orphans whose room may be taken back, oldest first: a training stream's, of a
        connection that has no registration now (its consumer was dropped: silent past the
        timeout, or refused). An exact stream's wait for their consumer (its report settles
        what it took of them); a connection registered again reads again, and its first
        TAKEN frees them."""
        return [(ident, o) for ident, o in self.orphans.items()
                if ident not in self.consumers and o.fd >= 0
                and self.exact.get(o.stream) is None]

    def reclaimable(self) -> tuple[int, int]:
        """(batches, bytes) that :meth:`reclaim` could free."""
        out = self._reclaimable()
        return sum(o.batches for _, o in out), sum(o.nbytes for _, o in out)

    def reclaim(self, batches: int, nbytes: int, needy: list[str]) -> tuple[int, int]:
        """Free at least ``batches`` and ``nbytes`` (as far as there is) of what consumers that
        are gone left in flight on training streams, for the read streams ``needy`` (which lack
        their floor): the connection of each, oldest first, is cut, so that libzmq frees
        what it still queues for it, and its batches leave the count. They were counted
        unconfirmed when it was dropped; if it wakes, it reconnects, registers again and is
        served again. Returns (batches, bytes) freed.

        Before, a consumer paused past the timeout kept its window of batches counted for as
        long as it was away: about 500 small batches in flight to one held a stream of
        2.4 MB batches, whose budget counts 111, at 0 batches."""
        freed_b = freed_y = 0
        for ident, o in self._reclaimable():
            if freed_b >= batches and freed_y >= nbytes:
                break
            del self.orphans[ident]
            # The descriptor checked by inode: a connection already closed frees itself.
            if cut_off(o.fd, o.fd_ino):
                self.metrics.cut_off.labels("consumer", "silent").inc()
            self._release(o)
            freed_b, freed_y = freed_b + o.batches, freed_y + o.nbytes
            self._log.warning(
                "consumer %s of stream %s, dropped (no registration now), had %d batches "
                "(%d bytes) in flight: its connection is cut to make room for %s (read, "
                "below its floor); if it wakes it registers again and is served again",
                o.name, o.stream, o.batches, o.nbytes, ", ".join(sorted(needy)))
        return freed_b, freed_y

    def _release(self, o: Orphan) -> None:
        """An orphan's memory is free; an exact stream's batches in it are served again."""
        self.freed = True
        items, o.items = o.items, []
        self._requeue(o.stream, items)

    def _requeue(self, stream: str, items: list[Held]) -> None:
        """Exact batches back to the front of the buffer, but those settled meanwhile (a
        consumer took them and reported so, or a resume said they were taken): never twice."""
        coord = self.exact.get(stream)
        for item in reversed(items):
            if coord is None or item.batch is None or coord.servable(item.batch.key,
                                                                     item.batch.pipeline):
                self.buffer.requeue(stream, item)

    def drop(self, ident: bytes, reason: str) -> None:
        c = self.consumers.remove(ident)
        if c is None:
            return
        self.freed = True
        ring = self._rr.get(c.stream)
        if ring is not None and ident in ring:
            ring.remove(ident)
            if not ring:
                del self._rr[c.stream]
        self._info.info("consumer %s %s (%s)", c.name,
                        "left" if reason in DEPARTED else "dropped", reason)
        self.metrics.dropped_peers.labels("consumer", reason).inc()
        self.exact.unread(ident)
        self.exact.forget(ident, gone=reason in ("bye", "unreachable"))
        unacked = c.delivered - c.taken
        if reason not in DEPARTED:
            self.metrics.unconfirmed.labels("consumer").inc(max(0, unacked))
        if c.inflight_bytes or c.inflight:
            o = self.orphans.setdefault(ident, Orphan(0, 0, c.fd, c.fd_ino, c.stream,
                                                      name=c.name))
            o.nbytes += c.inflight_bytes
            o.batches += unacked
            if self.exact.get(c.stream) is not None:
                o.items += list(c.inflight)
            if reason == "bye":  # it closes its socket: nothing of ours stays there
                self._release(self.orphans.pop(ident))
            elif len(self.orphans) > self.consumers.capacity:
                oldest = self.orphans.pop(next(iter(self.orphans)))
                self._cut_off(oldest.fd, oldest.fd_ino, "consumer", "orphans")
                self._release(oldest)

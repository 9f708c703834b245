"""The producer's side of the client loop: credit, sending, and what the broker says back.

Runs in the producer's I/O thread (:class:`feedline.transport.client.ClientLoop`), so heartbeats and
credit bookkeeping go on however long the pipeline takes to make the next batch. The owner
thread hands batches over through :class:`Outbox` (bounded: at most one waits there, one more
is held here); this side sends each to a broker whose credit covers it.

Wake-ups: the owner sleeps only while the backlog is full, and is woken only if it sleeps;
the I/O thread is woken when the backlog turns non-empty, unless it holds a batch waiting for
credit (a grant wakes it then). The backlog holds 32 items within 4 MiB (always one): with a
one-item backlog the two threads took turns for every batch, and once a direct-mode trainer
counted small batches by their bytes that was their limit (direct mode, 16 KB: 7,768 ->
18,553 batches/s; 150 KB: 4,421 -> 8,008; docs/performance.md); 32 let bundles grow (below).
Every item in it is a produced batch that a killed producer takes with it: at most 32,
within 4 MiB.

Bundles: to a host whose WELCOME offers them (a direct-mode trainer), the training batches
waiting behind the one being sent, of its layout and epoch and covered by credit, go with it
in one message (feedline.protocol.bundle), within BUNDLE_BYTES. If that send fails (not connected,
pipe full), the batches taken for it wait in ``_ahead`` and go first next time, in order.

One :class:`Channel` per broker (a producer may serve several: each batch goes to one of
them, by credit, so a faster training host gets more). Credit is two absolute totals since
the registration's HELLO, batches and bytes: a batch goes out only if both cover it. A batch
larger than its byte credit asks for more (WANT); credit the broker takes back (REVOKE) is
answered with what was sent (RETURNED). Grants of an earlier registration or of a replaced
broker are ignored.
"""

from __future__ import annotations

import logging
import queue
import time
from collections import deque

import zmq

from feedline.errors import AddressError, FeedlineError
from feedline.errors import BatchTooLarge as BatchTooLarge
from feedline.logs import RateLimitedLog
from feedline.producer.bundling import gather
from feedline.producer.leaving import BYE_SECONDS, Leaving
from feedline.producer.outbox import (
    BatchItem,
    ControlItem,
    Item,
    Outbox,
    SkipItem,
    UnitAsk,
    UnitEnd,
)
from feedline.producer.targets import Targets
from feedline.protocol import messages as m
from feedline.protocol import wire
from feedline.protocol.bundle import bundle_frames
from feedline.protocol.refusals import EXACT_PRODUCER_FATAL, PRODUCER_FATAL
from feedline.security import ClientKeys
from feedline.transport.link import Link, LinkConfig

log = logging.getLogger(__name__)
_CONTROL_SECONDS = 2.0  # how long EOS/ERROR wait for a connected broker, at most



class Channel:
    """Credit and sequence numbers towards one broker."""

    def __init__(self, link: Link) -> None:
        self.link = link
        self.seq = 0  # next sequence number (per broker: each counts its own gaps)
        self.welcome: m.Welcome | None = None
        self.reset_credit()

    def reset_credit(self) -> None:
        self.granted = self.granted_bytes = self.sent = self.sent_bytes = 0
        self.asked = 0  # the size of the last WANT, until a grant answers it
        self.largest_sent = 0  # the largest batch sent since the broker last marked us idle

    @property
    def credit(self) -> int:
        return self.granted - self.sent if self.link.welcomed else 0

    def covers(self, size: int) -> bool:
        return self.credit > 0 and self.sent_bytes + size <= self.granted_bytes

    def granted_unasked(self, size: int) -> bool:
        """The broker grants this batch's credit without a WANT: it gives a producer that
        has sent since it registered (or gave credit back) one credit as room frees, worth
        at least the largest batch it sent (broker/credit.py). So a producer that keeps up
        with its trainer does not ask for every batch (a message each way per batch, and
        work for the trainer's I/O thread in direct mode). Byte credit short of a larger
        batch, and a producer the broker holds idle, still ask."""
        return self.credit <= 0 and 0 < size <= self.largest_sent

    def too_small(self, size: int) -> bool:
        """The broker said it can never take a batch of ``size`` bytes."""
        w = self.welcome
        return w is not None and w.max_batch_bytes > 0 and size > w.max_batch_bytes


class ProducerIO:
    """The producer's role in the client loop (I/O thread only)."""

    def __init__(self, ctx: zmq.Context, targets: Targets, cfg: LinkConfig,
                 curve: ClientKeys | None, outbox: Outbox) -> None:
        self.out, self.targets = outbox, targets
        self._ctx, self._cfg, self._curve = ctx, cfg, curve
        self._packed_id = wire.packb(outbox.producer_id)
        self._log = RateLimitedLog(log, interval=10.0)
        self.channels = [self._channel(ctx, addr, cfg, curve) for addr in targets.endpoints()]
        self._head: Item | None = None
        self._head_since = time.monotonic()
        self._credit_log = RateLimitedLog(log, interval=60.0)
        self._control_until = 0.0
        self._rr = 0
        self._synced = time.monotonic()
        self._leaving = Leaving(outbox.producer_id)  # targets left, until their answer to BYE
        # Batches taken from the backlog for a bundle that could not be sent: sent first.
        self._ahead: deque[Item] = deque()
        self._max_arrays = cfg.limits.max_arrays

    def _sync_targets(self) -> None:
        """Follow the endpoints behind the addresses (a DNS name's hosts come and go)."""
        now = time.monotonic()
        if now - self._synced < 1.0:
            return
        self._synced = now
        wanted = self.targets.endpoints()
        have = {ch.link.addr: ch for ch in self.channels}
        for ch in [c for a, c in have.items() if a not in wanted]:
            log.info("%s: %s is gone from the targets; leaving it", self.out.producer_id,
                     ch.link.addr)
            # BYE, and the link closed once the broker answered (leaving.py says why): what
            # was sent there arrives, if the host is still up to take it.
            self._leaving.add(ch.link, self._bye_seconds(), now)
            self.channels.remove(ch)
        for addr in wanted:
            if addr not in have:
                log.info("%s: serving a new target %s", self.out.producer_id, addr)
                self.channels.append(self._channel(self._ctx, addr, self._cfg, self._curve))

    def _channel(self, ctx: zmq.Context, addr: str, cfg: LinkConfig,
                 curve: ClientKeys | None) -> Channel:
        holder: list[Channel] = []

        def hello(registration: int) -> m.ProducerHello:
            ch = holder[0] if holder else None
            x = self.out.exact
            return m.ProducerHello(
                producer=self.out.producer_id, session=self.out.session,
                next_seq=ch.seq if ch else 0, max_batch_bytes=self.out.largest,
                stream=self.out.stream, registration=registration,
                last_broker=(ch.link.broker_id or 0) if ch else 0,
                delivery=x.delivery if x else m.TRAINING, dataset_size=x.dataset_size if x else 0,
                unit_size=x.unit_size if x else 0, epochs=x.epochs if x else 0,
                pipeline=x.fingerprint if x and x.fingerprint else self.out.pipeline,
                fleet=self.out.fleet[0], fleet_max=self.out.fleet[1],
                age_ms=max(1, int((time.monotonic() - self.out.started) * 1000)))

        def registered(_registration: int) -> None:
            if holder:
                holder[0].reset_credit()
            self.out.metrics.registrations.inc()

        link = Link(ctx, addr, hello, cfg, curve=curve, on_register=registered,
                    on_reject=lambda reason: self.out.metrics.rejected.labels(reason).inc(),
                    what=f"producer {self.out.producer_id}")
        holder.append(Channel(link))
        return holder[0]

    # -- the loop's callbacks -----------------------------------------------------------
    def sockets(self) -> list[zmq.Socket]:
        return []

    def on_ready(self, ready: list[zmq.Socket]) -> None:
        pass

    def links(self) -> list[Link]:
        return [ch.link for ch in self.channels]

    def on_message(self, link: Link, msg: m.Message, frames: list[zmq.Frame]) -> None:
        ch = next(c for c in self.channels if c.link is link)
        if isinstance(msg, m.Welcome):
            ch.welcome = msg
        elif isinstance(msg, m.Grant):
            if msg.registration == link.registration:
                ch.granted = max(ch.granted, msg.batches)
                ch.granted_bytes = max(ch.granted_bytes, msg.nbytes)
                ch.asked = 0
        elif isinstance(msg, m.Revoke):
            if msg.registration == link.registration:
                ch.granted, ch.granted_bytes, ch.asked = ch.sent, ch.sent_bytes, 0
                ch.largest_sent = 0  # idle at the broker now: more credit only when asked
                link.send_msg(m.Returned(sent=ch.sent, sent_bytes=ch.sent_bytes,
                                         registration=link.registration))
        elif isinstance(msg, m.Refused):
            self._refused(ch, msg)
        elif isinstance(msg, (m.Unit, m.UnitWait)):
            if msg.registration == link.registration:
                try:
                    self.out.units.put_nowait(msg)
                except queue.Full:  # the owner asks one at a time: a stray answer
                    pass
        else:
            self.out.metrics.rejected.labels("unexpected_kind").inc()
        # Nothing sent from here: on_tick, later in the same turn, sends what a grant allows
        # (once for all the messages read, not once for each).

    def _refused(self, ch: Channel, msg: m.Refused) -> None:
        self.out.metrics.refused.labels(msg.reason).inc()
        # A refused batch leaves us idle at the broker (more credit only when asked): ask
        # for the next batch's credit instead of waiting for a grant nobody sends. (Any other
        # refusal ends the registration or the producer; an extra WANT costs nothing.)
        ch.largest_sent = 0
        if self.out.exact is not None and msg.reason in EXACT_PRODUCER_FATAL \
                and not ch.link.welcomed and ch is self.channels[0]:
            # An exact stream's registration refused for a reason no retry changes: the
            # owner raises it (one line) instead of waiting for a broker that said no.
            # Not "exact": a training producer that claims its shards asks for units too.
            self.out.error = FeedlineError(f"the broker at {ch.link.addr} refused this "
                                           f"producer ({msg.reason}): {msg.detail}")
            self.out.refused = True
        if msg.reason in PRODUCER_FATAL and not ch.link.welcomed:
            # A consumer's address (a broker's egress): no retry changes that. One line,
            # raised by the owner, instead of a producer that waits there for ever.
            self.out.error = AddressError(f"{ch.link.addr} refused this producer "
                                          f"({msg.reason}): {msg.detail}")
            self.out.refused = True
        if msg.reason == "batch_too_large":
            ch.welcome = m.Welcome(broker=msg.broker, max_batch_bytes=msg.limit,
                                   registration=ch.link.registration)
        if not ch.link.welcomed:
            return  # our registration refused: the link said so, once, at WARNING
        self._log.warning("broker %s refused %s: %s%s", ch.link.addr,
                          f"batch {msg.seq}" if msg.seq >= 0 else "a message", msg.reason,
                          f" ({msg.detail})" if msg.detail else "")

    def on_wake(self) -> None:
        pass  # on_tick follows in the same turn of the loop, after the messages: it sends

    def _pump(self) -> None:
        """Send what was handed over, in order, as far as credit allows."""
        out = self.out
        while True:
            if self._head is None:
                if self._ahead:
                    self._head = self._ahead.popleft()
                else:
                    try:
                        self._head = out.items.get_nowait()
                    except queue.Empty:
                        break
                out.holding = True
                self._head_since = time.monotonic()
            sent = self._send(self._head)
            if not sent:
                break
            self._head = None
            out.done += sent
            out.holding = False  # before looking at the backlog again (Outbox.holding)
        out.credit = sum(ch.credit for ch in self.channels)
        if self._head is None and out.done >= out.handed and not out.idle.is_set():
            out.idle.set()

    def on_tick(self) -> None:
        self._sync_targets()
        if self._leaving:
            self._leaving.tick(time.monotonic())
        self._pump()
        self._waiting()

    def _waiting(self) -> None:
        """Say so when a batch has waited long for credit: which side is slow."""
        now = time.monotonic()
        if not isinstance(self._head, BatchItem):
            self._head_since = now
            return
        waited = now - self._head_since
        if waited < self._cfg.credit_warn:
            return
        if not any(ch.link.welcomed for ch in self.channels):
            return  # the link says it cannot reach a broker: that is the story
        self._credit_log.warning(
            "%s: no credit for %.0fs: the training side takes batches slower than this "
            "producer makes them, or no training process is connected to %s (not a fault: "
            "feedline_producer_credit_wait_seconds shows how often)", self.out.producer_id,
            waited, ", ".join(ch.link.addr for ch in self.channels))

    def _send(self, item: Item) -> int:
        """Send ``item`` (and the items a bundle takes with it); how many were sent."""
        if isinstance(item, SkipItem):
            for ch in self.channels:
                ch.seq += item.n
            return 1
        if isinstance(item, (UnitAsk, UnitEnd)):
            return int(self._send_unit(item))
        if isinstance(item, ControlItem):
            return int(self._send_control(item.msg))
        return self._send_batch(item)

    def _send_batch(self, item: BatchItem) -> int:
        size = item.prepared.wire_bytes
        ready = [ch for ch in self.channels if ch.covers(size)]
        if item.unit >= 0:
            ready = ready[:1] if self.channels and ready and ready[0] is self.channels[0] else []
        if not ready:
            if self.channels and all(ch.too_small(size) for ch in self.channels):
                limits = sorted({ch.welcome.max_batch_bytes for ch in self.channels
                                 if ch.welcome})
                self.out.error = BatchTooLarge(
                    f"a batch of {size / 2**20:.1f} MiB is larger than what the broker can "
                    f"hold (--max-bytes {', '.join(f'{x / 2**20:.1f} MiB' for x in limits)}): "
                    "raise the broker's --max-bytes or make batches smaller")
                return 1  # dropped: the owner raises
            for ch in self.channels:
                if ch.link.welcomed and ch.asked != size and not ch.covers(size) \
                        and not ch.too_small(size) and not ch.granted_unasked(size):
                    if ch.link.send_msg(m.Want(sent=ch.sent, sent_bytes=ch.sent_bytes,
                                               size=size, registration=ch.link.registration)):
                        ch.asked = size
            return 0
        self._rr += 1
        ch = max(ready, key=lambda c: (c.credit, (self._rr + self.channels.index(c))
                                       % len(self.channels)))
        if item.unit < 0 and ch.welcome is not None and ch.welcome.bundle > 1:
            more = gather(item, ch.welcome, ch.credit, ch.granted_bytes - ch.sent_bytes,
                          self._max_arrays, self._ahead, self.out.items)
            if more:
                return self._send_bundle(ch, [item, *more], ch.welcome.join)
        frames = item.prepared.frames(producer=self._packed_id, session=self.out.session,
                                      seq=ch.seq, epoch=item.epoch, unit=item.unit,
                                      index=item.index, last=item.last,
                                      pipeline=item.pipeline, lineage=item.lineage)
        if not ch.link.send_frames(frames, copy=False):
            return 0  # not connected or pipe full: keep it, the link recovers
        self._sent(ch, [item], len(frames[0]))
        return 1

    def _sent(self, ch: Channel, items: list[BatchItem], header_bytes: int) -> None:
        n, nbytes = len(items), sum([it.prepared.nbytes for it in items])
        ch.seq += n
        ch.sent += n
        # What the broker counts: the bytes sent, not the bound that credit had to cover (the
        # difference, a few bytes a batch, would add up to a WANT for every batch).
        ch.sent_bytes += header_bytes + nbytes
        ch.largest_sent = max(ch.largest_sent, items[0].prepared.wire_bytes)  # one layout
        self.out.metrics.sent_batches.inc(n)
        self.out.metrics.sent_bytes.inc(nbytes)
        self.out.sent += n
        self.out.sent_bytes += nbytes

    def _send_bundle(self, ch: Channel, items: list[BatchItem], join: int) -> int:
        frames = bundle_frames([it.prepared for it in items], producer=self._packed_id,
                               session=self.out.session, seq=ch.seq, epoch=items[0].epoch,
                               join=join)
        if not ch.link.send_frames(frames, copy=False):
            self._ahead.extendleft(reversed(items[1:]))  # sent first next time, in order
            return 0
        self._sent(ch, items, len(frames[0]))
        self.out.metrics.sent_bundles.inc()
        return len(items)

    def _send_unit(self, item: UnitAsk | UnitEnd) -> bool:
        """Exact delivery speaks to one broker: the first channel (several hosts would need a
        coordinator they share; docs/tensorflow.md)."""
        ch = self.channels[0]
        if not ch.link.welcomed:
            return False
        reg = ch.link.registration
        msg: m.Message = (m.UnitRequest(registration=reg, first=item.first, ask=item.ask)
                          if isinstance(item, UnitAsk) else
                          m.UnitDone(epoch=item.epoch, unit=item.unit, batches=item.batches,
                                     registration=reg, empty=list(item.empty)))
        return ch.link.send_msg(msg)

    def _send_control(self, msg: m.Eos | m.Error) -> bool:
        now = time.monotonic()
        if self._control_until == 0.0:
            self._control_until = now + _CONTROL_SECONDS
        targets = [ch for ch in self.channels if ch.link.welcomed]
        if not targets and now < self._control_until:
            return False
        sent = [ch.link.send_msg(msg) for ch in targets]
        if not any(sent):
            log.warning("could not tell any broker %s (not connected)", type(msg).__name__)
        self._control_until = 0.0
        return True

    def on_close(self) -> None:
        # BYE, then its answer (bounded): a connection closed with a GRANT unread is reset,
        # and the reset would throw away our last batch and the BYE (leaving.py says more).
        told = [ch.link for ch in self.channels
                if ch.link.send_msg(m.Bye()) and ch.link.welcomed]
        left = self._leaving.close(self._bye_seconds(), told)
        if left:
            log.debug("%s: %d broker(s) did not answer BYE in time", self.out.producer_id, left)
        self.out.bye_unanswered = left
        # For the exit summary: a target no broker ever answered on is named with why.
        self.out.unreached = [ch.link.explain() for ch in self.channels
                              if ch.link.reach.welcomed_at is None]

    def _bye_seconds(self) -> float:
        return min(BYE_SECONDS, self._cfg.flush_ms / 1000)

"""What a producer is handed to make: exact streams' units and training streams' shard claims.

Both are asked for the same way and routed here by the stream's delivery (:class:`Units`,
:meth:`Units.route`).

Exact units. A producer asks for a unit (UNIT_REQUEST, numbered: the answer echoes the number)
and is answered with one (UNIT), or told why not (UNIT_WAIT: ``busy``, the epoch's last units
are in progress elsewhere or the broker is recovering; ``finished``, its run is served). One
told ``busy`` is remembered, and sent its unit as soon as the coordinator may have one (its
``progress`` moved: the next epoch began, a unit was given back): an epoch's end then costs no
producer a backoff, only a message. A producer that does not number its requests asks again by
itself.

Shard claims. A training producer whose source reads shards declares how many
(``dataset_size`` in its HELLO, delivery ``training``) and asks for units as exact delivery's
producers do (UnitRequest -> Unit). Unlike exact delivery nothing is tracked per batch: a unit
is handed out once per epoch and is the producer's from the moment it acknowledges it
(UnitDone, sent as it starts reading): at most once, as the training mode is. A unit handed
out and not yet acknowledged goes to the next producer that asks if its owner is gone (the
answer was lost with the connection, or the producer died before it started), and to the owner
again if it asks again. The epoch moves on when every unit of it was handed out: producers
never wait at an epoch's end for the slowest one (a producer still reading the last shard of
epoch ``e`` while the others start ``e + 1`` is expected).

The state is two integers per stream and one pending unit per producer; it lives in the
broker's memory: a restarted broker starts the stream's claims at epoch 0 (its producers go on
with what they hold).

A table's lifetime is its producers': once its last producer left it lingers :data:`LINGER`
seconds (a producer restarted, or one whose link was down past the heartbeat timeout, goes on
where the stream was), then the next producer of the stream starts a fresh one at epoch 0. A
table whose run is served (every epoch handed out) goes at once with its last producer: the
same pipeline run again (the next job) is served again. A producer with another shard list
(another count, or another list's fingerprint) starts a fresh table if the old one's producers
are gone; while they are attached it waits for them if none of them has been heard from since
it first asked (they were killed: the heartbeat timeout drops them,
:mod:`feedline.exact.succession`), and is refused, with a line naming both lists, if one has
(it still reads). A producer that registers after the run was handed out is of that run if it
started before (it lost the race to a faster one of its job: told ``finished``), and of the
next run if it started after (or did not say when it started): it is told ``busy`` until the
run's producers are gone, then starts it."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from feedline.errors import Refusal
from feedline.exact import (
    WAIT,
    Assignment,
    Coordinator,
    ExactPlan,
    ExactStreams,
    NoUnit,
    Succession,
)
from feedline.protocol import messages as m
from feedline.serving.peers import Peer

log = logging.getLogger(__name__)

MAX_STREAMS = 256  # claim tables kept; the oldest idle one goes first beyond that
# Seconds a claim table outlives its last producer (unless its run was served): what a
# producer that restarts (or whose link was down past the heartbeat timeout) needs to find its
# stream where it was. A producer of the stream that comes later starts at epoch 0.
LINGER = 30.0


@dataclass
class Claims:
    """One training stream's shard claims."""

    units: int
    epochs: int = 0  # 0: forever
    epoch: int = 0
    next: int = 0
    fingerprint: int = 0  # of the shard list (0: not said)
    handed: dict[bytes, tuple[int, int]] = field(default_factory=dict)  # owner -> unacked
    returned: list[tuple[int, int]] = field(default_factory=list)
    members: set[bytes] = field(default_factory=set)  # its registered producers
    next_run: set[bytes] = field(default_factory=set)  # members of the next run
    left: float = 0.0  # when its last producer left (with no members)
    served_at: float | None = None  # when its run was last handed out (time.monotonic())

    @property
    def finished(self) -> bool:
        """Every epoch of its run was handed out."""
        return bool(self.epochs) and self.epoch >= self.epochs

    def request(self, owner: bytes) -> Assignment | NoUnit:
        """A unit for ``owner``, ``finished`` once every epoch was handed out; ``busy`` for a
        producer of the next run while the served run's producers are still attached."""
        got = self.handed.get(owner)
        if got is None and owner in self.next_run:
            if self.members - self.next_run:
                return NoUnit.BUSY
            self._next_run()
        if got is None and self.returned:
            got = self.returned.pop(0)
        if got is None:
            if self.finished:
                return NoUnit.FINISHED
            got = (self.epoch, self.next)
            self.next += 1
            if self.next >= self.units:
                self.epoch, self.next = self.epoch + 1, 0
                if self.finished:
                    self.served_at = time.monotonic()
        self.handed[owner] = got
        return Assignment(got[0], got[1], 0)

    def _next_run(self) -> None:
        """The served run's producers are gone: the next run's start it, at epoch 0."""
        self.epoch, self.next, self.handed, self.returned = 0, 0, {}, []
        self.next_run.clear()

    def ack(self, owner: bytes, epoch: int, unit: int) -> None:
        """``owner`` started reading the unit: it is no longer anybody else's."""
        if self.handed.get(owner) == (epoch, unit):
            del self.handed[owner]

    def answer(self, owner: bytes, msg: m.UnitRequest | m.UnitDone, broker: int,
               registration: int) -> m.Unit | m.UnitWait | None:
        """The reply to a producer's UnitRequest (a unit, or why none), None to a UnitDone
        (its acknowledgement) or to a message of an earlier registration."""
        if msg.registration != registration:
            return None
        if isinstance(msg, m.UnitDone):
            self.ack(owner, msg.epoch, msg.unit)
            return None
        got = self.request(owner)
        if isinstance(got, str):
            return m.UnitWait(broker=broker, reason=got, registration=registration)
        return m.Unit(broker=broker, epoch=got.epoch, unit=got.unit, start=0,
                      registration=registration)

    def release(self, owner: bytes) -> None:
        """``owner`` is gone: a unit it never acknowledged goes to the next that asks."""
        got = self.handed.pop(owner, None)
        if got is not None:
            self.returned.append(got)


class ClaimStreams:
    """The claim tables of a broker's training streams that read shards. ``succession``: what
    tells a killed producer of an old shard list from a running one (None: every registered
    one runs)."""

    def __init__(self, linger: float = LINGER, succession: Succession | None = None) -> None:
        self.streams: dict[str, Claims] = {}
        self.linger = linger
        self.succession = succession

    def get(self, stream: str) -> Claims | None:
        return self.streams.get(stream)

    def join(self, stream: str, units: int, epochs: int, owner: bytes, fingerprint: int = 0,
             now: float | None = None, started: float | None = None) -> Claims:
        """The stream's table for a producer that reads ``units`` shards (``fingerprint``: of
        their list, 0 if not said; ``started``: when it started, on the clock of ``now``, None
        if not said); :class:`Refusal` (one line: what to do) if it may not join now."""
        now = time.monotonic() if now is None else now
        c = self.streams.get(stream)
        if c is not None and not c.members:
            why = self._stale(c, units, fingerprint, now)
            if why:
                log.info("stream %s: a fresh claim table (%s)", stream, why)
                del self.streams[stream]
                c = None
        if c is None:
            if len(self.streams) >= MAX_STREAMS:
                idle = [s for s, t in self.streams.items() if not t.members]
                if not idle:
                    raise Refusal("too_many_streams",
                                  f"more than {MAX_STREAMS} streams read shards through this "
                                  "broker: stop the producers of a stream nobody reads, or use "
                                  "another broker")
                del self.streams[idle[0]]
            c = self.streams[stream] = Claims(units, epochs, fingerprint=fingerprint)
        elif c.units != units or _differ(c.fingerprint, fingerprint):
            self._another_list(stream, c, units, fingerprint, now)
        if self.succession is not None:
            self.succession.settled(stream)
        if c.finished and owner not in c.members and not (
                started is not None and c.served_at is not None and started < c.served_at):
            c.next_run.add(owner)  # once this run's producers are gone
        c.members.add(owner)
        return c

    def _another_list(self, stream: str, c: Claims, units: int, fingerprint: int,
                      now: float) -> None:
        """A producer of another shard list than ``c``'s, whose producers are attached: told
        to wait for them if they went silent, refused if one of them reads (Refusal, both)."""
        ours, theirs = _list(units, fingerprint), _list(c.units, c.fingerprint)
        left = None if self.succession is None else \
            self.succession.wait(stream, c.members, now)
        if left is not None:
            raise Refusal(WAIT, f"stream {stream!r} reads {theirs}, and its {len(c.members)} "
                          f"producer(s) have been silent since this producer ({ours}) first "
                          f"asked: it waits for the old list's claims to end, at most "
                          f"{left:.1f}s more (the broker drops silent producers at its heartbeat "
                          "timeout), then starts a fresh claim table")
        raise Refusal("delivery_mismatch",
                      f"stream {stream!r} reads {theirs} and {len(c.members)} of its producers "
                      f"are still attached; this producer reads {ours}: stop the stream's "
                      "other producers first (a fresh claim table starts once they are "
                      "gone), or give this pipeline another stream")

    def _stale(self, c: Claims, units: int, fingerprint: int, now: float) -> str:
        """Why the idle table ``c`` goes for a producer that joins now ('' if it stays)."""
        if c.units != units or _differ(c.fingerprint, fingerprint):
            return f"{units} shards now, {c.units} before: the shard list changed"
        if c.finished:
            return "its run was served and its producers left: the next run"
        if now - c.left >= self.linger:
            return f"its producers left {now - c.left:.0f}s ago (more than {self.linger:.0f}s)"
        return ""

    def leave(self, stream: str, owner: bytes, now: float | None = None) -> None:
        """A producer of the stream is gone (a no-op for one that does not read shards)."""
        c = self.streams.get(stream)
        if c is not None and owner in c.members:
            c.members.discard(owner)
            c.next_run.discard(owner)
            c.release(owner)
            if not c.members:
                c.left = time.monotonic() if now is None else now


def _list(units: int, fingerprint: int) -> str:
    return f"{units} shards" + (f" (list {fingerprint:x})" if fingerprint else "")


def _differ(a: int, b: int) -> bool:
    """Two shard lists' fingerprints differ (0: not said, matches any)."""
    return bool(a and b and a != b)


def admit(exact: ExactStreams, claims: ClaimStreams, ident: bytes,
          msg: m.ProducerHello) -> None:
    """A producer's delivery agrees with its stream's: a stream is exact or not, for every
    producer of it, with one pipeline; the host has room for its state; a training producer
    that claims shards declares the stream's shards. :class:`Refusal` if not (or, reason
    ``wait_old_producers``, not yet)."""
    now = time.monotonic()
    started = now - msg.age_ms / 1000 if msg.age_ms else None
    if msg.delivery == m.EXACT:
        exact.join(msg.stream, ExactPlan(msg.dataset_size, msg.unit_size, msg.epochs,
                                         msg.pipeline), now, ident, msg.session, started)
        return
    exact.training_may_join(msg.stream)
    if msg.dataset_size > 0:  # a training producer that claims its shards
        claims.join(msg.stream, msg.dataset_size, msg.epochs, ident, msg.pipeline, now,
                    started)

Control = Callable[[bytes, m.Message], int]


class Units:
    """The unit requests of exact streams' producers (``control`` sends one a message,
    ``epoch_end(stream, epoch)`` tells a stream's consumers an epoch is complete)."""

    def __init__(self, exact: ExactStreams, control: Control, instance: int,
                 epoch_end: Callable[[str, int], None],
                 claims: ClaimStreams | None = None) -> None:
        self.exact, self._control, self.instance = exact, control, instance
        self.claims = claims if claims is not None else ClaimStreams()
        self._epoch_end = epoch_end
        # producers told "busy": ident -> (the coordinator's progress then, request, first)
        self._waiting: dict[bytes, tuple[int, int, bool]] = {}

    def route(self, p: Peer, msg: m.UnitRequest | m.UnitDone) -> None:
        """A producer's UNIT_REQUEST or UNIT_DONE: answered by its training stream's shard
        claims, or by its exact stream's coordinator (:meth:`message`); refused on a stream
        that is neither."""
        c = self.exact.get(p.stream)
        claims = self.claims.get(p.stream) if c is None else None
        if claims is not None:  # a training producer claims a shard, or starts one
            reply = claims.answer(p.ident, msg, self.instance, p.registration)
            if reply is not None:
                self._control(p.ident, reply)
            return
        if c is None:
            raise Refusal("not_exact", f"{type(msg).__name__} on stream {p.stream}")
        self.message(p, c, msg)

    def message(self, p: Peer, c: Coordinator, msg: m.UnitRequest | m.UnitDone) -> None:
        """A producer of ``c``'s stream asks for a unit or says one is done."""
        if msg.registration != p.registration:
            return  # about an earlier registration on this connection
        if isinstance(msg, m.UnitDone):
            for epoch in c.unit_done(p.ident, msg.epoch, msg.unit, msg.batches, msg.empty):
                self._epoch_end(p.stream, epoch)
            return
        self._answer(p, c, msg.ask, msg.first, time.monotonic())

    def _answer(self, p: Peer, c: Coordinator, ask: int, first: bool, now: float,
                pushed: bool = False) -> None:
        """Answer request ``ask`` with a unit or why not (``pushed``: a try for one told
        ``busy``, which is not told so again)."""
        got = c.request(p.ident, now, first)
        if got is NoUnit.BUSY:
            if ask:
                self._waiting[p.ident] = (c.progress, ask, first)
            if not pushed:
                self._control(p.ident, m.UnitWait(broker=self.instance, reason=got.value,
                                                  registration=p.registration, ask=ask))
            return
        self._waiting.pop(p.ident, None)
        if isinstance(got, NoUnit):
            self._control(p.ident, m.UnitWait(broker=self.instance, reason=got.value,
                                              registration=p.registration, ask=ask))
        else:
            self._control(p.ident, m.Unit(broker=self.instance, epoch=got.epoch, unit=got.unit,
                                          start=got.start, registration=p.registration,
                                          ask=ask))

    def push(self, now: float, producers: Callable[[bytes], Peer | None]) -> None:
        """Try again for every producer told ``busy`` whose coordinator moved since."""
        for ident, (seen, ask, first) in list(self._waiting.items()):
            p = producers(ident)
            c = self.exact.get(p.stream) if p is not None else None
            if p is None or c is None:
                del self._waiting[ident]
            elif c.progress != seen:
                self._answer(p, c, ask, first, now, pushed=True)

    def waiting(self) -> bool:
        return bool(self._waiting)

    def forget(self, idents: Iterable[bytes]) -> None:
        for ident in idents:
            self._waiting.pop(ident, None)

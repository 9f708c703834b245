"""Shard claims for training streams: each unit (a shard) to one producer per epoch.

A training producer whose source reads shards declares how many (``dataset_size`` in its
HELLO, delivery ``training``) and asks for units as exact delivery's producers do
(UnitRequest -> Unit). Unlike exact delivery nothing is tracked per batch: a unit is handed
out once per epoch and is the producer's from the moment it acknowledges it (UnitDone, sent
as it starts reading): at most once, as the training mode is. A unit handed out and not yet
acknowledged goes to the next producer that asks if its owner is gone (the answer was lost
with the connection, or the producer died before it started), and to the owner again if it
asks again. The epoch moves on when every unit of it was handed out: producers never wait at
an epoch's end for the slowest one (a producer still reading the last shard of epoch ``e``
while the others start ``e + 1`` is expected).

The state is two integers per stream and one pending unit per producer; it lives in the
broker's memory: a restarted broker starts the stream's claims at epoch 0 (its producers go
on with what they hold).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from feedline import messages as m
from feedline.errors import Refusal
from feedline.serving.coordinator import Assignment, ExactPlan

if TYPE_CHECKING:
    from feedline.serving.exact_streams import ExactStreams

MAX_STREAMS = 256  # claim tables kept; the oldest idle one goes first beyond that


@dataclass
class Claims:
    """One training stream's shard claims."""

    units: int
    epochs: int = 0  # 0: forever
    epoch: int = 0
    next: int = 0
    handed: dict[bytes, tuple[int, int]] = field(default_factory=dict)  # owner -> unacked
    returned: list[tuple[int, int]] = field(default_factory=list)
    members: set[bytes] = field(default_factory=set)  # its registered producers

    def request(self, owner: bytes) -> Assignment | str:
        """A unit for ``owner``, ``finished`` once every epoch was handed out."""
        got = self.handed.get(owner)
        if got is None and self.returned:
            got = self.returned.pop(0)
        if got is None:
            if self.epochs and self.epoch >= self.epochs:
                return "finished"
            got = (self.epoch, self.next)
            self.next += 1
            if self.next >= self.units:
                self.epoch, self.next = self.epoch + 1, 0
        self.handed[owner] = got
        return Assignment(got[0], got[1], 0)

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
    """The claim tables of a broker's training streams that read shards."""

    def __init__(self) -> None:
        self.streams: dict[str, Claims] = {}

    def get(self, stream: str) -> Claims | None:
        return self.streams.get(stream)

    def join(self, stream: str, units: int, epochs: int, owner: bytes) -> Claims | str:
        """The stream's table for a producer that reads ``units`` shards, or why not."""
        c = self.streams.get(stream)
        if c is None:
            if len(self.streams) >= MAX_STREAMS:
                idle = [s for s, t in self.streams.items() if not t.members]
                if not idle:
                    return f"more than {MAX_STREAMS} streams read shards through this broker"
                del self.streams[idle[0]]
            c = self.streams[stream] = Claims(units, epochs)
        elif c.units != units:
            return (f"stream {stream!r} reads {c.units} shards; this producer reads {units}: "
                    "every producer of a stream must read the same shards")
        c.members.add(owner)
        return c

    def leave(self, stream: str, owner: bytes) -> None:
        """A producer of the stream is gone (a no-op for one that does not read shards)."""
        c = self.streams.get(stream)
        if c is not None and owner in c.members:
            c.members.discard(owner)
            c.release(owner)


def admit(exact: ExactStreams, claims: ClaimStreams, ident: bytes,
          msg: m.ProducerHello) -> None:
    """A producer's delivery agrees with its stream's: a stream is exact or not, for every
    producer of it, with one pipeline; the host has room for its state; a training producer
    that claims shards declares the stream's shards. :class:`Refusal` if not."""
    if msg.delivery == m.EXACT:
        exact.join(msg.stream, ExactPlan(msg.dataset_size, msg.unit_size, msg.epochs,
                                         msg.pipeline), time.monotonic(), ident, msg.session)
        return
    exact.training_may_join(msg.stream)
    if msg.dataset_size > 0:  # a training producer that claims its shards
        joined = claims.join(msg.stream, msg.dataset_size, msg.epochs, ident)
        if isinstance(joined, str):
            raise Refusal("delivery_mismatch", joined)

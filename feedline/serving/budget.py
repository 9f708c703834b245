"""The memory budget of a host that serves producers, and the shares taken of it.

A broker (``--max-batches``, ``--max-bytes``) and a direct-mode trainer (``window``,
``max_bytes``) each have one :class:`Budget`: everything its peers can make it hold
(batches buffered or queued, in flight to consumers, and the credit granted to producers)
is within ``max_batches`` batches and ``max_bytes`` bytes. Every part that takes a fraction of
it asks this object, so that each rule is written once and the memory formula in
docs/architecture.md is read off it:

- :attr:`Budget.new_producers`: what producers that have not sent a batch yet hold together
  (a quarter), so that registrations which never send cannot take the room of those that do;
- :attr:`Budget.per_consumer`: what one consumer may have in flight (half), so that one that
  never reads leaves the rest to the buffer and the other consumers;
- :meth:`Budget.per_stream`: what one stream may hold (held and granted) when several are
  produced: an equal part each, half of it for a stream nobody reads, and never less than
  :attr:`Budget.stream_floor` (a quarter) for a stream that is read, however many other
  streams there are;
- :meth:`Budget.max_message`: the largest message a producer or tensorpack may send (a batch
  never outgrows the whole budget); frames are weighed against it as they are read
  (:mod:`feedline.protocol.framing`).

tensorpack's ingress takes no share of its own: it is one more producer to the credit
planner (:mod:`feedline.serving.tensorpack`), within the same shares.

A broker's and a direct-mode trainer's windows count small batches by their bytes
(:func:`depth`; the credit planner's ``by_bytes``): a window of ``n`` batches holds ``n`` batches of
:data:`SMALL_BATCH` (8 MiB) or more, and as many smaller ones as fit in ``n`` x 8 MiB, at most
:data:`DEPTH` x ``n`` (so batches of 64 KiB and more count by their bytes alone). A 16 KB
batch costs its credit's round trip (two thread wake-ups) more than its copy: four of them in
flight leave the wire idle, while four 9.6 MB batches keep it busy; and a bundle of them
(:mod:`feedline.protocol.bundle`) is only as large as the credit a producer holds. Batches of 150 KB
to 1 MB still waited for credit with windows of ``n`` x 2 MiB (55 and 8 batches in flight at
the default 4): ``n`` x 8 MiB holds no more bytes than a window of 8 MiB batches, and less
than one of the 9.6 MB batches of 64 images. The bytes bound is unchanged; what a window's
count of small batches costs beyond their bytes is a Python object each.

Pure values: no clock, no sockets. Batches and bytes always come in that order.
"""

from __future__ import annotations

from dataclasses import dataclass

from feedline.errors import ConfigError
from feedline.protocol.codec import Limits
from feedline.verdict import MODEL_BOUND_ABOVE

SMALL_BATCH = 8 << 20  # bytes: a batch this large or larger counts as one in a window (was 2 MiB)
DEPTH = 128  # a window of n batches holds at most DEPTH x n small batches (was 16)


def depth(batches: int, unit: int) -> int:
    """How many batches of ``unit`` bytes a window of ``batches`` batches holds: ``batches``
    for batches of :data:`SMALL_BATCH` or more (or of a size not known yet, ``unit`` 0); as
    many smaller ones as fit in ``batches`` x :data:`SMALL_BATCH` bytes, at most :data:`DEPTH`
    x ``batches``."""
    if unit <= 0 or unit >= SMALL_BATCH:
        return batches
    return min(DEPTH * batches, max(batches, batches * SMALL_BATCH // unit))


TOP_UP = 8  # a window of w batches is topped up once w // TOP_UP of it is free (at least 1)
LEAST_GRANT = 6  # ... or once this many are, if that is more and at most a quarter of it


def top_up(window: int) -> int:
    """How much of a producer's window of ``window`` batches must be free before it gets
    more credit unasked: 1 for a window under 16 (of batches of 2 MiB or more: every batch
    taken is granted again at once), else an eighth of it or :data:`LEAST_GRANT` batches,
    whichever is more, but not more than a quarter of it. A GRANT is a plan and a message
    each way through two I/O threads; a producer that holds 3/4 of a deep window still has
    plenty in flight. (An eighth of the window of 1 MB batches, 31, is 3: a plan and a GRANT
    for every bundle of 3 batches; 6 halves them: +14% GB/s, docs/performance.md.)"""
    if window < 2 * TOP_UP:
        return 1
    return max(window // TOP_UP, min(window // 4, LEAST_GRANT))


def report_after(queued: int, window: int) -> int:
    """Takes a consumer's report (TAKEN) may wait for, with ``queued`` batches in its queue
    and a window of ``window``: a top-up of the window (what a producer's GRANT waits for:
    6 of the 31 of 1 MB batches), and only takes that leave the queue over three quarters
    full (:data:`feedline.verdict.MODEL_BOUND_ABOVE`). What a broker counts as held there,
    delivered and not reported, gives its bottleneck verdict and sizes the fleet: it then
    stays on the queue's side of that line. 1 (every take) for a window under 16 or a queue
    below the line. The broker then sends a top-up at once, whole bundles instead of
    batches split off them, and the consumer's I/O thread wakes for one report instead of
    one a take (docs/performance.md, "Takes reported by the top-up")."""
    return max(1, min(top_up(window), queued - int(window * MODEL_BOUND_ABOVE)))


@dataclass(frozen=True)
class Share:
    """A part of the budget: at most ``batches`` batches and ``nbytes`` bytes."""

    batches: int
    nbytes: int


@dataclass(frozen=True)
class Budget:
    """``max_batches`` batches and ``max_bytes`` bytes, both >= 1 (ConfigError otherwise)."""

    max_batches: int
    max_bytes: int

    def __post_init__(self) -> None:
        if self.max_batches < 1:
            raise ConfigError(f"the budget's batches must be >= 1, not {self.max_batches}")
        if self.max_bytes < 1:
            raise ConfigError(f"the budget's bytes must be >= 1, not {self.max_bytes}")

    def part(self, parts: int) -> Share:
        """One of ``parts`` equal parts (at least one batch and one byte)."""
        return Share(max(1, self.max_batches // parts), max(1, self.max_bytes // parts))

    def for_unit(self, unit: int) -> Budget:
        """This budget for batches of ``unit`` bytes: its batches counted by :func:`depth`."""
        batches = depth(self.max_batches, unit)
        return self if batches == self.max_batches else Budget(batches, self.max_bytes)

    @property
    def whole(self) -> Share:
        return Share(self.max_batches, self.max_bytes)

    @property
    def new_producers(self) -> Share:
        """Held together by producers that have not sent a batch yet: a quarter (at least one
        batch; one batch of any size fits while none of them holds anything)."""
        return Share(max(1, self.max_batches // 4), self.max_bytes // 4)

    @property
    def per_consumer(self) -> Share:
        """In flight to one consumer connection, at most: half."""
        return self.part(2)

    @property
    def stream_floor(self) -> Share:
        """What a stream that a consumer reads may always hold: a quarter, whatever other
        streams are registered, produced or hold (a broker evicts what unread streams hold
        when a read one lacks it: :meth:`feedline.broker.core.Broker._enforce_shares`)."""
        return self.part(4)

    def per_stream(self, streams: int, read: bool) -> Share:
        """A stream's share when ``streams`` streams (itself included) are produced: the whole
        budget for one alone; else an equal part, at least :attr:`stream_floor` for a stream
        that is read, and half an equal part for one that nobody reads (the rest of what it
        buffers is evicted: :meth:`feedline.serving.credit.CreditPlanner.shares`)."""
        k = max(1, streams)
        if k == 1:
            return self.whole
        if not read:
            return self.part(2 * k)
        equal, floor = self.part(k), self.stream_floor
        return Share(max(equal.batches, floor.batches), max(equal.nbytes, floor.nbytes))

    def max_message(self, limits: Limits) -> int:
        """The largest message (wire bytes, header included) a host reads: what the limits
        allow, and never more than the whole budget."""
        return min(self.max_bytes, limits.max_message_bytes + limits.max_header_bytes)

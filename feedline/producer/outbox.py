"""What the producer's owner thread hands its I/O thread: the items (a batch, an end, a
sequence skip, exact delivery's unit requests and ends) and :class:`Outbox`, the state both
threads share (the bounded backlog, the counts of items handed over and done, the error to
raise in the owner's next send). :mod:`feedline.producer.channel` is the I/O thread's side.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import NamedTuple

from feedline.producer.metrics import ProducerMetrics
from feedline.protocol import messages as m
from feedline.protocol import wire
from feedline.transport.client import ClientLoop, Waker
from feedline.transport.handover import Backlog

# Handed over and not yet taken by the I/O thread, at most: BACKLOG_ITEMS within
# BACKLOG_BYTES (but always one, whatever its size). Deep enough that the owner thread and
# the I/O thread do not take turns for every small batch (feedline/producer/channel.py).
BACKLOG_ITEMS = 32
BACKLOG_BYTES = 4 << 20


@dataclass(frozen=True)
class BatchItem:
    prepared: wire.Prepared
    epoch: int
    unit: int = -1  # exact delivery: its place in its work unit
    index: int = 0
    last: bool = False
    pipeline: int = 0
    lineage: bytes = b""  # exact delivery: wire.lineage_fields, packed once per producer


@dataclass(frozen=True)
class UnitAsk:
    """Exact delivery: ask the broker for a work unit (the answer comes in Outbox.units);
    ``first``: this producer was never given one."""

    first: bool = False
    ask: int = 0  # its number: the answer names it


@dataclass(frozen=True)
class UnitEnd:
    """Exact delivery: a unit's batches were all handed over (sent after them, in order)."""

    epoch: int
    unit: int
    batches: int
    empty: tuple[int, ...] = ()


@dataclass(frozen=True)
class ExactSpec:
    """What a producer that works by units declares: the dataset's size, a unit's, the
    epochs (0: all). ``delivery`` is ``exact``, or ``training`` for a training producer that
    claims its shards from the broker (``dataset_size``: the shards, ``unit_size`` 1)."""

    dataset_size: int
    unit_size: int
    epochs: int = 0
    delivery: str = m.EXACT
    fingerprint: int = 0  # of the pipeline (feedline.producer.exact.ExactPipeline.fingerprint)


class Fleet(NamedTuple):
    """The supervisor (``feedline fleet``) that started a producer: its id and ``--max`` (said
    in HELLO), and ``join``: the producer was added to a fleet whose run is under way, so on a
    stream whose run is already served it ends (the run is over) instead of starting the
    next one (what a late scale-up would otherwise do)."""

    id: str = ""
    max: int = 0
    join: bool = False


@dataclass(frozen=True)
class ControlItem:
    msg: m.Eos | m.Error


@dataclass(frozen=True)
class SkipItem:
    """Advance every channel's sequence number (what a batch lost on the way looks like)."""

    n: int


Item = BatchItem | ControlItem | SkipItem | UnitAsk | UnitEnd


def item_bytes(item: Item) -> int:
    """What an item weighs in the backlog: a batch its wire bytes, the rest nothing."""
    return item.prepared.wire_bytes if isinstance(item, BatchItem) else 0


@dataclass
class Outbox:
    """What the owner thread and the I/O thread share."""

    producer_id: str
    session: int
    stream: str
    metrics: ProducerMetrics
    items: Backlog[Item] = field(default_factory=lambda: Backlog(BACKLOG_ITEMS, BACKLOG_BYTES))
    handed: int = 0  # items handed over (written by the owner only) ...
    done: int = 0  # ... and sent or dropped (by the I/O thread only)
    # Batches (and their array bytes) that went onto the connection of a broker that had
    # welcomed us and granted credit for them: what a broker took, not what was handed over
    # (that may wait here, or in the I/O thread, for a broker that never comes). Written by
    # the I/O thread; read by the owner for the exit summary.
    sent: int = 0
    sent_bytes: int = 0
    # Written by the I/O thread as it closes: why each broker that never welcomed us was
    # not reached (Link.explain), and how many brokers did not answer our BYE (what was
    # sent there last may not have arrived).
    unreached: list[str] = field(default_factory=list)
    bye_unanswered: int = 0
    idle: threading.Event = field(default_factory=threading.Event)  # set when done == handed
    error: BaseException | None = None  # raised in the owner's next send
    # A broker refused our registration for a reason no retry changes (an egress given as
    # --broker, an exact stream's mismatch): the owner raises ``error`` and ends at once;
    # there is nobody to tell of the failure and nothing to flush.
    refused: bool = False
    credit: int = 0  # batches the brokers would take now (for the owner's eyes only)
    largest: int = 0  # the largest batch prepared so far (declared in HELLOs)
    # The I/O thread holds an item it could not send yet (no credit): a new one queues
    # behind it, so handing one over needs no wake (the grant that frees the held one wakes
    # the loop, which then takes the next). Written before the I/O thread looks at the
    # backlog again, read by the owner after it put: one of them sees the other.
    holding: bool = False
    waker: Waker | None = None
    loop: ClientLoop | None = None
    exact: ExactSpec | None = None
    fleet: Fleet = Fleet()  # the supervisor that started us
    # A training pipeline's fingerprint (0: not said), declared in HELLO: a broker drops the
    # leftovers of a departed pipeline once another produces the stream (docs/architecture.md,
    # "Streams"). An exact pipeline's is its spec's.
    pipeline: int = 0
    # When this producer started (a time.monotonic() reading): each HELLO says how long ago
    # (an exact stream's broker tells a late producer of a served run from the next job's).
    started: float = field(default_factory=time.monotonic)
    units: queue.Queue[m.Unit | m.UnitWait] = field(default_factory=lambda: queue.Queue(8))

    def nudge(self) -> None:
        """Wake the I/O thread for what the owner just handed over (call after the put):
        unless it holds an item that the new one queues behind (:attr:`holding`), or the
        backlog held items before (their put woke it, and it takes all it can each turn:
        if it stopped, it holds one)."""
        if not self.holding and len(self.items) == 1 and self.waker is not None:
            self.waker.wake()

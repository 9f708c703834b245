"""What the credit planner (:mod:`feedline.serving.credit`) keeps of each producer, and the
plan it answers with."""

from __future__ import annotations

from dataclasses import dataclass

from feedline.protocol.messages import DEFAULT_STREAM


@dataclass
class ProducerCredit:
    declared: int = 0  # largest batch it expects (HELLO), bytes
    largest: int = 0  # largest batch received, bytes
    granted: int = 0  # absolute totals since its HELLO
    granted_bytes: int = 0
    received: int = 0
    received_bytes: int = 0
    short_bytes: int = 0  # WANT: bytes its next batch needs beyond its byte credit
    short_batch: bool = False  # WANT: ... and it has no batch credit either
    revoking_since: float | None = None
    idle: bool = False  # new, or gave its credit back: more only when it asks
    held_since: float = 0.0  # when it last started holding credit, or last used it
    held_seconds: float = 0.0  # time it held unused batch credit, up to held_since
    stream: str = DEFAULT_STREAM

    @property
    def outstanding(self) -> int:
        return max(0, self.granted - self.received)

    def credit_seconds(self, now: float) -> float:
        """Seconds it held unused batch credit since its HELLO, up to ``now``: the time it
        was asked for a batch and had not sent it (what tells a producer that runs free from
        one the trainers hold back; sizing reads it). Credit given back on a REVOKE (unused for
        a lease: an idle producer) is not counted."""
        return self.held_seconds + (max(0.0, now - self.held_since) if self.outstanding else 0.0)

    @property
    def reserved(self) -> int:
        return max(0, self.granted_bytes - self.received_bytes)

    @property
    def unit(self) -> int:
        return max(self.declared, self.largest)

    def covers(self, batches: int, nbytes: int) -> bool:
        """Its grant covers ``batches`` more batches of ``nbytes`` in all: counting them is
        no breach."""
        return (self.received + batches <= self.granted
                and self.received_bytes + nbytes <= self.granted_bytes)

    @property
    def wanting(self) -> bool:
        return self.short_bytes > 0 or self.short_batch


@dataclass(frozen=True)
class Plan:
    grants: list[bytes]  # producers whose totals grew: send them GRANT
    revokes: list[bytes]  # producers to ask for unused credit: send them REVOKE

"""What an exact stream is made of, apart from its coordinator: the plan (the pipeline's
sizes, its runs and its fingerprint, as the journal keeps it), a unit's progress (bitmasks of
the batches here and settled), a unit handed to a producer, and why a producer gets none."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

Key = tuple[int, int, int]  # (epoch, unit, index)


@dataclass(frozen=True)
class ExactPlan:
    dataset_size: int
    unit_size: int
    epochs: int = 0  # per run; 0: forever
    fingerprint: int = 0  # of the pipeline; 0: not said

    @property
    def units(self) -> int:
        return -(-self.dataset_size // self.unit_size)

    def same_pipeline(self, other: ExactPlan) -> bool:
        """The same sizes and fingerprint (a fingerprint of 0, from a journal written before
        plans had one, matches any)."""
        return (self.dataset_size, self.unit_size) == (other.dataset_size, other.unit_size) \
            and (self.fingerprint == other.fingerprint or not self.fingerprint * other.fingerprint)

    def describe(self) -> str:
        """The plan in a user's words, for a log line or a refusal. A producer of a sharded
        source declares its work units (shards, or slices of them) as a dataset of units of 1,
        so a unit size of 1 is said as units, not samples."""
        fp = f"fingerprint {self.fingerprint:x}" if self.fingerprint else "no fingerprint"
        if self.unit_size == 1:
            return f"{self.units} work units (single samples, or a sharded source's shards " \
                f"or slices), {fp}"
        return f"{self.dataset_size} samples in {self.units} units of {self.unit_size}, {fp}"


def _full(total: int) -> int:
    return (1 << total) - 1


@dataclass
class UnitProgress:
    owner: bytes | None = None
    accepted: int = 0  # bitmask: here (buffered, in flight) or settled
    settled: int = 0  # bitmask: taken by a consumer
    total: int | None = None  # batches, once its producer said it is done

    def complete(self) -> bool:
        return self.total is not None and self.settled & _full(self.total) == _full(self.total)

    def first_missing(self) -> int:
        return (~self.accepted & (self.accepted + 1)).bit_length() - 1

    def produced(self) -> bool:
        return self.total is not None and self.accepted & _full(self.total) == _full(self.total)


class NoUnit(str, Enum):
    """Why a producer that asked for a unit gets none (the UNIT_WAIT message's reason: the
    value is its wire string)."""

    BUSY = "busy"  # the epoch's last units are made elsewhere, or recovering: ask again
    FINISHED = "finished"  # the run is served: the producer ends


@dataclass(frozen=True)
class Assignment:
    epoch: int
    unit: int
    start: int

"""What an ingress hands its sink (a message as it arrived, weighed, with its batch decoded),
and what a sink is."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from feedline.protocol.wire import Batch


@dataclass(slots=True)  # one per batch: slots make it 0.2 us cheaper
class Held:
    frames: list[Any]  # [header, arrays...] as received (a batch of a bundle: none)
    nbytes: int  # wire bytes: what the memory budget counts
    array_bytes: int
    session: int
    gap: int  # batches of its session lost upstream since the previous one
    broadcast: bool = False  # EOS / ERROR: to every consumer of the stream, in order
    batch: Batch | None = None  # decoded (views on the frames), for a sink that wants it
    # Batches in it: a broker keeps a bundle (feedline.protocol.bundle) whole, [header, arrays...]
    # of
    # ``count`` batches, and forwards it whole to a consumer that takes bundles.
    count: int = 1
    part: bool = False  # a part of a bundle the broker split (feedline.broker.parts)


Send = Callable[[bytes, list[Any]], int]  # 0 sent, zmq.EAGAIN full, zmq.EHOSTUNREACH gone


class Sink(Protocol):
    """Where accepted batches go, and what it holds (for the budget)."""

    def held(self) -> tuple[int, int]:
        """(batches, bytes) held: buffered, and in flight to consumers."""
        ...

    def held_by_stream(self) -> dict[str, tuple[int, int]]:
        """The same, per stream."""
        ...

    def read(self, stream: str) -> bool:
        """Some consumer reads ``stream`` now."""
        ...

    def accept(self, stream: str, item: Held) -> bool:
        """Take a batch (always: credit reserved its room) or a control message (False if
        there is no room for it)."""
        ...

    def accept_batches(self, stream: str, batches: list[Batch], gap: int) -> None:
        """Take a bundle's batches (decoded; credit reserved their room) as :meth:`accept`
        would each alone, ``gap`` (the batches lost before them) with the first. Called
        where an ingress does not keep a bundle whole (``IngressConfig.whole``)."""
        ...

    def epoch_end(self, stream: str, epoch: int) -> None:
        """Exact delivery: every batch of ``epoch`` was taken; tell the stream's consumers."""
        ...

    def producer_joined(self, stream: str, producer: str) -> None:
        """A producer registered for ``stream``: a producer's ERROR held for consumers that
        never came is stale now (the stream is served again) and goes."""
        ...

    def keys(self, stream: str) -> set[tuple[int, int, int]]:
        """Exact delivery: the keys of ``stream``'s batches held here (buffered, in flight to
        consumers, or to consumers that left): what a job's host may not give back."""
        ...

"""What the broker keeps of each consumer registration, and of what a gone one left in flight.

A :class:`Consumer`'s window counts small batches by their bytes
(:func:`feedline.serving.budget.depth`), for the largest batch delivered to it: a window of 4
holds 512 batches of 16 KB and 4 of 9.6 MB. An :class:`Orphan` is what a consumer that is gone
(dropped, or registered again on its connection) still has in flight
(:mod:`feedline.broker.egress`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from feedline.serving.budget import depth
from feedline.serving.held import Held
from feedline.serving.peers import Peer


@dataclass
class Consumer(Peer):
    window: int = 1
    max_bytes: int = 1
    delivered: int = 0
    taken: int = 0
    inflight: deque[Held] = field(default_factory=deque)  # delivered, not yet taken (whole)
    inflight_bytes: int = 0
    # Its DELIVER envelope for a batch without a gap: the same bytes for every batch of this
    # registration, built once (encoding one per batch cost the broker ~3 us a batch).
    envelope: bytes = b""
    waited: float = 0.0  # seconds its loop waited for data (it says so with TAKEN)
    # Wire bytes of the largest batch delivered to this registration (an exact stream's
    # excepted: its ranks split each epoch, one batch each). Its window counts small batches
    # by their bytes for it (budget.depth): the count only shrinks, and the consumer,
    # counting the same batches, never finds more than its window.
    largest: int = 0
    bundle: int = 0  # the most batches it takes in one delivery (feedline.protocol.bundle)
    head_taken: int = 0  # batches it took of the bundle first in ``inflight``

    @property
    def in_force(self) -> int:
        """Its window in force: counted for ``largest``."""
        return depth(self.window, self.largest)

    def room(self, size: int, cap: int, cap_batches: int, orphan: Orphan | None = None,
             deep: bool = True, count: int = 1, unit: int = 0) -> bool:
        """Room for ``count`` batches (a bundle, or one) of ``size`` bytes in all within its
        window and byte budget, and within the caps of one connection (what an earlier
        registration of it left in flight counts), both counted by bytes for ``unit`` (one
        batch's bytes; ``size`` when 0) and ``largest`` if ``deep`` (else one each)."""
        held = self.delivered - self.taken + count
        unit = unit or size
        unit = (unit if unit > self.largest else self.largest) if deep else 0
        if held > depth(self.window, unit):
            return False
        cap_batches = depth(cap_batches, unit)
        if orphan is not None:
            if held + orphan.batches > cap_batches or \
                    self.inflight_bytes + orphan.nbytes + size > cap:
                return False
        elif held > cap_batches:
            return False
        return self.inflight_bytes == 0 or self.inflight_bytes + size <= min(self.max_bytes, cap)

    def whole(self, unit: int, cap_batches: int) -> int:
        """The most batches of ``unit`` bytes each it can be sent in one delivery: what it
        offered (``bundle``), within its whole window and the connection's cap."""
        unit = unit if unit > self.largest else self.largest
        return min(max(1, self.bundle), depth(self.window, unit), depth(cap_batches, unit))


@dataclass
class Orphan:
    nbytes: int
    batches: int
    fd: int
    fd_ino: int
    stream: str = ""
    items: list[Held] = field(default_factory=list)  # exact streams: served again when freed
    name: str = ""  # the consumer's id, for the line that says its connection was cut

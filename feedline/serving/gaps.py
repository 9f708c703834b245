"""Sequence gaps: batches a producer sent that never reached the broker, counted once.

Each producer process has a random session and numbers its batches 0, 1, 2, ... per broker.
The tracker keeps the last number seen per session (bounded, least recently used first out:
sessions end with restarts). A gap between two batches is what was lost on the way; so is a
gap between the last batch and a new HELLO's next number (a producer that was dropped and
registers again tells us how far it got, and whatever it sent meanwhile never arrived).
"""

from __future__ import annotations

from collections import OrderedDict


class GapTracker:
    """Last sequence number per producer session; at most ``capacity`` sessions."""

    def __init__(self, capacity: int = 4096) -> None:
        self.capacity = capacity
        self._last: OrderedDict[int, int] = OrderedDict()

    def __len__(self) -> int:
        return len(self._last)

    def _set(self, session: int, last: int) -> None:
        self._last[session] = last
        self._last.move_to_end(session)
        while len(self._last) > self.capacity:
            self._last.popitem(last=False)

    def hello(self, session: int, next_seq: int) -> int:
        """A (re)registration that will send ``next_seq`` next; returns the batches lost
        since the last one we saw from this session (0 for a session we do not know)."""
        last = self._last.get(session)
        lost = 0 if last is None else max(0, next_seq - last - 1)
        if last is None or next_seq - 1 > last:
            self._set(session, next_seq - 1)
        return lost

    def batch(self, session: int, seq: int) -> int:
        """A batch arrived; returns the gap before it (0 if none, or if it is a stray)."""
        last = self._last.get(session)
        gap = 0 if last is None else max(0, seq - last - 1)
        if last is None or seq > last:
            self._set(session, seq)
        return gap

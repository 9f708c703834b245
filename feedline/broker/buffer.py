"""The broker's buffer: batches waiting for a consumer, per stream, with their bytes.

A batch is held as the frames it arrived in (forwarded as they are: ``copy=False``) and its
wire size (header included: bytes inline in a header are memory too); a bundle of batches
(:mod:`feedline.protocol.bundle`) as one item that counts as the batches it holds. End-of-stream and
error messages wait in line behind the batches their producer sent before them, and go to every
consumer of the stream; there are at most ``control_slack`` of them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from feedline.serving.held import Held


class Buffer:
    """FIFO per stream; totals across streams for the budget."""

    def __init__(self, control_slack: int = 64) -> None:
        self.control_slack = control_slack
        self._streams: dict[str, deque[Held]] = {}
        # (batches, bytes) of each listed stream, kept as items come and go: a credit plan
        # reads them every loop turn, and a walk of a deep buffer per plan cost more than
        # the plan.
        self._totals: dict[str, tuple[int, int]] = {}
        self.batches = 0
        self.nbytes = 0
        self.controls = 0

    def streams(self) -> list[str]:
        return [s for s, q in self._streams.items() if q]

    def __len__(self) -> int:
        return self.batches + self.controls

    def count(self, stream: str) -> int:
        """Batches of ``stream`` buffered (a bundle's each)."""
        return self._totals.get(stream, (0, 0))[0]

    def push(self, stream: str, item: Held) -> bool:
        """Queue ``item``; False (not queued) for a control message beyond the slack."""
        if item.broadcast:
            if self.controls >= self.control_slack:
                return False
            self.controls += 1
        else:
            self.batches += item.count
            self.nbytes += item.nbytes
        self._streams.setdefault(stream, deque()).append(item)
        self._add(stream, item, 1)
        return True

    def _add(self, stream: str, item: Held, sign: int) -> None:
        b, y = self._totals.get(stream, (0, 0))
        if not item.broadcast:
            b, y = b + sign * item.count, y + sign * item.nbytes
        self._totals[stream] = (b, y)

    def peek(self, stream: str) -> Held | None:
        q = self._streams.get(stream)
        return q[0] if q else None

    def pop(self, stream: str) -> Held:
        q = self._streams[stream]
        item = q.popleft()
        if q:
            self._add(stream, item, -1)
        else:
            del self._streams[stream]
            del self._totals[stream]
        if item.broadcast:
            self.controls -= 1
        else:
            self.batches -= item.count
            self.nbytes -= item.nbytes
        return item

    def by_stream(self) -> dict[str, tuple[int, int]]:
        """(batches, bytes) buffered per stream (every stream that holds anything)."""
        return dict(self._totals)

    def evict(self, stream: str, max_batches: int, max_bytes: int) -> list[Held]:
        """Drop the oldest batches of ``stream`` until it holds at most that much; returns
        them (control messages stay, in order)."""
        q = self._streams.get(stream)
        out: list[Held] = []
        if not q:
            return out
        keep: deque[Held] = deque()
        b, y = self._totals.get(stream, (0, 0))
        for h in q:
            if not h.broadcast and (b > max_batches or y > max_bytes):
                out.append(h)
                b, y = b - h.count, y - h.nbytes
                self.batches -= h.count
                self.nbytes -= h.nbytes
            else:
                keep.append(h)
        self._keep(stream, keep)
        return out

    def items(self, stream: str) -> list[Held]:
        return list(self._streams.get(stream, ()))

    def discard(self, stream: str, void: Callable[[Held], bool]) -> int:
        """Drop the items of ``stream`` for which ``void`` holds (called once an item, in
        order: it may count what it drops); returns how many."""
        q = self._streams.get(stream)
        if not q:
            return 0
        keep: deque[Held] = deque()
        dropped: list[Held] = []
        for h in q:
            (dropped if void(h) else keep).append(h)
        if not dropped:
            return 0
        for h in dropped:
            if h.broadcast:
                self.controls -= 1
            else:
                self.batches -= h.count
                self.nbytes -= h.nbytes
        self._keep(stream, keep)
        return len(dropped)

    def _keep(self, stream: str, keep: deque[Held]) -> None:
        # An emptied stream goes: what is listed (by_stream) is what is held.
        if keep:
            self._streams[stream] = keep
            batches = [h for h in keep if not h.broadcast]
            self._totals[stream] = (sum(h.count for h in batches),
                                    sum(h.nbytes for h in batches))
        else:
            del self._streams[stream]
            del self._totals[stream]

    def requeue(self, stream: str, item: Held) -> None:
        """Put back an item that could not be sent (in front: order is kept)."""
        self._streams.setdefault(stream, deque()).appendleft(item)
        self._add(stream, item, 1)
        if item.broadcast:
            self.controls += 1
        else:
            self.batches += item.count
            self.nbytes += item.nbytes

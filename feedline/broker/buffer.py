"""The broker's buffer: batches waiting for a consumer, per stream, with their bytes.

A batch is held as the frames it arrived in (forwarded as they are: ``copy=False``) and its
wire size (header included: bytes inline in a header are memory too). End-of-stream and error
messages wait in line behind the batches their producer sent before them, and go to every
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
        self.batches = 0
        self.nbytes = 0
        self.controls = 0

    def streams(self) -> list[str]:
        return [s for s, q in self._streams.items() if q]

    def __len__(self) -> int:
        return self.batches + self.controls

    def count(self, stream: str) -> int:
        q = self._streams.get(stream)
        return len(q) if q is not None else 0

    def push(self, stream: str, item: Held) -> bool:
        """Queue ``item``; False (not queued) for a control message beyond the slack."""
        if item.broadcast:
            if self.controls >= self.control_slack:
                return False
            self.controls += 1
        else:
            self.batches += 1
            self.nbytes += item.nbytes
        self._streams.setdefault(stream, deque()).append(item)
        return True

    def peek(self, stream: str) -> Held | None:
        q = self._streams.get(stream)
        return q[0] if q else None

    def pop(self, stream: str) -> Held:
        q = self._streams[stream]
        item = q.popleft()
        if not q:
            del self._streams[stream]
        if item.broadcast:
            self.controls -= 1
        else:
            self.batches -= 1
            self.nbytes -= item.nbytes
        return item

    def by_stream(self) -> dict[str, tuple[int, int]]:
        """(batches, bytes) buffered per stream."""
        out = {}
        for s, q in self._streams.items():
            items = [h for h in q if not h.broadcast]
            out[s] = (len(items), sum(h.nbytes for h in items))
        return out

    def evict(self, stream: str, max_batches: int, max_bytes: int) -> list[Held]:
        """Drop the oldest batches of ``stream`` until it holds at most that much; returns
        them (control messages stay, in order)."""
        q = self._streams.get(stream)
        out: list[Held] = []
        if not q:
            return out
        keep: deque[Held] = deque()
        b, y = self.by_stream().get(stream, (0, 0))
        for h in q:
            if not h.broadcast and (b > max_batches or y > max_bytes):
                out.append(h)
                b, y = b - 1, y - h.nbytes
                self.batches -= 1
                self.nbytes -= h.nbytes
            else:
                keep.append(h)
        self._keep(stream, keep)
        return out

    def items(self, stream: str) -> list[Held]:
        return list(self._streams.get(stream, ()))

    def discard(self, stream: str, void: Callable[[Held], bool]) -> int:
        """Drop the items of ``stream`` for which ``void`` holds; returns how many."""
        q = self._streams.get(stream)
        if not q:
            return 0
        keep = deque(h for h in q if not void(h))
        dropped = [h for h in q if void(h)]
        for h in dropped:
            if h.broadcast:
                self.controls -= 1
            else:
                self.batches -= 1
                self.nbytes -= h.nbytes
        self._keep(stream, keep)
        return len(dropped)

    def _keep(self, stream: str, keep: deque[Held]) -> None:
        # An emptied stream goes: what is listed (by_stream) is what is held.
        if keep:
            self._streams[stream] = keep
        else:
            del self._streams[stream]

    def requeue(self, stream: str, item: Held) -> None:
        """Put back an item that could not be sent (in front: order is kept)."""
        self._streams.setdefault(stream, deque()).appendleft(item)
        if item.broadcast:
            self.controls += 1
        else:
            self.batches += 1
            self.nbytes += item.nbytes

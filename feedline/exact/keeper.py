"""A consumer's side of exact delivery: what its process took of the epoch (its cursor), the
last of it (reported when it registers again), and the checkpoint it resumes from.

One :class:`CursorKeeper` per consumer, owned by it and used under its lock (the iterating
thread takes batches; the I/O thread builds HELLOs). What a registration carries
(:meth:`CursorKeeper.hello_cursor`):

- the checkpoint to resume from, until a batch came after it (the broker applied it);
- else what it took last of this epoch (``recent``: its last commit's worth and a window, what
  a restarted broker's journal may lack), as much as a registration carries;
- else nothing.
"""

from __future__ import annotations

from collections import deque

from feedline.errors import ConfigError, FeedlineError
from feedline.exact.coordinator import RECORDS_PER_COMMIT
from feedline.exact.cursor import MAX_CURSOR_BYTES, Cursor


class CursorKeeper:
    """The cursor of one consumer's stream; ``slots``: the batches it may hold at once (its
    recent batches are kept for a commit's worth beyond them)."""

    def __init__(self, stream: str, slots: int) -> None:
        self.stream = stream
        self.cursor = Cursor(stream)
        self.recent: deque[tuple[int, int]] = deque(maxlen=RECORDS_PER_COMMIT + slots + 64)
        self.resume: Cursor | None = None

    def resume_from(self, cursor: Cursor) -> None:
        """Start from a job's checkpoint: sent with the first HELLO, and what was taken of
        its epoch stays taken. A cursor too large for a registration is refused here, in one
        line (a rank's own cursor of scattered batches: resume from the merged one)."""
        if cursor.stream != self.stream:
            raise ConfigError(f"resume: a cursor of stream {cursor.stream!r}, not {self.stream!r}")
        cursor.resume = True
        size = len(cursor.encode())
        if size > MAX_CURSOR_BYTES:
            raise ConfigError(
                f"resume: this cursor takes {size} bytes, more than the "
                f"{MAX_CURSOR_BYTES} a registration carries: it holds batches scattered "
                "over the epoch, as one rank's cursor does; resume every rank from the "
                "merged cursor of all of them (Cursor.merge), which holds runs")
        self.resume = cursor
        self.cursor = cursor.copy()
        self.cursor.resume = False

    def seen(self, epoch: int, unit: int, index: int) -> bool:
        """The batch was taken before (served again after a broker restart, before our report
        reached it): to be acknowledged, not given to the model twice."""
        return epoch == self.cursor.epoch and self.cursor.has(unit, index)

    def check(self, pipeline: int) -> None:
        """A batch of another pipeline than the one taken from (the stream's producers were
        replaced) is an error: the cursor could not say it. Call before the batch counts."""
        c = self.cursor
        if c.pipeline and pipeline != c.pipeline and c.bits:
            raise FeedlineError(
                f"stream {self.stream!r} now serves another pipeline (fingerprint "
                f"{pipeline:x}) than the one this process took batches of "
                f"({c.pipeline:x}): its producers were replaced; start the job "
                "again (with a new RemoteDataZMQ)")

    def take(self, epoch: int, unit: int, index: int, pipeline: int) -> None:
        """Count a batch the model takes (:meth:`check` first)."""
        self.check(pipeline)
        c = self.cursor
        if epoch != c.epoch or not c.pipeline:
            if epoch != c.epoch:
                self.cursor = c = Cursor(self.stream, epoch)
                self.recent.clear()
            c.pipeline = pipeline
        c.add(unit, index)
        self.recent.append((unit, index))
        # The resume was applied (a batch came after it): later registrations report what
        # we take instead.
        self.resume = None

    def hello_cursor(self) -> bytes:
        """What a registration carries (the module's docstring)."""
        if self.resume is not None:
            return self.resume.encode()
        if self.recent:
            return report(self.cursor, list(self.recent))
        return b""


def report(cursor: Cursor, recent: list[tuple[int, int]]) -> bytes:
    """The cursor of the batches taken last (``recent``, oldest first), as much of it as a
    registration carries (the oldest go first: a broker's journal has those)."""
    while True:
        part = Cursor(cursor.stream, cursor.epoch, pipeline=cursor.pipeline)
        for u, i in recent:
            part.add(u, i)
        data = part.encode()
        if len(data) <= MAX_CURSOR_BYTES or len(recent) <= 1:
            return data
        recent = recent[len(recent) // 4:]

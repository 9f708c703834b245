"""A stream's dataset changed (another shard list, another exact pipeline) while producers of
the old one are still registered: is the old one still read, or are its producers dead?

A producer killed (``kill -9``, its machine gone) stays registered until the host's heartbeat
timeout drops it. A producer of the new dataset that registers meanwhile is told to wait
(reason :data:`WAIT`: it says HELLO again, as after any refused registration, and logs that
it waits) while none of the old producers has been heard from since a producer of the new
dataset first asked, and is admitted once they are dropped: it starts the stream afresh. One
of them heard from since is running: the new producer is refused for good (one line, what to
do). A running producer is heard from at least every heartbeat interval (a batch, or its
heartbeat), and a refused HELLO is sent again no sooner than twice that, so a running old
producer is told from a dead one by the new producer's second HELLO at the latest.

The state is one pair of times per stream being asked for, at most :data:`MAX_ASKED`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Collection

from feedline.protocol import messages as m

WAIT = m.WAIT_OLD_PRODUCERS  # the refusal's reason (a metric label): wait, say HELLO again
MAX_ASKED = 256  # streams remembered as asked for by a new dataset's producer, at most

Heard = Callable[[bytes], float | None]  # when a registered producer was last heard from


class Succession:
    """Whether a new dataset's producer waits for a stream's old producers (``heard``: when
    each was last heard from, None if it is not registered any more; ``timeout``: the
    heartbeat timeout that drops a silent one)."""

    def __init__(self, heard: Heard, timeout: float) -> None:
        self.heard, self.timeout = heard, timeout
        # stream -> (when a producer of a new dataset first asked, when one last asked)
        self._asked: OrderedDict[str, tuple[float, float]] = OrderedDict()

    def wait(self, stream: str, old: Collection[bytes], now: float) -> float | None:
        """Seconds, at most, until the old producers ``old`` are dropped, if a producer of a
        new dataset that asks now waits for them; None if it is refused: one of them was
        heard from since a producer of the new dataset first asked (it runs)."""
        first, last = self._asked.pop(stream, (now, now))
        if now - last > 2 * self.timeout:  # whoever asked then gave up: a new question
            first = now
        seen = [t for t in map(self.heard, old) if t is not None]
        if any(t > first for t in seen):
            return None
        self._asked[stream] = (first, now)
        while len(self._asked) > MAX_ASKED:
            self._asked.popitem(last=False)
        return max([0.0] + [self.timeout - (now - t) for t in seen])

    def settled(self, stream: str) -> None:
        """The stream's dataset is decided (the new one admitted): forget the question."""
        self._asked.pop(stream, None)

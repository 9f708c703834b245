"""A bundle in parts: when the broker splits what a producer sent as one message.

A broker keeps a bundle (:mod:`feedline.protocol.bundle`) as it arrived and sends it whole to a
consumer that takes bundles and has room for all of it. It splits one:

- for a consumer that takes fewer batches in one delivery (an older one: none, so plain
  batches), or whose whole window is smaller than the bundle, and when a stream has several
  consumers (the ranks of a job: each gets an equal part, as it would get its batches in
  turn one by one): into parts every consumer of the stream can be sent (:func:`split_for`);
- for a consumer that has room for part of it, and holds less than half its window or has
  a top-up of it free (an eighth, or more: budget.top_up): the part that fills its window
  goes first (:func:`fill_for`). One with less room waits for room for more: splitting at
  every batch it takes would send it a batch at a time (a consumer with few batches queued
  reports every take). So a consumer that stops taking holds its window, or less by under a
  top-up of it.

Each part gets a header of its own (its first sequence number, its count; a part of one is
a plain batch); the array frames are the bundle's own (no copy). The parts weigh what they
hold: their arrays, and their new headers.
"""

from __future__ import annotations

from collections.abc import Sequence

from feedline.broker.consumers import Consumer
from feedline.protocol import bundle
from feedline.protocol.codec import Limits
from feedline.serving.budget import depth, top_up
from feedline.serving.held import Held


def split_for(consumers: Sequence[Consumer], item: Held, unit: int,
              cap_batches: int) -> list[int] | None:
    """The part sizes of ``item`` every one of ``consumers`` can be sent whole (batches of
    ``unit`` bytes each), or None if each can be sent it whole."""
    # Several consumers of a stream (the ranks of a job) get an equal part of it each, as
    # they would get its batches in turn one by one (of a bundle as it came: not again of a
    # part, which would halve it down to single batches).
    most = item.count
    if len(consumers) > 1 and not item.part:
        most = -(-item.count // len(consumers))
    for c in consumers:
        most = min(most, c.whole(unit, cap_batches))
    if most >= item.count:
        return None
    whole, rest = divmod(item.count, most)
    return [most] * whole + ([rest] if rest else [])


def fill_for(consumers: Sequence[Consumer], item: Held, unit: int) -> list[int] | None:
    """The part of ``item`` that fills the window of the first of ``consumers`` that holds
    less than half of it or has a top-up of it free (budget.top_up, an eighth or more, as a
    producer's window is topped up), and the rest; None if there is none."""
    for c in consumers:
        held = c.delivered - c.taken
        most = depth(c.window, unit if unit > c.largest else c.largest)
        room = most - held
        if 0 < room < item.count and (2 * held < most or room >= top_up(most)):
            return [room, item.count - room]
    return None


def split(item: Held, sizes: list[int], limits: Limits) -> list[Held]:
    """``item`` (a bundle) as parts of ``sizes`` batches, in order; the first keeps its gap."""
    per = item.array_bytes // item.count
    out = []
    for i, frames in enumerate(bundle.split(item.frames, limits, sizes)):
        out.append(Held(frames, sum(len(f) for f in frames), sizes[i] * per, item.session,
                        item.gap if i == 0 else 0, count=sizes[i], part=True))
    return out

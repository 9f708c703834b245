"""A bundle in parts: when the broker splits what a producer sent as one message.

A broker keeps a bundle (:mod:`feedline.bundle`) as it arrived and sends it whole to a
consumer that takes bundles and has room for all of it. It splits one:

- for a consumer that takes fewer batches in one delivery (an older one: none, so plain
  batches), or whose whole window is smaller than the bundle: into parts every consumer of
  the stream can be sent (:func:`split_for`);
- for a consumer that holds less than half its window and has room for part of it: the part
  that fills its window goes first (:func:`fill_for`). One that holds more waits for room
  for the whole bundle: splitting at every batch it takes would send it a batch at a time.

Each part gets a header of its own (its first sequence number, its count; a part of one is
a plain batch); the array frames are the bundle's own (no copy). The parts weigh what they
hold: their arrays, and their new headers.
"""

from __future__ import annotations

from collections.abc import Sequence

from feedline import bundle
from feedline.broker.consumers import Consumer
from feedline.codec import Limits
from feedline.serving.budget import depth
from feedline.serving.held import Held


def split_for(consumers: Sequence[Consumer], item: Held, unit: int,
              cap_batches: int) -> list[int] | None:
    """The part sizes of ``item`` every one of ``consumers`` can be sent whole (batches of
    ``unit`` bytes each), or None if each can be sent it whole."""
    most = item.count
    for c in consumers:
        most = min(most, c.whole(unit, cap_batches))
    if most >= item.count:
        return None
    whole, rest = divmod(item.count, most)
    return [most] * whole + ([rest] if rest else [])


def fill_for(consumers: Sequence[Consumer], item: Held, unit: int) -> list[int] | None:
    """The part of ``item`` that fills the window of the first of ``consumers`` holding less
    than half of it, and the rest; None if there is none."""
    for c in consumers:
        held = c.delivered - c.taken
        most = depth(c.window, unit if unit > c.largest else c.largest)
        if 0 < most - held < item.count and 2 * held < most:
            return [most - held, item.count - most + held]
    return None


def split(item: Held, sizes: list[int], limits: Limits) -> list[Held]:
    """``item`` (a bundle) as parts of ``sizes`` batches, in order; the first keeps its gap."""
    per = item.array_bytes // item.count
    out = []
    for i, frames in enumerate(bundle.split(item.frames, limits, sizes)):
        out.append(Held(frames, sum(len(f) for f in frames), sizes[i] * per, item.session,
                        item.gap if i == 0 else 0, count=sizes[i]))
    return out

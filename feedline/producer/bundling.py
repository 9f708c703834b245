"""Which waiting batches go with the one being sent, in one bundle
(:mod:`feedline.protocol.bundle`).

The producer's I/O thread asks this when it sends a training batch to a host that offers
bundles: the batches behind it (first those held back from a bundle that could not be sent,
then the backlog's), in order, as long as each is a training batch of the same layout (the
same header tail: dtypes, shapes, structure) and epoch, and the bundle stays within the
host's count, the frame limit, BUNDLE_BYTES, and the credit (batches and bytes). It never
waits for a batch: a bundle is what is already there.
"""

from __future__ import annotations

from collections import deque

from feedline.producer.outbox import BatchItem, Item
from feedline.protocol import messages as m
from feedline.protocol.bundle import BUNDLE_BYTES, MAX_BUNDLE
from feedline.transport.handover import Backlog


def gather(item: BatchItem, welcome: m.Welcome, credit: int, room: int, max_arrays: int,
           ahead: deque[Item], backlog: Backlog[Item]) -> list[BatchItem]:
    """The batches to send with ``item`` (taken from ``ahead``, then ``backlog``; none if
    the host offers no bundles or the next one does not fit).

    ``credit``: batches the host's grant covers (``item`` included); ``room``: bytes it
    covers (``item``'s wire bytes included); ``max_arrays``: array frames in one message."""
    # Batches of one layout (one header tail: the same shapes) weigh the same wire bytes.
    cap = min(BUNDLE_BYTES, welcome.max_batch_bytes or BUNDLE_BYTES, room)
    most = min(welcome.bundle, MAX_BUNDLE, credit, cap // max(item.prepared.wire_bytes, 1),
               max_arrays // max(len(item.prepared.arrays), 1))
    more: list[BatchItem] = []
    while len(more) + 1 < most:
        nxt = ahead[0] if ahead else backlog.peek()
        if type(nxt) is not BatchItem or nxt.unit >= 0 or nxt.epoch != item.epoch \
                or nxt.prepared.tail != item.prepared.tail:
            break
        more.append(ahead.popleft() if ahead else backlog.get_nowait())  # type: ignore[arg-type]
    return more

"""The budget object and the shares taken of it (feedline/serving/budget.py), on their own
and as the credit planner applies them. docs/architecture.md's memory formula is read off
these rules."""

from __future__ import annotations

import pytest

from feedline.protocol.codec import Limits
from feedline.serving.budget import DEPTH, SMALL_BATCH, Budget, Share, depth
from feedline.serving.credit import CreditPlanner

MiB = 1 << 20


def test_the_shares_are_named_fractions_of_one_budget():
    b = Budget(max_batches=32, max_bytes=64 * MiB)
    assert b.whole == Share(32, 64 * MiB)
    assert b.new_producers == Share(8, 16 * MiB)
    assert b.per_consumer == Share(16, 32 * MiB)
    assert b.stream_floor == Share(8, 16 * MiB)
    assert b.per_stream(1, read=False) == b.whole, "one stream alone may use all of it"
    assert b.per_stream(2, read=True) == Share(16, 32 * MiB)
    assert b.per_stream(2, read=False) == Share(8, 16 * MiB), "unread: half its part"
    assert b.per_stream(100, read=True) == b.stream_floor, "a read stream keeps its floor"
    assert b.per_stream(100, read=False) == Share(1, 64 * MiB // 200)


def test_a_window_counts_batches_under_8_mib_by_their_bytes():
    """A direct-mode trainer's windows (docs/architecture.md): n batches of 8 MiB or more,
    else as many as fit in n x 8 MiB, never fewer than n nor more than DEPTH (128) n."""
    assert depth(4, 0) == 4, "a size not known yet: counted in batches"
    assert depth(4, SMALL_BATCH) == depth(4, 9_633_792) == 4
    assert depth(4, SMALL_BATCH - 1) == 4
    assert depth(4, 150_528) == 222  # one 224x224x3 image
    assert depth(4, 1_053_724) == 31  # seven of them
    assert depth(4, 65_536) == DEPTH * 4, "64 KiB and more: counted by bytes alone"
    assert depth(4, 65_537) < DEPTH * 4
    assert depth(4, 16_000) == depth(4, 1) == DEPTH * 4 == 512
    b = Budget(32, 64 * MiB)
    assert b.for_unit(10 * MiB) is b and b.for_unit(0) is b
    small = b.for_unit(16_000)
    assert small == Budget(DEPTH * 32, 64 * MiB), "the bytes stay the bound"
    assert small.new_producers == Share(DEPTH * 8, 16 * MiB)


def test_a_tiny_budget_still_has_room_for_one_batch_everywhere():
    b = Budget(max_batches=1, max_bytes=3)
    for share in (b.per_consumer, b.stream_floor, b.per_stream(7, read=False), b.part(9)):
        assert share.batches >= 1 and share.nbytes >= 1, share
    assert b.new_producers.batches == 1


def test_the_largest_message_is_within_the_budget_and_the_limits():
    lim = Limits(max_message_bytes=8 * MiB)
    assert Budget(4, 64 * MiB).max_message(lim) == 8 * MiB + lim.max_header_bytes
    assert Budget(4, 2 * MiB).max_message(lim) == 2 * MiB


@pytest.mark.parametrize("batches, nbytes", [(0, 1), (1, 0), (-3, 5)])
def test_an_empty_budget_is_refused(batches, nbytes):
    with pytest.raises(ValueError, match="must be >= 1"):
        Budget(batches, nbytes)


def _running(cp: CreditPlanner, key: bytes, stream: str) -> None:
    """A producer that has sent a batch of 100 bytes on ``stream`` and asks for the next."""
    c = cp.join(key, declared=100, stream=stream)
    c.granted = c.received = 1
    c.granted_bytes = c.received_bytes = c.largest = 100
    cp.want(key, sent=1, sent_bytes=100, size=100)


def test_registrations_that_never_send_do_not_count_as_streams():
    """Finding 15: 110 registrations on stream names of their own, none sending, leave the
    one produced stream the whole budget (they counted as 110 streams: 1/111 of it)."""
    cp = CreditPlanner(Budget(32, 64 * MiB), window=32, lease=2.0)
    for i in range(110):
        cp.join(bytes([i % 256, i // 256]), declared=MiB, stream=f"s{i}")
    _running(cp, b"train", "train")
    nobody_reads = {f"s{i}" for i in range(110)}
    assert cp.shares({}, nobody_reads)["train"] == Share(32, 64 * MiB)
    cp.plan(0.0, 0, 0, {}, unread=nobody_reads)
    assert cp.producers[b"train"].outstanding == 32


def test_a_read_stream_that_has_not_sent_yet_counts():
    """A consumer waits for stream ``val``, whose producer has not sent yet, while stream
    ``default`` (nobody reads it) holds the whole buffer: ``default``'s share is half an
    equal part of two streams, not the whole budget, so the broker evicts down to it and
    ``val``'s producer gets its first credit. (Counting only produced streams, ``default``
    kept everything and ``val`` never got a batch through.)"""
    cp = CreditPlanner(Budget(32, 64 * MiB), window=32, lease=2.0)
    _running(cp, b"d", "default")
    cp.join(b"v", declared=MiB, stream="val")
    shares = cp.shares({"default": (32, 32 * MiB)}, {"default"})
    assert shares["default"] == Share(8, 16 * MiB)
    assert shares["val"] == Share(16, 32 * MiB)


def test_streams_that_are_produced_leave_a_read_stream_its_floor():
    """19 streams produced by others and nobody reads them: the stream that is read keeps a
    quarter of the budget (its floor), and each unread one half an equal part."""
    cp = CreditPlanner(Budget(32, 64 * MiB), window=32, lease=2.0)
    for i in range(19):
        _running(cp, bytes([i]), f"other{i}")
    _running(cp, b"train", "train")
    unread = {f"other{i}" for i in range(19)}
    shares = cp.shares({}, unread)
    assert shares["train"] == Share(8, 16 * MiB)
    assert shares["other0"] == Share(1, 64 * MiB // 40)
    cp.plan(0.0, 0, 0, {}, unread=unread)
    assert cp.producers[b"train"].outstanding == 8

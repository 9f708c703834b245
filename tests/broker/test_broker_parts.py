"""The broker's parts on their own, without sockets: the credit planner, the peer table, the
sequence-gap tracker, the buffer. Each rule here was taught by a fault scenario or a hostile
peer (docs/architecture.md, docs/reliability.md)."""

from __future__ import annotations

import numpy as np
import pytest

from feedline.broker.buffer import Buffer
from feedline.errors import Refusal
from feedline.protocol.bundle import BUNDLE_BYTES
from feedline.protocol.encode import prepare_batch
from feedline.serving.budget import LEAST_GRANT, SMALL_BATCH, Budget, depth, top_up
from feedline.serving.credit import CreditPlanner
from feedline.serving.gaps import GapTracker
from feedline.serving.held import Held
from feedline.serving.peers import Peer, PeerTable

MiB = 1 << 20


def planner(max_batches: int = 32, max_bytes: int = 64 * MiB, window: int = 4,
            lease: float = 2.0) -> CreditPlanner:
    return CreditPlanner(Budget(max_batches, max_bytes), window, lease)


def totals(cp: CreditPlanner) -> tuple[int, int]:
    return cp.outstanding()


def start(cp: CreditPlanner, key: bytes, declared: int, stream: str = "default") -> None:
    """A running producer: registered, its first batch sent and taken (so the rules for
    producers that have not sent yet do not apply), asking for credit for the next."""
    c = cp.join(key, declared=declared, stream=stream)
    c.granted = c.received = 1
    c.granted_bytes = c.received_bytes = c.largest = declared
    cp.want(key, sent=1, sent_bytes=declared, size=declared)


# --------------------------------------------------------------------------- credit planner


def test_credit_never_exceeds_the_budget_in_batches_or_bytes():
    cp = planner(max_batches=32, max_bytes=64 * MiB)
    for i in range(8):  # eight producers declaring 16 MiB batches: 4 fit, not 32
        start(cp, bytes([i]), 16 * MiB)
    plan = cp.plan(0.0, held_batches=0, held_bytes=0)
    batches, nbytes = totals(cp)
    assert nbytes <= 64 * MiB and batches == 4
    assert len(plan.grants) == 4, "one each, fewest outstanding first"


def test_what_is_held_already_counts_against_the_budget():
    cp = planner(max_batches=10, max_bytes=10 * MiB)
    start(cp, b"p", MiB)
    cp.plan(0.0, held_batches=8, held_bytes=8 * MiB)
    assert totals(cp) == (2, 2 * MiB)


def test_a_trainers_planner_counts_small_batches_by_their_bytes():
    """by_bytes (direct mode): a producer of 16 KB batches may hold 512 (128 x 4) where a
    planner counting batches gives 4; the budget's batches count the same way, by the
    largest batches of the producers registered; a producer of large batches brings both
    back, and the count stays when the producers leave (what was granted under it may still
    be queued)."""
    broker = planner(max_batches=8)
    start(broker, b"small", 16_000)
    broker.plan(0.0, 0, 0)
    assert totals(broker)[0] == 4, "a broker's windows are batches"
    cp = CreditPlanner(Budget(8, 64 * MiB), 4, 2.0, by_bytes=True)
    start(cp, b"small", 16_000)
    cp.plan(0.0, 0, 0)
    window, count = depth(4, 16_000), depth(8, 16_000)
    assert totals(cp)[0] == window == 512 and cp.budget.max_batches == count == 1024
    start(cp, b"large", SMALL_BATCH)
    cp.plan(0.0, 0, 0)
    assert cp.budget == Budget(8, 64 * MiB)
    assert cp.producers[b"large"].outstanding == 0, "512 outstanding: nothing is free"
    for _ in range(window - 4):  # the small producer's batches arrive and are taken
        cp.batch(b"small", 16_000, 0.0)
    cp.plan(0.0, 0, 0)
    assert cp.producers[b"large"].outstanding >= 1
    assert cp.producers[b"small"].outstanding <= window and totals(cp)[0] <= 8
    cp.leave(b"large")
    cp.plan(0.0, 4, 64_000)
    assert cp.budget.max_batches == count, "small batches alone again"
    cp.leave(b"small")
    cp.plan(0.0, 4, 64_000)
    assert cp.budget.max_batches == count, "no producer: the count its batches came under stays"


def test_a_deep_window_is_topped_up_by_parts_not_a_grant_per_batch():
    """A producer's window of 512 small batches (the count by bytes) gets more credit once 64
    of it are free, all 64 in one GRANT; a window of 4 (large batches) gets each batch's
    credit back at once, as ever."""
    cp = CreditPlanner(Budget(8, 64 * MiB), 4, 2.0, by_bytes=True)
    start(cp, b"small", 16_000)
    cp.plan(0.0, 0, 0)
    window = depth(4, 16_000)
    assert cp.producers[b"small"].outstanding == window == 512 and top_up(window) == 64
    for n in range(1, 64):
        cp.batch(b"small", 16_000, 0.0)
        assert cp.plan(0.0, 0, 0).grants == [], f"a GRANT after {n} of 512 arrived"
    cp.batch(b"small", 16_000, 0.0)
    assert cp.plan(0.0, 0, 0).grants == [b"small"]
    assert cp.producers[b"small"].outstanding == window, "filled again in one GRANT"
    for _ in range(window):  # the whole window arrives before the next plan
        cp.batch(b"small", 16_000, 0.0)
    assert cp.plan(0.0, 0, 0).grants == [b"small"], "a producer with nothing left is never held"
    large = planner(max_batches=8, window=4)
    start(large, b"large", 4 * MiB)
    large.plan(0.0, 0, 0)
    large.batch(b"large", 4 * MiB, 0.0)
    assert large.plan(0.0, 1, 4 * MiB).grants == [b"large"] and top_up(4) == 1


def test_a_top_up_is_an_eighth_of_a_deep_window_and_at_least_two_bundles_of_1_mb():
    """How much of a producer's window must be free before a GRANT, for the batch sizes of
    benchmarks/transport.py: an eighth of a deep window (16 KB, 150 KB), at least
    LEAST_GRANT (two bundles of 1 MB batches: a bundle holds 3 of them) but never more than a
    quarter, and every batch for a window under 16 (4 MB and more)."""
    windows = {size: depth(4, size) for size in (16_000, 150_528, 1_053_696, 2 * MiB,
                                                  4 * MiB, 9_633_792)}
    assert [windows[s] for s in windows] == [512, 222, 31, 16, 8, 4]
    assert [top_up(w) for w in windows.values()] == [64, 27, 6, 4, 1, 1]
    for w in range(1, 600):
        t = top_up(w)
        assert 1 <= t <= max(1, w // 4), (w, t)
        assert t >= (w // 8 if w >= 16 else 1), (w, t)
    one_mb = prepare_batch([np.zeros((7, 224, 224, 3), np.uint8), np.zeros(7, np.int32)])
    assert one_mb.wire_bytes > 1_053_696
    assert 2 * (BUNDLE_BYTES // one_mb.wire_bytes) == LEAST_GRANT, "two bundles of 3"


def test_a_plan_short_of_room_waits_for_a_top_up_to_be_taken():
    """A producer of 1 MB batches whose window (31) the budget cannot fill (a broker's 254
    for them, 250 held): its arrivals leave the planner ``blocked``, not ``due`` (an arrival
    frees no room), and a plan is worth making again once ``wake`` batches were taken from
    what is held (a top-up of a window of 1 MB batches: 6); then it gets what they freed in
    one GRANT. Before: a plan at every batch that arrived or was taken, and a GRANT of a credit
    or two."""
    mb = 1_053_696
    cp = CreditPlanner(Budget(32, 1 << 30), 4, 2.0, by_bytes=True)
    start(cp, b"p", mb)
    cp.plan(0.0, 250, 250 * mb)
    assert cp.budget.max_batches == depth(32, mb) == 254
    assert cp.wake == top_up(depth(4, mb)) == LEAST_GRANT == 6
    p = cp.producers[b"p"]
    assert p.outstanding == 4 and cp.blocked
    for _ in range(4):  # its credit arrives: held 254, nothing free
        cp.batch(b"p", mb, 0.0)
        assert not cp.due, "an arrival while the budget is full: no plan to make"
    assert cp.plan(0.0, 248, 248 * mb).grants == [b"p"], "6 taken: room for 6"
    assert p.outstanding == 6 and cp.blocked
    cp.plan(0.0, 0, 0)  # taken: its window fills
    assert p.outstanding == 31 and not cp.blocked
    for n in range(1, 6):
        cp.batch(b"p", mb, 0.0)
        assert not cp.due, f"{n} of 31 free: less than a top-up"
    cp.batch(b"p", mb, 0.0)
    assert cp.due, "6 free (a top-up of its window: two bundles of 3) and room in the budget"
    small = planner(max_batches=32)
    start(small, b"q", 16_000)
    assert small.wake == 1, "windows counted in batches, under 16: at every batch taken"
    deep = CreditPlanner(Budget(32, 1 << 30), 4, 2.0, by_bytes=True)
    start(deep, b"r", 16_000)
    deep.plan(0.0, 0, 0)
    assert deep.wake == top_up(512) == 64, "16 KB: a top-up of a window of 512"


def test_a_new_registration_holds_no_credit_until_it_asks():
    """A peer that registers and never asks (a HELLO flood, a producer whose pipeline has
    not made its first batch) holds nothing; a running producer gets its window."""
    cp = planner(max_batches=32, window=4)
    for i in range(50):
        cp.join(bytes([i]), declared=MiB)
    assert cp.plan(0.0, 0, 0).grants == [] and totals(cp) == (0, 0)
    start(cp, b"honest", MiB)
    assert cp.plan(0.0, 0, 0).grants == [b"honest"]
    assert cp.producers[b"honest"].outstanding == 4
    assert totals(cp) == (4, 4 * MiB)


def test_producers_that_never_sent_hold_a_quarter_of_the_budget_together():
    """50 registrations that ask and never send (a flood that asks for credit) hold at most
    a quarter of --max-batches and --max-bytes; the running producers get the rest. A fresh
    producer's first batch fits even when it is larger than a quarter of the bytes."""
    cp = planner(max_batches=32, max_bytes=64 * MiB, window=4)
    for i in range(50):
        cp.join(bytes([i]), declared=MiB)
        cp.want(bytes([i]), sent=0, sent_bytes=0, size=MiB)
    for k in (b"run1", b"run2", b"run3", b"run4", b"run5", b"run6"):
        start(cp, k, MiB)
    cp.plan(0.0, 0, 0)
    fresh = sum(c.outstanding for c in cp.producers.values() if c.received == 0)
    assert fresh == 8, fresh
    assert [cp.producers[k].outstanding for k in (b"run1", b"run6")] == [4, 4]
    big = planner(max_batches=32, max_bytes=16 * MiB)
    big.join(b"new", declared=10 * MiB)
    big.want(b"new", sent=0, sent_bytes=0, size=10 * MiB)
    assert big.plan(0.0, 0, 0).grants == [b"new"]
    assert big.producers[b"new"].outstanding == 1


def test_a_producer_of_unknown_size_gets_credit_only_when_it_asks():
    cp = planner()
    cp.join(b"p", declared=0)
    assert cp.plan(0.0, 0, 0).grants == []
    assert cp.want(b"p", sent=0, sent_bytes=0, size=3 * MiB) is None
    assert cp.plan(0.0, 0, 0).grants == [b"p"]
    c = cp.producers[b"p"]
    assert c.granted >= 1 and c.granted_bytes >= 3 * MiB


def test_a_batch_larger_than_the_whole_budget_is_refused_not_granted():
    cp = planner(max_bytes=16 * MiB)
    cp.join(b"p", declared=64 * MiB)
    assert cp.want(b"p", 0, 0, size=64 * MiB) == "batch_too_large"
    cp.plan(0.0, 0, 0)
    assert totals(cp)[1] <= 16 * MiB


def test_a_want_tops_up_bytes_when_the_batch_credit_is_there():
    cp = planner(window=1)
    start(cp, b"p", MiB)
    cp.plan(0.0, 0, 0)
    c = cp.producers[b"p"]
    assert (c.outstanding, c.reserved) == (1, MiB)
    cp.want(b"p", sent=1, sent_bytes=MiB, size=3 * MiB)  # its next batch is bigger
    cp.plan(0.0, 0, 0)
    assert (c.outstanding, c.reserved) == (1, 3 * MiB), "bytes topped up, no extra batch"


def test_a_refused_batch_returns_its_credit():
    """The refused batch counts as received (both sides agree on the totals); the room it
    did not fill is planned anew: another producer can have it, and the refused producer
    gets credit again when it asks (WANT), not before.

    Before: the refused producer was given its window back unasked, and held it until
    someone else waited for room for a whole lease."""
    cp = planner(max_batches=4, window=4)
    start(cp, b"p", 1000)
    cp.plan(0.0, 0, 0)
    assert cp.producers[b"p"].outstanding == 4
    for _ in range(4):
        assert cp.batch(b"p", 1000, 0.1) is None
        cp.refused(b"p")
    assert cp.producers[b"p"].outstanding == 0
    cp.plan(0.2, held_batches=0, held_bytes=0)  # the broker refused them: nothing held
    assert cp.producers[b"p"].outstanding == 0, "more only when it asks"
    start(cp, b"q", 1000)
    cp.plan(0.3, held_batches=0, held_bytes=0)
    assert cp.producers[b"q"].outstanding == 4, "the room went to the one that asked"
    for _ in range(4):
        assert cp.batch(b"q", 1000, 0.4) is None  # taken by the trainers: nothing held
    cp.want(b"p", sent=4, sent_bytes=4000, size=1000)
    cp.plan(0.5, held_batches=0, held_bytes=0)
    assert cp.producers[b"p"].outstanding >= 1, "asked: granted again"


def test_sending_beyond_the_grant_is_a_breach():
    cp = planner(window=1)
    start(cp, b"p", 1000)
    cp.plan(0.0, 0, 0)
    assert cp.batch(b"p", 1000, 0.1) is None
    assert cp.batch(b"p", 1000, 0.1) == "no_credit"
    cp2 = planner(window=1)
    start(cp2, b"q", 1000)
    cp2.plan(0.0, 0, 0)
    assert cp2.batch(b"q", 5000, 0.1) == "over_credit"


def test_idle_credit_is_revoked_only_when_someone_waits_and_the_lease_ran_out():
    cp = planner(max_batches=8, window=4, lease=2.0)
    for k in (b"a", b"b"):
        start(cp, k, 1000)
    cp.plan(0.0, 0, 0)  # a and b hold all 8
    start(cp, b"busy", 1000)
    assert cp.plan(1.0, 0, 0).revokes == [], "within the lease"
    plan = cp.plan(3.0, 0, 0)
    assert sorted(plan.revokes) == [b"a", b"b"]
    # They answer with what they sent (nothing): the credit goes to the one that waits.
    assert cp.returned(b"a", sent=0, sent_bytes=0)
    assert cp.returned(b"b", sent=0, sent_bytes=0)
    cp.plan(3.1, 0, 0)
    assert cp.producers[b"busy"].outstanding == 4
    assert cp.producers[b"a"].outstanding == 0 and cp.producers[b"a"].idle
    # An idle producer gets credit again as soon as it asks.
    for _ in range(4):
        cp.batch(b"busy", 1000, 3.2)
    cp.want(b"a", sent=0, sent_bytes=0, size=1000)
    assert b"a" in cp.plan(3.3, 0, 0).grants


def test_the_time_a_producer_holds_credit_is_kept_exactly():
    """Sizing tells a producer that runs free (it holds credit: asked for batches, still
    making them) from one the trainers hold back (it answers each grant at once) by this
    time. It is kept at each grant and batch, not sampled: a sample taken just after a
    grant (where the broker's loop takes it) would see every producer holding credit."""
    cp = planner(max_batches=2, window=1)
    for k in (b"fast", b"slow"):
        start(cp, k, 1000)
    t = 0.0
    for _ in range(10):  # every 0.1 s the buffer has room for one batch of each
        cp.plan(t, 0, 0)
        cp.batch(b"fast", 1000, t + 0.001)  # sends as soon as it may
        cp.batch(b"slow", 1000, t + 0.09)  # needs 90 ms to make its batch
        t += 0.1
    cp.plan(t, 0, 0)  # both hold credit again from t
    fast, slow = (cp.producers[k].credit_seconds(t + 0.05) for k in (b"fast", b"slow"))
    assert fast == pytest.approx(10 * 0.001 + 0.05)
    assert slow == pytest.approx(10 * 0.09 + 0.05)


def test_no_revocation_when_nobody_waits():
    cp = planner(max_batches=32, window=4, lease=0.5)
    start(cp, b"slow", 1000)
    cp.plan(0.0, 0, 0)
    assert cp.plan(100.0, 0, 0).revokes == [], "a slow pipeline keeps its credit"


def test_a_returned_without_revoke_is_ignored_and_a_late_one_cannot_mint_credit():
    cp = planner(window=2)
    start(cp, b"p", 1000)
    cp.plan(0.0, 0, 0)
    assert not cp.returned(b"p", sent=5, sent_bytes=5000)
    c = cp.producers[b"p"]
    assert (c.outstanding, c.reserved) == (2, 2000)


def test_unanswered_revocations_are_reported_for_cutting_off():
    cp = planner(max_batches=4, window=4, lease=1.0)
    start(cp, b"mute", 1000)
    cp.plan(0.0, 0, 0)
    start(cp, b"other", 1000)
    cp.plan(2.0, 0, 0)
    assert cp.unanswered(3.0, timeout=5.0) == []
    assert cp.unanswered(7.5, timeout=5.0) == [b"mute"]


def test_grants_are_fair_among_many_producers():
    """64 producers on 32 credits: every one is served over a few rounds."""
    cp = planner(max_batches=32, window=4)
    keys = [i.to_bytes(2, "big") for i in range(64)]
    for k in keys:
        start(cp, k, 100)
    served = dict.fromkeys(keys, 0)
    for t in range(200):
        cp.plan(float(t), 0, 0)
        for k in keys:  # every holder sends one batch per round
            c = cp.producers[k]
            if c.outstanding:
                cp.batch(k, 100, float(t))
                served[k] += 1
    mean = sum(served.values()) / len(served)
    assert min(served.values()) >= mean / 4, served


# ------------------------------------------------------------------------------ peer table


def test_the_peer_table_is_bounded_and_liveness_works_for_any_role():
    table: PeerTable[Peer] = PeerTable("producer", capacity=2)
    table.add(Peer(b"a", "a", 1, 1, "default", last_seen=0.0, last_sent=0.0))
    table.add(Peer(b"b", "b", 2, 1, "default", last_seen=4.0, last_sent=4.0))
    with pytest.raises(Refusal, match="too_many_peers"):
        table.add(Peer(b"c", "c", 3, 1, "default"))
    table.add(Peer(b"a", "a", 1, 2, "default", last_seen=0.0))  # re-registration: room
    assert [p.name for p in table.expired(6.0, timeout=5.0)] == ["a"]
    assert [p.name for p in table.due(4.5, interval=1.0)] == ["a"]
    table.pause(6.0)  # our loop stalled: their silence was ours
    assert table.expired(6.0, timeout=5.0) == []


# ------------------------------------------------------------------------------------ gaps


def test_gaps_between_batches_and_before_a_new_hello_are_counted_once():
    g = GapTracker(capacity=4)
    assert g.hello(session=7, next_seq=0) == 0
    assert [g.batch(7, s) for s in (0, 1, 4, 5)] == [0, 0, 2, 0]
    # Dropped, it sent 6 and 7 into the void, and says hello again with 8 next.
    assert g.hello(7, next_seq=8) == 2
    assert g.hello(7, next_seq=8) == 0, "a repeated HELLO counts nothing twice"
    assert g.batch(7, 8) == 0
    assert g.batch(7, 3) == 0, "a stray old batch is not a gap"


def test_a_session_we_never_saw_starts_clean_and_the_table_is_bounded():
    g = GapTracker(capacity=3)
    assert g.hello(1, next_seq=50) == 0  # registered with another broker before: not ours
    for s in range(2, 100):
        g.hello(s, 0)
    assert len(g) == 3


# ---------------------------------------------------------------------------------- buffer


def test_the_buffer_counts_bytes_per_stream_and_bounds_control_messages():
    b = Buffer(control_slack=1)
    b.push("train", Held([b"h"], 100, 90, 1, 0))
    b.push("val", Held([b"h"], 10, 5, 2, 0))
    assert (b.batches, b.nbytes) == (2, 110) and sorted(b.streams()) == ["train", "val"]
    assert b.push("train", Held([b"eos"], 0, 0, 1, 0, broadcast=True))
    assert not b.push("train", Held([b"eos"], 0, 0, 1, 0, broadcast=True)), "slack full"
    item = b.pop("train")
    b.requeue("train", item)
    assert b.peek("train") is item and b.nbytes == 110


def test_streams_share_the_budget_and_an_unread_one_keeps_half_its_share():
    cp = planner(max_batches=32, window=32)
    start(cp, b"train", 100, stream="train")
    start(cp, b"val", 100, stream="val")
    cp.plan(0.0, 0, 0, {}, unread=set())
    assert cp.producers[b"train"].outstanding == 16 and cp.producers[b"val"].outstanding == 16
    cp2 = planner(max_batches=32, window=32)
    start(cp2, b"train", 100, stream="train")
    start(cp2, b"orphan", 100, stream="val")
    cp2.plan(0.0, 0, 0, {}, unread={"val"})
    assert cp2.producers[b"orphan"].outstanding == 8, "unread: half of its 16"
    assert cp2.producers[b"train"].outstanding == 16
    cp3 = planner(max_batches=32, window=32)
    start(cp3, b"alone", 100, stream="val")
    cp3.plan(0.0, 0, 0, {}, unread={"val"})
    assert cp3.producers[b"alone"].outstanding == 32, "one stream alone: all of it"


def test_the_buffer_evicts_the_oldest_batches_of_a_stream():
    b = Buffer()
    for i in range(5):
        b.push("val", Held([bytes([i])], 10, 10, 1, 0))
    b.push("val", Held([b"eos"], 0, 0, 1, 0, broadcast=True))
    gone = b.evict("val", 2, 1000)
    assert [h.frames[0] for h in gone] == [b"\0", b"\1", b"\2"]
    assert (b.batches, b.nbytes, b.controls) == (2, 20, 1)


def test_a_stream_the_buffer_emptied_is_no_longer_listed_as_held():
    """What ``by_stream`` lists is what the host holds: the serving core reclaims an exact
    stream only when nothing of it is held, so a stream emptied by eviction or by discarding
    (batches a consumer reported taken) must not stay listed, with nothing, for ever."""
    b = Buffer()
    for s in ("a", "b"):
        for i in range(3):
            b.push(s, Held([bytes([i])], 10, 10, 1, 0))
    assert b.evict("a", 0, 0) and b.discard("b", lambda h: True) == 3
    assert b.by_stream() == {} and b.streams() == [] and (b.batches, b.nbytes) == (0, 0)
    b.push("a", Held([b"x"], 10, 10, 1, 0))
    assert b.by_stream() == {"a": (1, 10)}

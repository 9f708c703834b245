"""Credit always comes back (issue 16): a refused batch returns it, an unused grant expires, and
a late grant of a replaced broker is worth nothing.

The hosts are both hosts of the serving core (the ``host`` fixture: a ``python -m
feedline.broker`` process and a direct-mode trainer process), or a ROUTER played by the test
for what only a fake broker can send (there the peer under test is a producer, the same in
both modes); the peers that break the rules are DEALERs speaking the protocol by hand
(tests/support/flow_support.py), next to real producer processes and a real training side.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest
import zmq

from feedline.procs import wait_for
from feedline.producer import Sender
from feedline.producer.outbox import BACKLOG_BYTES, BACKLOG_ITEMS
from feedline.protocol import wire
from feedline.serving.budget import DEPTH, depth
from tests.support.flow_support import (
    FAST,
    HELLO,
    WANT,
    FakeBroker,
    fake_yaml,
    sender_and_fake_broker,
    start_producer,
)
from tests.support.hand_protocol import (
    ARRAY,
    BATCH,
    RAW_BATCH_BYTES,
    RawPeer,
    batch_header,
    broker_credit,
    broker_grant,
    broker_heartbeat,
    want_of,
    welcome,
)

OVER_LIMIT = [0] * 3000  # a list longer than Limits.max_container_len (2048)
WINDOW = 4  # the broker's default producer window
PRODUCERS = 8  # 8 x WINDOW = the default max_batches: together they can hold all the credit
CREDIT_GAUGE = "feedline_broker_credit_outstanding_batches"


def heartbeat_until(peers: list[RawPeer], done: Callable[[], bool], seconds: float) -> bool:
    """Keep hand-played producers alive (and read their credit) until ``done()``."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for p in peers:
            p.read()
            p.heartbeat()
        if done():
            return True
        time.sleep(0.1)
    return False


def registered_raw_producers(ctx: zmq.Context, addr: str, name: str) -> list[RawPeer]:
    """PRODUCERS hand-played producers that asked for credit, each holding what the broker
    gave it: one credit each, as producers that have not sent yet hold a quarter of
    --max-batches together (8 of 32; each had its window, all 32, before that rule)."""
    peers = [RawPeer(ctx, addr) for _ in range(PRODUCERS)]
    for i, p in enumerate(peers):
        p.hello_producer(f"{name}{i}", 1000 + i)
    assert heartbeat_until(peers, lambda: all(p.granted == 1 for p in peers), 15), \
        [p.granted for p in peers]
    heartbeat_until(peers, lambda: False, 0.5)  # and nothing more comes
    assert [p.granted for p in peers] == [1] * PRODUCERS
    return peers


def test_encode_batch_names_the_limit_it_breaks():
    """Claim: ``wire.encode_batch`` of a datapoint that is a list of 3000 scalars (over
    ``Limits.max_container_len`` = 2048) raises ``wire.EncodeError`` whose message names
    ``max_container_len``: the encoder applies the decoder's limits.

    Before: it returns a 6 KB header without complaint; the broker then refuses the batch."""
    with pytest.raises(wire.EncodeError, match="max_container_len"):
        wire.encode_batch(OVER_LIMIT, producer="p", session=1, seq=0)


def test_sender_send_raises_for_a_batch_over_the_limits(host):
    """Claim: ``Sender.send`` of that datapoint raises ``EncodeError`` naming
    ``max_container_len`` and sends nothing (the host refuses nothing).

    Before: it sends it; the broker counts it as rejected (bad_msgpack)."""
    h = host()
    with Sender(h.ingress, producer_id="toolong", link=FAST) as s:
        with pytest.raises(wire.EncodeError, match="max_container_len"):
            s.send(OVER_LIMIT)
        s.send([np.zeros(2, np.float32)])  # a batch that is fine: the link is up
        s.flush(10)
    wait_for(lambda: h.metrics.value("feedline_broker_received_batches_total") >= 1, 10,
             what="the valid batch")
    assert not h.metrics.by_label("feedline_broker_rejected_messages_total", "reason")


def test_a_refused_batch_returns_its_credit(host, daemons, tmp_path):
    """Claim: eight producers (hand-played) hold the credit they are given and spend it on
    batches the broker refuses (a datapoint of 3000 scalars). The credit comes back: the
    outstanding-credit gauge ends within the window of the one refused producer whose next
    batch was valid (the other seven hold nothing), a healthy producer next to them delivers
    its 20 batches within 20 s, and a refused producer that asks (WANT) is granted credit
    again and its next, valid, batch is delivered.

    Before: the refused batches' credit stays outstanding while their senders heartbeat:
    0 of the healthy producer's 20 batches in 10 s, and no new credit for the refused ones.
    And later (until 2026-11-24): the refused producers were given their window again
    unasked and kept it unless someone waited for room for a whole lease; when the healthy
    producer got its batches first, two to four of them still held 4 each at the end (the
    gauge 12 or 20 against 8, about one run in eight under load)."""
    h = host()
    metrics = h.metrics
    ctx = zmq.Context()
    peers = registered_raw_producers(ctx, h.ingress, "refused")
    consumer = h.trainer()
    try:
        baseline = metrics.value(CREDIT_GAUGE)
        for i, p in enumerate(peers):
            for seq in range(p.granted):
                p.send([batch_header(f"refused{i}", 1000 + i, seq, [ARRAY(0), *OVER_LIMIT],
                                     [("<f4", [4])]), np.zeros(4, np.float32)])
        cfg = fake_yaml(tmp_path, "healthy", [[4, 4]], ["float32"], size=20, epochs=1)
        start_producer(daemons, h.ingress, cfg, "healthy")
        # Bounds with room for a loaded machine (the suite runs two tests at a time).
        heartbeat_until(peers, lambda: consumer.counts.get("healthy", 0) >= 20, 20)
        healthy = consumer.counts.get("healthy", 0)
        # It asks for credit for its next batch, as an honest producer whose credit was
        # spent (or asked back while it had nothing to send) does.
        peers[0].want(1024)
        again = heartbeat_until(peers, lambda: peers[0].granted > peers[0].sent, 10)
        if again:  # its next batch is a valid one
            peers[0].send([batch_header("refused0", 1000, peers[0].sent, [ARRAY(0)],
                                        [("<f4", [4])]),
                           np.ones(4, np.float32)])
            heartbeat_until(peers, lambda: consumer.counts.get("refused0", 0) >= 1, 10)
        gauge = metrics.value(CREDIT_GAUGE)
    finally:
        consumer.close()
        for p in peers:
            p.close()
        ctx.term()
    assert healthy == 20, f"healthy producer: {healthy} of 20 batches in 20 s"
    assert again, f"refused producer granted {peers[0].granted} in all, never more"
    assert consumer.counts.get("refused0") == 1, consumer.counts
    # refused0's valid batch earned it its window, counted for the 1 MiB it declared: 32
    # batches (budget.depth), as many as the baseline's 8 credits when windows held 2 MiB each.
    assert gauge <= max(baseline, depth(WINDOW, RAW_BATCH_BYTES)), (gauge, baseline)
    assert [p.granted - p.sent for p in peers[1:]] == [0] * (PRODUCERS - 1)


def test_idle_producers_do_not_keep_the_credit(host, daemons, tmp_path):
    """Claim: eight hand-played producers say HELLO, ask for credit, heartbeat and never send
    a batch; a real producer next to them gets batches flowing (>= 50 delivered to a consumer
    within 10 s), and what they hold stays within the quarter of --max-batches that producers
    which have not sent yet may hold (one each: their own counts say 8 in all; credit
    outstanding <= 8 + the busy one's window, which a broker and a direct-mode trainer count
    by bytes: up to DEPTH (128) x 4 of its 1 KB batches).

    Before: the idle ones hold all 32 credits (8 x window 4 = --max-batches): 0 batches
    delivered in 10 s, credit outstanding stays 32."""
    h = host()
    metrics = h.metrics
    ctx = zmq.Context()
    peers = registered_raw_producers(ctx, h.ingress, "idle")
    consumer = h.trainer()
    try:
        cfg = fake_yaml(tmp_path, "busy", [[16, 16]], ["float32"])
        start_producer(daemons, h.ingress, cfg, "busy")
        flowing = heartbeat_until(peers, lambda: consumer.counts.get("busy", 0) >= 50, 10)
        outstanding = metrics.value(CREDIT_GAUGE)
        idle = sum(p.granted - p.sent for p in peers)
    finally:
        consumer.close()
        for p in peers:
            p.close()
        ctx.term()
    assert flowing, f"busy producer: {consumer.counts.get('busy', 0)} batches in 10 s"
    assert idle <= PRODUCERS, [p.granted - p.sent for p in peers]
    assert outstanding <= PRODUCERS + DEPTH * WINDOW, outstanding


def test_a_late_credit_of_a_replaced_broker_is_ignored():
    """(The peer under test is a producer, against a broker played by the test.)

    Claim: a Sender registered with broker instance A, then with its replacement B (which
    grants 2), must not use a CREDIT that A sent late: it sends 2 batches to B, not more.

    Before: it takes A's late grant of 10 and sends 10 batches to B."""
    a, b = 1111, 2222
    with sender_and_fake_broker("late", [[np.full(4, i, np.int32)] for i in range(20)]) \
            as (fake, failure):
        reg = fake.wait_for_kind(HELLO, 10)["r"]
        fake.send(welcome(a, reg))
        fake.send(broker_credit(a, 1, reg))
        fake.wait_for_kind(BATCH, 10)
        fake.send(broker_heartbeat(b))  # a new instance: the Sender registers again
        reg = fake.wait_for_kind(HELLO, 10)["r"]
        fake.send(welcome(b, reg))
        fake.send(broker_credit(b, 2, reg))
        fake.send(broker_credit(a, 10, reg))  # late, from the replaced instance
        batches = 0
        for _ in range(5):  # 1 s, answering heartbeats so that the link stays up
            batches += sum(1 for h in fake.recv(0.2) if h.get("k") == BATCH)
            fake.send(broker_heartbeat(b))
    assert not failure, failure
    assert batches == 2, f"{batches} batches sent to instance B, which granted 2"



def test_a_running_producer_does_not_ask_for_every_batch():
    """(The peer under test is a producer, against a broker played by the test.)

    Claim: a producer that has sent under its registration gets its next credit unasked
    (feedline/serving/credit.py grants a running producer one credit as room frees,
     worth its largest
    batch), so it sends WANT only to start and when a batch outgrows that: not one WANT per
    batch. Played here by a broker that grants as the planner does: one more credit for each
    batch received, bytes = what it received + one unit (the largest batch, or what a WANT
    asked for), counted as the bytes that arrived.

    Before: 210 WANTs for 20 batches. A Sender counted the bound its credit had to cover,
    not the bytes it sent, so its byte credit ran short by a few bytes a batch, and it asked
    whenever its batch credit was used up, which, with a trainer that keeps up, is always.
    Each WANT was a message each way, and work for a direct-mode trainer's I/O
    thread, for every batch."""
    inst, n = 3333, 20
    wants = batches = received_bytes = unit = granted_bytes = 0
    with sender_and_fake_broker("steady", [[np.full(1000, i, np.int32)] for i in range(n)]) \
            as (fake, failure):
        reg = fake.wait_for_kind(HELLO, 10)["r"]
        fake.send(welcome(inst, reg))
        for h, size in fake.serve(inst, 20):
            if h.get("k") == WANT:
                wants += 1
                sent_bytes, size = want_of(h)
                unit = max(unit, size)
                granted_bytes = max(granted_bytes, sent_bytes + size)
            elif h.get("k") == BATCH:
                batches += 1
                received_bytes += size
                unit = max(unit, size)
            else:
                continue
            # As the planner: room for one batch more than received, worth one unit.
            granted_bytes = max(granted_bytes, received_bytes + unit)
            fake.send(broker_grant(inst, batches + 1, granted_bytes, reg))
            if batches >= n:
                break
    assert not failure, failure
    assert batches == n, f"{batches} of {n} batches arrived"
    # The first batch asks (nothing granted yet); one more if the first grant, sized by the
    # bytes that arrived, is short of the bound a batch's credit must cover.
    assert wants <= 2, f"{wants} WANTs for {n} batches"


def test_a_producer_asks_again_after_a_refused_batch():
    """(The peer under test is a producer, against a broker played by the test.)

    Claim: after the broker refuses one of its batches, a producer asks (WANT) for the
    credit of its next batch instead of waiting for a grant unasked: a host holds a producer
    whose batch it refused idle (feedline/serving/credit.py, ``refused``) and grants it more
    only when it asks. Played here by a broker that refuses the first batch and otherwise
    grants as the planner does: to a WANT, and one unasked credit per accepted batch.

    Before: with its batch credit spent and a batch sent under this registration, it took
    the next credit to come unasked and waited: 1 of 3 batches arrived in 15 s."""
    from feedline.protocol import messages as fm

    inst, n = 4444, 3
    batches = wants_after = received_bytes = 0
    with sender_and_fake_broker("refused-once",
                                [[np.full(1000, i, np.int32)] for i in range(n)]) \
            as (fake, failure):
        reg = fake.wait_for_kind(HELLO, 10)["r"]
        fake.send(welcome(inst, reg))
        for h, size in fake.serve(inst, 15):
            if h.get("k") == WANT:
                wants_after += batches > 0
                sent_bytes, size = want_of(h)
                fake.send(broker_grant(inst, batches + 1, sent_bytes + size, reg))
            elif h.get("k") == BATCH:
                batches += 1
                received_bytes += size
                if batches == 1:
                    fake.send(fm.encode(fm.Refused(broker=inst, reason="bad_header",
                                                   seq=int(h["s"]), detail="played")))
                else:
                    fake.send(broker_grant(inst, batches + 1, received_bytes + (1 << 20), reg))
            if batches >= n:
                break
    assert not failure, failure
    assert batches == n, f"{batches} of {n} batches arrived"
    assert wants_after >= 1, "it never asked after the refusal"


@pytest.mark.parametrize("nbytes, handed", [(16_000, 1 + BACKLOG_ITEMS), (1_500_000, 1 + 2),
                                             (3 << 20, 1 + 1)])
def test_a_producer_without_credit_holds_a_bounded_backlog(nbytes, handed):
    """(The peer under test is a producer, against a broker played by the test.)

    Claim: while no credit comes, a Sender's owner thread hands over small batches without
    waiting for its I/O thread, up to the backlog's bound, and then waits: the I/O thread
    holds one for credit and the backlog BACKLOG_ITEMS (32) of 16 KB, two of 1.5 MB
    (BACKLOG_BYTES, 4 MiB), one of 3 MiB (always one item, whatever its size). What a
    killed producer takes with it beyond its credit is this, and the one being handed over.

    Before: the backlog held one item of any size, and the owner thread and the I/O thread
    took turns for every batch (direct mode, 16 KB: 7,768 batches/s where 8 give 18,553)."""
    sent: list[int] = []
    batch = [np.zeros(nbytes, np.uint8)]  # more than the backlog's bounds take
    with sender_and_fake_broker("backlog", [batch] * (3 * BACKLOG_ITEMS), handed=sent) \
            as (fake, failure):
        reg = fake.wait_for_kind(HELLO, 10)["r"]
        fake.send(welcome(5555, reg))  # welcomed, and never a credit
        for _ in range(10):  # 2 s: the owner thread has long stopped handing over
            fake.recv(0.2)
            fake.send(broker_heartbeat(5555))
        assert len(sent) == handed, sent
        assert 2 * 1_500_000 < BACKLOG_BYTES < 3 * 1_500_000  # the 1.5 MB case's bound
    assert not failure, failure


def test_a_stopping_producer_does_not_wait_for_credit_nobody_gives():
    """(The peer under test is a producer, against a broker played by the test.)

    Claim: at a dataflow's end a Sender's flush waits for credit that comes late, and its
    held batches go out; told to stop (SIGTERM, a fleet's scale-down), it gives up on batches
    no broker has credit for once nothing moves, however long its flush may take (here an
    hour: a flush that waited would end the test by its timeout).

    Before: every stop waited the link's flush_ms (3 s) for credit, then the I/O thread's
    close; eight producers stopped one after another took 25 s in this suite's teardowns."""
    fake = FakeBroker()
    late: threading.Thread | None = None
    try:
        with Sender(fake.addr, producer_id="stopping", link=FAST) as s:
            reg = fake.wait_for_kind(HELLO, 10)["r"]
            fake.send(welcome(4444, reg))
            fake.send(broker_credit(4444, 1, reg))
            for i in range(3):  # one leaves; the I/O thread holds one; one waits behind it
                s.send([np.full(4, i, np.int32)])
            assert sum(1 for h in fake.recv(1.0) if h.get("k") == BATCH) == 1
            # The dataflow's end: credit comes a second later than the stopping path would
            # give up (the broker's heartbeats keep the link up meanwhile).
            def broker() -> None:
                for i in range(10):
                    fake.send(broker_heartbeat(4444))
                    if i == 5:
                        fake.send(broker_credit(4444, 3, reg))
                    time.sleep(0.2)

            late = threading.Thread(target=broker)
            late.start()
            assert s.flush(30.0)
            late.join()
            late = None
            assert sum(1 for h in fake.recv(1.0) if h.get("k") == BATCH) == 2
            for i in range(2):  # credit used up again: one held, one behind it
                s.send([np.full(4, 10 + i, np.int32)])
            fake.send(broker_heartbeat(4444))
            assert not s.flush(3600.0, stopping=True)
            s.stopped = True  # its close gives up the same way
    finally:
        if late is not None:
            late.join()
        fake.close()


def test_a_stopping_producer_does_not_wait_for_a_broker_that_is_gone():
    """(The peer under test is a producer, against a broker played by the test.)

    Claim: a producer told to stop while it holds credit from a broker that is gone (the
    trainer host died with it, as when the demo is killed -9) gives up on the batch it cannot
    send once nothing moves, however long its flush may take (an hour here: a flush that
    waited would end the test by its timeout). With credit, a send fails only when no broker
    is connected (the pipe holds far more than a credit window).

    Before: it waited the link's flush_ms (3 s) with credit in hand; the suite's kill -9 of
    the demo saw its producer outlive it by more than 15 s on a loaded machine."""
    fake = FakeBroker()
    try:
        # A heartbeat timeout longer than the test: the producer does not find the broker
        # dead (and drop its credit) while it stops, as with the default 5 s.
        with Sender(fake.addr, producer_id="orphaned",
                    link=dataclasses.replace(FAST, heartbeat_timeout=3600.0)) as s:
            reg = fake.wait_for_kind(HELLO, 10)["r"]
            fake.send(welcome(4444, reg))
            fake.send(broker_credit(4444, 1000, reg))
            s.send([np.zeros(4, np.int32)])
            assert sum(1 for h in fake.recv(1.0) if h.get("k") == BATCH) == 1
            fake.close()
            # A batch sent before the producer's side saw the connection go is queued and
            # counts as sent; the next ones cannot be. Paced, so that the bound is time (the
            # side sees it within milliseconds unloaded; CI's loaded run queued 50 unpaced
            # batches first), not a count, and well inside the 1000 batches of credit.
            stuck, deadline = False, time.monotonic() + 20
            for i in range(500):
                s.send([np.full(4, i, np.int32)])
                if not s.flush(0.5):
                    stuck = True
                    break
                if time.monotonic() > deadline:
                    break
                time.sleep(0.02)
            assert stuck, "every batch was queued: the producer never saw the broker go"
            assert not s.flush(3600.0, stopping=True)
            s.stopped = True
    finally:
        fake.close()

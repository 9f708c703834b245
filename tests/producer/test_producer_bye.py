"""A producer that finishes leaves nothing behind: BYE is answered, and the producer closes
only once it has read the answer.

Found by tests/consumer/test_data_path.py (three producers of 40 batches that finish in
milliseconds):
about 1 run in 10, one producer's last batch and its BYE never reached the broker, which
then dropped it by timeout. A TCP connection closed with received data unread (a GRANT that
arrived just before the close) is reset, not closed, and the reset throws away what the
kernel had not sent yet. Now the broker answers BYE as the last message on the connection,
and a closing producer reads until that answer (bounded), so nothing is unread at its close.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import zmq

from feedline.producer import Sender
from feedline.protocol import messages as m
from feedline.transport.link import LinkConfig
from tests.support.flow_support import HELLO, FakeBroker
from tests.support.hand_protocol import (
    BATCH,
    BYE,
    K,
    broker_grant,
    broker_heartbeat,
    producer_hello,
    unpack,
    welcome,
)

FAST = LinkConfig(heartbeat_interval=0.2, heartbeat_timeout=1.5)
ANSWER_AFTER = 0.5  # s: how long the broker played by the test holds back its answer


def test_a_closing_producer_reads_until_the_broker_answers_its_bye():
    """(The peer under test is a producer, against a broker played by the test.)

    The broker keeps sending (heartbeats after every batch: data the producer must read)
    and answers BYE only ``ANSWER_AFTER`` s late: every batch and the BYE arrive, and the
    Sender's close returns only after the answer was sent."""
    fake = FakeBroker()
    n = 40
    closed_at: list[float] = []

    def produce() -> None:
        with Sender(fake.addr, producer_id="leaving", link=FAST) as s:
            for i in range(n):
                s.send([np.full(16384, i, np.uint8)])
        closed_at.append(time.monotonic())

    t = threading.Thread(target=produce, daemon=True)
    try:
        t.start()
        reg = fake.wait_for_kind(HELLO, 10)["r"]
        fake.send(welcome(5555, reg))
        fake.send(broker_grant(5555, n, 1 << 30, reg))
        batches, answered_at = 0, None
        for header, _ in fake.serve(5555, 20):
            if header.get("k") == BATCH:
                batches += 1
                fake.send(broker_heartbeat(5555))  # unread data, as GRANTs would be
            elif header.get("k") == BYE:
                time.sleep(ANSWER_AFTER)
                assert not closed_at, "the producer closed before BYE was answered"
                answered_at = time.monotonic()
                fake.send(m.encode(m.Bye()))
                break
        t.join(10)
        assert batches == n, "every batch arrived before the BYE"
        assert answered_at is not None and closed_at and closed_at[0] >= answered_at
    finally:
        t.join(10)
        fake.close()


def test_a_producer_whose_broker_never_answers_bye_still_closes():
    """A broker that does not answer BYE (gone, or of a version before the answer) does not
    keep a closing producer: its close returns (the wait is bounded, 1 s), after its batch
    and its BYE arrived. The 10 s join only guards against a hang; it measures nothing."""
    fake = FakeBroker()
    closed = threading.Event()

    def produce() -> None:
        with Sender(fake.addr, producer_id="unanswered", link=FAST) as s:
            s.send([np.zeros(4, np.uint8)])
        closed.set()

    t = threading.Thread(target=produce, daemon=True)
    try:
        t.start()
        reg = fake.wait_for_kind(HELLO, 10)["r"]
        fake.send(welcome(6666, reg))
        fake.send(broker_grant(6666, 1, 1 << 20, reg))
        kinds = [h.get("k") for h in fake.recv(3.0)]
        t.join(10)
        assert closed.is_set(), "the producer did not close without an answer to its BYE"
        assert kinds.count(BATCH) == 1 and kinds[-1] == BYE, kinds
    finally:
        t.join(10)
        fake.close()


def test_the_broker_answers_bye_last(thread_broker, endpoints):
    """A real broker answers a producer's BYE with BYE, and sends nothing after it; a BYE
    from a peer it does not know (dropped already) is answered too."""
    thread_broker()
    ctx = zmq.Context()
    try:
        for registered in (True, False):
            peer = ctx.socket(zmq.DEALER)
            peer.linger = 0
            peer.connect(endpoints.ingress)
            if registered:
                peer.send(producer_hello("bye-test", 77))
                assert peer.poll(5000), "no WELCOME"
                assert unpack(peer.recv())["k"] == K.WELCOME
            peer.send(m.encode(m.Bye()))
            kinds = []
            while peer.poll(1000):
                kinds.append(unpack(peer.recv())["k"])
            assert kinds and kinds[-1] == BYE, kinds
            assert kinds.count(BYE) == 1, kinds
            peer.close()
    finally:
        ctx.destroy(linger=0)  # closes a peer that a failed assertion left open

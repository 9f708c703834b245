"""What benchmarks/hostile.py found: hostile peers that the broker refuses correctly (its memory
stays within the budget) but that still take the honest peers' share.

Each test is the smallest real set-up that shows one finding: a host (a broker in a thread,
or both hosts of the serving core as processes: the ``host`` fixture), a real Sender or
RemoteDataZMQ as the honest peer, and a hand-played peer (tests/support/flow_support.py). A consumer
that hogs the egress is the broker's business only: direct mode has no egress.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import zmq

from feedline.errors import Stopped
from feedline.procs import wait_for
from feedline.producer import Sender
from feedline.protocol import messages as m
from tests.support.flow_support import FAST, CountingConsumer, MiB
from tests.support.hand_protocol import ARRAY, RawPeer, batch_header


def _send_forever(addr: str, name: str, nbytes: int, stop: threading.Event) -> threading.Thread:
    """A real Sender sending constant ``nbytes`` batches until ``stop``."""

    def run() -> None:
        batch = [np.zeros(nbytes, np.uint8)]
        with Sender(addr, producer_id=name, link=FAST) as s:
            try:
                while not stop.is_set():
                    s.send(batch, stop=stop)
            except Stopped:
                pass

    t = threading.Thread(target=run, name=f"sender-{name}", daemon=True)
    t.start()
    return t


def test_byte_credit_left_over_by_small_batches_comes_back(host):
    """Claim: a hand-played producer declares 1 MiB batches (HELLO), is granted its window
    (4 batches, 4 x 1 MiB, once it has sent), spends 4 batch credits on 1 KiB batches and then only
    heartbeats. A real producer of 1 MiB batches next to it gets batches through (>= 20
    within 10 s): the ~4 MiB of byte credit left over, with no batch credit to use it, is
    asked back like any credit unused for --credit-lease.

    Before: with --max-bytes 4MiB the honest producer delivers 0 batches in 10 s; the planner
    shows the idle one holding 0 batches and 4 MiB - 4 KiB reserved, forever (with the
    default 1 GiB budget, 1024 tiny batches do the same: benchmarks/hostile.py's "refused"
    scenario, whose refused batches count as received)."""
    h = host("--max-bytes", str(4 * MiB))
    ctx = zmq.Context()
    idle = RawPeer(ctx, h.ingress)
    stop = threading.Event()
    consumer = h.trainer()
    try:
        idle.hello_producer("tiny", 42)  # declares RAW_BATCH_BYTES, 1 MiB, and asks
        for seq in range(4):  # a new producer starts with one credit, then gets its window
            assert idle.wait_credit(seq, 10), idle.granted
            idle.send([batch_header("tiny", 42, seq, [ARRAY(0)], [("|u1", [1024])]),
                       np.zeros(1024, np.uint8)])
        wait_for(lambda: consumer.counts.get("tiny", 0) == 4, 10, what="the 4 tiny batches")
        _send_forever(h.ingress, "honest", MiB, stop)
        end = time.monotonic() + 10
        while time.monotonic() < end and consumer.counts.get("honest", 0) < 20:
            idle.read(100)
            idle.heartbeat()
        honest = consumer.counts.get("honest", 0)
        reserved = h.metrics.value("feedline_broker_reserved_bytes")
    finally:
        stop.set()
        consumer.close()
        idle.close()
        ctx.destroy(linger=0)
    assert honest >= 20, f"honest producer: {honest} batches in 10 s; outstanding {reserved}"


def test_a_consumer_that_never_reads_leaves_the_others_their_share(thread_broker, endpoints):
    """Claim (broker only: the hog holds the broker's egress; direct mode has none): a
    hand-played consumer says HELLO with window 4096, heartbeats and never reads; an honest
    RemoteDataZMQ next to it keeps getting batches from a real producer (>= 200 more within
    10 s once the hog has taken what it can): one consumer holds at most the budget's
    per-consumer share (half) in flight, batches and bytes (feedline/serving/budget.py).

    Before: the hog holds all 32 batches of --max-batches in flight (1 KiB each: nowhere near
    half of --max-bytes); the honest consumer gets 0 more in 10 s (17 batches in 5 s in a
    probe, 1601 with the hog's window at 4)."""
    tb = thread_broker()
    ctx = zmq.Context()
    stop = threading.Event()
    consumer = CountingConsumer(endpoints.egress)
    hog = RawPeer(ctx, endpoints.egress, rcvhwm=1)
    try:
        _send_forever(endpoints.ingress, "honest", 1024, stop)
        wait_for(lambda: consumer.total >= 50, 20, what="honest traffic")
        hog.hello_consumer("hog", 4096)

        def hog_is_full() -> bool:
            hog.heartbeat()
            return tb.broker.egress.inflight()[0] >= tb.broker.budget.per_consumer.batches

        try:
            wait_for(hog_is_full, 10, interval=0.2, what="the hog to take batches")
        except TimeoutError:
            pass  # it could not take half: what follows passes
        before = consumer.total
        end = time.monotonic() + 10
        while time.monotonic() < end and consumer.total < before + 200:
            hog.heartbeat()
            time.sleep(0.2)
        got = consumer.total - before
        inflight = tb.broker.egress.inflight()
    finally:
        stop.set()
        consumer.close()
        hog.close()
        ctx.destroy(linger=0)
    assert got >= 200, f"honest consumer: {got} batches in 10 s; in flight {inflight}"


def test_a_consumer_that_registers_again_without_reading_leaves_the_others_their_share(
        thread_broker, endpoints):
    """Claim (broker only, as above): a hand-played consumer says HELLO with window 4096 and
    never reads, takes its half of --max-batches, then says HELLO again on the same
    connection (a new session and registration, as a restarted iterator would) and
    heartbeats; an honest RemoteDataZMQ next to it still gets >= 200 more batches within
    10 s.

    Before (benchmarks/hostile.py, "hog", after the half-budget cap): the first registration's
    16 batches stay counted as orphans and the second takes 16 more: 32 of 32 in flight, the
    honest consumer gets 0 (the benchmark's 4 s windows show 0.70x: the HELLO again comes
    2.7 s in, and nothing is delivered after it)."""
    tb = thread_broker()
    ctx = zmq.Context()
    stop = threading.Event()
    consumer = CountingConsumer(endpoints.egress)
    hog = RawPeer(ctx, endpoints.egress, rcvhwm=1)
    half = tb.broker.budget.per_consumer.batches

    def hello(n: int) -> None:
        hog.sock.send(m.encode(m.ConsumerHello(consumer="hog", session=n, window=4096,
                                               max_bytes=1 << 40, registration=n)))

    def hog_holds(batches: int) -> bool:
        hog.heartbeat()
        return tb.broker.egress.inflight()[0] >= batches

    try:
        _send_forever(endpoints.ingress, "honest", 1024, stop)
        wait_for(lambda: consumer.total >= 50, 20, what="honest traffic")
        hello(1)
        wait_for(lambda: hog_holds(half), 10, interval=0.2, what="the hog's first half")
        hello(2)
        try:
            wait_for(lambda: hog_holds(2 * half), 5, interval=0.2, what="the hog's second half")
        except TimeoutError:
            pass  # it could not take more: what follows passes
        before = consumer.total
        end = time.monotonic() + 10
        while time.monotonic() < end and consumer.total < before + 200:
            hog.heartbeat()
            time.sleep(0.2)
        got = consumer.total - before
        inflight = tb.broker.egress.inflight()
    finally:
        stop.set()
        consumer.close()
        hog.close()
        ctx.destroy(linger=0)
    assert got >= 200, f"honest consumer: {got} batches in 10 s; in flight {inflight}"

"""Peers that break the rules are cut off and counted; the others do not notice (issue 16).

A message of a million empty frames, a flood of registrations, dtypes that do not travel
between machines, bools that are not 0 or 1, a broker that sends a malformed envelope. The
attackers are real sockets: ZeroMQ DEALERs and ROUTERs, or a raw stream speaking ZMTP by hand
where libzmq would not let us misbehave (or would take seconds to). What attacks a host runs
against both hosts of the serving core (the ``host`` fixture: a broker process and a
direct-mode trainer process); what attacks a broker's consumer side (its egress) runs against
the broker only, as direct mode has none.
"""

from __future__ import annotations

import math
import threading
import time

import msgpack
import numpy as np
import pytest
import zmq
from prometheus_client import CollectorRegistry

from feedline.consumer import ConsumerOptions, RemoteDataZMQ
from feedline.procs import wait_for
from feedline.protocol import wire
from feedline.transport.link import LinkConfig
from tests.support.flow_support import (
    FAST,
    HELLO,
    OVERHEAD,
    FakeBroker,
    RssSampler,
    fake_yaml,
    start_producer,
)
from tests.support.hand_protocol import (
    ARRAY,
    RawPeer,
    batch_header,
    broker_heartbeat,
    deliver_envelope,
    empty_frames,
    welcome,
    zmtp_dealer,
)
from tests.support.hosts import honest_round

FRAMES = 1_000_000
ZMQ_MSG_T = 64  # what libzmq holds per frame before the first one is readable (zmq_msg_t)

@pytest.mark.parametrize("side", ["ingress", "egress"])
def test_a_message_of_a_million_empty_frames(side, host, daemons, endpoints, tmp_path):
    """Claim: one message of 1,000,000 empty frames from a DEALER on the broker's ingress (or
    egress) is refused and counted (feedline_broker_rejected_messages_total, reason
    "too_many_frames"), honest peers are not dropped meanwhile (dropped_peers, reason timeout,
    stays 0) and are served right after, and the broker's RSS grows by at most 64 bytes per
    frame (libzmq's zmq_msg_t, held before any frame is readable) + 48 MiB. Liveness: heartbeat
    1 s, timeout 15 s on every side. Reading a million frames takes the broker 4 to 7 s on
    this machine and longer on a loaded one (the suite runs two tests at a time), during which
    it serves no one (docs/reliability.md); the default 5 s timeout can drop honest peers
    then, which is a matter of speed, not of what this test checks.

    Before: recv_multipart(copy=False) makes a zmq.Frame per frame (~8 s for 1M) before the
    count is checked: the broker grew by 255-260 MiB and an honest peer was dropped for a
    timeout in most runs (the consumer or the producer); counted as too_many_arrays
    (ingress) or bad_envelope (egress)."""
    if side == "egress":
        host.broker_only("the egress is the broker's consumer side")
    liveness = ("--heartbeat-interval", "1", "--heartbeat-timeout", "15")
    broker = host(liveness=liveness)
    metrics = broker.metrics
    start_producer(daemons, broker.ingress, fake_yaml(tmp_path, "steady", [[8]], ["float32"]),
                   "steady", *liveness)
    consumer = broker.trainer(link=LinkConfig(heartbeat_interval=1.0, heartbeat_timeout=15.0))
    addr = broker.ingress if side == "ingress" else endpoints.egress
    try:
        wait_for(lambda: consumer.total >= 20, 20, what="honest traffic")
        bound = ZMQ_MSG_T * FRAMES + OVERHEAD
        with RssSampler(broker.pid) as rss:
            attacker = zmtp_dealer(addr)
            try:
                attacker.sendall(empty_frames(FRAMES))
                wait_for(lambda: sum(metrics.by_label("feedline_broker_rejected_messages_total",
                                                      "reason").values()) >= 1, 60,
                         what="the message refused")
            finally:
                attacker.close()
            before = consumer.total
            wait_for(lambda: consumer.total >= before + 20, 20, what="honest traffic after")
    finally:
        consumer.close()
    rejected = metrics.by_label("feedline_broker_rejected_messages_total", "reason")
    dropped = {role: metrics.value("feedline_broker_dropped_peers_total", role=role,
                                   reason="timeout") for role in ("producer", "consumer")}
    assert rss.peak_growth <= bound, f"broker grew {rss.mib()} MiB; dropped {dropped}"
    assert dropped == {"producer": 0, "consumer": 0}, dropped
    assert rejected.get("too_many_arrays") == 1, rejected
    # Under load (the suite runs two tests at a time) unknown_peer refusals have shown up
    # besides: one in the egress run 2 runs in 3, and two in each run once (CI, 2026-11-27):
    # messages from a connection the broker does not know, answered with RESET, upon which an
    # honest peer registers again. Their origin is not pinned down (not reproduced alone or
    # under 6 busy processes; the broker's refused and dropped lines are printed if the
    # bound fails). An honest peer sends a few messages at most before it registers again:
    # at most 2 for each of the two honest peers here. Nothing else is refused.
    assert set(rejected) <= {"too_many_arrays", "unknown_peer"}, rejected
    refused = [ln for ln in broker.log_text().splitlines() if "refused" in ln or "dropped" in ln]
    assert rejected.get("unknown_peer", 0) <= 4, (rejected, refused[-20:])


def test_a_hello_flood_keeps_the_log_short(host):
    """Claim: 50,000 HELLOs with new producer ids and sessions (n > 0), from 50 DEALERs: the
    broker's log stays short (< 200 lines; repeated lines are rate-limited with a count of
    what was suppressed), its RSS grows by at most 48 MiB, an honest round passes after, and
    a connection registers at most 10 times a second: the rest of its HELLOs are refused and
    counted (feedline_broker_rejected_messages_total, reason "hello_flood"), so the flood
    does not cost the broker a registration (tables, metric series) per message.

    Before: a "producer floodN joined" line per HELLO: 50,056 lines; then every HELLO was a
    registration (~270 us of broker CPU each)."""
    broker = host()
    metrics = broker.metrics
    ctx = zmq.Context()
    peers = [RawPeer(ctx, broker.ingress) for _ in range(50)]
    t0 = time.monotonic()
    with RssSampler(broker.pid, limit=OVERHEAD) as rss:
        try:
            for i in range(1000):
                for j, p in enumerate(peers):
                    n = i * len(peers) + j
                    p.hello_producer(f"flood{n}", 1 << 40 | n, n=1 + n)
            honest_round(broker)
            sizes = [-1]

            def settled() -> bool:  # the broker's log has stopped growing
                sizes.append(len(broker.log_text()))
                return sizes[-1] == sizes[-2]

            wait_for(settled, 60, interval=1.0, what="the broker's log to settle")
            # The log is rate-limited, so it settles before the broker has read every HELLO:
            # the count of refused ones is what must stop growing.
            refused = [-1.0]

            def counted() -> bool:
                refused.append(metrics.by_label("feedline_broker_rejected_messages_total",
                                                "reason").get("hello_flood", 0))
                return refused[-1] == refused[-2]

            wait_for(counted, 60, interval=1.0, what="the broker to get through the flood")
            elapsed = time.monotonic() - t0
        finally:
            for p in peers:
                p.close()
            ctx.term()
    lines = broker.log_text().splitlines()
    assert len(lines) < 200, f"{len(lines)} log lines; last: {lines[-3:]}"
    assert rss.peak_growth <= OVERHEAD, f"broker grew {rss.mib()} MiB"
    rejected = metrics.by_label("feedline_broker_rejected_messages_total", "reason")
    # 50 connections at 10 registrations a second for as long as the flood and the honest
    # round took: the rest of the 50,000 HELLOs are refused (with no limit, none is).
    accepted = 50_000 - rejected.get("hello_flood", 0)
    assert accepted <= 50 * 10 * (elapsed + 1), (rejected, f"{elapsed:.1f} s")


# ------------------------------------------------------------------------------ dtypes


def _frames_with(dtype: str, payload: bytes, shape: list[int]) -> list:
    """A batch as the real encoder makes it, then given another dtype and payload (so that
    the header is otherwise valid in whatever protocol version the encoder speaks)."""
    header, _ = wire.encode_batch([np.zeros(2, np.float64)], producer="p", session=1, seq=0)
    h = msgpack.unpackb(header, raw=False)
    h["a"] = [[dtype, shape]]
    return [msgpack.packb(h, use_bin_type=True), payload]


@pytest.mark.parametrize("dtype", ["<f16", "<c32"])
def test_the_decoder_refuses_long_doubles(dtype):
    """Claim: decode_batch refuses ``<f16`` and ``<c32`` (numpy long double: x86 and aarch64
    disagree on their layout, TensorFlow cannot take them) with DecodeError bad_dtype.

    Before: accepted (np.longdouble arrays returned)."""
    with pytest.raises(wire.DecodeError) as err:
        wire.decode_batch(_frames_with(dtype, b"\0" * 2 * np.dtype(dtype).itemsize, [2]))
    assert err.value.reason == "bad_dtype"


@pytest.mark.parametrize("dtype", [np.longdouble, np.clongdouble])
def test_the_encoder_refuses_long_doubles(dtype):
    """Claim: encode_batch refuses to send long double arrays (EncodeError).

    Before: encoded as <f16 / <c32."""
    with pytest.raises(wire.EncodeError):
        wire.encode_batch([np.zeros(2, dtype)], producer="p", session=1, seq=0)


def test_the_decoder_refuses_bools_that_are_not_0_or_1():
    """Claim: a bool array whose bytes are 2 and 255 is refused with a DecodeError (numpy would
    hand out bools that compare unequal to True; TensorFlow's behaviour is undefined).

    Before: accepted."""
    with pytest.raises(wire.DecodeError):
        wire.decode_batch(_frames_with("|b1", b"\x02\xff", [2]))


# ------------------------------------------------------------------ a hostile broker

BAD_GAPS = {"str": "x", "nan": math.nan, "inf": math.inf, "list": [1], "huge": (1 << 64) - 1}


@pytest.mark.parametrize("bad", list(BAD_GAPS), ids=list(BAD_GAPS))
def test_a_malformed_deliver_envelope_does_not_kill_the_consumer(bad):
    """Claim: a DELIVER envelope whose gap ("g") is 'x', NaN, inf, a list or 2**64-1, sent by a
    fake broker to a real RemoteDataZMQ, is counted in feedline_consumer_rejected_messages_total
    and the valid batch sent after it is received.

    Before: 'x', NaN, inf and a list raise in the I/O thread (int(g)), which dies: the
    iterator raises that ValueError/OverflowError/TypeError; 2**64-1 is taken as 18e18
    batches lost, nothing rejected."""
    fake = FakeBroker()
    registry = CollectorRegistry()
    instance = 77
    got: list = []
    body = [batch_header("p", 1, 0, [ARRAY(0)], [("<i4", [1])])]
    with RemoteDataZMQ(fake.addr, timeout=10,
                       options=ConsumerOptions(link=FAST, registry=registry)) as src:

        def take() -> None:
            try:
                got.append(next(iter(src)))
            except Exception as e:  # what the iterating thread saw
                got.append(e)

        t = threading.Thread(target=take, daemon=True)
        t.start()
        try:
            reg = fake.wait_for_kind(HELLO, 10)["r"]
            fake.send(welcome(instance, reg))
            fake.send(deliver_envelope(instance, BAD_GAPS[bad], reg), *body,
                      np.array([-1], "<i4").tobytes())
            fake.send(deliver_envelope(instance, 0, reg), *body,
                      np.array([7], "<i4").tobytes())
            end = time.monotonic() + 10
            while t.is_alive() and time.monotonic() < end:
                fake.recv(0.1)  # the consumer's heartbeats; ours keep the link up
                fake.send(broker_heartbeat(instance))
        finally:
            t.join(10)
            fake.close()
    rejected = {s.labels["reason"]: s.value for m in registry.collect() for s in m.samples
                if s.name == "feedline_consumer_rejected_messages_total"}
    assert len(got) == 1 and not isinstance(got[0], Exception), got
    assert int(got[0][0][0]) == 7, got
    assert sum(rejected.values()) == 1, rejected

"""Several batches in one message (feedline.protocol.bundle): what a direct-mode trainer takes.

The decoder gives what decoding each batch alone gives, refuses every malformed bundle whole
with a reason; a real producer sends bundles to a real direct-mode trainer (sockets on
127.0.0.1) and every batch arrives once, in order, with credit agreeing on both sides; a
hand-played producer's bundles beyond the rules are refused and counted, or cut off, and the
trainer goes on.
"""

from __future__ import annotations

import contextlib
import threading
import time

import msgpack
import numpy as np
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from prometheus_client import CollectorRegistry

from feedline.broker.buffer import Buffer
from feedline.broker.egress import ConsumerSide
from feedline.consumer import ConsumerOptions, RemoteDataZMQ
from feedline.errors import ReceiveTimeout
from feedline.procs import free_port, wait_for
from feedline.producer import Sender
from feedline.protocol import messages as m
from feedline.protocol import wire
from feedline.protocol.bundle import (
    BUNDLE_BYTES,
    JOIN_BYTES,
    JOIN_FORWARDED,
    MAX_BUNDLE,
    bundle_frames,
    check_bundle,
    decode_bundle,
)
from feedline.protocol.codec import DecodeError, Limits
from feedline.serving.budget import Budget, depth
from feedline.serving.held import Held
from feedline.serving.metrics import BrokerMetrics
from tests.support.hand_protocol import RawPeer, unpack

FAST = {"heartbeat_interval": 0.2, "heartbeat_timeout": 1.5}
PID = wire.packb("p")


def _datapoints(n: int, start: int = 0) -> list[list[np.ndarray]]:
    return [[np.full(1, i, np.int64), np.full((4, 4), i, np.float32)]
            for i in range(start, start + n)]


def _alone(dp, seq: int) -> wire.Batch:
    return wire.decode_batch(wire.encode_batch(dp, producer="p", session=7, seq=seq, epoch=2))


@pytest.mark.parametrize("shape", ["list", "tuple", "dict", "scalars"])
def test_a_bundle_decodes_to_what_each_batch_alone_decodes_to(shape):
    dps: list = _datapoints(5)
    if shape == "scalars":  # a 0-d array and bools: a view of each, not a numpy scalar
        dps = [[np.array(i, np.int64), np.array([i % 2, 1, 0], bool)] for i in range(5)]
    if shape == "tuple":
        dps = [tuple(dp) for dp in dps]
    elif shape == "dict":  # a structure that is not the arrays in order: rebuilt per batch
        dps = [{"y": dp[1], "x": dp[0]} for dp in dps]
    prepared = [wire.prepare_batch(dp) for dp in dps]
    frames = bundle_frames(prepared, producer=PID, session=7, seq=40, epoch=2)
    header = wire.header_map(frames[0])
    got = decode_bundle(frames, wire.DEFAULT_LIMITS, header, MAX_BUNDLE)
    assert [b.seq for b in got] == [40, 41, 42, 43, 44]
    for i, b in enumerate(got):
        alone = _alone(dps[i], 40 + i)
        assert (b.producer, b.session, b.epoch, b.nbytes, b.unit) == (
            alone.producer, alone.session, alone.epoch, alone.nbytes, -1)
        assert type(b.datapoint) is type(alone.datapoint)
        items = (sorted(b.datapoint.items()) if shape == "dict" else enumerate(b.datapoint))
        for (k, a), (k2, a2) in zip(items, sorted(alone.datapoint.items()) if shape == "dict"
                                    else enumerate(alone.datapoint), strict=True):
            assert k == k2 and np.array_equal(a, a2) and not a.flags.writeable
            assert type(a) is np.ndarray and (a.dtype, a.shape) == (a2.dtype, a2.shape)
    # The header's bytes are counted with the first batch: what the producer counts as sent.
    assert sum(b.wire_bytes for b in got) == len(frames[0]) + sum(p.nbytes for p in prepared)


@pytest.mark.parametrize("side, join, joined", [
    (224, JOIN_BYTES, True), (320, JOIN_BYTES, False), (320, JOIN_FORWARDED, True),
    (400, JOIN_FORWARDED, False)])
def test_one_image_batches_travel_joined_and_larger_ones_a_frame_each(side, join, joined):
    """Batches of one 224x224x3 image (150 KB) go joined, 3 frames for 4 batches rather than
    9 (faster both through a broker and in direct mode: benchmarks/NOTES.md); 320x320x3
    (300 KB), where joining cost direct mode a fifth, a frame per array of each batch, but
    joined to a broker (``join``: its WELCOME asks for up to JOIN_FORWARDED); 400x400x3
    (480 KB) a frame each to both. The receiver gets each batch's own bytes either way."""
    dps = [[np.full((side, side, 3), i, np.uint8), np.full(1, i, np.int32)] for i in range(4)]
    frames = bundle_frames([wire.prepare_batch(dp) for dp in dps], producer=PID, session=1,
                           seq=0, epoch=0, join=join)
    assert len(frames) == (3 if joined else 9)
    got = decode_bundle(frames, wire.DEFAULT_LIMITS, wire.header_map(frames[0]), MAX_BUNDLE)
    assert len(got) == 4
    for i, b in enumerate(got):
        assert np.array_equal(b.datapoint[0], dps[i][0]) and b.datapoint[1].tolist() == [i]


def _bundle(count: int = 3, big: bool = False, **header) -> list:
    """A bundle of ``count`` batches: joined, or (``big``: batches over JOIN_BYTES) a frame
    per array of each batch; ``header`` entries replaced."""
    dps = _datapoints(count)
    if big:
        dps = [[dp[0], np.zeros(JOIN_BYTES // 4 + 1, np.float32)] for dp in dps]
    frames = bundle_frames([wire.prepare_batch(dp) for dp in dps], producer=PID,
                           session=1, seq=0, epoch=0)
    if header:
        h = msgpack.unpackb(frames[0], raw=False, strict_map_key=False)
        h.update(header)
        frames[0] = msgpack.packb(h, use_bin_type=True)
    return frames


@pytest.mark.parametrize("make, most, reason", [
    (lambda: _bundle(MAX_BUNDLE + 1), MAX_BUNDLE, "bad_header"),  # more than the host takes
    (lambda: _bundle(5), 4, "bad_header"),  # ... than this host said
    (lambda: _bundle(3, n=1), MAX_BUNDLE, "bad_header"),  # a bundle of one
    (lambda: _bundle(3, n=True), MAX_BUNDLE, "bad_header"),  # a bool is no count
    (lambda: _bundle(3, n=4), MAX_BUNDLE, "shape_mismatch"),  # says 4, joined frames of 3
    (lambda: _bundle(3, big=True, n=4), MAX_BUNDLE, "frame_count"),  # ... a frame per array
    (lambda: _bundle(3)[:-1], MAX_BUNDLE, "frame_count"),  # one frame short
    (lambda: _bundle(3, u=0, i=0, l=False), MAX_BUNDLE, "bad_header"),  # exact batches
    (lambda: _bundle(3, s=(1 << 63) - 2), MAX_BUNDLE, "bad_header"),  # seqs past 2**63 - 1
    (lambda: _bundle(3, c=9), MAX_BUNDLE, "bad_structure"),
    (lambda: _bundle(3, a=[["|O", [1]], ["<f4", [4, 4]]]), MAX_BUNDLE, "bad_dtype"),
    (lambda: [*_bundle(3)[:-1], b"\0" * 63], MAX_BUNDLE, "shape_mismatch"),  # the last batch
    (lambda: _bundle(3, big=True)[:-1], MAX_BUNDLE, "frame_count"),
    (lambda: [*_bundle(3, big=True)[:-1], b"\0" * 63], MAX_BUNDLE, "shape_mismatch"),
])
def test_a_malformed_bundle_is_refused_whole(make, most, reason):
    """By the decoder (a direct-mode trainer, a consumer) and by the check a broker makes
    before it forwards one (check_bundle), with the same reason."""
    frames = make()
    for check in (decode_bundle, check_bundle):
        with pytest.raises(DecodeError) as e:
            check(frames, wire.DEFAULT_LIMITS, wire.header_map(frames[0]), most)
        assert e.value.reason == reason, check.__name__


@settings(max_examples=200, deadline=None)
@given(n=st.integers(2, 6), bools=st.booleans(), big=st.booleans(), at=st.integers(0, 100),
       cut=st.integers(-2, 2), byte=st.sampled_from([0, 1, 2, 255]))
def test_a_broker_checks_a_bundle_as_its_consumers_decode_it(n, bools, big, at, cut, byte):
    """check_bundle accepts exactly the bundles decode_bundle accepts, and weighs them
    alike, joined or not (``big``: batches over JOIN_BYTES): one frame made longer or
    shorter, or a byte changed (a bool's, or a number's)."""
    rows = JOIN_BYTES // 4 + 1 if big else 2
    dps = [[np.full(3, i, np.int64), np.ones((rows, 2), bool if bools else np.float32)]
           for i in range(n)]
    frames = [f if isinstance(f, bytes) else bytes(f) for f in bundle_frames(
        [wire.prepare_batch(dp) for dp in dps], producer=PID, session=1, seq=0, epoch=0)]
    i = 1 + at % (len(frames) - 1)
    f = bytearray(frames[i])
    if cut > 0:
        f += b"\1" * cut
    elif cut < 0:
        del f[cut:]
    elif f:
        f[0] = byte
    frames[i] = bytes(f)
    header = wire.header_map(frames[0])
    try:
        batches = decode_bundle(frames, wire.DEFAULT_LIMITS, header, MAX_BUNDLE)
    except DecodeError as e:
        with pytest.raises(DecodeError) as e2:
            check_bundle(frames, wire.DEFAULT_LIMITS, header, MAX_BUNDLE)
        assert e2.value.reason == e.reason
        return
    assert check_bundle(frames, wire.DEFAULT_LIMITS, header, MAX_BUNDLE) == (
        len(batches), batches[0].nbytes)


def test_a_bundle_counts_its_batches_together_against_the_message_limit():
    """Each batch fits the limit alone; together they do not: refused."""
    tight = Limits(max_message_bytes=3 * 72)  # one batch: 8 + 64 array bytes
    frames = _bundle(4)
    with pytest.raises(DecodeError) as e:
        decode_bundle(frames, tight, wire.header_map(frames[0], tight), MAX_BUNDLE)
    assert e.value.reason == "message_too_large"
    assert len(decode_bundle(_bundle(3), tight, wire.header_map(_bundle(3)[0], tight),
                             MAX_BUNDLE)) == 3


class _Taking:
    """Iterates a RemoteDataZMQ in a thread (a direct-mode trainer serves once iterated),
    keeping what it takes; sleeps ``pause`` s after the ``pause_at``-th batch (a slow step)."""

    def __init__(self, src: RemoteDataZMQ, pause_at: int = -1, pause: float = 0.0) -> None:
        self.got: list = []
        self._src, self._pause_at, self._pause = src, pause_at, pause
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with contextlib.suppress(ReceiveTimeout):
            for b in self._src:
                self.got.append(b)
                if len(self.got) == self._pause_at:
                    time.sleep(self._pause)

    def wait(self, n: int, seconds: float = 30) -> list:
        wait_for(lambda: len(self.got) >= n, seconds, what=f"{n} batches taken")
        return self.got


def test_a_producer_bundles_small_batches_to_a_direct_mode_trainer_and_loses_nothing():
    """A Sender sends 2,000 batches of 16 KB to a direct-mode trainer that pauses after its
    50th (batches pile up behind the credit): they go in bundles, and each arrives once, in
    order, with its own sequence number; neither side refuses or cuts off anything (both
    count the same credit)."""
    from feedline.transport.link import LinkConfig

    n = 2000
    addr = f"tcp://127.0.0.1:{free_port()}"
    sreg, treg = CollectorRegistry(), CollectorRegistry()
    link = LinkConfig(**FAST)
    payload = np.zeros(16_000, np.uint8)
    with RemoteDataZMQ(addr, bind=True, timeout=30, return_meta=True,
                       options=ConsumerOptions(link=link, registry=treg)) as src:
        taking = _Taking(src, pause_at=50, pause=0.5)
        with Sender(addr, producer_id="bundler", link=link, registry=sreg) as s:
            for i in range(n):
                s.send([np.full(1, i, np.int64), payload])
            got = taking.wait(n)
        bundles = sreg.get_sample_value("feedline_producer_sent_bundles_total")
        sent = sreg.get_sample_value("feedline_producer_sent_batches_total")
    assert [int(b.datapoint[0][0]) for b in got] == list(range(n))
    assert [b.seq for b in got] == list(range(n))
    assert sent == n
    # How many depends on which side is faster once the trainer goes on (under load, either):
    # at least the batches that piled up behind its pause went in bundles.
    assert bundles is not None and bundles >= 1, f"{bundles} bundles for {n} batches"
    for name in ("feedline_broker_refused_batches_total", "feedline_broker_rejected_messages_total",
                 "feedline_broker_cut_off_connections_total"):
        assert not any(s.value for metric in treg.collect() for s in metric.samples
                       if s.name == name), name


def _registered(ctx: zmq.Context, addr: str, pid: str) -> tuple[RawPeer, dict]:
    """A hand-played producer, welcomed, holding the one credit of a new registration."""
    peer = RawPeer(ctx, addr)
    peer.hello_producer(pid, session=1)
    welcome: dict = {}
    deadline = time.monotonic() + 10
    while not (welcome and peer.granted >= 1):
        assert time.monotonic() < deadline, (welcome, peer.granted)
        for h in peer.read(100):
            if h["k"] == wire.Kind.WELCOME:
                welcome = h
    return peer, welcome


def _raw_bundle(n: int, seq: int) -> list:
    frames = bundle_frames([wire.prepare_batch(dp) for dp in _datapoints(n, seq)],
                           producer=wire.packb("raw"), session=1, seq=seq, epoch=0)
    return [f if isinstance(f, bytes) else f.tobytes() for f in frames]


def _refused(peer: RawPeer, seconds: float = 5) -> list[str]:
    """The reasons of the REFUSED that arrive within ``seconds``."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        refused = [h["r"] for h in peer.read(100) if h["k"] == wire.Kind.REFUSED]
        if refused:
            return refused
    return []


def test_welcome_says_how_many_batches_a_bundle_may_hold():
    assert m.decode(m.encode(m.Welcome(broker=1, bundle=5))).bundle == 5
    assert m.decode(m.encode(m.Welcome(broker=1))).bundle == 0  # as an older host says it


def test_welcome_says_how_large_a_batch_goes_joined():
    assert m.decode(m.encode(m.Welcome(broker=1, join=JOIN_FORWARDED))).join == JOIN_FORWARDED
    assert m.decode(m.encode(m.Welcome(broker=1))).join == 0  # the producer's default
    for bad in (-1, True, "big"):  # refused as any ill-typed field is
        with pytest.raises(DecodeError):
            m.decode(msgpack.packb({**unpack(m.encode(m.Welcome(broker=1))), "jn": bad}))


def test_a_direct_mode_trainer_refuses_a_bundle_beyond_what_it_offered_and_goes_on():
    """The trainer's WELCOME offers bundles of MAX_BUNDLE; a hand-played producer sends one
    that says MAX_BUNDLE + 1 (refused whole, counted as one batch: its count is not believed;
    its credit comes back when it asks), then an honest one of 3, which arrives whole."""
    from feedline.transport.link import LinkConfig

    addr = f"tcp://127.0.0.1:{free_port()}"
    ctx = zmq.Context()
    treg = CollectorRegistry()
    try:
        with RemoteDataZMQ(addr, bind=True, timeout=10, return_meta=True,
                           options=ConsumerOptions(link=LinkConfig(**FAST), registry=treg)) as src:
            taking = _Taking(src)
            peer, welcome = _registered(ctx, addr, "raw")
            assert welcome.get("bn") == MAX_BUNDLE
            frames = _raw_bundle(3, 0)
            h = unpack(frames[0])
            h["n"] = MAX_BUNDLE + 1
            peer.send([msgpack.packb(h, use_bin_type=True), *frames[1:]])
            assert _refused(peer) == ["bad_header"]
            assert treg.get_sample_value("feedline_broker_refused_batches_total",
                                         {"producer": "raw", "reason": "bad_header"}) == 1
            peer.want(1 << 20)
            assert peer.wait_credit(peer.sent + 2, 10), "no credit after the refusal"
            peer.sock.send_multipart(_raw_bundle(3, 0))
            got = taking.wait(3, 10)
            assert [int(b.datapoint[0][0]) for b in got] == [0, 1, 2]
            assert [b.seq for b in got] == [0, 1, 2]
            assert not treg.get_sample_value("feedline_broker_cut_off_connections_total",
                                             {"role": "producer", "reason": "no_credit"})
            peer.close()
    finally:
        ctx.destroy(linger=0)


def test_a_bundle_beyond_its_credit_cuts_its_producer_off():
    """A new registration holds one credit (slow start); a bundle of 3 is two batches beyond
    it: the producer is cut off, as for batches sent one by one beyond their credit."""
    from feedline.transport.link import LinkConfig

    addr = f"tcp://127.0.0.1:{free_port()}"
    ctx = zmq.Context()
    treg = CollectorRegistry()
    try:
        with RemoteDataZMQ(addr, bind=True, timeout=10,
                           options=ConsumerOptions(link=LinkConfig(**FAST), registry=treg)) as src:
            _Taking(src)
            peer, _ = _registered(ctx, addr, "greedy")
            assert peer.granted == 1
            peer.send(_raw_bundle(3, 0))
            wait_for(lambda: treg.get_sample_value(
                "feedline_broker_cut_off_connections_total",
                {"role": "producer", "reason": "no_credit"}), 10, what="the cut-off")
            peer.close()
    finally:
        ctx.destroy(linger=0)


def _raw_consumer(ctx: zmq.Context, addr: str, cid: str, bundle: int) -> RawPeer:
    peer = RawPeer(ctx, addr)
    peer.sock.send(m.encode(m.ConsumerHello(consumer=cid, session=3, window=4,
                                            max_bytes=1 << 30, registration=1, bundle=bundle)))
    return peer


def _deliveries(peer: RawPeer, batches: int, seconds: float = 10) -> list[list[bytes]]:
    """The DELIVERs that arrive until they hold ``batches`` batches: [header, arrays...]."""
    out: list[list[bytes]] = []
    end = time.monotonic() + seconds
    held = 0
    while held < batches and time.monotonic() < end:
        if not peer.sock.poll(100):
            continue
        frames = peer.sock.recv_multipart()
        if unpack(frames[0])["k"] == wire.Kind.DELIVER:
            out.append(frames[1:])
            h = wire.header_map(frames[1])
            held += h["n"] if h["k"] == wire.Kind.BUNDLE else 1
    return out


def test_a_broker_forwards_a_bundle_whole_or_split_as_each_consumer_takes_it(thread_broker,
                                                                              endpoints):
    """A broker offers bundles. One of 3 is forwarded whole to a consumer that takes bundles
    (one DELIVER), and split into three plain batches, each with its own sequence number and
    arrays, for one that takes none (an older consumer): split counted once."""
    b = thread_broker()
    ctx = zmq.Context()
    try:
        peer, welcome = _registered(ctx, endpoints.ingress, "raw")
        assert welcome.get("bn") == MAX_BUNDLE
        # Its first batch alone (a new registration holds one credit until it sent one).
        alone = wire.encode_batch(_datapoints(1)[0], producer="raw", session=1, seq=0, epoch=0)
        peer.send([alone[0], *[a.tobytes() for a in alone[1:]]])
        for bundle, seq in ((MAX_BUNDLE, 1), (0, 4)):
            consumer = _raw_consumer(ctx, endpoints.egress, f"c{bundle}", bundle)
            if seq == 1:
                assert len(_deliveries(consumer, 1)) == 1
            peer.want(1 << 20)
            assert peer.wait_credit(peer.sent + 2, 10), "no credit for a bundle of 3"
            peer.send(_raw_bundle(3, seq))
            got = _deliveries(consumer, 3)
            if bundle:
                assert len(got) == 1 and wire.header_map(got[0][0])["n"] == 3
                batches = decode_bundle(got[0], wire.DEFAULT_LIMITS,
                                        wire.header_map(got[0][0]), MAX_BUNDLE)
            else:
                assert len(got) == 3
                batches = [wire.decode_batch(f) for f in got]
            assert [x.seq for x in batches] == [seq, seq + 1, seq + 2]
            assert [int(x.datapoint[0][0]) for x in batches] == [seq, seq + 1, seq + 2]
            consumer.sock.send(m.encode(m.Bye()))
            consumer.close()
        reg = b.broker.registry
        # Counted by the broker's thread just after it sent: perhaps after it arrived here.
        wait_for(lambda: reg.get_sample_value("feedline_broker_forwarded_batches_total") == 7,
                 5, what="7 batches counted forwarded")
        assert reg.get_sample_value("feedline_broker_split_bundles_total") == 1
        peer.close()
    finally:
        ctx.destroy(linger=0)


def test_a_producer_bundles_small_batches_through_a_broker_and_loses_nothing(thread_broker,
                                                                               endpoints):
    """A Sender sends 2,000 batches of 16 KB through a broker to a consumer that pauses after
    its 50th: they go in bundles, and each arrives once, in order, with its own sequence
    number; nothing is refused or cut off, and the broker holds nothing in flight at the end
    (a bundle's batches taken one by one count as its whole)."""
    from feedline.transport.link import LinkConfig

    n = 2000
    b = thread_broker()
    sreg, creg = CollectorRegistry(), CollectorRegistry()
    link = LinkConfig(**FAST)
    payload = np.zeros(16_000, np.uint8)
    with RemoteDataZMQ(endpoints.egress, timeout=30, return_meta=True,
                       options=ConsumerOptions(link=link, registry=creg)) as src:
        taking = _Taking(src, pause_at=50, pause=0.5)
        with Sender(endpoints.ingress, producer_id="bundler", link=link, registry=sreg) as s:
            for i in range(n):
                s.send([np.full(1, i, np.int64), payload])
            got = taking.wait(n)
        bundles = sreg.get_sample_value("feedline_producer_sent_bundles_total")
        wait_for(lambda: b.broker.egress.inflight() == (0, 0), 10, what="nothing in flight")
    assert [int(x.datapoint[0][0]) for x in got] == list(range(n))
    assert [x.seq for x in got] == list(range(n))
    assert bundles is not None and bundles >= 1, f"{bundles} bundles for {n} batches"
    reg = b.broker.registry
    assert reg.get_sample_value("feedline_broker_forwarded_batches_total") == n
    for name in ("feedline_broker_refused_batches_total", "feedline_broker_rejected_messages_total",
                 "feedline_broker_cut_off_connections_total"):
        assert not any(s.value for metric in reg.collect() for s in metric.samples
                       if s.name == name), name
    assert not any(s.value for metric in creg.collect() for s in metric.samples
                   if s.name == "feedline_consumer_rejected_messages_total")


def test_a_broker_asks_for_larger_batches_joined_and_a_sender_joins_them(thread_broker,
                                                                         endpoints):
    """A broker pays for each frame of a bundle three times (its ingress, its egress, the
    consumer), a direct-mode trainer once: the broker's WELCOME asks for batches of up to
    JOIN_FORWARDED joined, the trainer's leaves the producer's default (JOIN_BYTES). A
    Sender's batches of two images (301 KB, over JOIN_BYTES) reach the broker's consumer in
    joined bundles, 3 frames whatever their count, each batch once and in order."""
    from feedline.transport.link import LinkConfig

    thread_broker()
    ctx = zmq.Context()
    n = 48
    try:
        peer, welcome = _registered(ctx, endpoints.ingress, "raw")
        assert welcome.get("jn") == JOIN_FORWARDED
        peer.close()
        addr = f"tcp://127.0.0.1:{free_port()}"
        with RemoteDataZMQ(addr, bind=True, timeout=10,
                           options=ConsumerOptions(link=LinkConfig(**FAST))) as src:
            _Taking(src)
            peer, welcome = _registered(ctx, addr, "raw")
            assert welcome.get("jn", 0) == 0
            peer.close()
        consumer = RawPeer(ctx, endpoints.egress)
        consumer.sock.send(m.encode(m.ConsumerHello(
            consumer="c", session=3, window=n, max_bytes=1 << 30, registration=1,
            bundle=MAX_BUNDLE)))
        images = np.zeros((2, 224, 224, 3), np.uint8)
        with Sender(endpoints.ingress, producer_id="joiner", link=LinkConfig(**FAST)) as s:
            for i in range(n):
                s.send([images, np.full(2, i, np.int32)])
            got = _deliveries(consumer, n, 20)
        kinds = [wire.header_map(f[0])["k"] for f in got]
        sizes = [len(f) for f, k in zip(got, kinds, strict=True) if k == wire.Kind.BUNDLE]
        assert sizes, f"{len(got)} deliveries, none a bundle"
        assert sizes == [3] * len(sizes)
        batches = [x for f, k in zip(got, kinds, strict=True) for x in (
            decode_bundle(f, wire.DEFAULT_LIMITS, wire.header_map(f[0]), MAX_BUNDLE)
            if k == wire.Kind.BUNDLE else [wire.decode_batch(f)])]
        assert [int(x.datapoint[1][0]) for x in batches] == list(range(n))
        assert all(x.datapoint[0].shape == (2, 224, 224, 3) for x in batches)
        consumer.close()
    finally:
        ctx.destroy(linger=0)


class EgressBundles(RuleBasedStateMachine):
    """The broker's consumer side with bundles, a model: bundles and batches of three sizes
    are buffered; consumers that take bundles of various sizes (or none) and have windows of
    1..4 register, take, fill up and leave; after every step every batch was sent once, in
    the order it was buffered; no delivery holds more batches than its consumer takes in one
    or has room for; and what the broker counts in flight and buffered is what it holds."""

    SIZES = (100, 20_000, 700_000)

    def __init__(self) -> None:
        super().__init__()
        self.sent: list[tuple[bytes, list]] = []
        self.full: set[bytes] = set()
        self.side = ConsumerSide(self._send, Buffer(), BrokerMetrics(CollectorRegistry()),
                                 wire.DEFAULT_LIMITS, Budget(64, 1 << 26), 16, 5,
                                 lambda *_: None)
        self.pushed: list[int] = []
        self.seqs: list[int] = []  # in the order they were sent
        self.offer: dict[bytes, int] = {}
        self.regs = 0

    def _send(self, ident: bytes, frames: list) -> int:
        if ident in self.full and unpack(frames[0])["k"] == wire.Kind.DELIVER:
            return zmq.EAGAIN
        self.sent.append((ident, frames))
        return 0

    @rule(ident=st.sampled_from([b"a", b"b", b"c"]), window=st.integers(1, 4),
          bundle=st.sampled_from([0, 1, 2, 5, MAX_BUNDLE]))
    def hello(self, ident: bytes, window: int, bundle: int) -> None:
        self.regs += 1  # a minute apart: within the HELLO rate
        self.side.on_message(ident, [zmq.Frame(m.encode(m.ConsumerHello(
            consumer="c", session=1, window=window, max_bytes=1 << 30, registration=self.regs,
            bundle=bundle)))], -1, 60.0 * self.regs)
        self.offer[ident] = bundle

    @rule(k=st.integers(1, 8), size=st.sampled_from(SIZES))
    def push(self, k: int, size: int) -> None:
        seq = len(self.pushed)
        prepared = [wire.prepare_batch([np.full(size, seq + i % 256, np.uint8)])
                    for i in range(k)]
        if k == 1:
            frames = prepared[0].frames(producer=PID, session=1, seq=seq, epoch=0)
        else:
            frames = bundle_frames(prepared, producer=PID, session=1, seq=seq, epoch=0)
        frames = [f if isinstance(f, bytes) else bytes(f) for f in frames]
        self.side.buffer.push("default", Held(frames, sum(len(f) for f in frames), k * size,
                                              1, 0, count=k))
        self.pushed += range(seq, seq + k)

    @rule(ident=st.sampled_from([b"a", b"b", b"c"]))
    def fill_up(self, ident: bytes) -> None:
        self.full ^= {ident}

    @rule()
    def dispatch(self) -> None:
        before = len(self.sent)
        self.side.dispatch(1.0)
        for ident, frames in self.sent[before:]:
            if unpack(frames[0])["k"] != wire.Kind.DELIVER:
                continue
            h = wire.header_map(frames[1])
            n = h["n"] if h["k"] == wire.Kind.BUNDLE else 1
            assert n <= max(1, self.offer[ident]), "more batches than it takes in one"
            self.seqs += range(h["s"], h["s"] + n)
        # Nothing waits for good: while no pipe is full (a full one ends the round), a consumer
        # with nothing in flight and no orphan is always sent the next item.
        idle = [c for c in self.side.consumers if c.delivered == c.taken
                and not self.full and c.ident not in self.side.orphans]
        assert not (idle and self.side.buffer.batches), "an item waits with an idle consumer"

    @rule(data=st.data())
    def take(self, data: st.DataObject) -> None:
        consumers = list(self.side.consumers)
        if not consumers:
            return
        c = data.draw(st.sampled_from(consumers))
        more = data.draw(st.integers(0, c.delivered - c.taken))
        self.side.on_message(c.ident, [zmq.Frame(m.encode(m.Taken(
            taken=c.taken + more, registration=c.registration)))], -1, 0.0)

    @rule(ident=st.sampled_from([b"a", b"b", b"c"]))
    def bye(self, ident: bytes) -> None:
        if self.side.consumers.get(ident) is not None:
            self.side.on_message(ident, [zmq.Frame(m.encode(m.Bye()))], -1, 0.0)

    @invariant()
    def sent_once_in_order(self) -> None:
        assert self.seqs == self.pushed[:len(self.seqs)]
        assert self.side.buffer.batches == len(self.pushed) - len(self.seqs)

    @invariant()
    def counted_as_held(self) -> None:
        side = self.side
        items = side.buffer.items("default")
        assert side.buffer.nbytes == sum(h.nbytes for h in items)
        for c in side.consumers:
            assert sum(h.count for h in c.inflight) - c.head_taken == c.delivered - c.taken
            assert c.inflight_bytes == sum(h.nbytes for h in c.inflight)
            assert c.delivered - c.taken <= depth(c.window, c.largest)


TestEgressBundles = EgressBundles.TestCase
TestEgressBundles.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


_LAYOUTS = {  # two layouts: one array of 1,000 bytes; two small ones
    "a": lambda: [np.zeros(1000, np.uint8)],
    "b": lambda: [np.zeros(10, np.float32), np.zeros(3, np.int64)],
}


@settings(max_examples=300, deadline=None)
@given(queue=st.lists(st.tuples(st.sampled_from(["a", "b", "skip"]), st.integers(0, 1),
                                st.booleans()), max_size=40),
       held=st.integers(0, 40), offered=st.integers(0, 70), credit=st.integers(1, 80),
       room=st.integers(1100, 80_000), max_arrays=st.integers(1, 1024))
def test_a_bundle_takes_the_longest_fitting_run_behind_its_batch(queue, held, offered, credit,
                                                                 room, max_arrays):
    """``gather`` against its rules: what it takes is the front of what waits (the batches
    held back from a failed bundle first, then the backlog's), in order; each of them a
    training batch of the batch's layout and epoch; within the offer, MAX_BUNDLE, the credit,
    the frame limit and the bytes; and it stops only where the next one breaks a rule."""
    from collections import deque

    from feedline.producer.bundling import gather
    from feedline.producer.outbox import BatchItem, SkipItem
    from feedline.transport.handover import Backlog

    def item(layout: str, epoch: int, exact: bool):
        if layout == "skip":
            return SkipItem(1)
        return BatchItem(wire.prepare_batch(_LAYOUTS[layout]()), epoch, unit=0 if exact else -1)

    first = BatchItem(wire.prepare_batch(_LAYOUTS["a"]()), 0)
    waiting = [item(*q) for q in queue]
    ahead: deque = deque(waiting[:held])
    backlog: Backlog = Backlog(64, 1 << 30)
    for it in waiting[held:]:
        assert backlog.put(it, 0, 0)
    welcome = m.Welcome(broker=1, bundle=offered, max_batch_bytes=0)
    more = gather(first, welcome, credit, room, max_arrays, ahead, backlog)
    left = list(ahead) + [backlog.get_nowait() for _ in range(len(backlog))]
    assert more + left == waiting, "not the front of what waits, in order"
    most = min(offered, MAX_BUNDLE, credit, max_arrays)
    sizes = [first.prepared.wire_bytes] + [b.prepared.wire_bytes for b in more]
    assert not more or (1 + len(more) <= most and sum(sizes) <= min(room, BUNDLE_BYTES))
    for b in more:
        assert type(b) is BatchItem and b.unit < 0 and b.epoch == 0
        assert b.prepared.tail == first.prepared.tail
    if left and 1 + len(more) < most:
        nxt = left[0]
        assert (type(nxt) is not BatchItem or nxt.unit >= 0 or nxt.epoch != 0
                or nxt.prepared.tail != first.prepared.tail
                or sum(sizes) + nxt.prepared.wire_bytes > min(room, BUNDLE_BYTES)), \
            "stopped before a batch that fits"


def test_a_buffered_bundle_counts_as_its_batches_and_is_evicted_whole():
    """In the broker's buffer a bundle weighs its batches (the budget, the shares and
    eviction count them): one of 5 and a batch hold 6; evicting down to 1 batch drops the
    bundle whole, the oldest, and leaves the batch."""
    buf = Buffer()
    buf.push("s", Held([b"h", b"x" * 50], 51, 50, 1, 0, count=5))
    buf.push("s", Held([b"h", b"y" * 10], 11, 10, 1, 0))
    assert (buf.batches, buf.nbytes, buf.count("s"), buf.by_stream()) == (6, 62, 6, {"s": (6, 62)})
    dropped = buf.evict("s", 1, 1 << 20)
    assert [h.count for h in dropped] == [5]
    assert (buf.batches, buf.nbytes, buf.by_stream()) == (1, 11, {"s": (1, 11)})
    assert buf.pop("s").count == 1 and buf.batches == 0


def test_the_consumers_of_a_stream_get_equal_parts_of_a_bundle_once():
    """Two consumers (ranks) that take bundles: one of 8 goes as two parts of 4, one to each;
    the parts are not split again (halving a part at every turn would end in single
    batches)."""
    sent: list[tuple[bytes, list]] = []

    def send(ident: bytes, frames: list) -> int:
        sent.append((ident, frames))
        return 0

    side = ConsumerSide(send, Buffer(), BrokerMetrics(CollectorRegistry()), wire.DEFAULT_LIMITS,
                        Budget(64, 1 << 26), 16, 5, lambda *_: None)
    for reg, ident in enumerate((b"r0", b"r1"), 1):
        side.on_message(ident, [zmq.Frame(m.encode(m.ConsumerHello(
            consumer=ident.decode(), session=reg, window=4, max_bytes=1 << 30,
            registration=reg, bundle=MAX_BUNDLE)))], -1, 0.0)
    frames = bundle_frames([wire.prepare_batch(dp) for dp in _datapoints(8)], producer=PID,
                           session=1, seq=0, epoch=0)
    side.buffer.push("default", Held(frames, sum(len(f) for f in frames), 8 * 72, 1, 0,
                                     count=8))
    sent.clear()
    assert side.dispatch(1.0) == 8
    got = {ident: wire.header_map(f[1]) for ident, f in sent}
    assert {ident: (h["s"], h["n"]) for ident, h in got.items()} == {b"r0": (0, 4),
                                                                      b"r1": (4, 4)}
    assert side.metrics.split_bundles.value == 1

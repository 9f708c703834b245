"""The per-batch fast paths give what the general code gives: prepare_batch's remembered
layouts, decode_batch's in-order arrays and its Batch, control messages set without their
__init__, the link's remembered envelope, and the lock-free metrics' exposition."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from feedline.metrics import OwnedCounter, OwnedCounters, OwnedHistogram
from feedline.protocol import encode, messages, wire
from feedline.protocol.codec import DEFAULT_LIMITS, Limits

_dtypes = st.sampled_from(["|u1", "<i4", "<f4", ">f8", "|b1", "<c8", "<u8"])
_shapes = st.lists(st.integers(0, 4), min_size=0, max_size=3).map(tuple)


@st.composite
def _datapoints(draw):
    n = draw(st.integers(1, 4))
    arrays = [np.zeros(draw(_shapes), draw(_dtypes)) for _ in range(n)]
    return tuple(arrays) if draw(st.booleans()) else arrays


@settings(max_examples=150, deadline=None)
@given(_datapoints(), st.integers(1, 40))
def test_a_remembered_layout_prepares_what_a_walk_prepares(dp, id_len):
    encode._TAILS.clear()
    walked = encode._prepare(dp, DEFAULT_LIMITS, id_len)
    first = wire.prepare_batch(dp, DEFAULT_LIMITS, id_len)  # remembers the layout
    again = wire.prepare_batch(dp, DEFAULT_LIMITS, id_len)  # from what it remembered
    for p in (first, again):
        assert (p.tail, p.nbytes, p.wire_bytes) == (walked.tail, walked.nbytes,
                                                    walked.wire_bytes)
        assert all(a is b for a, b in zip(p.arrays, dp, strict=True))


def test_a_layout_of_the_other_byte_order_is_another_layout():
    # Layouts are keyed by dtype objects: equal dtypes have one ``str``, unequal ones
    # (another byte order) must not share a remembered header.
    for order in ("<", ">", "<", "="):
        dp = [np.zeros(3, order + "f8"), np.zeros(2, order + "i4")]
        assert wire.prepare_batch(dp).tail == encode._prepare(dp, DEFAULT_LIMITS, 0).tail


def test_a_remembered_layout_still_checks_what_differs_between_batches():
    good = [np.array([True, False])]
    wire.prepare_batch(good)
    bad = [np.array([1, 2], np.uint8).view(np.bool_)]  # the same layout, a byte 2
    with pytest.raises(wire.EncodeError, match="bool"):
        wire.prepare_batch(bad)
    labels = np.zeros(2, np.int32)  # a bool array after another: its place is remembered
    wire.prepare_batch([labels, np.array([True, False])])
    with pytest.raises(wire.EncodeError, match="bool"):
        wire.prepare_batch([labels, np.array([1, 3], np.uint8).view(np.bool_)])
    small = Limits(max_message_bytes=64)
    wire.prepare_batch([np.zeros(8, np.uint8)], small)
    with pytest.raises(wire.EncodeError, match="max_message_bytes"):
        wire.prepare_batch([np.zeros(65, np.uint8)], small)  # a new layout: walked
    other = Limits(max_ndim=1)
    wire.prepare_batch([np.zeros((2, 2), np.uint8)])  # remembered under the defaults ...
    with pytest.raises(wire.EncodeError, match="max_ndim"):  # ... not under other limits
        wire.prepare_batch([np.zeros((2, 2), np.uint8)], other)


@pytest.mark.parametrize("dp", [
    [np.arange(6, dtype="<i4").reshape(2, 3), np.ones(2, "|b1")],
    (np.zeros(3, "|u1"), np.zeros(1, "<f8")),
    {"a": np.zeros(2, "<u2"), "b": [np.zeros(1, "|u1"), 3]},
    [np.zeros(1, "|u1"), [np.zeros(2, "|u1")]],
])
def test_decoded_batches_hold_every_field(dp):
    frames = wire.encode_batch(dp, producer="p", session=9, seq=4, epoch=2)
    received = [f if isinstance(f, bytes) else f.tobytes() for f in frames]
    b = wire.decode_batch(received)
    # Every field of the dataclass is set (decode_batch builds it without its __init__).
    assert {f.name for f in dataclasses.fields(wire.Batch)} <= set(vars(b))
    assert (b.producer, b.session, b.seq, b.epoch) == ("p", 9, 4, 2)
    assert type(b.datapoint) is type(dp)
    assert b.nbytes == sum(a.nbytes for a in frames[1:])
    assert b.wire_bytes == b.nbytes + len(received[0])


def test_arrays_out_of_frame_order_are_rebuilt_by_the_walk():
    frames = wire.encode_batch([np.zeros(1, "|u1"), np.ones(2, "|u1")], producer="p",
                               session=1, seq=0)
    header = wire.unpackb(frames[0], raw=False)
    header["d"] = [header["d"][1], header["d"][0]]  # refs [1, 0]: not in order
    frames = [wire.packb(header), *(f.tobytes() for f in frames[1:])]
    b = wire.decode_batch(frames)
    assert [a.size for a in b.datapoint] == [2, 1]


def _instance(cls: type) -> messages.Message:
    """An instance of ``cls`` with every field given a value of its type."""
    values = {}
    for f in dataclasses.fields(cls):
        kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "")
        values[f.name] = {"int": 7, "str": "x", "bytes": b"y", "list[int]": [1, 2],
                         "bool": True}.get(kind)
        if f.name in ("reason",):
            values[f.name] = "some_reason"
        if f.name == "stream":
            values[f.name] = "s"
        if f.name == "delivery":
            values[f.name] = messages.EXACT
    return cls(**values)


@pytest.mark.parametrize("cls", sorted(set(messages._CLASSES.values()), key=str))
def test_every_control_message_decodes_to_what_was_encoded(cls):
    msg = _instance(cls)
    got = messages.decode(messages.encode(msg))
    assert got == msg and type(got) is cls and vars(got) == vars(msg)
    with pytest.raises(dataclasses.FrozenInstanceError):
        got.x = 1  # type: ignore[union-attr]
    if dataclasses.fields(cls):
        # Defaults and factories fill what a peer left out, each decode a fresh factory value.
        bare = {k: v for k, v in vars(msg).items()
                if next(f for f in dataclasses.fields(cls) if f.name == k).default
                is dataclasses.MISSING
                and next(f for f in dataclasses.fields(cls) if f.name == k).default_factory
                is dataclasses.MISSING}
        short = cls(**bare)
        assert messages.decode(messages.encode(short)) == short


def test_unit_done_decodes_a_fresh_list_each_time():
    frame = wire.packb({"v": wire.PROTOCOL_VERSION, "k": int(wire.Kind.UNIT_DONE), "e": 0,
                        "u": 1, "n": 2})
    a, b = messages.decode(frame), messages.decode(frame)
    assert a.empty == [] and a.empty is not b.empty  # type: ignore[union-attr]


def test_owned_metrics_expose_what_prometheus_client_metrics_expose():
    buckets = (0.001, 0.01, 0.1, 1, 10)
    mine, theirs = CollectorRegistry(), CollectorRegistry()
    c1 = OwnedCounter("t_batches", "doc", mine)
    c2 = Counter("t_batches", "doc", registry=theirs)
    h1 = OwnedHistogram("t_wait_seconds", "doc", buckets, mine)
    h2 = Histogram("t_wait_seconds", "doc", buckets=buckets, registry=theirs)
    for v in (0.0, 0.001, 0.004, 0.5, 10.0, 11.0):
        h1.observe(v)
        h2.observe(v)
        c1.inc(v)
        c2.inc(v)

    def samples(r: CollectorRegistry) -> list[str]:
        return sorted(line for line in generate_latest(r).decode().splitlines()
                      if not line.startswith("#") and "_created" not in line)

    assert samples(mine) == samples(theirs)


def test_owned_labelled_counters_expose_and_remove_as_labelled_counters_do():
    mine, theirs = CollectorRegistry(), CollectorRegistry()
    c1 = OwnedCounters("t_bytes", "doc", ["producer"], mine)
    c2 = Counter("t_bytes", "doc", ["producer"], registry=theirs)
    for c in (c1, c2):
        c.labels("a").inc(3)
        c.labels("b")  # a series at 0
        c.labels("c").inc()
        c.labels("a").inc(0.5)
        c.remove("c")
        c.remove("c")  # gone already: nothing to do
        with pytest.raises(ValueError):
            c.labels("a", "b")

    def samples(r: CollectorRegistry) -> list[str]:
        return sorted(line for line in generate_latest(r).decode().splitlines()
                      if "_created" not in line)

    assert samples(mine) == samples(theirs)
    assert 't_bytes_total{producer="a"} 3.5' in samples(mine)


def test_the_link_remembers_only_a_frame_equal_to_the_last():
    import zmq

    from feedline.transport.link import Link

    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    link = Link(ctx, f"tcp://127.0.0.1:{port}", lambda r: messages.ProducerHello(
        producer="p", session=1, registration=r))
    try:
        env = messages.encode(messages.Deliver(broker=5, gap=0, registration=1))
        first = link._decode(env)
        assert link._decode(bytes(env)) is first  # the same bytes: the same message
        other = link._decode(messages.encode(messages.Deliver(broker=5, gap=2,
                                                              registration=1)))
        assert other == messages.Deliver(broker=5, gap=2, registration=1)
        with pytest.raises(wire.DecodeError):
            link._decode(b"\x81\xa1v\x63")  # a bad version: refused, and not remembered
        assert link._decode(env) == first
    finally:
        link.close()
        router.close(0)
        ctx.term()

"""The wire protocol: exact bytes, round trips over dtypes and shapes, and refusals."""

from __future__ import annotations

import subprocess
import sys

import msgpack
import msgpack_numpy
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from feedline.protocol import messages, wire

# A known message, byte for byte. If this changes, the protocol changed: bump
# PROTOCOL_VERSION and say so in docs/architecture.md.
KNOWN_HEADER = bytes.fromhex(
    "89"  # map of 9
    "a176 02"  # "v": 2
    "a16b 02"  # "k": BATCH
    "a170 a170"  # "p": "p"
    "a171 07"  # "q": 7 (session)
    "a173 03"  # "s": 3 (seq)
    "a165 01"  # "e": 1 (epoch)
    "a163 00"  # "c": list
    "a164 93 d601 00000000 05 a178"  # "d": [array 0, 5, "x"]
    "a161 91 92 a33c7532 91 02"  # "a": [["<u2", [2]]]
)


def _as_received(frames):
    """What a receiver gets: each frame as bytes (arrays serialised by ZeroMQ)."""
    return [f if isinstance(f, bytes) else f.tobytes() for f in frames]


def test_exact_bytes_of_a_known_message():
    frames = wire.encode_batch([np.array([1, 2], dtype="<u2"), 5, "x"], producer="p",
                               session=7, seq=3, epoch=1)
    assert frames[0] == KNOWN_HEADER
    assert frames[1].tobytes() == b"\x01\x00\x02\x00"
    b = wire.decode_batch([KNOWN_HEADER, b"\x01\x00\x02\x00"])
    assert (b.producer, b.session, b.seq, b.epoch, b.nbytes) == ("p", 7, 3, 1, 4)
    np.testing.assert_array_equal(b.datapoint[0], [1, 2])
    assert b.datapoint[1:] == [5, "x"]


def test_exact_bytes_of_a_control_message():
    grant = messages.Grant(broker=9, batches=4, nbytes=7, registration=1)
    assert messages.encode(grant) == bytes.fromhex(
        "86 a176 02 a16b 03 a162 09 a174 04 a179 07 a172 01".replace(" ", ""))
    assert messages.decode(messages.encode(grant)) == grant


def test_arrays_are_sent_and_received_without_copies():
    a = np.arange(1000, dtype=np.float32)
    frames = wire.encode_batch([a], producer="p", session=1, seq=0)
    assert frames[1] is a  # the sender passes the array itself to zmq (copy=False)
    buf = bytearray(a.tobytes())
    out = wire.decode_batch([frames[0], buf]).datapoint[0]
    buf[:4] = np.float32(42).tobytes()
    assert out[0] == 42  # a view on the received buffer


def test_non_contiguous_arrays_are_made_contiguous():
    a = np.arange(12).reshape(3, 4)[:, ::2]
    frames = wire.encode_batch([a], producer="p", session=1, seq=0)
    out = wire.decode_batch(_as_received(frames)).datapoint[0]
    np.testing.assert_array_equal(out, a)


DTYPES = ["|b1", "|u1", "|i1", "<u2", "<i2", ">i2", "<u4", "<i4", ">f4", "<u8", "<i8", "<f2",
          "<f4", "<f8", ">f8", "<c8", "<c16"]


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(DTYPES).flatmap(
    lambda dt: hnp.arrays(np.dtype(dt), hnp.array_shapes(min_dims=0, max_dims=5, min_side=0,
                                                          max_side=6))))
def test_round_trip_every_dtype_and_shape(arr):
    frames = wire.encode_batch([arr], producer="p", session=1, seq=0)
    out = wire.decode_batch(_as_received(frames)).datapoint[0]
    assert out.dtype == arr.dtype and out.shape == arr.shape
    np.testing.assert_array_equal(out, arr)


scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**63 - 1),
                    st.floats(allow_nan=False), st.text(max_size=20), st.binary(max_size=20))
small_arrays = hnp.arrays(st.sampled_from([np.uint8, np.int32, np.float32]),
                          hnp.array_shapes(max_dims=3, max_side=4))
leaves = st.one_of(scalars, small_arrays)
datapoints = st.recursive(
    leaves,
    lambda kids: st.one_of(st.lists(kids, max_size=4),
                           st.dictionaries(st.text(max_size=8), kids, max_size=4)),
    max_leaves=12,
)


def _same(a, b) -> bool:
    if isinstance(a, np.ndarray):
        return (isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape
                and a.tobytes() == b.tobytes())
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


@settings(max_examples=200, deadline=None)
@given(st.one_of(st.lists(datapoints, max_size=5), st.tuples(datapoints, datapoints),
                 st.dictionaries(st.text(max_size=8), datapoints, max_size=4)))
def test_round_trip_nested_structures(dp):
    frames = wire.encode_batch(dp, producer="p", session=1, seq=0)
    assert _same(dp, wire.decode_batch(_as_received(frames)).datapoint)


def test_unsendable_values_are_refused_at_the_sender():
    for bad in ([np.array([object()])], [{1: np.zeros(2)}], [{1, 2}],
                [np.zeros(2, dtype=[("a", "<i4")])], [np.array(["str"])]):
        with pytest.raises(wire.EncodeError):
            wire.encode_batch(bad, producer="p", session=1, seq=0)


def _header(**overrides) -> bytes:
    h = msgpack.unpackb(wire.encode_batch([np.zeros(4, np.uint8)], producer="p", session=1,
                                          seq=0)[0])
    h.update(overrides)
    return msgpack.packb(h)


@pytest.mark.parametrize("frames,reason", [
    ([b"\xc1"], "bad_msgpack"),
    ([msgpack.packb([1, 2])], "bad_header"),
    ([_header(v=1), b"\0" * 4], "bad_version"),
    ([_header(k=77), b"\0" * 4], "bad_kind"),
    ([_header(a=[["|O", [4]]]), b"\0" * 32], "bad_dtype"),
    ([_header(a=[["O", [4]]]), b"\0" * 32], "bad_dtype"),
    ([_header(a=[["i4,O", [4]]]), b"\0" * 32], "bad_dtype"),
    ([_header(a=[["|V8", [4]]]), b"\0" * 32], "bad_dtype"),
    ([_header(a=[["|u1", [5]]]), b"\0" * 4], "shape_mismatch"),
    ([_header(a=[["|u1", [1 << 40, 1 << 40]]]), b"\0" * 4], "bad_shape"),
    ([_header(a=[["|u1", [-4]]]), b"\0" * 4], "bad_shape"),
    ([_header(a=[["|u1", [1] * 64]]), b"\0"], "too_many_dims"),
    ([_header(a=[["|u1", [4]]] * 5000)] + [b"\0" * 4] * 5000, "too_many_arrays"),
    ([_header(), b"\0" * 4, b"\0" * 4], "frame_count"),
    ([_header(p=""), b"\0" * 4], "bad_header"),
    ([_header(d=[msgpack.ExtType(9, b"x")]), b"\0" * 4], "bad_structure"),
    ([_header(d=[msgpack.ExtType(1, b"\0\0\0\7")]), b"\0" * 4], "bad_structure"),
    ([b"\x91" * 70000], "header_too_large"),
])
def test_hostile_messages_raise_decode_error(frames, reason):
    with pytest.raises(wire.DecodeError) as err:
        wire.decode_batch(frames)
    assert err.value.reason == reason


def test_deeply_nested_structure_is_refused():
    deep: list = [0]
    for _ in range(200):
        deep = [deep]
    with pytest.raises(wire.DecodeError):
        wire.decode_batch([_header(d=deep), b"\0" * 4])


def test_tensorpack_datapoints_decode_and_object_arrays_are_never_unpickled(tmp_path):
    dp = [np.arange(6, dtype=np.int16).reshape(2, 3), np.float32(2.5), 7, "cat"]
    out = wire.decode_tensorpack(msgpack.packb(dp, default=msgpack_numpy.encode,
                                               use_bin_type=True))
    np.testing.assert_array_equal(out[0], dp[0])
    assert out[1] == np.float32(2.5) and out[2:] == [7, "cat"]

    marker = tmp_path / "executed"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    evil = np.array([Evil()], dtype=object)
    payload = msgpack.packb([evil], default=msgpack_numpy.encode, use_bin_type=True)
    with pytest.raises(wire.DecodeError) as err:
        wire.decode_tensorpack(payload)
    assert err.value.reason == "bad_dtype" and not marker.exists()


def test_decoder_stays_safe_when_msgpack_numpy_patches_msgpack(tmp_path):
    """tensorpack calls msgpack_numpy.patch() at import; our decoder must not follow it."""
    marker = tmp_path / "executed"
    script = f"""
import msgpack, msgpack_numpy, numpy as np
msgpack_numpy.patch()  # what `import tensorpack` does
from feedline.protocol import messages, wire

class Evil:
    def __reduce__(self):
        return (open, ({str(marker)!r}, "w"))

payload = msgpack.packb([np.array([Evil()], dtype=object)], use_bin_type=True)
try:
    wire.decode_tensorpack(payload)
except wire.DecodeError as e:
    print("refused", e.reason)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60)
    assert out.stdout.strip() == "refused bad_dtype", out.stderr
    assert not marker.exists()


def test_lmdb_values_stay_safe_when_msgpack_numpy_patches_msgpack(tmp_path):
    """The LMDB serializer shares the wire's msgpack: an LMDB file is never a pickle."""
    marker = tmp_path / "executed"
    script = f"""
import pickle, msgpack, msgpack_numpy
msgpack_numpy.patch()  # what `import tensorpack` does
from feedline.producer.dataflow import serialize

class Evil:
    def __reduce__(self):
        return (open, ({str(marker)!r}, "w"))

as_numpy = {{b"nd": True, b"type": "|O", b"kind": b"O", b"shape": [1],
             b"data": pickle.dumps(Evil())}}
out = serialize.loads(msgpack.packb([as_numpy], use_bin_type=True))
print(type(out[0]).__name__)
head = msgpack.packb(["|O", [1]])
try:
    serialize.loads(msgpack.packb([msgpack.ExtType(42, head + b"x" * 8)]))
except ValueError as e:
    print("refused")
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60)
    assert out.stdout.split() == ["dict", "refused"], out.stderr
    assert not marker.exists()

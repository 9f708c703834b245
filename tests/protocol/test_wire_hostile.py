"""The decoder against hostile bytes: known attacks, and properties over arbitrary input.

Contract under test (feedline.protocol.wire): decode_header, decode_batch and decode_tensorpack
raise
DecodeError for anything they refuse, and never any other exception, never unpickle, never
let numpy interpret bytes as object pointers. The broker-level versions of these attacks, on
a real broker process, are in test_security_hostile.py. Round trips are in test_wire.py.
"""

from __future__ import annotations

import pickle
import subprocess
import sys
import textwrap
import tracemalloc
from pathlib import Path

import msgpack
import msgpack_numpy
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from feedline.protocol import wire
from tests.support import ROOT

ARRAY = msgpack.ExtType(1, b"\0\0\0\0")


class MakesFile:
    """Unpickling this creates ``path``: the marker of code run by a pickle payload."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def pickle_array_payload(marker: Path) -> bytes:
    """A msgpack-numpy datapoint whose object array unpickles MakesFile (what msgpack_numpy's
    own decode does with kind 'O')."""
    evil = {b"nd": True, b"type": "|O", b"kind": b"O", b"shape": [1],
            b"data": pickle.dumps(np.array([MakesFile(str(marker))], dtype=object))}
    return wire.packb([evil, {b"nd": True, b"type": "<i4", b"kind": b"", b"shape": [1],
                              b"data": b"\1\0\0\0"}])


def batch_header(**over) -> dict:
    h = {"v": 2, "k": 2, "p": "x", "q": 1, "s": 0, "e": 0, "c": 0, "d": [ARRAY],
         "a": [["<f4", [4]]]}
    h.update(over)
    return h


def refused(frames: list, reason: str | None = None) -> wire.DecodeError:
    with pytest.raises(wire.DecodeError) as ei:
        wire.decode_batch(frames)
    if reason is not None:
        assert ei.value.reason == reason, ei.value
    return ei.value


# ------------------------------------------------------------------------- known attacks


def test_the_pickle_payload_is_real_and_our_decoder_refuses_it(tmp_path):
    proof = tmp_path / "proof"
    msgpack_numpy.unpackb(pickle_array_payload(proof), object_hook=msgpack_numpy.decode)
    assert proof.exists(), "the payload must really run code when unpickled"
    marker = tmp_path / "marker"
    with pytest.raises(wire.DecodeError) as ei:
        wire.decode_tensorpack(pickle_array_payload(marker))
    assert ei.value.reason == "bad_dtype"
    assert not marker.exists()


def test_decoder_stays_safe_after_msgpack_numpy_patch(tmp_path):
    """tensorpack calls msgpack_numpy.patch() at import, rebinding msgpack.unpackb to a
    function that unpickles: a training process importing tensorpack stays safe."""
    marker = tmp_path / "marker"
    payload = tmp_path / "payload"
    payload.write_bytes(pickle_array_payload(marker))
    code = textwrap.dedent(f"""
        import msgpack_numpy; msgpack_numpy.patch()
        from feedline.protocol import wire
        data = open({str(payload)!r}, "rb").read()
        try:
            wire.decode_tensorpack(data)
        except wire.DecodeError as e:
            print("refused", e.reason)
    """)
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "refused bad_dtype"
    assert not marker.exists()


EVIL_DTYPES = ["O", "|O", "<O", "|O8", "object", "V8", "|V8", "S8", "U2", "M8[s]", "m8",
               "[('a', 'O')]", "(2,)i4", "i4,O", "f4 ", " f4", "<f4\x00", "b", "?", "c",
               "<i3", "<f12", "|u16", 7, None, b"<f4", ["<f4"], {"x": 1}]


def test_object_and_structured_dtype_strings_never_reach_numpy():
    """Run in a subprocess: frombuffer with an object dtype reads the bytes as pointers and
    crashes the interpreter. Both the feedline header and the tensorpack path refuse them."""
    code = textwrap.dedent(f"""
        import msgpack
        from feedline.protocol import wire
        evil = {EVIL_DTYPES!r}
        ext = msgpack.ExtType(1, b"\\0\\0\\0\\0")
        for dt in evil:
            h = {{"v": 2, "k": 2, "p": "x", "q": 1, "s": 0, "e": 0, "c": 0, "d": [ext],
                 "a": [[dt, [4]]]}}
            try:
                wire.decode_batch([wire.packb(h), b"A" * 32])
                raise SystemExit(f"accepted {{dt!r}}")
            except wire.DecodeError as e:
                assert e.reason == "bad_dtype", (dt, e)
            tp = {{b"nd": True, b"type": dt, b"kind": b"", b"shape": [4], b"data": b"A" * 32}}
            try:
                wire.decode_tensorpack(wire.packb([tp]))
                raise SystemExit(f"tensorpack accepted {{dt!r}}")
            except wire.DecodeError as e:
                assert e.reason == "bad_dtype", (dt, e)
        print("all refused")
    """)
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr)
    assert r.stdout.strip() == "all refused"


@pytest.mark.parametrize("shape,nbytes,reason", [
    ([4], 15, "shape_mismatch"),  # one byte short
    ([4], 17, "shape_mismatch"),
    ([2, 2], 0, "shape_mismatch"),
    ([-1], 16, "bad_shape"),
    ([True, 4], 16, "bad_shape"),
    ([4.0], 16, "bad_shape"),
    ([[4]], 16, "bad_shape"),
    (["4"], 16, "bad_shape"),
    ([2**62, 2**62], 16, "bad_shape"),  # huge: product overflows 64 bits
    ([0, 2**30, 2**30, 2**30], 0, "bad_shape"),  # empty, yet numpy could not represent it
    ([1 << 30, 2], 0, "bad_shape"),
    ([1] * 33, 4, "too_many_dims"),
])
def test_shapes_that_lie_or_are_huge(shape, nbytes, reason):
    refused([wire.packb(batch_header(a=[["<f4", shape]])), b"\0" * nbytes], reason)


@pytest.mark.parametrize("shape,nbytes", [
    ([4], 15), ([-1], 4), ([2**62, 2**62], 0), ([0, 2**62, 2**62], 0), ([0, 2**63 - 1], 0),
    ([1] * 40, 4), ("4", 16), ([True], 4),
])
def test_tensorpack_shapes_that_lie_or_are_huge(shape, nbytes):
    tp = {b"nd": True, b"type": "<f4", b"kind": b"", b"shape": shape, b"data": b"\0" * nbytes}
    with pytest.raises(wire.DecodeError):
        wire.decode_tensorpack(wire.packb([tp]))


def test_frame_count_and_structure_lies():
    h = wire.packb(batch_header(a=[["<f4", [1]], ["<f4", [1]]], d=[ARRAY, ARRAY]))
    refused([h, b"\0" * 4], "frame_count")  # truncated multipart: a frame missing
    refused([h, b"\0" * 4, b"\0" * 4, b"\0" * 4], "frame_count")  # an extra frame
    refused([wire.packb(batch_header(d=[ARRAY, ARRAY])), b"\0" * 16], "bad_structure")
    refused([wire.packb(batch_header(d=[msgpack.ExtType(1, b"\0\0\0\7")])), b"\0" * 16],
            "bad_structure")
    refused([wire.packb(batch_header(d=[msgpack.ExtType(9, b"x")])), b"\0" * 16],
            "bad_structure")
    refused([wire.packb(batch_header(d=[])), b"\0" * 16], "bad_structure")  # unreferenced
    refused([wire.packb(batch_header(a=[["<f4", [4]]] * 1025)), *[b""] * 1025])
    refused([], "empty")
    refused([wire.packb(batch_header())], "frame_count")  # header alone: half a batch


@pytest.mark.parametrize("payload", [
    b"\xdd\xff\xff\xff\xff",  # array of 4G elements, 5 bytes
    b"\xdf\xff\xff\xff\xff",  # map of 4G entries
    b"\xdb\xff\xff\xff\xff",  # str of 4 GiB
    b"\xc6\xff\xff\xff\xff",  # bin of 4 GiB
    b"\xc9\xff\xff\xff\xff\x01",  # ext of 4 GiB
    b"\x91" * 60_000 + b"\xc0",  # lists nested 60 000 deep
    b"\x81\xa1a" * 20_000 + b"\xc0",  # maps nested 20 000 deep
    b"\xdc\xff\xff" + b"\xdc\xff\xff" * 20_000,  # nested arrays claiming 65535 each
], ids=["array4G", "map4G", "str4G", "bin4G", "ext4G", "deep_lists", "deep_maps",
        "nested_claims"])
def test_msgpack_bombs_are_refused_without_amplification(payload):
    tracemalloc.start()
    try:
        for decode in (wire.decode_header, wire.decode_tensorpack):
            with pytest.raises(wire.DecodeError):
                decode(payload)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 32 * 1024 * 1024, f"decoding {len(payload)} bytes peaked at {peak} bytes"


def test_deep_structure_inside_a_valid_header():
    deep: list = [ARRAY]
    for _ in range(40):
        deep = [deep]
    refused([wire.packb(batch_header(d=deep)), b"\0" * 16], "too_deep")
    tp: list = [1]
    for _ in range(40):
        tp = [tp]
    with pytest.raises(wire.DecodeError):
        wire.decode_tensorpack(wire.packb(tp))


def test_oversized_header_and_message():
    big = wire.packb(batch_header(x="y" * 70_000))
    refused([big, b"\0" * 16], "header_too_large")
    small = wire.Limits(max_message_bytes=1024)
    with pytest.raises(wire.DecodeError) as ei:
        wire.decode_batch([wire.packb(batch_header(a=[["<f4", [512]]])), b"\0" * 2048], small)
    assert ei.value.reason in ("message_too_large", "bad_shape")
    with pytest.raises(wire.DecodeError) as ei:  # bin of 70 000 bytes > 1024 + 64 KiB
        wire.decode_tensorpack(b"\xc6" + (70_000).to_bytes(4, "big") + b"\0" * 70_000, small)
    assert ei.value.reason == "message_too_large"


# ------------------------------------------------------------------------- properties

_HYP = settings(max_examples=300, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# Everything msgpack can carry: ints in its 64-bit range, ext types of any code and size.
_scalars = (st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats()
            | st.text(max_size=8) | st.binary(max_size=8)
            | st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=6)))
_msgpackable = st.recursive(
    _scalars,
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=4), kids,
                                                             max_size=4),
    max_leaves=24)
_dtypes = st.sampled_from(["<f4", "|u1", "<i8", "|b1", ">f8", "<c16", "<f2", *EVIL_DTYPES])
_dims = st.integers(-2, 8) | st.sampled_from([0, 2**31, 2**62, 2**63 - 1]) | _scalars
_specs = st.lists(st.lists(_dtypes | _scalars, min_size=0, max_size=1).flatmap(
    lambda dt: st.tuples(st.just(dt[0] if dt else "<f4"), st.lists(_dims, max_size=4))),
    max_size=4).map(lambda specs: [[d, s] for d, s in specs])
_frames = st.lists(st.binary(max_size=64), max_size=5)


def _only_decode_errors(fn, *args) -> None:
    try:
        fn(*args)
    except wire.DecodeError:
        pass


@_HYP
@given(st.binary(max_size=256))
def test_arbitrary_bytes_header_only_decode_error(data):
    _only_decode_errors(wire.decode_header, data)
    _only_decode_errors(wire.decode_tensorpack, data)


@_HYP
@given(_msgpackable, _frames)
def test_arbitrary_msgpack_headers_only_decode_error(obj, frames):
    _only_decode_errors(wire.decode_header, wire.packb(obj))
    _only_decode_errors(wire.decode_batch, [wire.packb(obj), *frames])
    _only_decode_errors(wire.decode_tensorpack, wire.packb(obj))


@_HYP
@given(st.dictionaries(st.sampled_from(list("vkpqsecda")), _msgpackable, max_size=9),
       _specs, _msgpackable, _frames)
def test_batch_headers_with_arbitrary_fields_only_decode_error(fields, specs, structure,
                                                               frames):
    h = batch_header(**fields)
    h["a"], h["d"] = specs, structure if fields.get("d") is None else fields["d"]
    _only_decode_errors(wire.decode_batch, [wire.packb(h), *frames])
    # nearly valid: consistent frame count, random dtypes and shapes, random frame bytes
    _only_decode_errors(wire.decode_batch,
                        [wire.packb(batch_header(a=specs, d=[ARRAY] * len(specs))),
                         *frames[: len(specs)], *[b""] * (len(specs) - len(frames))])


@_HYP
@given(st.lists(st.fixed_dictionaries({
    b"nd": st.booleans() | _scalars, b"type": _dtypes | _scalars,
    b"kind": st.sampled_from([b"", b"O", b"V", "", None]),
    b"shape": st.lists(_dims, max_size=4) | _scalars, b"data": st.binary(max_size=64) | _scalars,
}), max_size=3))
def test_tensorpack_arrays_with_arbitrary_fields_only_decode_error(arrays):
    _only_decode_errors(wire.decode_tensorpack, wire.packb(arrays))

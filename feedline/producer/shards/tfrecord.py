"""TFRecord files and ``tf.train.Example`` records, read without TensorFlow.

A TFRecord file is a sequence of records::

    uint64 length (little-endian) | uint32 masked_crc32c(length) | data | uint32 masked_crc32c(data)

Both CRCs are checked (CRC-32C by ``google-crc32c``, masked as TensorFlow does). A bad data
CRC loses one record (the length was sound, so the next record is found); a bad length CRC or
a record cut short by the end of the file loses the rest of the file: each is a
:class:`~feedline.producer.shards.records.CorruptRecord` naming the file and the offset.

:func:`parse_example` reads the protobuf wire format of ``Example`` -> ``Features`` ->
``map<string, Feature>`` (bytes, float and int64 lists, packed or not) for the keys asked
for, skipping the rest; :func:`encode_example` and :func:`frame` write them (tests,
benchmarks, conversion).
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import google_crc32c
import numpy as np

from feedline.errors import DataError
from feedline.producer.shards.records import CorruptRecord, Readable

_MASK_DELTA = 0xA282EAD8
MAX_RECORD = 1 << 30


def masked_crc(data: bytes) -> int:
    crc = google_crc32c.value(data)
    return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF


def frame(data: bytes) -> bytes:
    """One TFRecord record holding ``data``."""
    head = struct.pack("<Q", len(data))
    return head + struct.pack("<I", masked_crc(head)) + data + struct.pack("<I", masked_crc(data))


def records(stream: Readable, name: str, max_record: int = MAX_RECORD) -> Iterator[bytes]:
    """Each record's data, CRCs checked. A resumable CorruptRecord (bad data CRC, a record
    over ``max_record``) leaves the stream at the next record: call again to go on."""
    while True:
        at = stream.offset
        head = stream.read(12)
        if not head:
            return
        where = f"{name}#{at}"
        if len(head) < 12:
            raise CorruptRecord(where, "the file ends inside a record header", False)
        (length,), (crc,) = struct.unpack("<Q", head[:8]), struct.unpack("<I", head[8:])
        if masked_crc(head[:8]) != crc:
            raise CorruptRecord(where, "bad length CRC", False)
        if length > max_record:
            got = stream.skip(length + 4)
            raise CorruptRecord(where, f"a {length}-byte record (more than max_sample_bytes)",
                                got == length + 4)
        data = stream.read(length + 4)
        if len(data) < length + 4:
            raise CorruptRecord(where, f"the file ends inside this record ({len(data)} of "
                                f"{length + 4} bytes)", False)
        if masked_crc(data[:length]) != struct.unpack("<I", data[length:])[0]:
            raise CorruptRecord(where, "bad data CRC", True)
        yield data[:length]


# -- protobuf wire format --------------------------------------------------------------------

def _varint(buf: bytes, i: int) -> tuple[int, int]:
    shift = result = 0
    while True:
        if i >= len(buf) or shift > 63:
            raise DataError("truncated varint")
        b = buf[i]
        i += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:  # ten bytes carry 70 bits: protobuf keeps the low 64
            return result & 0xFFFFFFFFFFFFFFFF, i
        shift += 7


def _fields(buf: bytes) -> Iterator[tuple[int, int, Any]]:
    """(field number, wire type, value): an int for varints and fixed, bytes for
    length-delimited."""
    i, n = 0, len(buf)
    while i < n:
        tag, i = _varint(buf, i)
        num, wt = tag >> 3, tag & 7
        v: Any
        if wt == 0:
            v, i = _varint(buf, i)
        elif wt == 2:
            ln, i = _varint(buf, i)
            if i + ln > n:
                raise DataError("truncated field")
            v, i = buf[i:i + ln], i + ln
        elif wt == 1:
            v, i = buf[i:i + 8], i + 8
        elif wt == 5:
            v, i = buf[i:i + 4], i + 4
        else:
            raise DataError(f"wire type {wt}")
        if i > n:
            raise DataError("truncated field")
        yield num, wt, v


def _int64s(items: Iterable[tuple[int, int, Any]]) -> list[int]:
    out: list[int] = []
    for num, wt, v in items:
        if num != 1:
            continue
        if wt == 0:
            out.append(v)
        elif wt == 2:  # packed
            i = 0
            while i < len(v):
                x, i = _varint(v, i)
                out.append(x)
    return [x - (1 << 64) if x >= 1 << 63 else x for x in out]


def _feature(buf: bytes) -> Any:
    for kind, wt, body in _fields(buf):
        if wt != 2:  # a list is length-delimited; anything else is no feature value
            raise DataError(f"feature value field {kind} of wire type {wt}")
        items = list(_fields(body))
        if kind == 1:  # bytes_list
            return [v for num, wt, v in items if num == 1 and wt == 2]
        if kind == 2:  # float_list
            raw = b"".join(v for num, wt, v in items if num == 1 and wt in (2, 5))
            if len(raw) % 4:
                raise DataError(f"a float list of {len(raw)} bytes (not a multiple of 4)")
            return np.frombuffer(raw, "<f4").astype(np.float32)
        if kind == 3:
            return _int64s(items)
    return []


def parse_example(data: bytes, keys: Sequence[str] | None = None) -> dict[str, Any]:
    """The features of a serialized ``tf.train.Example``: key -> list of bytes (bytes_list),
    list of int (int64_list) or float32 array (float_list); only ``keys`` if given. Raises
    :class:`~feedline.errors.DataError` (a ValueError), and nothing else, for what is not a
    well-formed Example (``tests/shards/test_shards_fuzz.py`` holds it to that)."""
    want = None if keys is None else set(keys)
    out: dict[str, Any] = {}
    for num, wt, features in _fields(data):
        if num != 1 or wt != 2:
            continue
        for fnum, fwt, entry in _fields(features):
            if fnum != 1 or fwt != 2:
                continue
            key, value = None, b""
            for enum, ewt, v in _fields(entry):
                if enum == 1 and ewt == 2:
                    key = v.decode("utf-8", "replace")
                elif enum == 2 and ewt == 2:
                    value = v
            if key is not None and (want is None or key in want):
                out[key] = _feature(value)
    return out


def _key(num: int, wt: int) -> bytes:
    return _uvarint(num << 3 | wt)


def _uvarint(x: int) -> bytes:
    x &= (1 << 64) - 1
    out = bytearray()
    while True:
        b = x & 0x7F
        x >>= 7
        if x:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _ld(num: int, body: bytes) -> bytes:
    return _key(num, 2) + _uvarint(len(body)) + body


def encode_example(features: Mapping[str, Any]) -> bytes:
    """A serialized ``tf.train.Example``: bytes (or a list of them) -> bytes_list, ints ->
    int64_list, floats -> float_list."""
    entries = b""
    for key, value in features.items():
        vals = list(value) if isinstance(value, (list, tuple, np.ndarray)) else [value]
        if all(isinstance(v, (bytes, bytearray)) for v in vals):
            body = _ld(1, b"".join(_ld(1, bytes(v)) for v in vals))
        elif all(isinstance(v, (int, np.integer)) for v in vals):
            body = _ld(3, _ld(1, b"".join(_uvarint(int(v)) for v in vals)))
        else:
            body = _ld(2, _ld(1, np.asarray(vals, "<f4").tobytes()))
        entries += _ld(1, _ld(1, key.encode()) + _ld(2, body))
    return _ld(1, entries)

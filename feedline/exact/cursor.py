"""The exact-delivery cursor: which batches of one epoch a consumer (or a whole job) took.

A batch of an exact stream is known by ``(epoch, unit, index)``. A :class:`Cursor` holds, for
one stream, one pipeline and one epoch, the indices taken in each unit (a bitmask per unit).
It belongs to its pipeline: ``pipeline`` is the fingerprint of what decides the sample order
and the units (``feedline.producer.exact.ExactPipeline.fingerprint``), which every batch of
an exact stream carries; a broker refuses to resume from a cursor of another pipeline.

Its bytes (:meth:`Cursor.encode`) are canonical and small by construction: consecutive units
whose taken indices are the same form one group, and each group's indices are written as runs
or as a bitmap, whichever is shorter. A job's merged cursor (whole units up to where the epoch
is, and the few units in progress) takes a few bytes per unit in progress, whatever the
dataset's size. :meth:`Cursor.ident` names the content: equal cursors are one resume request.

Byte layout (varint: unsigned LEB128)::

    b"FLC2" | u8 flags (1: resume) | u64 pipeline (big-endian) | varint epoch
    | varint len + stream (utf-8) | varint groups
    | per group: varint first unit - end of the previous group | varint units (>= 1) | u8 form
      form 0, runs:   varint runs, per run: varint gap after the previous run, varint length
      form 1, bitmap: varint bytes, the bytes (bit i % 8 of byte i // 8: index i)
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from feedline.errors import ConfigError, DecodeError

_MAGIC = b"FLC2"
_U64 = struct.Struct(">Q")
MAX_BITS = 1 << 20  # batches in one unit, at most
MAX_UNITS = 1 << 18  # units of an exact stream's dataset, at most
# What a registration (a consumer's HELLO) carries of a cursor, at most: the HELLO is one
# frame of at most 64 KiB (Limits.max_header_bytes), and the rest of it is small.
MAX_CURSOR_BYTES = 48 * 1024
# Bits of the distinct groups a cursor's bytes may decode to, at most: a run is a few bytes
# for up to MAX_BITS bits, so the bytes alone do not bound the memory decoding takes.
MAX_DECODED_BITS = 64 << 20


@dataclass
class Cursor:
    """What has been taken of ``epoch`` of ``stream`` (pipeline ``pipeline``; 0: not known
    yet): unit -> bitmask of batch indices. ``resume`` asks a broker to set the epoch's state
    to exactly this cursor (a job restarted from its checkpoint)."""

    stream: str
    epoch: int = 0
    bits: dict[int, int] = field(default_factory=dict)
    pipeline: int = 0
    resume: bool = False

    @staticmethod
    def of(stream: str, epoch: int = 0, taken: Mapping[int, Iterable[int]] | None = None,
           pipeline: int = 0) -> Cursor:
        """A cursor from unit -> indices (sets, lists, ranges)."""
        out = Cursor(stream, epoch, pipeline=pipeline)
        for u, idx in (taken or {}).items():
            for i in idx:
                out.add(u, i)
        return out

    def add(self, unit: int, index: int) -> None:
        self.bits[unit] = self.bits.get(unit, 0) | (1 << index)

    def has(self, unit: int, index: int) -> bool:
        return bool(self.bits.get(unit, 0) >> index & 1)

    def indices(self, unit: int) -> list[int]:
        return _indices(self.bits.get(unit, 0))

    @property
    def taken(self) -> dict[int, set[int]]:
        """unit -> indices (a copy, for reading)."""
        return {u: set(_indices(b)) for u, b in self.bits.items() if b}

    def count(self) -> int:
        return sum(b.bit_count() for b in self.bits.values())

    def keys(self) -> Iterator[tuple[int, int, int]]:
        for u in sorted(self.bits):
            for i in _indices(self.bits[u]):
                yield (self.epoch, u, i)

    def copy(self) -> Cursor:
        return Cursor(self.stream, self.epoch, dict(self.bits), self.pipeline, self.resume)

    @staticmethod
    def merge(cursors: Iterable[Cursor]) -> Cursor:
        """The union of several processes' cursors of one stream: the latest epoch wins (a
        batch of epoch e + 1 is served only once every batch of epoch e was taken). The same
        cursors give the same result, whatever their order: every rank may merge them."""
        items = list(cursors)
        if not items:
            raise ConfigError("nothing to merge")
        streams = {c.stream for c in items}
        if len(streams) != 1:
            raise ConfigError(f"cursors of different streams: {sorted(streams)}")
        epoch = max(c.epoch for c in items)
        latest = [c for c in items if c.epoch == epoch]
        pipelines = {c.pipeline for c in latest if c.pipeline}
        if len(pipelines) > 1:
            raise ConfigError("cursors of different pipelines (their fingerprints differ): "
                             "merge only the cursors of one job")
        out = Cursor(items[0].stream, epoch, pipeline=pipelines.pop() if pipelines else 0)
        for c in latest:
            for u, b in c.bits.items():
                out.bits[u] = out.bits.get(u, 0) | b
        return out

    # -- plain data -----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON, YAML, any framework's checkpoint): ``taken`` holds each unit's
        indices as ``[start, length]`` runs."""
        return {"stream": self.stream, "epoch": self.epoch, "pipeline": self.pipeline,
                "taken": {str(u): [list(r) for r in runs(b)]
                          for u, b in sorted(self.bits.items()) if b}}

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> Cursor:
        """The inverse of :meth:`to_dict` (also reads lists of indices); ConfigError for
        anything else."""
        try:
            out = Cursor(str(d["stream"]), int(d["epoch"]), pipeline=int(d.get("pipeline", 0)))
            if not 0 <= out.epoch < 1 << 63:
                raise ConfigError(f"epoch {out.epoch} is not a count below 2**63")
            if not 0 <= out.pipeline < 1 << 64:
                raise ConfigError(f"pipeline fingerprint {out.pipeline} is not 64 bits")
            for u, items in dict(d.get("taken") or {}).items():
                if not 0 <= int(u) < MAX_UNITS:
                    raise ConfigError(f"unit {u} is not below {MAX_UNITS}")
                for item in items:
                    if isinstance(item, (list, tuple)):
                        start, length = (int(x) for x in item)
                        _check_run(start, length)
                        out.bits[int(u)] = out.bits.get(int(u), 0) | _mask(start, length)
                    else:
                        _check_run(int(item), 1)
                        out.add(int(u), int(item))
        except (KeyError, TypeError, ValueError) as e:  # DecodeError: a run out of bounds
            raise ConfigError(f"not a cursor: {e}") from None
        return out

    # -- bytes ----------------------------------------------------------------------------
    def encode(self) -> bytes:
        s = self.stream.encode()
        groups = _groups(self.bits)
        out = [_MAGIC, bytes([1 if self.resume else 0]), _U64.pack(self.pipeline),
               _varint(self.epoch), _varint(len(s)), s, _varint(len(groups))]
        end = 0
        for first, n, b in groups:
            out += [_varint(first - end), _varint(n), _indices_bytes(b)]
            end = first + n
        return b"".join(out)

    def ident(self) -> bytes:
        """8 bytes naming this cursor's content (stream, pipeline, epoch, taken): equal
        cursors, however they were made, name the same resume request."""
        return hashlib.blake2b(self.encode()[5:], digest_size=8).digest()

    @staticmethod
    def decode(data: bytes, max_units: int = MAX_UNITS) -> Cursor:
        """Parse :meth:`encode`'s bytes, units below ``max_units`` only; :class:`DecodeError`
        (``bad_cursor``) otherwise. The work is bounded by ``len(data)`` and ``max_units``."""
        try:
            r = _Reader(data)
            if r.take(4) != _MAGIC:
                raise DecodeError("bad_cursor", "not a feedline cursor (magic)")
            flags = r.take(1)[0]
            if flags > 1:
                raise DecodeError("bad_cursor", "flags")
            (pipeline,) = _U64.unpack(r.take(8))
            epoch = r.varint()
            stream = r.take(r.varint()).decode()
            out = Cursor(stream, epoch, pipeline=pipeline, resume=bool(flags))
            end = decoded = 0
            for _ in range(r.varint()):
                first = end + r.varint()
                n = r.varint()
                if n < 1 or first + n > max_units:
                    raise DecodeError("bad_cursor", f"units beyond {max_units}")
                b = r.indices(MAX_DECODED_BITS - decoded)
                if not b:
                    raise DecodeError("bad_cursor", "an empty group")
                decoded += b.bit_length()
                for u in range(first, first + n):
                    out.bits[u] = b
                end = first + n
            if r.pos != len(data):
                raise DecodeError("bad_cursor", "trailing bytes")
        except (IndexError, struct.error, UnicodeDecodeError) as e:
            raise DecodeError("bad_cursor", str(e)) from None
        return out

    @staticmethod
    def peek(data: bytes) -> tuple[str, int, int, bool]:
        """(stream, epoch, pipeline, resume) of encoded bytes, without reading the units;
        :class:`DecodeError` (``bad_cursor``) if even that does not parse."""
        try:
            r = _Reader(data)
            if r.take(4) != _MAGIC:
                raise DecodeError("bad_cursor", "not a feedline cursor (magic)")
            flags = r.take(1)[0]
            (pipeline,) = _U64.unpack(r.take(8))
            epoch = r.varint()
            stream = r.take(r.varint()).decode()
            if flags > 1:
                raise DecodeError("bad_cursor", "flags")
        except (IndexError, struct.error, UnicodeDecodeError) as e:
            raise DecodeError("bad_cursor", str(e)) from None
        return stream, epoch, pipeline, bool(flags)


# -- bitmasks ---------------------------------------------------------------------------------

def _mask(start: int, length: int) -> int:
    return ((1 << length) - 1) << start


def from_runs(items: Iterable[Iterable[int]]) -> int:
    """The bitmask of ``[start, length]`` runs (the inverse of :func:`runs`)."""
    b = 0
    for start, length in items:
        _check_run(start, length)
        b |= _mask(start, length)
    return b


def _check_run(start: int, length: int) -> None:
    if start < 0 or length < 1 or start + length > MAX_BITS:
        raise DecodeError("bad_cursor", f"indices beyond {MAX_BITS}")


def _indices(b: int) -> list[int]:
    out = []
    while b:
        low = b & -b
        out.append(low.bit_length() - 1)
        b ^= low
    return out


def runs(b: int) -> list[tuple[int, int]]:
    """(start, length) of each run of set bits of ``b``, in order."""
    out = []
    pos = 0
    while b:
        zeros = (b & -b).bit_length() - 1
        b >>= zeros
        pos += zeros
        ones = (~b & (b + 1)).bit_length() - 1
        out.append((pos, ones))
        b >>= ones
        pos += ones
    return out


def _groups(bits: Mapping[int, int]) -> list[tuple[int, int, int]]:
    """(first unit, units, bitmask): consecutive units with the same non-empty bitmask."""
    out: list[tuple[int, int, int]] = []
    for u in sorted(bits):
        b = bits[u]
        if not b:
            continue
        if out and out[-1][0] + out[-1][1] == u and out[-1][2] == b:
            first, n, _ = out[-1]
            out[-1] = (first, n + 1, b)
        else:
            out.append((u, 1, b))
    return out


def _indices_bytes(b: int) -> bytes:
    """Form 0 (runs) or 1 (bitmap), whichever is shorter (runs on a tie)."""
    r = runs(b)
    parts = [_varint(len(r))]
    end = 0
    for start, length in r:
        parts += [_varint(start - end), _varint(length)]
        end = start + length
    as_runs = b"\0" + b"".join(parts)
    nbytes = (b.bit_length() + 7) // 8
    as_bitmap = b"\1" + _varint(nbytes) + b.to_bytes(nbytes, "little")
    return as_runs if len(as_runs) <= len(as_bitmap) else as_bitmap


def _varint(n: int) -> bytes:
    if n < 0:  # n >> 7 of a negative number is never 0: it would loop for ever
        raise ConfigError(f"a negative count ({n}) has no varint")
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def take(self, n: int) -> bytes:
        out = self.data[self.pos:self.pos + n]
        if len(out) != n:
            raise DecodeError("bad_cursor", "short")
        self.pos += n
        return out

    def varint(self) -> int:
        n = shift = 0
        while True:
            byte = self.take(1)[0]
            n |= (byte & 0x7F) << shift
            if not byte & 0x80:
                return n
            shift += 7
            if shift > 63:
                raise DecodeError("bad_cursor", "varint too long")

    def indices(self, room: int) -> int:
        """One group's indices, of at most ``room`` bits."""
        form = self.take(1)[0]
        if form == 1:
            nbytes = self.varint()
            if nbytes > MAX_BITS // 8:
                raise DecodeError("bad_cursor", f"indices beyond {MAX_BITS}")
            return int.from_bytes(self.take(nbytes), "little")
        if form != 0:
            raise DecodeError("bad_cursor", "form")
        b = end = 0
        for _ in range(self.varint()):
            start = end + self.varint()
            length = self.varint()
            _check_run(start, length)
            end = start + length
            if end > room:
                raise DecodeError("bad_cursor", "more than a cursor may hold")
            b |= _mask(start, length)
        return b

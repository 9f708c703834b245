"""The exact-delivery cursor: which batches of an epoch a consumer (or a whole job) has taken.

A batch of an exact stream is known by ``(epoch, unit, index)``. A :class:`Cursor` holds, for
one stream and one epoch, the indices taken in each unit: small (a bit per batch), a plain
dict for any framework (:meth:`Cursor.to_dict`), bytes for a checkpoint or the wire
(:meth:`Cursor.encode`, a layout checked field by field by :meth:`Cursor.decode`).

Byte layout (big-endian)::

    b"FLC1" | u64 token | u8 flags (1: resume) | u32 epoch | u16 len + stream (utf-8)
    | u32 units | per unit: u32 unit, u32 bits, ceil(bits / 8) bytes of bitmap (bit i: index i)
"""

from __future__ import annotations

import random
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from feedline.codec import DecodeError
from feedline.errors import ConfigError

_MAGIC = b"FLC1"
_HEAD = struct.Struct(">QBIH")
_UNIT = struct.Struct(">II")
_U32 = struct.Struct(">I")
MAX_BITS = 1 << 20  # batches in one unit, at most


@dataclass
class Cursor:
    """What has been taken of ``epoch`` of ``stream``: unit -> batch indices.

    ``token`` names this snapshot (a broker applies a resume once per token); ``resume``
    asks the broker to roll back to exactly this state (a job restarted from its checkpoint).
    """

    stream: str
    epoch: int = 0
    taken: dict[int, set[int]] = field(default_factory=dict)
    token: int = field(default_factory=lambda: random.getrandbits(63))
    resume: bool = False

    def add(self, unit: int, index: int) -> None:
        self.taken.setdefault(unit, set()).add(index)

    def count(self) -> int:
        return sum(len(v) for v in self.taken.values())

    def keys(self) -> Iterable[tuple[int, int, int]]:
        for u in sorted(self.taken):
            for i in sorted(self.taken[u]):
                yield (self.epoch, u, i)

    @staticmethod
    def merge(cursors: Iterable[Cursor]) -> Cursor:
        """The union of several processes' cursors (of one stream; the latest epoch wins)."""
        items = list(cursors)
        if not items:
            raise ConfigError("nothing to merge")
        streams = {c.stream for c in items}
        if len(streams) != 1:
            raise ConfigError(f"cursors of different streams: {sorted(streams)}")
        epoch = max(c.epoch for c in items)
        out = Cursor(items[0].stream, epoch)
        for c in items:
            if c.epoch == epoch:
                for u, idx in c.taken.items():
                    out.taken.setdefault(u, set()).update(idx)
        return out

    # -- plain data -----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {"stream": self.stream, "epoch": self.epoch, "token": self.token,
                "taken": {str(u): sorted(v) for u, v in sorted(self.taken.items())}}

    @staticmethod
    def from_dict(d: dict[str, Any]) -> Cursor:
        return Cursor(str(d["stream"]), int(d["epoch"]),
                      {int(u): {int(i) for i in v} for u, v in d.get("taken", {}).items()},
                      int(d.get("token", random.getrandbits(63))))

    # -- bytes ----------------------------------------------------------------------------
    def encode(self) -> bytes:
        s = self.stream.encode()
        out = [_MAGIC, _HEAD.pack(self.token, 1 if self.resume else 0, self.epoch, len(s)), s,
               _U32.pack(len(self.taken))]
        for u in sorted(self.taken):
            idx = self.taken[u]
            bits = (max(idx) + 1) if idx else 0
            bitmap = bytearray((bits + 7) // 8)
            for i in idx:
                bitmap[i >> 3] |= 1 << (i & 7)
            out += [_UNIT.pack(u, bits), bytes(bitmap)]
        return b"".join(out)

    @staticmethod
    def decode(data: bytes) -> Cursor:
        """Parse :meth:`encode`'s bytes; :class:`DecodeError` (``bad_cursor``) otherwise."""
        try:
            if data[:4] != _MAGIC:
                raise DecodeError("bad_cursor", "magic")
            pos = 4
            token, flags, epoch, slen = _HEAD.unpack_from(data, pos)
            pos += _HEAD.size
            stream = data[pos:pos + slen].decode()
            pos += slen
            (n,) = _U32.unpack_from(data, pos)
            pos += 4
            taken: dict[int, set[int]] = {}
            for _ in range(n):
                u, bits = _UNIT.unpack_from(data, pos)
                pos += _UNIT.size
                if bits > MAX_BITS or u in taken:
                    raise DecodeError("bad_cursor", "unit")
                nb = (bits + 7) // 8
                bitmap = data[pos:pos + nb]
                if len(bitmap) != nb:
                    raise DecodeError("bad_cursor", "short")
                pos += nb
                taken[u] = {i for i in range(bits) if bitmap[i >> 3] >> (i & 7) & 1}
            if pos != len(data) or flags > 1:
                raise DecodeError("bad_cursor", "trailing")
        except (struct.error, UnicodeDecodeError) as e:
            raise DecodeError("bad_cursor", str(e)) from None
        return Cursor(stream, epoch, taken, token, bool(flags))

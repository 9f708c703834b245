"""Encoding a datapoint into a batch message, under the limits every receiver applies.

The byte layout is :mod:`feedline.protocol.wire`'s docstring. A datapoint is checked and flattened
once
(:func:`prepare_batch`, in the thread that made it) and framed when it is sent
(:meth:`Prepared.frames`, with the session and sequence number of the broker it goes to).
"""

from __future__ import annotations

import struct
from typing import Any

import msgpack
import numpy as np

from feedline.protocol.codec import (
    CONTAINER_BARE,
    CONTAINER_DICT,
    CONTAINER_LIST,
    CONTAINER_TUPLE,
    DEFAULT_LIMITS,
    PROTOCOL_VERSION,
    DecodeError,
    EncodeError,
    Kind,
    Limits,
    check_bools,
    packb,
    sendable_dtype,
)

ARRAY_EXT = 1  # the msgpack ExtType code of an array reference
U32 = struct.Struct(">I")
_U8, _U16, _U64 = struct.Struct(">B"), struct.Struct(">H"), struct.Struct(">Q")


class _Flattener:
    """Walks a datapoint into the header's structure and the list of arrays, applying the
    limits every receiver applies, so that a datapoint no receiver would take fails here with
    the limit named (a refused batch would cost a credit and tell the operator less)."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.arrays: list[np.ndarray] = []
        self.nbytes = 0

    def walk(self, obj: Any, depth: int) -> Any:
        lim = self.limits
        if depth > lim.max_depth:
            raise EncodeError(f"datapoint nested deeper than max_depth={lim.max_depth}")
        if isinstance(obj, (np.ndarray, np.generic)):
            return self._array(np.asarray(obj))
        if isinstance(obj, (list, tuple, dict)) and len(obj) > lim.max_container_len:
            raise EncodeError(f"a {type(obj).__name__} of {len(obj)} entries in the datapoint: "
                              f"receivers refuse more than max_container_len="
                              f"{lim.max_container_len} (send an array instead)")
        if isinstance(obj, (list, tuple)):
            return [self.walk(x, depth + 1) for x in obj]
        if isinstance(obj, dict):
            out = {}
            for k, v in obj.items():
                if not isinstance(k, str):
                    raise EncodeError(f"dict keys must be str, got {type(k).__name__}")
                out[k] = self.walk(v, depth + 1)
            return out
        if isinstance(obj, int) and not isinstance(obj, bool) and not -(2**63) <= obj < 2**64:
            raise EncodeError(f"integer {obj} does not fit 64 bits (send an array instead)")
        if obj is None or isinstance(obj, (bool, int, float, str, bytes)):
            return obj
        raise EncodeError(f"cannot send a {type(obj).__name__} (arrays, scalars, str, bytes only)")

    def _array(self, arr: np.ndarray) -> msgpack.ExtType:
        lim = self.limits
        if arr.dtype.kind not in "biufc" or not sendable_dtype(arr.dtype):
            raise EncodeError(f"dtype {arr.dtype} ({arr.dtype.str}) cannot be sent: numeric and "
                              "bool dtypes only, no long double (f16/c32)")
        if arr.ndim > lim.max_ndim:
            raise EncodeError(f"array of {arr.ndim} dims: max_ndim={lim.max_ndim}")
        if len(self.arrays) >= lim.max_arrays:
            raise EncodeError(f"more than max_arrays={lim.max_arrays} arrays in one datapoint")
        if not arr.flags.c_contiguous:
            arr = np.ascontiguousarray(arr)
        if arr.dtype.kind == "b":
            _check_bools(arr)
        self.nbytes += arr.nbytes
        if self.nbytes > lim.max_message_bytes:
            raise EncodeError(f"the datapoint's arrays exceed max_message_bytes="
                              f"{lim.max_message_bytes}")
        self.arrays.append(arr)
        return msgpack.ExtType(ARRAY_EXT, U32.pack(len(self.arrays) - 1))


def _container(dp: Any) -> int:
    if isinstance(dp, tuple):
        return CONTAINER_TUPLE
    if isinstance(dp, list):
        return CONTAINER_LIST
    if isinstance(dp, dict):
        return CONTAINER_DICT
    return CONTAINER_BARE


_HEADER_SLACK = 112  # the map header, "v" ... "e" (and "u", "i", "l", "f"), their largest values


class Prepared:
    """A datapoint checked against the limits and flattened, ready to be framed for any
    producer session and sequence number (the I/O thread picks those when it sends).

    ``wire_bytes`` is an upper bound of the message's size (header and arrays) whatever the
    session and sequence numbers: what credit must cover. Not changed once made (a plain
    class with slots, not a frozen dataclass: one is made for every batch, and a frozen
    dataclass's ``__init__`` cost 1.6 us of the 6.9 that preparing a batch took).
    """

    __slots__ = ("tail", "arrays", "nbytes", "wire_bytes")

    def __init__(self, tail: bytes, arrays: tuple[np.ndarray, ...], nbytes: int,
                 wire_bytes: int) -> None:
        self.tail = tail  # the header's "c", "d" and "a" entries, packed once
        self.arrays = arrays
        self.nbytes = nbytes  # array bytes
        self.wire_bytes = wire_bytes

    def __repr__(self) -> str:
        return (f"Prepared(arrays={len(self.arrays)}, nbytes={self.nbytes}, "
                f"wire_bytes={self.wire_bytes})")

    def frames(self, *, producer: bytes, session: int, seq: int, epoch: int,
               unit: int = -1, index: int = 0, last: bool = False,
               pipeline: int = 0, lineage: bytes = b"") -> list[Any]:
        """``[header, arrays...]``; ``producer`` is the packed producer id (:func:`packb`).

        Exact delivery: ``unit`` >= 0 adds the batch's place in its work unit: ``"u"`` the
        unit, ``"i"`` its index there, ``"l"`` true for the unit's last batch, ``"f"`` the
        pipeline's fingerprint (what the consumers' cursors are tied to); ``lineage``, the
        two entries :func:`lineage_fields` packed (``"F"`` and ``"V"``), or nothing."""
        if unit < 0:
            head = b"\x89" + _V_K + sender_fields(producer, session, seq, epoch)
        else:
            head = (b"\x8f" if lineage else b"\x8d") + _V_K \
                + sender_fields(producer, session, seq, epoch) \
                + b"\xa1u" + uint(unit) + b"\xa1i" + uint(index) + b"\xa1l" \
                + (b"\xc3" if last else b"\xc2") + b"\xa1f" + packb(pipeline) + lineage
        return [head + self.tail, *self.arrays]


MAX_CODE_LEN = 64  # characters of a code version (feedline.version.code_version)


def lineage_fields(file: int, code: str) -> bytes:
    """An exact batch's lineage entries, packed once per producer: ``"F"`` the fingerprint
    of the pipeline file it runs (0 .. 2**63 - 1), ``"V"`` its code version (a str of at
    most :data:`MAX_CODE_LEN` characters). What the rest of a batch's lineage is (its sample
    ids, their seeds) follows from the pipeline file and ``(epoch, unit, index)``: it is
    recomputed, never sent (docs/architecture.md, "Lineage")."""
    if not 0 <= file < 1 << 63:
        raise EncodeError(f"a pipeline file's fingerprint is 0 .. 2**63 - 1, not {file}")
    if len(code) > MAX_CODE_LEN:
        raise EncodeError(f"a code version is at most {MAX_CODE_LEN} characters")
    return b"\xa1F" + packb(file) + b"\xa1V" + packb(code)


def sender_fields(producer: bytes, session: int, seq: int, epoch: int) -> bytes:
    """The ``p``, ``q``, ``s`` and ``e`` entries of a batch (or bundle) header, packed;
    ``producer`` packed already (:func:`packb`)."""
    return b"\xa1p" + producer + b"\xa1q" + uint(session) + b"\xa1s" + uint(seq) \
        + b"\xa1e" + uint(epoch)


def uint(n: int) -> bytes:
    """A non-negative int as msgpack packs it (the shortest form), without a Packer: the
    header of every batch has three of them."""
    if n < 0x80:
        return _FIXINT[n] if n >= 0 else packb(n)
    if n < 0x100:
        return b"\xcc" + _U8.pack(n)
    if n < 0x10000:
        return b"\xcd" + _U16.pack(n)
    if n < 0x100000000:
        return b"\xce" + U32.pack(n)
    return b"\xcf" + _U64.pack(n) if n < 1 << 64 else packb(n)


_FIXINT = [bytes([i]) for i in range(0x80)]


_V_K = packb("v") + packb(PROTOCOL_VERSION) + packb("k") + packb(int(Kind.BATCH))


def prepare_batch(datapoint: Any, limits: Limits = DEFAULT_LIMITS,
                  producer_id_len: int = 0) -> Prepared:
    """Check and flatten ``datapoint``; raises :class:`EncodeError` naming the limit for
    anything a receiver applying ``limits`` would refuse.

    A list or tuple of C-contiguous arrays (what a batching pipeline yields) is checked once
    per layout (dtypes, shapes, limits): its header tail, array bytes and bool arrays are
    remembered (:data:`_TAILS`), and a batch of a known layout checks only what can differ
    between two batches of it (its bool bytes). Anything else is walked whole.
    """
    if type(datapoint) is list or type(datapoint) is tuple:
        key = _layout(datapoint, limits, producer_id_len)
        if key is not None:
            hit = _TAILS.get(key)
            if hit is not None and hit[0] is limits:
                for i in hit[3]:
                    _check_bools(datapoint[i])
                nbytes = hit[4]
                return Prepared(hit[1], tuple(datapoint), nbytes, nbytes + hit[2])
            prepared = _prepare(datapoint, limits, producer_id_len)
            if len(_TAILS) >= _MAX_TAILS:
                _TAILS.clear()
            bools = tuple(i for i, a in enumerate(datapoint) if a.dtype.kind == "b")
            _TAILS[key] = (limits, prepared.tail, prepared.wire_bytes - prepared.nbytes, bools,
                           prepared.nbytes)
            return prepared
    return _prepare(datapoint, limits, producer_id_len)


_MAX_TAILS = 64  # layouts remembered; a pipeline has one or a few
# (limits id, producer id length, container, (dtype, shape) of each array) -> (limits, the
# header's tail, the header's bytes, the indices of bool arrays, the array bytes): what
# prepare_batch found for that layout (which _prepare accepted: within max_message_bytes).
_TAILS: dict[tuple, tuple[Limits, bytes, int, tuple[int, ...], int]] = {}


def _layout(dp: list | tuple, limits: Limits, id_len: int) -> tuple | None:
    """The key of a list or tuple of C-contiguous arrays, or None (walked whole). Dtypes
    are keyed as themselves: equal dtypes have one ``str`` (what the header carries), and
    ``dtype.str`` builds a new string each time (0.65 us an array)."""
    if not 0 < len(dp) <= 64:
        return None
    sig = []
    for a in dp:
        if type(a) is not np.ndarray or not a.flags.c_contiguous:
            return None
        sig.append((a.dtype, a.shape))
    return (id(limits), id_len, type(dp) is tuple, *sig)


def _check_bools(a: np.ndarray) -> None:
    try:
        check_bools(a)
    except DecodeError:
        raise EncodeError("a bool array holds bytes other than 0 and 1") from None


def _prepare(datapoint: Any, limits: Limits, producer_id_len: int) -> Prepared:
    flat = _Flattener(limits)
    structure = flat.walk(datapoint, 0)
    try:
        tail = (packb("c") + packb(_container(datapoint)) + packb("d") + packb(structure)
                + packb("a") + packb([[a.dtype.str, list(a.shape)] for a in flat.arrays]))
    except (OverflowError, ValueError) as e:
        raise EncodeError(f"cannot encode the datapoint: {e}") from None
    header_bytes = len(tail) + _HEADER_SLACK + producer_id_len * 4
    if header_bytes > limits.max_header_bytes:
        raise EncodeError(f"the header (structure, scalars, strings and bytes inline) is "
                          f"about {header_bytes} bytes: receivers refuse more than "
                          f"max_header_bytes={limits.max_header_bytes} (send large values as "
                          "arrays)")
    return Prepared(tail, tuple(flat.arrays), flat.nbytes, flat.nbytes + header_bytes)


def encode_batch(
    datapoint: Any, *, producer: str, session: int, seq: int, epoch: int = 0,
    limits: Limits = DEFAULT_LIMITS,
) -> list[Any]:
    """Frames for one datapoint: ``[header_bytes, array, array, ...]``.

    Arrays are returned as-is (C-contiguous ones are not copied): send them with
    ``copy=False`` and do not mutate them afterwards. Raises :class:`EncodeError`, naming the
    limit, for anything a receiver applying ``limits`` would refuse.
    """
    if not 0 < len(producer) <= limits.max_id_len:
        raise EncodeError(f"producer id must be 1..{limits.max_id_len} characters")
    prepared = prepare_batch(datapoint, limits, len(producer))
    return prepared.frames(producer=packb(producer), session=session, seq=seq, epoch=epoch)

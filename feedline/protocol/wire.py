"""The feedline wire protocol: the one place that turns bytes from the network into objects.

Every feedline message is one ZeroMQ multipart message whose first frame is a *header*: a
msgpack map with short string keys. Control messages (hello, credit, heartbeat, end-of-stream,
error, reset) are the header alone. A batch is the header followed by one raw frame per array.

Batch header (producer -> broker, and broker -> consumer after an envelope frame)::

    {"v": 2,                     # protocol version (PROTOCOL_VERSION)
     "k": 2,                     # Kind.BATCH
     "p": "host-1234",           # producer id (str, <= 256 bytes)
     "q": 7014823871,            # producer session: random per producer process start
     "s": 41,                    # per-session sequence number, 0, 1, 2, ...
     "e": 0,                     # epoch
     "c": 0,                     # container of the datapoint: 0 list, 1 tuple, 2 dict, 3 bare
     "d": [ExtType(1, b"\0\0\0\0"), ExtType(1, b"\0\0\0\1")],   # structure, see below
     "a": [["|u1", [64, 224, 224, 3]], ["<i4", [64]]]}         # dtype + shape of each frame

Exact delivery's batches add ``"u"`` (work unit), ``"i"`` (index in it), ``"l"`` (the unit's
last batch) and ``"f"`` (the pipeline's fingerprint, < 2**63); and, from producers that
say them (optional: an older producer's batches have neither), ``"F"`` (the fingerprint of
the pipeline file, < 2**63) and ``"V"`` (the producer's code version, a str of at most 64
characters): what a batch's lineage holds that its place cannot give
(:mod:`feedline.exact.lineage`). A receiver ignores keys it does not know.

``d`` is the datapoint with each array replaced by msgpack ExtType code 1 holding the big-endian
uint32 index of its frame (frames 1..n hold arrays 0..n-1). Python scalars, strings, bytes and
None travel inline. Nested containers are lists and str-keyed dicts (a nested tuple arrives as a
list); the top-level container is restored from ``c``. NumPy scalars travel as 0-d arrays.

Array frame i is exactly ``prod(shape_i) * itemsize_i`` bytes, C order, no padding. Senders
pass the arrays themselves with ``copy=False``; receivers rebuild them with ``np.frombuffer``
over the received frame (a read-only view, no copy).

Several batches of one layout may travel in one message to a direct-mode trainer that offers
it (a BUNDLE: :mod:`feedline.protocol.bundle`).

Broker -> consumer batches carry one extra frame in front, the *envelope* (a
:class:`feedline.protocol.messages.Deliver`). Control messages (hello, credit, heartbeat, ...) are
header-only and typed: :mod:`feedline.protocol.messages`.

Trust: :func:`decode_header`, :func:`decode_batch` and :func:`decode_tensorpack` accept only
the dtypes of :func:`feedline.protocol.codec.check_dtype` (bools only as bytes 0 and 1), check every
shape against its frame's length, bound sizes and counts (:class:`Limits`), never unpickle,
and raise :class:`DecodeError` (with a short ``reason`` usable as a metric label) for
anything else. :func:`encode_batch` applies the same limits before anything is sent.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import zmq

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
    Unpacker,
    check_bools,
    check_dtype,
    packb,
    unpackb,
)
from feedline.protocol.encode import (
    ARRAY_EXT,
    MAX_CODE_LEN,
    U32,
    Prepared,
    encode_batch,
    lineage_fields,
    prepare_batch,
)
from feedline.protocol.tensorpack_wire import decode_tensorpack

__all__ = [
    "CONTAINER_BARE", "CONTAINER_DICT", "CONTAINER_LIST", "CONTAINER_TUPLE", "DEFAULT_LIMITS",
    "PROTOCOL_VERSION", "Batch", "DecodeError", "EncodeError", "Kind", "Limits", "Unpacker",
    "check_batch_header", "check_dtype", "check_frame_lengths", "decode_batch", "decode_header",
    "decode_tensorpack", "encode_batch", "header_map", "lineage_fields", "packb",
    "prepare_batch", "Prepared", "unpackb",
]


# ---------------------------------------------------------------------------------- decoding


class _ArrayRef:
    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


def _ext_hook(code: int, data: bytes) -> _ArrayRef:
    if code != ARRAY_EXT or len(data) != 4:
        raise DecodeError("bad_structure", f"unknown ext type {code}")
    return _ArrayRef(U32.unpack(data)[0])


def _buffer(frame: Any) -> memoryview:
    """A byte view of a frame: bytes, or a zmq.Frame received with copy=False."""
    buf = getattr(frame, "buffer", frame)
    mv = memoryview(buf)
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


# What ``len()`` and ``np.ndarray(buffer=)`` read as bytes as they are: no view needed.
_BYTES_LIKE = (bytes, zmq.Frame)
_KINDS = {int(k): k for k in Kind}


def _bytes_of(frame: Any) -> Any:
    return frame if type(frame) in _BYTES_LIKE else _buffer(frame)


_OPTIONS: dict[int, tuple[Limits, dict[str, Any]]] = {}


def _unpack_options(limits: Limits) -> dict[str, Any]:
    """msgpack's own bounds for a header under ``limits``: one dict per Limits object, found
    by identity (hashing a Limits costs more than the unpacking it configures)."""
    hit = _OPTIONS.get(id(limits))
    if hit is not None and hit[0] is limits:
        return hit[1]
    n = limits.max_header_bytes
    entries = min(n, max(limits.max_container_len, limits.max_arrays))
    options = {"raw": False, "strict_map_key": True, "ext_hook": _ext_hook, "max_str_len": n,
               "max_bin_len": n, "max_array_len": entries, "max_map_len": entries,
               "max_ext_len": 16}
    if len(_OPTIONS) >= 64:
        _OPTIONS.clear()
    _OPTIONS[id(limits)] = (limits, options)
    return options


def header_map(frame: Any, limits: Limits = DEFAULT_LIMITS) -> dict[str, Any]:
    """Unpack a header frame and check its version and kind; the map, ``k`` a :class:`Kind`.

    The per-kind checks are the caller's: :func:`decode_batch` for batches,
    :func:`feedline.protocol.messages.decode` for control messages.
    """
    buf = _bytes_of(frame)
    if len(buf) > limits.max_header_bytes:
        raise DecodeError("header_too_large", f"{len(buf)} bytes")
    try:
        header = unpackb(buf, **_unpack_options(limits))
    except DecodeError:
        raise
    except Exception as e:  # msgpack raises several types; all mean "malformed"
        raise DecodeError("bad_msgpack", type(e).__name__) from None
    if type(header) is not dict:
        raise DecodeError("bad_header", "not a map")
    if header.get("v") != PROTOCOL_VERSION:
        raise DecodeError("bad_version", repr(header.get("v"))[:32])
    kind = header.get("k")
    # type(), not isinstance: a bool is an int, and True is not a kind.
    k = _KINDS.get(kind) if type(kind) is int else None
    if k is None:
        raise DecodeError("bad_kind", repr(kind)[:32])
    header["k"] = k
    return header


decode_header = header_map  # the name the batch path and older callers use


def _int(h: Mapping[str, Any], key: str, lo: int = 0, hi: int = (1 << 63) - 1) -> int:
    v = h.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise DecodeError("bad_header", f"field {key!r}")
    return v


_U63 = (1 << 63) - 1


def check_batch_header(header: Mapping[str, Any], nframes: int, limits: Limits) -> list[tuple]:
    """Validate a batch header against the number of array frames; return [(dtype, shape)]."""
    pid = header.get("p")
    if type(pid) is not str or not 0 < len(pid) <= limits.max_id_len:
        raise DecodeError("bad_header", "producer id")
    for key in ("q", "s", "e"):
        v = header.get(key)
        if type(v) is not int or not 0 <= v <= _U63:
            raise DecodeError("bad_header", f"field {key!r}")
    specs = header.get("a")
    if type(specs) is not list:
        raise DecodeError("bad_header", "array specs")
    if len(specs) > limits.max_arrays:
        raise DecodeError("too_many_arrays", str(len(specs)))
    if len(specs) != nframes:
        raise DecodeError("frame_count", f"{len(specs)} specs for {nframes} frames")
    out = []
    top = limits.max_message_bytes
    for spec in specs:
        if type(spec) is not list or len(spec) != 2 or type(spec[1]) is not list:
            raise DecodeError("bad_header", "array spec")
        dt = _dtype(spec[0])
        shape = spec[1]
        if len(shape) > limits.max_ndim:
            raise DecodeError("too_many_dims", str(len(shape)))
        for d in shape:
            # type(), not isinstance: msgpack gives int or bool, and a bool is no dimension.
            if type(d) is not int or not 0 <= d <= top:
                raise DecodeError("bad_shape", repr(d)[:32])
        _check_extent(shape, dt, limits)
        out.append((dt, tuple(shape)))
    return out


_DTYPES: dict[str, np.dtype] = {}  # dtype strings seen allowed: a few dozen at most


def _dtype(s: object) -> np.dtype:
    """:func:`check_dtype`, remembered: the allow-list is finite, so is this cache."""
    if type(s) is str:
        dt = _DTYPES.get(s)
        if dt is not None:
            return dt
    dt = check_dtype(s)
    _DTYPES[s] = dt  # type: ignore[index]  # a str: check_dtype refuses anything else
    return dt


def _check_extent(shape: Sequence[int], dt: np.dtype, limits: Limits) -> None:
    """Refuse shapes numpy cannot represent even when a zero makes them empty.

    ``[0, 2**62, 2**62]`` describes zero bytes, but numpy's reshape still multiplies the other
    dimensions and raises ValueError ("array is too big"): bound that product too.
    """
    extent = dt.itemsize
    for d in shape:
        extent *= max(d, 1)
        if extent > limits.max_message_bytes:
            raise DecodeError("bad_shape", "extent exceeds the message limit")


def _rebuild(
    node: Any, arrays: Sequence[np.ndarray], used: list[bool], depth: int, max_depth: int
) -> Any:
    if depth > max_depth:
        raise DecodeError("too_deep")
    if isinstance(node, _ArrayRef):
        if node.index >= len(arrays) or used[node.index]:
            raise DecodeError("bad_structure", f"array ref {node.index}")
        used[node.index] = True
        return arrays[node.index]
    if isinstance(node, list):
        return [_rebuild(x, arrays, used, depth + 1, max_depth) for x in node]
    if isinstance(node, dict):
        return {k: _rebuild(v, arrays, used, depth + 1, max_depth) for k, v in node.items()}
    return node


def check_frame_lengths(specs: Sequence[tuple], frames: Sequence[Any], limits: Limits) -> int:
    """Check each frame's byte length against its (dtype, shape); return the total bytes.

    Reads lengths only, never payloads: the broker calls this on frames it forwards.
    """
    total = 0
    for (dt, shape), frame in zip(specs, frames, strict=True):
        count = 1
        for d in shape:
            count *= d
        nbytes = count * dt.itemsize
        total += nbytes
        if total > limits.max_message_bytes:
            raise DecodeError("message_too_large", f"> {limits.max_message_bytes} bytes")
        if nbytes != len(frame):
            raise DecodeError("shape_mismatch", f"{shape} {dt.str}: {nbytes} != {len(frame)}")
    return total


def _arrays_from_frames(
    specs: Sequence[tuple], frames: Sequence[Any], limits: Limits
) -> tuple[list[np.ndarray], int]:
    """The arrays (read-only views on the frames) and their total bytes."""
    bufs = [_bytes_of(f) for f in frames]
    total = check_frame_lengths(specs, bufs, limits)
    arrays = []
    for (dt, shape), b in zip(specs, bufs, strict=True):
        arr = np.ndarray(shape, dt, b)  # the length was checked: exactly the frame
        arr.flags.writeable = False  # a view on a received frame: never written through
        if dt.kind == "b":
            check_bools(arr)
        arrays.append(arr)
    return arrays, total


@dataclass(frozen=True)
class Batch:
    """A decoded batch: its metadata and the datapoint (arrays are views on the frames).

    ``nbytes`` counts the array bytes; ``wire_bytes`` everything the message holds (header
    included), which is what a memory budget counts.
    """

    producer: str
    session: int
    seq: int
    epoch: int
    datapoint: Any
    nbytes: int
    wire_bytes: int = 0
    unit: int = -1  # exact delivery: its work unit (-1: not exact)
    index: int = -1  # ... its index in the unit
    last: bool = False  # ... the unit's last batch
    pipeline: int = 0  # ... the fingerprint of the pipeline that made it (0: not said)
    pipeline_file: int = 0  # ... the fingerprint of its pipeline file (0: not said)
    code: str = ""  # ... its producer's code version ("": not said)

    @property
    def key(self) -> tuple[int, int, int]:
        """``(epoch, unit, index)``: what exact delivery de-duplicates by."""
        return (self.epoch, self.unit, self.index)


def decode_batch(
    frames: Sequence[Any], limits: Limits = DEFAULT_LIMITS, header: dict | None = None
) -> Batch:
    """Decode ``[header, array frames...]`` into a :class:`Batch`; raises DecodeError.

    ``header`` may pass an already-decoded header for ``frames[0]``.
    """
    if not frames:
        raise DecodeError("empty")
    if len(frames) > limits.max_frames:
        raise DecodeError("too_many_arrays", str(len(frames)))
    if header is None:
        header = header_map(frames[0], limits)
    if header["k"] != Kind.BATCH:
        raise DecodeError("bad_kind", f"expected BATCH, got {header['k']!r}")
    specs = check_batch_header(header, len(frames) - 1, limits)
    arrays, nbytes = _arrays_from_frames(specs, frames[1:], limits)
    structure = header.get("d")
    dp = datapoint(structure, arrays, header.get("c", CONTAINER_LIST), limits,
                   _in_order(structure, len(arrays)))
    unit, index, last, pipeline, pipeline_file, code = -1, -1, False, 0, 0, ""
    if "u" in header:
        unit, index = _int(header, "u", 0, 1 << 40), _int(header, "i", 0, 1 << 40)
        flag = header.get("l")
        if not isinstance(flag, bool):
            raise DecodeError("bad_header", "field 'l'")
        last = flag
        if "f" in header:
            pipeline = _int(header, "f")
        if "F" in header:  # lineage (optional: older producers say neither)
            pipeline_file = _int(header, "F")
            code = header.get("V", "")
            if type(code) is not str or len(code) > MAX_CODE_LEN:
                raise DecodeError("bad_header", "field 'V'")
    # Batch's own __init__ sets each field through object.__setattr__ (it is frozen): a
    # third of a microsecond per field, for every batch. Its fields are all given here.
    batch = object.__new__(Batch)
    batch.__dict__.update(
        producer=header["p"], session=header["q"], seq=header["s"], epoch=header["e"],
        datapoint=dp, nbytes=nbytes, wire_bytes=nbytes + len(_bytes_of(frames[0])),
        unit=unit, index=index, last=last, pipeline=pipeline,
        pipeline_file=pipeline_file, code=code)
    return batch


def datapoint(structure: Any, arrays: list[np.ndarray], container: Any, limits: Limits,
              in_order: bool) -> Any:
    """The datapoint a header's structure and container make of ``arrays``; ``in_order``:
    the structure is the arrays in frame order (what most batches are: nothing to walk)."""
    if in_order:
        dp: Any = arrays
    else:
        used = [False] * len(arrays)
        try:
            dp = _rebuild(structure, arrays, used, 0, limits.max_depth)
        except RecursionError:
            raise DecodeError("too_deep") from None
        if not all(used):
            raise DecodeError("bad_structure", "unreferenced array frame")
    if container == CONTAINER_TUPLE and isinstance(dp, list):
        return tuple(dp)
    if (container == CONTAINER_LIST and not isinstance(dp, list)
            or container == CONTAINER_DICT and not isinstance(dp, dict)
            or container not in (0, 1, 2, 3)):
        raise DecodeError("bad_structure", "container")
    return dp


def _in_order(structure: Any, n: int) -> bool:
    """``structure`` is the list of the n array references in frame order."""
    if type(structure) is not list or len(structure) != n:
        return False
    for i, ref in enumerate(structure):
        if type(ref) is not _ArrayRef or ref.index != i:
            return False
    return True

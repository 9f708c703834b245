"""The feedline wire protocol: the one place that turns bytes from the network into objects.

Every feedline message is one ZeroMQ multipart message whose first frame is a *header*: a
msgpack map with short string keys. Control messages (hello, credit, heartbeat, end-of-stream,
error, reset) are the header alone. A batch is the header followed by one raw frame per array.

Batch header (producer -> broker, and broker -> consumer after an envelope frame)::

    {"v": 1,                     # protocol version (PROTOCOL_VERSION)
     "k": 2,                     # Kind.BATCH
     "p": "host-1234",           # producer id (str, <= 256 bytes)
     "q": 7014823871,            # producer session: random per producer process start
     "s": 41,                    # per-session sequence number, 0, 1, 2, ...
     "e": 0,                     # epoch
     "c": 0,                     # container of the datapoint: 0 list, 1 tuple, 2 dict, 3 bare
     "d": [ExtType(1, b"\0\0\0\0"), ExtType(1, b"\0\0\0\1")],   # structure, see below
     "a": [["|u1", [64, 224, 224, 3]], ["<i4", [64]]]}         # dtype + shape of each frame

``d`` is the datapoint with each array replaced by msgpack ExtType code 1 holding the big-endian
uint32 index of its frame (frames 1..n hold arrays 0..n-1). Python scalars, strings, bytes and
None travel inline. Nested containers are lists and str-keyed dicts (a nested tuple arrives as a
list); the top-level container is restored from ``c``. NumPy scalars travel as 0-d arrays.

Array frame i is exactly ``prod(shape_i) * itemsize_i`` bytes, C order, no padding. Senders
pass the arrays themselves with ``copy=False``; receivers rebuild them with ``np.frombuffer``
over the received frame (a read-only view, no copy).

Broker -> consumer batches carry one extra frame in front, the *envelope* (a header of kind
DELIVER with ``g``: batches of this producer session that the broker saw were lost upstream
since its previous delivered batch, counted once across all consumers).

Trust: :func:`decode_header`, :func:`decode_batch` and :func:`decode_tensorpack` accept only
numeric and bool dtypes, check every shape against its frame's length, bound sizes and counts
(:class:`Limits`), never unpickle, and raise :class:`DecodeError` (with a short ``reason``
usable as a metric label) for anything else.
"""

from __future__ import annotations

import enum
import re
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

# msgpack's own implementation, bound here so that no monkeypatch can swap it: tensorpack calls
# msgpack_numpy.patch() at import, which rebinds msgpack.unpackb to a function that unpickles
# object arrays. A training process that imports tensorpack must not make this decoder unsafe.
try:
    from msgpack._cmsgpack import Packer as _Packer
    from msgpack._cmsgpack import Unpacker as Unpacker  # re-exported: msgpack's own
    from msgpack._cmsgpack import unpackb as _unpackb
except ImportError:  # pure-Python msgpack build
    from msgpack.fallback import Packer as _Packer  # type: ignore[assignment]
    from msgpack.fallback import Unpacker as Unpacker  # type: ignore[assignment]
    from msgpack.fallback import unpackb as _unpackb  # type: ignore[assignment]


def packb(obj: Any, default: Any = None) -> bytes:
    """msgpack-encode with msgpack's own packer (immune to msgpack_numpy.patch)."""
    return _Packer(use_bin_type=True, default=default).pack(obj)


def unpackb(buf: Any, **kwargs: Any) -> Any:
    """msgpack-decode with msgpack's own unpacker (never msgpack_numpy's, which unpickles).

    For bytes from outside the process, pass the ``max_*_len`` limits too.
    """
    return _unpackb(buf, **kwargs)

PROTOCOL_VERSION = 1
_ARRAY_EXT = 1
_U32 = struct.Struct(">I")


class Kind(enum.IntEnum):
    """Message kinds. Values are part of the protocol: never renumber."""

    HELLO = 1  # peer -> broker: register (role, id, session, consumer window)
    BATCH = 2  # producer -> broker: header + array frames
    CREDIT = 3  # broker -> producer: "you may send n more"; consumer -> broker: "I can take n"
    HEARTBEAT = 4  # both ways, when nothing else was sent for one interval
    EOS = 5  # producer -> broker -> consumers: this producer's dataflow ended
    ERROR = 6  # producer -> broker -> consumers: the pipeline raised, with traceback
    RESET = 7  # broker -> peer: "I do not know you (I restarted): say hello again"
    DELIVER = 8  # broker -> consumer: envelope frame in front of a forwarded batch
    BYE = 9  # peer -> broker: leaving; drop my state now


CONTAINER_LIST, CONTAINER_TUPLE, CONTAINER_DICT, CONTAINER_BARE = 0, 1, 2, 3


class DecodeError(ValueError):
    """A received message is malformed or exceeds a limit. ``reason`` is a metric label."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


@dataclass(frozen=True)
class Limits:
    """Bounds the decoder enforces on everything it receives."""

    max_header_bytes: int = 64 * 1024
    max_arrays: int = 1024
    max_ndim: int = 32
    max_message_bytes: int = 1 << 30  # total array bytes in one message (1 GiB)
    max_depth: int = 16  # nesting of containers in a datapoint
    max_id_len: int = 256
    # Entries of one msgpack list or map. msgpack preallocates what a list *claims*: without
    # this, 3 bytes per level of nesting claim 64 K slots each (a 60 KB header took 80 MB).
    # Worst case now: 1024 levels (msgpack's own stack limit) x this x 8 bytes, transient.
    max_container_len: int = 2048

    @property
    def max_frames(self) -> int:
        return self.max_arrays + 2  # envelope + header + arrays


DEFAULT_LIMITS = Limits()

# Byte-order char, then kind and size. No structured, object, string, void or datetime dtypes.
_DTYPE_RE = re.compile(r"^[<>|=]?(?:b1|[iu](?:1|2|4|8)|f(?:2|4|8|16)|c(?:8|16|32))$")


def check_dtype(s: object) -> np.dtype:
    """Return the dtype for an allowed dtype string, else raise DecodeError."""
    if not isinstance(s, str) or not _DTYPE_RE.match(s):
        raise DecodeError("bad_dtype", repr(s)[:64])
    dt = np.dtype(s)
    if dt.kind not in "biufc" or dt.hasobject or dt.fields is not None or dt.subdtype:
        raise DecodeError("bad_dtype", s)
    return dt


# ---------------------------------------------------------------------------------- encoding


class EncodeError(TypeError):
    """The datapoint holds something the protocol cannot carry (object arrays, sets, ...)."""


def _flatten(obj: Any, arrays: list[np.ndarray], depth: int) -> Any:
    if depth > DEFAULT_LIMITS.max_depth:
        raise EncodeError(f"datapoint nested deeper than {DEFAULT_LIMITS.max_depth}")
    if isinstance(obj, (np.ndarray, np.generic)):
        arr = np.asarray(obj)
        if arr.dtype.kind not in "biufc" or arr.dtype.fields is not None:
            raise EncodeError(f"dtype {arr.dtype} cannot be sent (numeric and bool only)")
        if not arr.flags.c_contiguous:
            arr = np.ascontiguousarray(arr)
        arrays.append(arr)
        return msgpack.ExtType(_ARRAY_EXT, _U32.pack(len(arrays) - 1))
    if isinstance(obj, (list, tuple)):
        return [_flatten(x, arrays, depth + 1) for x in obj]
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            if not isinstance(k, str):
                raise EncodeError(f"dict keys must be str, got {type(k).__name__}")
            out[k] = _flatten(v, arrays, depth + 1)
        return out
    if obj is None or isinstance(obj, (bool, int, float, str, bytes)):
        return obj
    raise EncodeError(f"cannot send a {type(obj).__name__} (arrays, scalars, str, bytes only)")


def _container(dp: Any) -> int:
    if isinstance(dp, tuple):
        return CONTAINER_TUPLE
    if isinstance(dp, list):
        return CONTAINER_LIST
    if isinstance(dp, dict):
        return CONTAINER_DICT
    return CONTAINER_BARE


def encode_batch(
    datapoint: Any, *, producer: str, session: int, seq: int, epoch: int = 0
) -> list[Any]:
    """Frames for one datapoint: ``[header_bytes, array, array, ...]``.

    Arrays are returned as-is (C-contiguous ones are not copied): send them with
    ``copy=False`` and do not mutate them afterwards.
    """
    arrays: list[np.ndarray] = []
    structure = _flatten(datapoint, arrays, 0)
    header = {
        "v": PROTOCOL_VERSION,
        "k": int(Kind.BATCH),
        "p": producer,
        "q": session,
        "s": seq,
        "e": epoch,
        "c": _container(datapoint),
        "d": structure,
        "a": [[a.dtype.str, list(a.shape)] for a in arrays],
    }
    return [packb(header), *arrays]


def encode_control(kind: Kind, **fields: Any) -> bytes:
    """A header-only message of ``kind`` with extra short-key fields."""
    return packb({"v": PROTOCOL_VERSION, "k": int(kind), **fields})


# ---------------------------------------------------------------------------------- decoding


class _ArrayRef:
    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


def _ext_hook(code: int, data: bytes) -> _ArrayRef:
    if code != _ARRAY_EXT or len(data) != 4:
        raise DecodeError("bad_structure", f"unknown ext type {code}")
    return _ArrayRef(_U32.unpack(data)[0])


def _buffer(frame: Any) -> memoryview:
    """A byte view of a frame: bytes, or a zmq.Frame received with copy=False."""
    buf = getattr(frame, "buffer", frame)
    mv = memoryview(buf)
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


def decode_header(frame: Any, limits: Limits = DEFAULT_LIMITS) -> dict[str, Any]:
    """Unpack and check a header frame; returns the map. Raises DecodeError."""
    buf = _buffer(frame)
    if len(buf) > limits.max_header_bytes:
        raise DecodeError("header_too_large", f"{len(buf)} bytes")
    n = limits.max_header_bytes
    entries = min(n, max(limits.max_container_len, limits.max_arrays))
    try:
        header = _unpackb(
            buf,
            raw=False,
            strict_map_key=True,
            ext_hook=_ext_hook,
            max_str_len=n,
            max_bin_len=n,
            max_array_len=entries,
            max_map_len=entries,
            max_ext_len=16,
        )
    except DecodeError:
        raise
    except Exception as e:  # msgpack raises several types; all mean "malformed"
        raise DecodeError("bad_msgpack", type(e).__name__) from None
    if not isinstance(header, dict):
        raise DecodeError("bad_header", "not a map")
    if header.get("v") != PROTOCOL_VERSION:
        raise DecodeError("bad_version", repr(header.get("v"))[:32])
    kind = header.get("k")
    if not isinstance(kind, int) or isinstance(kind, bool) or kind not in Kind._value2member_map_:
        raise DecodeError("bad_kind", repr(kind)[:32])
    header["k"] = Kind(kind)
    return header


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int(h: Mapping[str, Any], key: str, lo: int = 0, hi: int = (1 << 63) - 1) -> int:
    v = h.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise DecodeError("bad_header", f"field {key!r}")
    return v


def check_batch_header(header: Mapping[str, Any], nframes: int, limits: Limits) -> list[tuple]:
    """Validate a batch header against the number of array frames; return [(dtype, shape)]."""
    pid = header.get("p")
    if not isinstance(pid, str) or not 0 < len(pid) <= limits.max_id_len:
        raise DecodeError("bad_header", "producer id")
    _int(header, "q")
    _int(header, "s")
    _int(header, "e")
    specs = header.get("a")
    if not isinstance(specs, list):
        raise DecodeError("bad_header", "array specs")
    if len(specs) > limits.max_arrays:
        raise DecodeError("too_many_arrays", str(len(specs)))
    if len(specs) != nframes:
        raise DecodeError("frame_count", f"{len(specs)} specs for {nframes} frames")
    out = []
    for spec in specs:
        if not isinstance(spec, list) or len(spec) != 2 or not isinstance(spec[1], list):
            raise DecodeError("bad_header", "array spec")
        dt = check_dtype(spec[0])
        shape = spec[1]
        if len(shape) > limits.max_ndim:
            raise DecodeError("too_many_dims", str(len(shape)))
        for d in shape:
            if not _is_int(d) or not 0 <= d <= limits.max_message_bytes:
                raise DecodeError("bad_shape", repr(d)[:32])
        _check_extent(shape, dt, limits)
        out.append((dt, tuple(shape)))
    return out


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
) -> list[np.ndarray]:
    bufs = [_buffer(f) for f in frames]
    check_frame_lengths(specs, bufs, limits)
    pairs = zip(specs, bufs, strict=True)
    return [np.frombuffer(b, dtype=dt).reshape(shape) for (dt, shape), b in pairs]


@dataclass(frozen=True)
class Batch:
    """A decoded batch: its metadata and the datapoint (arrays are views on the frames)."""

    producer: str
    session: int
    seq: int
    epoch: int
    datapoint: Any
    nbytes: int


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
        header = decode_header(frames[0], limits)
    if header["k"] != Kind.BATCH:
        raise DecodeError("bad_kind", f"expected BATCH, got {header['k']!r}")
    specs = check_batch_header(header, len(frames) - 1, limits)
    arrays = _arrays_from_frames(specs, frames[1:], limits)
    used = [False] * len(arrays)
    container = header.get("c", CONTAINER_LIST)
    structure = header.get("d")
    try:
        dp = _rebuild(structure, arrays, used, 0, limits.max_depth)
    except RecursionError:
        raise DecodeError("too_deep") from None
    if not all(used):
        raise DecodeError("bad_structure", "unreferenced array frame")
    if container == CONTAINER_TUPLE and isinstance(dp, list):
        dp = tuple(dp)
    elif container == CONTAINER_LIST and not isinstance(dp, list):
        raise DecodeError("bad_structure", "container")
    elif container == CONTAINER_DICT and not isinstance(dp, dict):
        raise DecodeError("bad_structure", "container")
    elif container not in (0, 1, 2, 3):
        raise DecodeError("bad_structure", "container")
    return Batch(
        producer=header["p"],
        session=header["q"],
        seq=header["s"],
        epoch=header["e"],
        datapoint=dp,
        nbytes=sum(a.nbytes for a in arrays),
    )


# ------------------------------------------------------------------ tensorpack compatibility


def _tp_array(m: Mapping[Any, Any], limits: Limits) -> np.ndarray:
    kind = m.get(b"kind", b"")
    if kind not in (b"", ""):
        # b"O" would be pickle.loads, b"V" a structured dtype: refused, never interpreted.
        raise DecodeError("bad_dtype", f"msgpack-numpy kind {kind!r}"[:64])
    dt = check_dtype(m.get(b"type"))
    data = m.get(b"data")
    if not isinstance(data, bytes):
        raise DecodeError("bad_structure", "array data")
    if m.get(b"nd") is False:
        if len(data) != dt.itemsize:
            raise DecodeError("shape_mismatch", "scalar")
        return np.frombuffer(data, dtype=dt).reshape(())
    shape = m.get(b"shape")
    if not isinstance(shape, list) or len(shape) > limits.max_ndim:
        raise DecodeError("bad_shape", "shape")
    count = 1
    for d in shape:
        if not isinstance(d, int) or isinstance(d, bool) or d < 0:
            raise DecodeError("bad_shape", repr(d)[:32])
        count *= d
    _check_extent(shape, dt, limits)
    if count * dt.itemsize != len(data):
        raise DecodeError("shape_mismatch", f"{shape} {dt.str} vs {len(data)} bytes")
    return np.frombuffer(data, dtype=dt).reshape(shape)


def _tp_walk(node: Any, limits: Limits, depth: int, budget: list[int]) -> Any:
    if depth > limits.max_depth:
        raise DecodeError("too_deep")
    if isinstance(node, dict):
        if b"nd" in node:
            budget[0] -= 1
            if budget[0] < 0:
                raise DecodeError("too_many_arrays")
            return _tp_array(node, limits)
        if b"complex" in node:
            raise DecodeError("bad_structure", "complex scalar")
        return {
            (k.decode("utf-8", "replace") if isinstance(k, bytes) else k): _tp_walk(
                v, limits, depth + 1, budget
            )
            for k, v in node.items()
        }
    if isinstance(node, list):
        return [_tp_walk(x, limits, depth + 1, budget) for x in node]
    return node


def decode_tensorpack(frame: Any, limits: Limits = DEFAULT_LIMITS) -> Any:
    """Safely decode one tensorpack ``TENSORPACK_SERIALIZE=msgpack`` datapoint.

    msgpack-numpy's own ``decode`` unpickles object arrays; this never does.
    """
    buf = _buffer(frame)
    if len(buf) > limits.max_message_bytes + limits.max_header_bytes:
        raise DecodeError("message_too_large", f"{len(buf)} bytes")
    n = len(buf)
    try:
        obj = _unpackb(
            buf,
            raw=False,
            strict_map_key=False,
            max_str_len=min(n, limits.max_header_bytes),
            max_bin_len=n,
            max_array_len=min(n, max(limits.max_container_len, limits.max_arrays)),
            max_map_len=min(n, max(limits.max_container_len, limits.max_arrays)),
            max_ext_len=0,
        )
    except Exception as e:
        raise DecodeError("bad_msgpack", type(e).__name__) from None
    try:
        return _tp_walk(obj, limits, 0, [limits.max_arrays])
    except RecursionError:
        raise DecodeError("too_deep") from None

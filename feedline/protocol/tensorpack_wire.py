"""Safe decoding of tensorpack's ``TENSORPACK_SERIALIZE=msgpack`` datapoints.

tensorpack's ``send_dataflow_zmq`` sends one msgpack-numpy frame per datapoint. msgpack-numpy's
own ``decode`` unpickles object arrays; this module never does: it walks the unpacked map,
accepts only the dtypes of :func:`feedline.protocol.codec.check_dtype`, and bounds sizes and counts.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from feedline.protocol.codec import (
    DEFAULT_LIMITS,
    DecodeError,
    Limits,
    check_bools,
    check_dtype,
    unpackb,
)


def _buffer(frame: Any) -> memoryview:
    buf = getattr(frame, "buffer", frame)
    mv = memoryview(buf)
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


def _check_extent(shape: list[int], dt: np.dtype, limits: Limits) -> None:
    extent = dt.itemsize
    for d in shape:
        extent *= max(d, 1)
        if extent > limits.max_message_bytes:
            raise DecodeError("bad_shape", "extent exceeds the message limit")



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
        scalar = np.frombuffer(data, dtype=dt).reshape(())
        if dt.kind == "b":
            check_bools(scalar)
        return scalar
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
    arr = np.frombuffer(data, dtype=dt).reshape(shape)
    if dt.kind == "b":
        check_bools(arr)
    return arr


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
        obj = unpackb(
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

"""A safe, compact serialisation of datapoints (for LMDB files): msgpack plus numeric arrays.

Datapoints are nested lists, tuples and dicts of ``None``, bool, int, float, str, bytes and
numpy arrays / scalars of numeric or bool dtype. Arrays are stored as a msgpack extension
(dtype string, shape, raw bytes). Nothing is ever unpickled: an LMDB file from elsewhere can
be read without trusting it. Tuples come back as lists (as in tensorpack).
"""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np

from feedline.errors import DataError
from feedline.protocol import wire

_ARRAY = 42


def _default(obj: Any) -> Any:
    if isinstance(obj, np.generic):
        obj = np.asarray(obj)
    if isinstance(obj, np.ndarray):
        if obj.dtype.kind not in "biufc" or obj.dtype.fields is not None:
            raise TypeError(f"cannot serialise an array of dtype {obj.dtype}")
        arr = obj if obj.flags.c_contiguous else obj.copy(order="C")  # keeps 0-d shapes
        head = wire.packb([arr.dtype.str, list(arr.shape)])
        return msgpack.ExtType(_ARRAY, head + arr.tobytes())
    raise TypeError(f"cannot serialise {type(obj).__name__}")


def _ext_hook(code: int, data: bytes) -> Any:
    if code != _ARRAY:
        raise DataError(f"unknown extension type {code}")
    unpacker = wire.Unpacker(raw=False)
    unpacker.feed(data)
    dtype_str, shape = unpacker.unpack()
    try:
        dt = wire.check_dtype(dtype_str)  # numeric and bool only: never object arrays
    except wire.DecodeError as e:
        raise DataError(f"refusing dtype {dtype_str!r}") from e
    offset = unpacker.tell()
    return np.frombuffer(data, dtype=dt, offset=offset).reshape(tuple(shape))


def dumps(dp: Any) -> bytes:
    """Serialise one datapoint."""
    return wire.packb(dp, default=_default)


def loads(buf: bytes | memoryview) -> Any:
    """Rebuild a datapoint; arrays are read-only views on ``buf``'s copy."""
    # wire.unpackb is msgpack's own: a process that imported tensorpack (which monkeypatches
    # msgpack to unpickle object arrays) still never unpickles what an LMDB file holds.
    return wire.unpackb(buf, ext_hook=_ext_hook, raw=False, strict_map_key=False)

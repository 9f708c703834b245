"""A shard record's fields as datapoint components, the way the other sources give them.

Image bytes (and any other opaque bytes) become a 1-D uint8 array that remembers where it
came from (:class:`~feedline.producer.dataflow.image_folder.FileBytes`, ``shard#key.ext``),
so that a decoder's error names the record; a class label becomes an int, JSON an object,
text a str. A field that is missing or does not parse is a resumable
:class:`~feedline.producer.shards.records.CorruptRecord` naming the record, and nothing
else: the bytes are hostile (``tests/shards/test_shards_fuzz.py`` holds every decoder to that). JSON
nested deeper than :data:`MAX_JSON_DEPTH` is corrupt too: Python's parser recurses, and a
datapoint that deep could not be sent anyway (the wire takes 16 levels).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from feedline.producer.dataflow.image_folder import _file_bytes
from feedline.producer.shards.records import CorruptRecord

INT_EXTS = ("cls", "cls2", "class", "label", "index", "idx", "id")
TEXT_EXTS = ("txt", "text")
MAX_JSON_DEPTH = 64  # arrays and objects inside each other in one .json field
_TOO_DEEP = object()


def _json_depth(obj: Any, limit: int) -> int:
    """How deep ``obj`` nests, counted without recursion, up to ``limit + 1``."""
    if not isinstance(obj, (list, dict)):
        return 0
    deepest, stack = 0, [(obj, 1)]
    while stack:
        node, d = stack.pop()
        if d > limit:
            return d
        deepest = max(deepest, d)
        stack.extend((v, d + 1) for v in (node.values() if isinstance(node, dict) else node)
                     if isinstance(v, (list, dict)))  # containers only: scalars cannot nest
    return deepest


def json_field(data: bytes, where: str) -> Any:
    """A ``.json`` member as an object; CorruptRecord if it does not parse or nests deeper
    than MAX_JSON_DEPTH."""
    # Fewer brackets than the limit cannot nest past it: most fields skip the depth walk.
    deep = data.count(b"[") + data.count(b"{") > MAX_JSON_DEPTH
    try:
        obj = json.loads(data)
    except RecursionError:  # deeper than the interpreter's stack allows
        deep, obj = True, _TOO_DEEP
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, a 5000-digit int
        raise CorruptRecord(where, f"not JSON: {e}", True) from None
    if deep and (obj is _TOO_DEEP or _json_depth(obj, MAX_JSON_DEPTH) > MAX_JSON_DEPTH):
        raise CorruptRecord(where, f"JSON nested deeper than {MAX_JSON_DEPTH} levels", True)
    return obj


def as_array(data: bytes | bytearray, where: str) -> np.ndarray:
    return _file_bytes(np.frombuffer(data, np.uint8), where)


def wds_field(ext: str, data: bytes, where: str) -> Any:
    """A WebDataset member by its extension (the last dotted part decides)."""
    last = ext.rsplit(".", 1)[-1]
    try:
        if last in INT_EXTS:
            return int(data.decode("ascii").strip())
        if last == "json":
            return json_field(data, where)
        if last in TEXT_EXTS:
            return data.decode("utf-8")
    except (ValueError, UnicodeDecodeError) as e:
        raise CorruptRecord(where, f"field {ext}: {e}", True) from None
    return as_array(data, where)


def pick(sample: Mapping[str, Any], spec: str, where: str) -> tuple[str, Any]:
    """The first of ``spec``'s alternatives (``jpg;jpeg;png``) the sample has."""
    for alt in spec.split(";"):
        if alt in sample:
            return alt, sample[alt]
    raise CorruptRecord(where, f"no field {spec!r} (it has {sorted(sample)})", True)


def feature(values: Any, key: str, where: str) -> Any:
    """A tf.train.Example feature: one bytes -> uint8 array, one int -> int, a list of ints
    -> int64 array, floats -> float32 array (one -> float), several bytes -> list."""
    if isinstance(values, np.ndarray):
        return float(values[0]) if values.size == 1 else values
    if not isinstance(values, Sequence) or not values:
        raise CorruptRecord(where, f"feature {key!r} is empty", True)
    if isinstance(values[0], bytes):
        return as_array(values[0], f"{where}:{key}") if len(values) == 1 else list(values)
    return int(values[0]) if len(values) == 1 else np.asarray(values, np.int64)


def column_value(value: Any, where: str) -> Any:
    """A Parquet cell: bytes -> uint8 array, everything else as pyarrow gives it."""
    return as_array(value, where) if isinstance(value, (bytes, bytearray)) else value

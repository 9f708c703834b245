"""A shard record's fields as datapoint components, the way the other sources give them.

Image bytes (and any other opaque bytes) become a 1-D uint8 array that remembers where it
came from (:class:`~feedline.producer.dataflow.image_folder.FileBytes`, ``shard#key.ext``),
so that a decoder's error names the record; a class label becomes an int, JSON an object,
text a str. A field that is missing or does not parse is a resumable
:class:`~feedline.producer.shards.records.CorruptRecord` naming the record, and nothing
else: the bytes are hostile (``tests/shards/test_shards_fuzz.py`` holds every decoder to that).

A field is also corrupt where the wire could not carry it in a batch: an integer (a label,
or a number in JSON) that does not fit int64; JSON nested deeper than
:data:`MAX_JSON_DEPTH` (the wire's :data:`~feedline.protocol.codec.MAX_DEPTH` less the
:data:`FIELD_DEPTH` levels a batch puts above a field; Python's parser recurses, too); a JSON
array or object of more entries than a receiver takes in one container
(``Limits.max_container_len``). Counted and named where it was read, not found when the
batch is sent.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from feedline.errors import DataError
from feedline.producer.dataflow.image_folder import _file_bytes
from feedline.producer.shards.records import CorruptRecord
from feedline.protocol.codec import DEFAULT_LIMITS, MAX_DEPTH

INT_EXTS = ("cls", "cls2", "class", "label", "index", "idx", "id")
TEXT_EXTS = ("txt", "text")
# The levels above a field's value in a batch: the batch's list of components, and the list
# of a component's values (``batch: {use_list: true}``, how JSON and text are batched).
FIELD_DEPTH = 2
# Arrays and objects inside each other in one .json field: what the wire carries in a batch
# (its scalars sit one level deeper still).
MAX_JSON_DEPTH = MAX_DEPTH - FIELD_DEPTH
MAX_JSON_ENTRIES = DEFAULT_LIMITS.max_container_len  # entries of one JSON array or object
INT64 = (-(2**63), 2**63)  # the integers a field may hold: [lo, hi)
_TOO_DEEP = object()


class _Unsendable(DataError):
    """A JSON value the wire cannot carry (raised inside the parser)."""


def check_int(v: int) -> int:
    """``v`` if it fits int64 (what a batch stacks labels into), else DataError (a
    ValueError)."""
    if not INT64[0] <= v < INT64[1]:
        raise DataError(f"{v} does not fit int64")
    return v


def _json_int(text: str) -> int:
    try:
        return check_int(int(text))
    except ValueError:  # past int64, or past Python's 4300 digits
        shown = text if len(text) <= 30 else f"{text[:12]}... ({len(text)} digits)"
        raise _Unsendable(f"an integer that does not fit int64: {shown}") from None


def _json_shape(obj: Any, limit: int) -> tuple[int, int]:
    """(how deep ``obj`` nests, up to ``limit + 1``; the most entries of one of its
    containers), counted without recursion."""
    if not isinstance(obj, (list, dict)):
        return 0, 0
    deepest, widest, stack = 0, 0, [(obj, 1)]
    while stack:
        node, d = stack.pop()
        if d > limit:
            return d, widest
        deepest, widest = max(deepest, d), max(widest, len(node))
        stack.extend((v, d + 1) for v in (node.values() if isinstance(node, dict) else node)
                     if isinstance(v, (list, dict)))  # containers only: scalars cannot nest
    return deepest, widest


def json_field(data: bytes, where: str) -> Any:
    """A ``.json`` member as an object; CorruptRecord if it does not parse, nests deeper
    than MAX_JSON_DEPTH, has a container of more than MAX_JSON_ENTRIES entries or an
    integer that does not fit int64."""
    # Fewer brackets or commas than the limits cannot reach them: most fields skip the walk.
    brackets = data.count(b"[") + data.count(b"{")
    walk = brackets > MAX_JSON_DEPTH or data.count(b",") >= MAX_JSON_ENTRIES
    try:
        obj = json.loads(data, parse_int=_json_int)
    except RecursionError:  # deeper than the interpreter's stack allows
        walk, obj = True, _TOO_DEEP
    except _Unsendable as e:
        raise CorruptRecord(where, f"JSON with {e}", True) from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise CorruptRecord(where, f"not JSON: {e}", True) from None
    if walk:
        depth, entries = (MAX_JSON_DEPTH + 1, 0) if obj is _TOO_DEEP else \
            _json_shape(obj, MAX_JSON_DEPTH)
        if depth > MAX_JSON_DEPTH:
            raise CorruptRecord(where, f"JSON nested deeper than {MAX_JSON_DEPTH} levels (what "
                                "the wire carries in a batch)", True)
        if entries > MAX_JSON_ENTRIES:
            raise CorruptRecord(where, f"JSON with a container of {entries} entries (a batch "
                                f"carries at most {MAX_JSON_ENTRIES})", True)
    return obj


def as_array(data: bytes | bytearray, where: str) -> np.ndarray:
    return _file_bytes(np.frombuffer(data, np.uint8), where)


def wds_field(ext: str, data: bytes, where: str) -> Any:
    """A WebDataset member by its extension (the last dotted part decides)."""
    last = ext.rsplit(".", 1)[-1]
    try:
        if last in INT_EXTS:
            return check_int(int(data.decode("ascii").strip()))
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
        if len(values) > MAX_JSON_ENTRIES:
            raise CorruptRecord(where, f"feature {key!r} has {len(values)} byte strings (a "
                                f"batch carries at most {MAX_JSON_ENTRIES} in one list)", True)
        return as_array(values[0], f"{where}:{key}") if len(values) == 1 else list(values)
    return int(values[0]) if len(values) == 1 else np.asarray(values, np.int64)


def column_value(value: Any, where: str) -> Any:
    """A Parquet cell: bytes -> uint8 array, everything else as pyarrow gives it."""
    return as_array(value, where) if isinstance(value, (bytes, bytearray)) else value

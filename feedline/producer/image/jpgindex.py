"""JPEG side indexes: random access into JPEGs as they are, with no transcoding.

A baseline JPEG's Huffman-coded data can only be read from its start, so a crop's decode
entropy-decodes every block of every row above and inside it. An index records, for every
MCU row and every ``step`` MCUs within it, the bit where that MCU starts and each
component's DC prediction there (``_jpgidx.c`` has the format). With it, the fused decoder
(:func:`feedline.producer.image.turbo.decode_box`, and so the presets) entropy-decodes only
the MCU rows under the crop, and in them only from the entry left of the crop to the entry
right of it: the same pixels as without it. The JPEG itself stays byte for byte what it
was; the index is a small side file (about 3% of the file at ``step`` 4).

Where it is written: ``feedline index FOLDER`` (``PATH.jpgidx`` beside each JPEG of an image
folder), ``feedline convert --index-jpeg`` (a member ``KEY.jpgidx`` beside each JPEG) and
``feedline lmdb build --index-jpeg``. In code::

    from feedline.producer.image.jpgindex import build_index
    index = build_index(jpeg_bytes)     # bytes, or None where the file is not indexable

An index holds its file's checksum: it never applies to another file; and its own, so that
one damaged where it is stored (a bit flipped in a shard, bytes lost) is refused rather than
decoded by. One that does not fit (another file's, truncated, edited) is refused before
anything is decoded by it, with a warning naming the file, and the image decodes without it
(:func:`~feedline.producer.image.turbo.index_refusals` counts those decodes).

Not indexable (None): progressive files, files with restart markers (``feedline lmdb build
--prepare-jpeg`` makes those; they need no index), arithmetic-coded, 12-bit or lossless
ones, and files whose optimised Huffman tables cannot code a segment's first DC value; they
decode as they do without an index.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

from feedline.errors import ConfigError, FeedlineError
from feedline.producer.image.decode import CorruptImage, as_buffer, name_of
from feedline.producer.image.turbo import _MISSING, Unsupported, _jpegturbo, refused_index

AVAILABLE = _jpegturbo is not None
# The suffix of a side index: PATH.jpgidx beside PATH, member KEY.jpgidx beside KEY.jpg.
SUFFIX = ".jpgidx"
# MCUs per index entry within a row: 4 measured the best trade between the index's size and
# the MCUs entropy-decoded left and right of a crop for nothing (docs/performance.md).
DEFAULT_STEP = 4
# An index is a few percent of its file; anything far larger is not one.
MAX_INDEX_BYTES = 1 << 24


class BadIndex(FeedlineError):
    """An index that does not fit its JPEG (another file's, truncated, edited)."""


class IndexInfo(NamedTuple):
    """What a checked index covers: the file's MCU grid and the entries' spacing."""

    mcu_cols: int
    mcu_rows: int
    step: int
    entries: int


class Indexing(NamedTuple):
    """What :func:`index_jpeg` made: ``jpgidx``, the index (None where the file is not
    indexable: ``note`` says why)."""

    jpgidx: bytes | None
    note: str


def _need() -> Any:
    if _jpegturbo is None:
        raise Unsupported(f"JPEG indexes need the compiled extension ({_MISSING})")
    return _jpegturbo


def index_jpeg(data: Any, step: int = DEFAULT_STEP, source: Any = None) -> Indexing:
    """The index of one image (bytes, bytearray, memoryview or a uint8 array), or None and
    why not (not a JPEG, not a baseline JPEG, ...). :class:`CorruptImage` (naming the file
    of ``source``) for a JPEG whose entropy-coded data does not decode."""
    jt = _need()
    if not 1 <= step <= 255:
        raise ConfigError(f"step must be 1..255 MCUs, got {step}")
    buf = as_buffer(data)
    if buf.size < 2 or buf[0] != 0xFF or buf[1] != 0xD8:
        return Indexing(None, "not a JPEG")
    try:
        index, note = jt.index_build(buf, step)
    except jt.CorruptJPEG as e:
        raise CorruptImage(f"{name_of(data if source is None else source)}: {e}") from e
    return Indexing(index, note)


def build_index(data: Any, step: int = DEFAULT_STEP) -> bytes | None:
    """The index of ``data``, or None where it is not indexable (:func:`index_jpeg` says
    why). Stable entry point for dataset writers."""
    return index_jpeg(data, step).jpgidx


def check_index(data: Any, index: Any) -> IndexInfo:
    """Whether ``index`` fits the JPEG ``data`` (its checksum, frame and every entry):
    :class:`IndexInfo`, or :class:`BadIndex` saying why not."""
    jt = _need()
    try:
        return IndexInfo(*jt.index_check(as_buffer(data), as_buffer(index)))
    except jt.BadIndex as e:
        raise BadIndex(f"{name_of(data)}: {e}") from e


def seal(index: Any) -> bytes:
    """``index`` with its own checksum (its last 8 bytes) made right again: for tests and
    fuzzing that edit an index's entries and must reach the checks behind that checksum."""
    return bytes(_need().index_seal(as_buffer(index)))


def index_path(image: str | Path) -> Path:
    """Where the side index of an image file lives: ``PATH.jpgidx``."""
    return Path(f"{image}{SUFFIX}")


def load_index(image: str | Path) -> bytes | None:
    """The side index of an image file, or None if it has none. Not checked here: the
    decoder checks it against the file's bytes and decodes without it if it does not fit."""
    try:
        with open(index_path(image), "rb") as f:
            data = f.read(MAX_INDEX_BYTES + 1)
    except (FileNotFoundError, NotADirectoryError):
        return None
    if len(data) > MAX_INDEX_BYTES:
        refused_index(str(image), f"{index_path(image)} is over {MAX_INDEX_BYTES} bytes, "
                      "not a JPEG index")
        return None
    return data

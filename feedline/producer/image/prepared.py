"""Prepared JPEGs: transcoded losslessly when a dataset is written, so that a crop decodes
only the blocks it needs.

A JPEG's Huffman-coded data can only be read from the start: to decode a crop, libjpeg must
entropy-decode every block of every row down to the crop's last, and on photos that is most of
the work. :func:`prepare_jpeg` rewrites a JPEG once, at the coefficient level (nothing is
requantised: every decoder gives the same pixels as from the original), as one baseline scan
with a restart marker after every MCU (so each MCU starts on a byte boundary with its DC
predictions reset), Huffman tables optimised for the image (they pay back most of what the
markers cost), and an MCU index: an APP9 segment with where each MCU row starts in the scan.
The fused decoder (:func:`feedline.producer.image.turbo.decode_box`, and so the presets) sees
the index and decodes a JPEG made of just the MCUs under the crop; other decoders skip the
segment. Files without an index decode as before.

Use it where a dataset is written: ``feedline lmdb build --prepare-jpeg``, or in a converter::

    from feedline.producer.image.prepared import prepare_jpeg
    stored = prepare_jpeg(jpeg_bytes)   # bytes; the input unchanged if not preparable

The same pixels, always: a prepared file decodes, by any decoder, to the pixels of its
original, and the fused decoder's crop of it equals a full decode's crop (docs/pipelines.md,
"Prepared JPEGs", has the measurements). Progressive files become baseline (the same
coefficients); the few progressive files whose scans stop before the last bit of some
coefficients are left as they are (libjpeg smooths such blocks, a baseline copy would not), as
are CMYK/YCCK JPEGs (OpenCV decodes those) and anything that is not a JPEG.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from feedline.producer.image.decode import MAX_PIXELS, CorruptImage, as_buffer, name_of
from feedline.producer.image.turbo import _MISSING, Unsupported, _jpegturbo

AVAILABLE = _jpegturbo is not None


@dataclass(frozen=True)
class Preparation:
    """What :func:`prepare` made: ``data`` is the prepared JPEG when ``prepared``, else the
    input's bytes unchanged and ``note`` says why."""

    data: bytes
    prepared: bool
    note: str = ""


def prepare(data: Any, optimize: bool = True, max_pixels: int = MAX_PIXELS,
            source: Any = None) -> Preparation:
    """Prepare one image (bytes, bytearray, memoryview or a uint8 array).

    Not a JPEG, a CMYK/YCCK JPEG, an incompletely refined progressive one, a 12-bit or
    lossless JPEG (libjpeg's 8-bit transcoder cannot read it; OpenCV may still decode it):
    returned unchanged (``prepared`` False, ``note`` says which). :class:`CorruptImage`
    (naming the file of ``source``) for a JPEG that does not decode or declares more than
    ``max_pixels``; :class:`~feedline.producer.image.turbo.Unsupported` where the extension
    is not built (preparing needs libjpeg's transcoder).
    ``optimize=False`` keeps the standard Huffman tables: faster, a few percent larger.
    """
    buf = as_buffer(data)
    if buf.size < 2 or buf[0] != 0xFF or buf[1] != 0xD8:
        return Preparation(buf.tobytes(), False, "not a JPEG")
    if _jpegturbo is None:
        raise Unsupported(f"preparing JPEGs needs the compiled extension ({_MISSING})")
    try:
        out, note = _jpegturbo.prepare(buf, optimize, max_pixels)
    except _jpegturbo.Unsupported as e:  # a JPEG process it does not read: kept, as CMYK is
        return Preparation(buf.tobytes(), False, str(e))
    except _jpegturbo.CorruptJPEG as e:
        raise CorruptImage(f"{name_of(data if source is None else source)}: {e}") from e
    if out is None:
        return Preparation(buf.tobytes(), False, note)
    return Preparation(out, True)


def prepare_jpeg(data: Any, optimize: bool = True, max_pixels: int = MAX_PIXELS) -> bytes:
    """The prepared JPEG of ``data``, or its bytes unchanged where it is not a JPEG this
    prepares (see :func:`prepare`, which also says why). Stable entry point for dataset
    writers; raises :class:`CorruptImage` for a JPEG that does not decode."""
    return prepare(data, optimize, max_pixels).data


def is_prepared(data: Any) -> bool:
    """Whether ``data`` carries an MCU index (that fits it: an index that does not is a
    :class:`CorruptImage`). False where the extension is not built."""
    if _jpegturbo is None:
        return False
    try:
        return _jpegturbo.index_info(as_buffer(data)) is not None
    except _jpegturbo.CorruptJPEG as e:
        raise CorruptImage(f"{name_of(data)}: {e}") from e

"""Decoding image bytes with OpenCV, at full or reduced scale; errors that name the file.

libjpeg can decode a JPEG at 1/2, 1/4 or 1/8 of its size by scaling in the DCT domain
(``cv2.IMREAD_REDUCED_COLOR_2/4/8``): several times less work than a full decode followed by a
resize, and a proper low-pass filter. :func:`reduction_for` picks the largest factor that
still leaves at least the pixels the caller is going to keep, so the result is only ever
shrunk further, never enlarged: what the model sees stays equivalent.

EXIF orientation is ignored (``IMREAD_IGNORE_ORIENTATION``): pixels are used as stored, as by
tf.data, PIL and the fused decoder (:mod:`feedline.producer.image.turbo`), so a crop box drawn from
the
frame header's size fits the decoded image, and the decoders agree.
"""

from __future__ import annotations

from typing import Any

import cv2
import numpy as np

from feedline.errors import ConfigError
from feedline.errors import CorruptImage as CorruptImage

_FLAGS = {r: f | cv2.IMREAD_IGNORE_ORIENTATION for r, f in [
    (1, cv2.IMREAD_COLOR), (2, cv2.IMREAD_REDUCED_COLOR_2), (4, cv2.IMREAD_REDUCED_COLOR_4),
    (8, cv2.IMREAD_REDUCED_COLOR_8)]}
# The largest width x height decoded (a 9500x7100 photo): a few hundred bytes can declare a
# 65535x65535 JPEG, and OpenCV's own limit (2**30 pixels) is a 3 GB image.
MAX_PIXELS = 1 << 26
# SOFn markers that carry the frame size (not DHT C4, JPG C8, DAC CC).
_SOF = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}


def name_of(data: Any) -> str:
    """How an error names the image ``data`` came from: the path it carries (a path string,
    or the ``path`` of :class:`~feedline.producer.dataflow.image_folder.FileBytes`), else its size
    in
    bytes."""
    if isinstance(data, str):
        return data
    path = getattr(data, "path", None)
    if path:
        return str(path)
    size = getattr(data, "size", None) if isinstance(data, np.ndarray) else \
        len(data) if isinstance(data, (bytes, bytearray, memoryview)) else None
    return f"{size} bytes" if size is not None else "image"


def as_buffer(data: Any) -> np.ndarray:
    """Bytes, bytearray, memoryview or a uint8 array -> a 1-D uint8 array (no copy)."""
    if isinstance(data, np.ndarray):
        if data.dtype != np.uint8:
            raise CorruptImage(f"image bytes must be uint8, got {data.dtype}")
        return data.reshape(-1)
    if isinstance(data, (bytes, bytearray, memoryview)):
        return np.frombuffer(data, np.uint8)
    if isinstance(data, str):
        with open(data, "rb") as f:
            return np.frombuffer(f.read(), np.uint8)
    raise CorruptImage(f"cannot decode a {type(data).__name__}")


def jpeg_size(buf: np.ndarray) -> tuple[int, int] | None:
    """``(height, width)`` from a JPEG's frame header without decoding; None if not a JPEG
    (or the header is not found in the first 64 KiB)."""
    b = buf[: 1 << 16].tobytes()
    if len(b) < 4 or b[0] != 0xFF or b[1] != 0xD8:
        return None
    i = 2
    while i + 9 < len(b):
        if b[i] != 0xFF:
            return None
        marker = b[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker in (0xD8, 0x01) or 0xD0 <= marker <= 0xD7:
            i += 2
            continue
        length = (b[i + 2] << 8) | b[i + 3]
        if marker in _SOF:
            h = (b[i + 5] << 8) | b[i + 6]
            w = (b[i + 7] << 8) | b[i + 8]
            return (h, w) if h and w else None
        if marker == 0xDA or length < 2:  # start of scan before any frame header
            return None
        i += 2 + length
    return None


def reduction_for(src_hw: tuple[int, int], keep_hw: tuple[float, float],
                  out_hw: tuple[int, int]) -> int:
    """The largest DCT scale factor (1, 2, 4 or 8) such that a region of ``keep_hw`` pixels
    of the source still has at least ``out_hw`` pixels after reduction."""
    for r in (8, 4, 2):
        if keep_hw[0] / r >= out_hw[0] and keep_hw[1] / r >= out_hw[1] \
                and src_hw[0] >= 8 * r and src_hw[1] >= 8 * r:
            return r
    return 1


def declared_size(buf: np.ndarray) -> tuple[int, int] | None:
    """``(height, width)`` a JPEG's frame header or a PNG's IHDR declares, else None."""
    if buf.size >= 24 and buf[:8].tobytes() == b"\x89PNG\r\n\x1a\n":
        w, h = int.from_bytes(buf[16:20].tobytes(), "big"), int.from_bytes(buf[20:24].tobytes(),
                                                                           "big")
        return h, w
    return jpeg_size(buf)


def decode(data: Any, reduce: int = 1, source: Any = None,
           max_pixels: int = MAX_PIXELS) -> np.ndarray:
    """Decode to an HxWx3 uint8 BGR array (OpenCV's order), at ``1/reduce`` scale.

    A reduced image is ``ceil(h / reduce) x ceil(w / reduce)``. Raises
    :class:`CorruptImage` (a :class:`SampleError`: skippable) if the bytes do not decode or
    declare more than ``max_pixels`` (JPEG and PNG; checked before anything is allocated),
    naming the file of ``source`` (or of ``data``; see :func:`name_of`).
    """
    if reduce not in _FLAGS:
        raise ConfigError(f"reduce must be 1, 2, 4 or 8, got {reduce!r}")
    buf = as_buffer(data)
    src = data if source is None else source
    if buf.size == 0:
        raise CorruptImage(f"{name_of(src)}: empty image")
    hw = declared_size(buf)
    if hw is not None and hw[0] * hw[1] > max_pixels:
        raise CorruptImage(f"{name_of(src)}: declares {hw[1]}x{hw[0]} pixels, over the limit "
                           f"of {max_pixels}")
    img = cv2.imdecode(buf, _FLAGS[reduce])
    if img is None:
        where = name_of(src)
        what = where if where.endswith(" bytes") else f"{where} ({buf.size} bytes)"
        raise CorruptImage(f"cannot decode {what} as an image")
    return img


def to_rgb(img: np.ndarray) -> np.ndarray:
    """BGR -> RGB (a new contiguous array)."""
    return cv2.cvtColor(img, cv2.COLOR_BGR2RGB)

"""Fused crop-and-scale JPEG decoding: only the crop's region, at the smallest DCT scale M/8.

A crop of ``ch x cw`` source pixels resized to ``out_h x out_w`` does not need every pixel
of the JPEG. libjpeg-turbo scales in the IDCT by any M/8 (M = 1..8), skips the rows above
the crop (``jpeg_skip_scanlines``), decodes only the iMCU columns that hold it
(``jpeg_crop_scanline``) and stops below it. :func:`plan` picks the smallest M whose scaled
crop is still at least the output size on both sides (never enlarged: the remaining resize
is a shrink of less than 2x, or of any factor at M = 1), and the region of the scaled image
that covers the crop plus the pixels the final resize reads around it. :func:`decode_box`
runs the plan through the compiled extension (``_jpegturbo.c``) and resizes. A prepared JPEG
(:mod:`.prepared`: restart markers after every MCU and an MCU index) is decoded from the
MCUs under the region only, instead of every row down to it: the same pixels.

The extension is optional: :data:`AVAILABLE` is False where it was not built (no compiler or
no libjpeg-turbo headers at install time) and the presets decode with OpenCV instead;
:func:`decoder_info` says which. EXIF orientation is ignored, as by OpenCV with
``IMREAD_IGNORE_ORIENTATION``, tf.data and PIL: pixels are used as stored.
"""

from __future__ import annotations

import logging
import math
import threading
from typing import Any, NamedTuple

import cv2
import numpy as np

from feedline.errors import ConfigError, FeedlineError
from feedline.producer.image.decode import MAX_PIXELS, CorruptImage, name_of
from feedline.producer.image.geometry import resize

try:
    from feedline.producer.image import _jpegturbo  # type: ignore[attr-defined]
except ImportError as e:  # not built: OpenCV decodes (see setup.py)
    _jpegturbo = None
    _MISSING = (f"libjpeg-turbo extension not built: {e}" if not isinstance(
        e, ModuleNotFoundError) else "libjpeg-turbo extension not built: the install found no "
        "C compiler or no libjpeg-turbo headers (jpeglib.h)")
else:
    _MISSING = ""

AVAILABLE = _jpegturbo is not None
log = logging.getLogger(__name__)
# Progressive files have ~10 scans; thousands of tiny ones only cost CPU.
MAX_SCANS = 256
# The scales planned by default: libjpeg-turbo has SIMD IDCTs for 8/8, 4/8, 2/8 and 1/8 only;
# 3/8 and 5/8..7/8 run plain-C IDCTs (chroma at up to 14x14) and measured slower than the next
# of these (docs/pipelines.md), so a box that 3/8 would fit is decoded at 4/8, and so on.
FAST_SCALES = (1, 2, 4, 8)
# Columns more than needed on each side of a horizontal crop: libjpeg-turbo's fancy
# upsampling of subsampled chroma treats a crop's first column (and its last one, at an even
# position) as the image edge, so those pixels differ from a full decode; they are never used.
EDGE = 1


class Unsupported(FeedlineError):
    """A JPEG this decoder does not handle (CMYK/YCCK, 12-bit, lossless): decode otherwise."""


def decoder_info() -> str:
    """Which JPEG decoder the presets use, in words (for ``feedline --version`` and logs)."""
    if _jpegturbo is not None:
        return f"libjpeg-turbo {_jpegturbo.LIBJPEG_TURBO_VERSION}, fused crop+scale"
    return f"OpenCV {cv2.__version__} ({_MISSING})"


class Plan(NamedTuple):
    """How to decode a box: at ``scale``/8, the rows ``[r0, r1)`` and columns ``[c0, c1)`` of
    the scaled image (``scaled_hw``); ``box`` is the crop in those scaled pixels
    ``(y0, x0, y1, x1)``, fractional. (A named tuple: made once per image, it costs a
    fraction of a frozen dataclass.)"""

    scale: int
    scaled_hw: tuple[int, int]
    r0: int
    c0: int
    r1: int
    c1: int
    box: tuple[float, float, float, float]


def dct_scale(box_hw: tuple[float, float], out_hw: tuple[int, int],
              scales: tuple[int, ...] = FAST_SCALES) -> int:
    """The smallest M of ``scales`` (within 1..8) with ``box * M / 8 >= out`` on both sides;
    the largest of them if none is."""
    need = max(8 * out_hw[0] / box_hw[0], 8 * out_hw[1] / box_hw[1]) - 1e-9
    best = 0
    for m in scales:
        if m >= need and (best == 0 or m < best):
            best = m
    return best or max(scales)


def plan(src_hw: tuple[int, int], box: tuple[float, float, float, float],
         out_hw: tuple[int, int], scales: tuple[int, ...] = FAST_SCALES) -> Plan:
    """The decode of ``box = (y0, x0, y1, x1)`` (source pixels, within ``src_hw``) for an
    ``out_hw`` output: the DCT scale (:func:`dct_scale`), and the scaled image's region that
    holds the box and every pixel the final resize reads (bilinear: one around)."""
    h, w = src_hw
    y0, x0, y1, x1 = box
    if not (0 <= y0 < y1 <= h and 0 <= x0 < x1 <= w):
        raise ConfigError(f"box {box} is not inside a {h}x{w} image")
    if scales is not FAST_SCALES and (not scales or not all(1 <= m <= 8 for m in scales)):
        raise ConfigError(f"scales must be in 1..8, got {scales}")
    m = dct_scale((y1 - y0, x1 - x0), out_hw, scales)
    s = m / 8
    sh, sw = -(-h * m // 8), -(-w * m // 8)
    b = (y0 * s, x0 * s, y1 * s, x1 * s)
    r0, r1 = max(0, math.floor(b[0]) - 1), min(sh, math.ceil(b[2]) + 1)
    c0, c1 = max(0, math.floor(b[1]) - 1), min(sw, math.ceil(b[3]) + 1)
    return Plan(m, (sh, sw), r0, c0, r1, c1, b)


def decode_box(data: np.ndarray, src_hw: tuple[int, int], box: tuple[float, float, float,
               float], out_hw: tuple[int, int], bgr: bool = True, source: Any = None,
               max_pixels: int = MAX_PIXELS, scales: tuple[int, ...] = FAST_SCALES,
               flip: bool = False, index: Any = None) -> np.ndarray:
    """Decode the ``box`` of a JPEG whose header says ``src_hw``, resized to ``out_hw``
    (``HxWx3`` uint8, BGR unless ``bgr`` is False, mirrored left-right if ``flip``).

    The result is what a full decode, a crop and :func:`~feedline.producer.image.geometry.resize`
    give, computed from fewer pixels: identical when no DCT scaling applies (M = 8) and the
    box is whole pixels. A prepared JPEG (:mod:`.prepared`: it carries an MCU index) is
    decoded from the MCUs under the region only; the pixels are the same. Raises
    :class:`CorruptImage` if the data does not decode (or its MCU index does not fit it),
    naming the file of ``source`` (the object the bytes came from, see
    :func:`.decode.name_of`), and :class:`Unsupported` for a JPEG this decoder leaves to
    OpenCV. Needs the extension (:data:`AVAILABLE`).

    ``index``: the JPEG's side index (:mod:`.jpgindex`), or None. With it, only the MCUs
    under the region are entropy-decoded; the pixels are the same. An index that does not
    fit the file is refused before it is used (a warning names the file, once) and the file
    decodes without it.
    """
    if _jpegturbo is None:
        raise Unsupported(_MISSING)
    p = plan(src_hw, box, out_hw, scales)
    # One more column each side (never used, see EDGE), unless at the image's edge.
    qc0, qc1 = max(0, p.c0 - EDGE), min(p.scaled_hw[1], p.c1 + EDGE)
    try:
        try:
            px, xs, width, ih, iw = _jpegturbo.decode(
                data, p.scale, p.r0, qc0, p.r1 - p.r0, qc1 - qc0, bgr, max_pixels, MAX_SCANS,
                index)
        except _jpegturbo.BadIndex as e:
            refused_index(_name(source, data), str(e))
            px, xs, width, ih, iw = _jpegturbo.decode(
                data, p.scale, p.r0, qc0, p.r1 - p.r0, qc1 - qc0, bgr, max_pixels, MAX_SCANS)
    except _jpegturbo.Unsupported as e:
        raise Unsupported(str(e)) from e
    except _jpegturbo.CorruptJPEG as e:
        raise CorruptImage(f"{_name(source, data)}: {e}") from e
    if ih != src_hw[0] or iw != src_hw[1]:
        raise CorruptImage(f"{_name(source, data)}: the frame header says {src_hw[1]}x"
                           f"{src_hw[0]}, libjpeg decodes {iw}x{ih}")
    region = np.frombuffer(px, np.uint8).reshape(p.r1 - p.r0, width, 3)[:, p.c0 - xs:p.c1 - xs]
    y0, x0, y1, x1 = p.box
    y0, x0, y1, x1 = y0 - p.r0, x0 - p.c0, y1 - p.r0, x1 - p.c0  # the box in the region
    oh, ow = out_hw
    if y0.is_integer() and x0.is_integer() and y1.is_integer() and x1.is_integer():
        # Whole pixels: what the full-decode path does (at 8/8, the very same pixels).
        return resize(region[int(y0):int(y1), int(x0):int(x1)], ow, oh, flip)
    fy, fx = (y1 - y0) / oh, (x1 - x0) / ow
    if max(fy, fx) <= 2.0:
        # Bilinear at the exact positions: a shrink of less than 2x aliases no more than the
        # full-decode path's own bilinear resize below 2x.
        out = _jpegturbo.resample(region, y0, x0, fy, fx, oh, ow, flip)
        return np.frombuffer(out, np.uint8).reshape(oh, ow, 3)
    # A shrink of 2x or more (at 1/8 only): area averaging of the box rounded to pixels,
    # which moves it by less than a quarter of an output pixel.
    (a, b), (c, d) = _whole(y0, y1, region.shape[0]), _whole(x0, x1, region.shape[1])
    out = cv2.resize(region[a:b, c:d], (ow, oh), interpolation=cv2.INTER_AREA)
    return cv2.flip(out, 1) if flip else out


_refused: set[str] = set()
_refusals = 0  # every decode whose index was refused, in this process
_refusals_lock = threading.Lock()  # map threads decode at once


def index_refusals() -> int:
    """How many decodes of this process found their side index refused (damaged, another
    file's, ...) and decoded the image without it: the pixels are right, the time is a
    plain decode's. Each file's first is also a WARNING naming it."""
    return _refusals


def refused_index(source: str, why: str) -> None:
    """Counts a refused side index (:func:`index_refusals`) and logs it, once per file (the
    file then decodes without it)."""
    global _refusals
    with _refusals_lock:
        _refusals += 1
        count = _refusals
        if source in _refused:
            return
        if len(_refused) < 10000:  # bounded: a dataset of bad indexes warns for its first files
            _refused.add(source)
    log.warning("%s: %s; decoded without it, %d refused in this process (rebuild the index: "
                "feedline index, or convert / lmdb build --index-jpeg)", source, why,
                count)


def _whole(lo: float, hi: float, size: int) -> tuple[int, int]:
    """``[lo, hi)`` rounded to whole pixels of ``[0, size)``, at least one."""
    a = min(max(0, round(lo)), size - 1)
    return a, max(a + 1, min(size, round(hi)))


def header(data: np.ndarray, source: Any = None) -> tuple[int, int]:
    """``(height, width)`` from libjpeg's reading of the frame header; :class:`CorruptImage`
    if there is none."""
    if _jpegturbo is None:
        raise Unsupported(_MISSING)
    try:
        h, w, _, _ = _jpegturbo.header(data)
    except _jpegturbo.Unsupported as e:
        raise Unsupported(str(e)) from e
    except _jpegturbo.CorruptJPEG as e:
        raise CorruptImage(f"{_name(source, data)}: {e}") from e
    return int(h), int(w)


def frame(data: np.ndarray) -> tuple[int, bool]:
    """``(components, progressive)`` of a JPEG whose header :func:`header` read."""
    if _jpegturbo is None:
        raise Unsupported(_MISSING)
    try:
        _, _, comps, progressive = _jpegturbo.header(data)
    except (_jpegturbo.Unsupported, _jpegturbo.CorruptJPEG) as e:
        raise CorruptImage(str(e)) from e
    return int(comps), bool(progressive)


def _name(source: Any, data: Any) -> str:
    return name_of(data if source is None else source)

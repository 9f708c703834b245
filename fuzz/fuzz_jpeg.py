"""atheris (libFuzzer) harness for the fused JPEG decoder: only CorruptImage and Unsupported
may escape.

Run (see fuzz/README.md)::

    python fuzz/fuzz_jpeg.py --make-corpus fuzz/corpus-jpeg
    python fuzz/fuzz_jpeg.py fuzz/corpus-jpeg -max_total_time=600 -rss_limit_mb=2048

It drives :func:`feedline.producer.image.turbo.header` and
:func:`~feedline.producer.image.turbo.decode_box`
(the compiled extension: libjpeg-turbo's region and DCT-scaled decode, then the fractional
resampler; for a prepared file, the MCU index and the synthetic JPEG of the crop's MCUs) with
a crop box and output size taken from the input. Any other exception is a
finding, and so is a result that breaks the contract (not ``out_h x out_w x 3`` uint8), a
crash or a sanitizer report in the C code, or a run over ``-rss_limit_mb`` (the decoder
bounds what a file can make it allocate: here ``MAX_PIXELS`` pixels).

Input layout: byte 0 picks the mode, bytes 1-8 the geometry, the rest is the payload.

- mode 0: the payload is the file;
- mode 1: byte 9 picks one of the valid seed files (every sampling, progressive, restart
  markers, prepared (MCU-indexed) files, grey, CMYK/YCCK, EXIF), the payload edits it:
  ``[u16 truncate-at]`` then ``[u16 position][u8 value]`` edits, so mutations stay inside
  real JPEG structure;
- mode 2: byte 9 picks a prepared seed, the payload lies in its MCU index and scan:
  ``[u8 op][u32 value]`` edits, op % 5: 0 sets row offset ``value >> 16`` (mod rows) to
  ``value & 0xFFFF`` plus the true offset of that row, 1 sets index field ``op >> 4`` (mod 5:
  version, interval, cols, rows, scan length) to ``value``, 2 renumbers restart marker
  ``value >> 8`` to ``value & 7``, 3 truncates the file ``value`` bytes into its scan, 4 swaps
  two row offsets;
- mode 3: byte 9 picks a baseline seed and builds its side index (jpgindex), the payload
  edits the index: ``[u16 position][u8 value]`` edits past its 40-byte header (so its
  checksum of the file still matches and the entries reach the decoder's own checks), or,
  with position 0xFFFF, the index cut to ``value`` x 4 bytes; the decode must give an image
  (by the index, or without it once refused).

Geometry: bytes 1-4 the box (top, left, height, width as fractions of the image), byte 5 the
output size (1-128), byte 6 bit 0 BGR or RGB, bit 1 a fractional box (as ImageNetVal's),
bit 2 every scale 1..8 instead of the fast ones, byte 7-8 unused (room for later).

The C code is not coverage-instrumented (CPython's gcc build; libFuzzer's instrumentation
needs clang, and libjpeg-turbo is the system's). For feedback, :func:`_outcome` turns what
the decoder did into Python branches libFuzzer sees: the frame's kind (components,
progressive, sampling), the DCT scale, and which of libjpeg's messages an error was; an input
that reaches a new one is kept. The seeds and edits of mode 1 put inputs deep into valid
structure. fuzz/README.md has a sanitizer run.
"""

from __future__ import annotations

import struct
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import atheris

# This checkout's feedline, not an installed one: the fuzzer runs from any directory.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

with atheris.instrument_imports(include=["feedline.producer.image"]):
    from feedline.producer.image import turbo
    from feedline.producer.image.decode import CorruptImage

import cv2  # noqa: E402
import numpy as np  # noqa: E402

MODES = 4
HEAD = 9
MAX_PIXELS = 1 << 22  # 4 Mpx: libjpeg's buffers stay far under the run's -rss_limit_mb
_EDIT = struct.Struct(">HB")
_LIE = struct.Struct(">BI")


def _prepared_seeds() -> list[bytes]:
    """Prepared (MCU-indexed) files: every sampling and grey, several MCU rows each."""
    from tests.support import jpeg_data as jd

    if not turbo.AVAILABLE:
        return []
    from feedline.producer.image.prepared import prepare_jpeg

    img = jd.photo(40, 56, 1)
    grey = cv2.cvtColor(img, cv2.COLOR_BGR2GRAY)
    return [prepare_jpeg(jd.encode(img, 85, s)) for s in jd.SAMPLING] + \
        [prepare_jpeg(jd.encode(grey, 85))]


PREPARED = _prepared_seeds()


def _seed_files() -> list[bytes]:
    """Small valid JPEGs of every kind the decoder meets (deterministic)."""
    from tests.support import jpeg_data as jd

    img = jd.photo(40, 56, 1)
    grey = cv2.cvtColor(img, cv2.COLOR_BGR2GRAY)
    files = [jd.encode(img, 85, s, p, r) for s in jd.SAMPLING for p in (False, True)
             for r in (0, 1)]
    files += PREPARED
    # The last six, in this order (tests/image/test_jpeg_fuzz.py counts CMYK and YCCK from the end).
    files += [jd.encode(grey, 85), jd.encode(grey, 85, progressive=True), jd.cmyk(img),
              jd.cmyk(img, ycck=True), jd.with_exif_orientation(img),
              jd.encode(jd.photo(17, 9, 2), 75)]
    return files


SEED_FILES = _seed_files()


def _indexed_seeds() -> list[tuple[bytes, bytes]]:
    """The baseline seeds that take a side index, with their indexes (not CMYK/YCCK: the
    decoder leaves those to OpenCV)."""
    if not turbo.AVAILABLE:
        return []
    from feedline.producer.image.jpgindex import build_index

    out = []
    for f in SEED_FILES:
        try:
            if turbo.frame(np.frombuffer(f, np.uint8))[0] == 4:
                continue
            index = build_index(f)
        except CorruptImage:
            continue
        if index is not None:
            out.append((f, index))
    return out


INDEXED = _indexed_seeds()


def _edited(payload: bytes) -> bytes:
    """Mode 1: a seed file with the payload's truncation and byte edits applied."""
    if not payload:
        return SEED_FILES[0]
    data = bytearray(SEED_FILES[payload[0] % len(SEED_FILES)])
    rest = payload[1:]
    if len(rest) >= 2:
        cut = struct.unpack(">H", rest[:2])[0]
        if cut and cut < len(data):
            del data[cut:]
        rest = rest[2:]
    for i in range(0, len(rest) - _EDIT.size + 1, _EDIT.size):
        pos, value = _EDIT.unpack_from(rest, i)
        if data:
            data[pos % len(data)] = value
    return bytes(data)


def _lied(payload: bytes) -> bytes:
    """Mode 2: a prepared seed with the payload's lies in its index and scan."""
    from tests.support import jpeg_data as jd

    if not payload or not PREPARED:
        return PREPARED[0] if PREPARED else SEED_FILES[0]
    data = PREPARED[payload[0] % len(PREPARED)]
    for i in range(1, len(payload) - _LIE.size + 1, _LIE.size):
        op, value = _LIE.unpack_from(payload, i)
        try:
            offsets = jd.index_offsets(data)
        except AssertionError:  # the index is gone (truncated away): nothing left to lie in
            break
        kind = op % 5
        if kind == 0 and offsets:
            r = (value >> 16) % len(offsets)
            offsets[r] = (offsets[r] + (value & 0xFFFF)) & 0xFFFFFFFF
            data = jd.with_index(data, offsets=offsets)
        elif kind == 1:
            name = ("version", "interval", "cols", "rows", "scan_len")[(op >> 4) % 5]
            size = 1 if name == "version" else 4 if name == "scan_len" else 2
            data = jd.with_index(data, None, **{name: value % (1 << (8 * size))})
        elif kind == 2:
            rst = jd.restart_markers(data)
            if rst:
                b = bytearray(data)
                b[rst[(value >> 8) % len(rst)] + 1] = 0xD0 + (value & 7)
                data = bytes(b)
        elif kind == 3:
            start, _ = jd.scan_data(data)
            data = data[:start + value % max(1, len(data) - start)]
        elif len(offsets) > 1:
            a, b2 = value % len(offsets), (value >> 8) % len(offsets)
            offsets[a], offsets[b2] = offsets[b2], offsets[a]
            data = jd.with_index(data, offsets=offsets)
    return data


def _index_lied(payload: bytes) -> tuple[bytes, bytes | None]:
    """Mode 3: a baseline seed and its side index with the payload's edits."""
    if not INDEXED:
        return SEED_FILES[0], None
    if not payload:
        return INDEXED[0]
    file, index = INDEXED[payload[0] % len(INDEXED)]
    lie = bytearray(index)
    for i in range(1, len(payload) - _EDIT.size + 1, _EDIT.size):
        pos, value = _EDIT.unpack_from(payload, i)
        if pos == 0xFFFF:
            del lie[4 * value:]
        elif len(lie) > 40:
            lie[40 + pos % (len(lie) - 40)] = value
    return file, bytes(lie)


def _box(geom: bytes, hw: tuple[int, int]) -> tuple[tuple[float, float, float, float],
                                                  tuple[int, int], bool, tuple[int, ...]]:
    h, w = hw
    top, left = geom[0] / 256 * h, geom[1] / 256 * w
    bh = max(1.0, (h - top) * (geom[2] + 1) / 256)
    bw = max(1.0, (w - left) * (geom[3] + 1) / 256)
    fractional = bool(geom[5] & 2)
    if not fractional:
        top, left, bh, bw = float(int(top)), float(int(left)), float(max(1, int(bh))), \
            float(max(1, int(bw)))
    y1, x1 = min(float(h), top + bh), min(float(w), left + bw)
    out = 1 + geom[4] % 128
    scales = tuple(range(1, 9)) if geom[5] & 4 else turbo.FAST_SCALES
    return (top, left, y1, x1), (out, out), not geom[5] & 1, scales


# libjpeg's messages (and ours) the decoder turns into errors, one source line each: an
# instrumented branch per message, so that libFuzzer keeps an input that reaches a new one.
_MESSAGES = ["Premature end", "Huffman code", "arithmetic", "premature end of data segment",
             "found marker", "over the limit", "scans", "Not a JPEG", "Bogus", "Invalid",
             "Unsupported", "Empty JPEG", "colour space", "Quantization table",
             "Huffman table", "sampling factors", "component", "outside", "frame header",
             "precision", "too wide", "backing store", "Insufficient memory", "marker",
             "MCU index", "restart marker", "inside the scan", "does not start", "intervals",
             "index version", "no EOI", "two MCU indexes", "not a baseline",
             "restart interval", "MCUs for a frame", "cut off"]
_BRANCHES = "\n".join(
    [f"    if {text!r} in detail: hit += {1 << i}" for i, text in enumerate(_MESSAGES)]
    + [f"    if comps == {c}: hit += {c} << 30" for c in (1, 3, 4)]
    + ["    if progressive: hit += 1 << 40"]
    + [f"    if scale == {m}: hit += {m} << 50" for m in range(1, 9)]
    + ["    if indexed: hit += 1 << 60"])
_namespace: dict[str, Any] = {}
exec(  # noqa: S102 - a fixed template: one branch per line, for coverage feedback
    f"def _branches(detail, comps, progressive, scale, indexed):\n    hit = 0\n{_BRANCHES}\n"
    f"    return hit\n", _namespace)
_branches: Callable[[str, int, bool, int, bool], int] = atheris.instrument_func(
    _namespace["_branches"])


def _outcome(kind: str, detail: str, frame: tuple[int, bool] | None, scale: int,
             indexed: bool = False) -> str:
    """``kind``, after spelling what happened as branches (see the module docstring)."""
    comps, progressive = frame if frame is not None else (0, False)
    _branches(detail, comps, progressive, scale, indexed)
    return kind


def one_input(data: bytes) -> str:
    """Decode one input; the outcome as a short string (``ok``, ``corrupt``,
    ``unsupported``, ``short``). Raises on a finding."""
    if len(data) < HEAD:
        return "short"
    mode, geom, payload = data[0] % MODES, data[1:HEAD], data[HEAD:]
    index = None
    if mode == 3:
        file, index = _index_lied(payload)
    else:
        file = payload if mode == 0 else _edited(payload) if mode == 1 else _lied(payload)
    buf = np.frombuffer(file, np.uint8)
    frame: tuple[int, bool] | None = None
    scale = 0
    indexed = b"feedline-mcu-index" in file
    try:
        hw = turbo.header(buf)
        frame = turbo.frame(buf)
        box, out_hw, bgr, scales = _box(geom, hw)
        if hw[0] * hw[1] > MAX_PIXELS:  # the decoder must refuse it without allocating
            box, out_hw = (0.0, 0.0, 1.0, 1.0), (1, 1)
        scale = turbo.plan(hw, box, out_hw, scales).scale
        img = turbo.decode_box(buf, hw, box, out_hw, bgr, max_pixels=MAX_PIXELS,
                               scales=scales, index=index)
    except CorruptImage as e:
        return _outcome("corrupt", str(e), frame, scale, indexed)
    except turbo.Unsupported as e:
        return _outcome("unsupported", str(e), frame, scale, indexed)
    if img.shape != (*out_hw, 3) or img.dtype != np.uint8:
        raise AssertionError(f"decode_box gave {img.shape} {img.dtype}, not {out_hw} x 3 uint8")
    return _outcome("ok", "", frame, scale, indexed)


def _target(data: bytes) -> None:
    one_input(data)


def seeds() -> dict[str, bytes]:
    """The seed files in both modes, a whole-image and a crop geometry each."""
    out: dict[str, bytes] = {}
    geoms = {"whole": bytes([0, 0, 255, 255, 63, 0, 0, 0]),
             "crop": bytes([40, 90, 140, 100, 27, 3, 0, 0])}
    for gname, geom in geoms.items():
        for i, f in enumerate(SEED_FILES):
            out[f"file-{i}-{gname}"] = bytes([0]) + geom + f
            out[f"edit-{i}-{gname}"] = bytes([1]) + geom + bytes([i, 0, 0])
        for i in range(len(PREPARED)):
            out[f"lie-{i}-{gname}"] = bytes([2]) + geom + bytes([i])
        for i in range(len(INDEXED)):
            out[f"index-{i}-{gname}"] = bytes([3]) + geom + bytes([i])
    return out


def make_corpus(directory: Path) -> int:
    directory.mkdir(parents=True, exist_ok=True)
    for name, data in seeds().items():
        (directory / name).write_bytes(data)
    return len(seeds())


def main(argv: list[str]) -> None:
    if len(argv) == 3 and argv[1] == "--make-corpus":
        print(f"wrote {make_corpus(Path(argv[2]))} seeds to {argv[2]}")
        return
    if not turbo.AVAILABLE:
        raise SystemExit(f"nothing to fuzz: {turbo.decoder_info()}")
    run: Callable[[bytes], None] = _target
    atheris.Setup(argv, run)
    atheris.Fuzz()


if __name__ == "__main__":
    main(sys.argv)

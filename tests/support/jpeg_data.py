"""Small JPEG folders for pipeline tests: smooth random images (decodable, varied sizes).

``make_folder(root, classes, per_class)`` writes ``root/c<k>/<n>.jpg`` whose label can be
recovered from the pixels: every image is filled with a colour derived from its global index,
plus a gradient, so tests can tell images apart after decoding.
"""

from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np


def make_image(index: int, h: int, w: int) -> np.ndarray:
    rng = np.random.default_rng(index)
    base = rng.integers(0, 200, 3)
    yy, xx = np.mgrid[0:h, 0:w]
    img = np.empty((h, w, 3), np.uint8)
    for c in range(3):
        img[..., c] = np.clip(base[c] + (xx * (c + 1) + yy) * 50 // (w + h), 0, 255)
    return img


def make_folder(root: Path, classes: int = 3, per_class: int = 4, seed: int = 0,
                sizes: tuple[int, int] = (120, 260)) -> list[Path]:
    """Write the images; returns their paths in sorted (label, name) order."""
    rng = np.random.default_rng(seed)
    paths = []
    i = 0
    for k in range(classes):
        d = root / f"c{k}"
        d.mkdir(parents=True, exist_ok=True)
        for n in range(per_class):
            h, w = (int(x) for x in rng.integers(sizes[0], sizes[1], 2))
            ok, enc = cv2.imencode(".jpg", make_image(i, h, w), [cv2.IMWRITE_JPEG_QUALITY, 90])
            assert ok
            p = d / f"{n:04d}.jpg"
            p.write_bytes(enc.tobytes())
            paths.append(p)
            i += 1
    return paths


# ------------------------------------------------------------------ JPEG files of every kind
# For tests/image/test_jpeg_*.py: real photos encoded in each JPEG variant, and hostile edits of
# them. A JPEG is walked as segments; a scan (SOS) runs to the next marker that is not a
# restart (RSTn) or a stuffed 0xFF00.


def photo(h: int, w: int, index: int = 0) -> np.ndarray:
    """An ``h x w`` BGR crop of one of scikit-image's photographs (real texture and edges,
    for quality measurements), enlarged with bicubic interpolation where the photo is
    smaller."""
    from feedline.producer.demo_data import load_photos

    photos = load_photos()
    src = photos[sorted(photos)[index % len(photos)]]
    scale = max(h / src.shape[0], w / src.shape[1], 1.0)
    if scale > 1.0:
        src = cv2.resize(src, (round(src.shape[1] * scale) + 1, round(src.shape[0] * scale) + 1),
                         interpolation=cv2.INTER_CUBIC)
    y0, x0 = (src.shape[0] - h) // 2, (src.shape[1] - w) // 2
    return np.ascontiguousarray(src[y0:y0 + h, x0:x0 + w])


SAMPLING = {"444": cv2.IMWRITE_JPEG_SAMPLING_FACTOR_444,
            "422": cv2.IMWRITE_JPEG_SAMPLING_FACTOR_422,
            "420": cv2.IMWRITE_JPEG_SAMPLING_FACTOR_420,
            "411": cv2.IMWRITE_JPEG_SAMPLING_FACTOR_411,
            "440": cv2.IMWRITE_JPEG_SAMPLING_FACTOR_440}


def encode(img: np.ndarray, quality: int = 90, sampling: str = "420",
           progressive: bool = False, restart: int = 0) -> bytes:
    """``img`` (BGR, or 2-D grey) as a JPEG with OpenCV's encoder (libjpeg-turbo)."""
    params = [cv2.IMWRITE_JPEG_QUALITY, quality, cv2.IMWRITE_JPEG_PROGRESSIVE, int(progressive),
              cv2.IMWRITE_JPEG_RST_INTERVAL, restart]
    if img.ndim == 3:
        params += [cv2.IMWRITE_JPEG_SAMPLING_FACTOR, SAMPLING[sampling]]
    ok, enc = cv2.imencode(".jpg", img, params)
    assert ok
    return enc.tobytes()


def segments(jpeg: bytes) -> list[tuple[int, int, int]]:
    """``(marker, start, end)`` of each segment; a scan's end includes its coded data."""
    out, i = [(0xD8, 0, 2)], 2
    while i + 4 <= len(jpeg):
        assert jpeg[i] == 0xFF, f"no marker at {i}"
        marker = jpeg[i + 1]
        if marker == 0xD9:
            out.append((marker, i, i + 2))
            break
        end = i + 2 + int.from_bytes(jpeg[i + 2:i + 4], "big")
        if marker == 0xDA:
            while end + 1 < len(jpeg) and not (jpeg[end] == 0xFF and jpeg[end + 1] not in (
                    0x00, *range(0xD0, 0xD8))):
                end += 1
        out.append((marker, i, end))
        i = end
    return out


def scan_data(jpeg: bytes) -> tuple[int, int]:
    """``(start, end)`` of the first scan's entropy-coded data."""
    for marker, start, end in segments(jpeg):
        if marker == 0xDA:
            return start + 2 + int.from_bytes(jpeg[start + 2:start + 4], "big"), end
    raise AssertionError("no scan")


def with_size(jpeg: bytes, h: int, w: int) -> bytes:
    """The same file with its frame header declaring ``h x w``."""
    for marker, start, _ in segments(jpeg):
        if marker in (0xC0, 0xC1, 0xC2):
            b = bytearray(jpeg)
            b[start + 5:start + 9] = h.to_bytes(2, "big") + w.to_bytes(2, "big")
            return bytes(b)
    raise AssertionError("no frame header")


def corrupt_scan(jpeg: bytes, seed: int = 0, count: int = 16) -> bytes:
    """``count`` random bytes of the first scan's data overwritten (never with 0xFF, so the
    markers stay where they were): garbage Huffman codes."""
    rng = np.random.default_rng(seed)
    start, end = scan_data(jpeg)
    b = bytearray(jpeg)
    for pos in rng.integers(start + (end - start) // 8, end, count):
        b[pos] = int(rng.integers(0, 0xFF))
    return bytes(b)


def many_scans(progressive: bytes, count: int) -> bytes:
    """A progressive file with its smallest first AC scan repeated until there are ``count``
    scans (a repeated first scan sets the same coefficients again: valid data, one more pass
    over the coefficients each)."""
    segs = segments(progressive)
    scans = [seg for seg in segs if seg[0] == 0xDA]

    def first_ac(seg: tuple[int, int, int]) -> bool:
        hdr_end = seg[1] + 2 + int.from_bytes(progressive[seg[1] + 2:seg[1] + 4], "big")
        ss, ah = progressive[hdr_end - 3], progressive[hdr_end - 1] >> 4
        return ss > 0 and ah == 0

    pick = min((seg for seg in scans if first_ac(seg)), key=lambda seg: seg[2] - seg[1])
    extra = progressive[pick[1]:pick[2]] * max(0, count - len(scans))
    return progressive[:scans[-1][2]] + extra + b"\xff\xd9"


def with_exif_orientation(img: np.ndarray, orientation: int = 6) -> bytes:
    """A JPEG carrying an EXIF orientation tag (6: display rotated 90 degrees clockwise)."""
    import io

    from PIL import Image

    exif = Image.Exif()
    exif[0x0112] = orientation
    out = io.BytesIO()
    Image.fromarray(img[..., ::-1]).save(out, "JPEG", quality=90, exif=exif.tobytes())
    return out.getvalue()


def cmyk(img: np.ndarray, ycck: bool = False) -> bytes:
    """An Adobe CMYK JPEG (PIL's encoder); ``ycck`` marks it as YCCK (Adobe transform 2), so
    the same data is read through the YCCK path."""
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(img[..., ::-1]).convert("CMYK").save(out, "JPEG", quality=90)
    data = out.getvalue()
    if not ycck:
        return data
    for marker, start, _ in segments(data):
        if marker == 0xEE:  # APP14 "Adobe": version, flags0, flags1, transform
            b = bytearray(data)
            b[start + 4 + 11] = 2
            return bytes(b)
    raise AssertionError("no Adobe marker")


# ------------------------------------------------------------- prepared (MCU-indexed) files
# The index segment (feedline/producer/image/_mcuindex.c): FF E9, length, "feedline-mcu-index",
# version u8, interval u16, cols u16, rows u16, scan_len u32, rows x u32 row offsets.
INDEX_MAGIC = b"feedline-mcu-index"
_FIELDS = {"version": (22, 1), "interval": (23, 2), "cols": (25, 2), "rows": (27, 2),
           "scan_len": (29, 4)}


def index_segment(jpeg: bytes) -> tuple[int, int]:
    """``(start, end)`` of a prepared file's index segment, marker included."""
    for marker, start, end in segments(jpeg):
        if marker == 0xE9 and jpeg[start + 4:start + 4 + len(INDEX_MAGIC)] == INDEX_MAGIC:
            return start, end
    raise AssertionError("no MCU index")


def index_fields(jpeg: bytes) -> dict[str, int]:
    """The index's fields but its offsets (:func:`index_offsets`)."""
    start, _ = index_segment(jpeg)
    return {k: int.from_bytes(jpeg[start + o:start + o + n], "big")
            for k, (o, n) in _FIELDS.items()}


def index_offsets(jpeg: bytes) -> list[int]:
    """Where the index says each MCU row starts, from the start of the scan's data."""
    start, end = index_segment(jpeg)
    return [int.from_bytes(jpeg[i:i + 4], "big") for i in range(start + 33, end, 4)]


def with_index(jpeg: bytes, offsets: list[int] | None = None, **fields: int) -> bytes:
    """The same file with index fields changed (``offsets``: the whole list, its segment's
    length following it)."""
    start, end = index_segment(jpeg)
    seg = bytearray(jpeg[start:end])
    if offsets is not None:
        seg[33:] = b"".join(o.to_bytes(4, "big") for o in offsets)
        seg[2:4] = (len(seg) - 2).to_bytes(2, "big")
    for k, v in fields.items():
        o, n = _FIELDS[k]
        seg[o:o + n] = v.to_bytes(n, "big")
    return jpeg[:start] + bytes(seg) + jpeg[end:]


def restart_markers(jpeg: bytes) -> list[int]:
    """Offsets of the restart markers (FF D0-D7) in the first scan's data."""
    start, end = scan_data(jpeg)
    return [i for i in range(start, end - 1)
            if jpeg[i] == 0xFF and 0xD0 <= jpeg[i + 1] <= 0xD7]

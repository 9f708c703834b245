"""JPEG side indexes (feedline/producer/image/jpgindex.py, _jpgidx.c): a crop decoded by the
index is exactly a full decode's crop at 8/8 and the plain fused decoder's at every other
scale, for every sampling and grey; an index that lies is refused before it is used and the
image decodes without it; what cannot be indexed says why; an image folder brings each
file's index with its bytes."""

from __future__ import annotations

import logging
import pickle
import struct
from pathlib import Path

import cv2
import numpy as np
import pytest

from feedline.producer.dataflow.image_folder import FileBytes, ImageFolder, _file_bytes
from feedline.producer.image import ImageNetTrain, ImageNetVal, turbo
from feedline.producer.image.decode import CorruptImage
from feedline.producer.image.jpgindex import (
    BadIndex,
    build_index,
    check_index,
    index_jpeg,
    index_path,
    load_index,
    seal,
)
from feedline.producer.image.prepared import prepare_jpeg
from tests.support.jpeg_data import SAMPLING, encode, photo

pytestmark = pytest.mark.skipif(not turbo.AVAILABLE, reason=turbo.decoder_info())

KINDS = [*SAMPLING, "grey"]


def _jpeg(kind: str, h: int, w: int, index: int = 3) -> np.ndarray:
    img = photo(h, w, index)
    if kind == "grey":
        return np.frombuffer(encode(cv2.cvtColor(img, cv2.COLOR_BGR2GRAY), 88), np.uint8)
    return np.frombuffer(encode(img, 88, kind), np.uint8)


def _full(data: np.ndarray) -> np.ndarray:
    img = cv2.imdecode(data, cv2.IMREAD_COLOR)
    assert img is not None
    return img


def _boxes(h: int, w: int, n: int, seed: int) -> list[tuple[int, int, int, int]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        y0, x0 = int(rng.integers(0, h)), int(rng.integers(0, w))
        out.append((y0, x0, int(rng.integers(y0 + 1, h + 1)), int(rng.integers(x0 + 1, w + 1))))
    return out


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("step", [1, 4])
def test_indexed_crop_is_the_full_decode_crop(kind: str, step: int) -> None:
    # Odd sizes: partial MCUs at the right and bottom edges; several index entries per row.
    data = _jpeg(kind, 203, 331)
    index = build_index(data, step)
    assert index is not None
    full = _full(data)
    for y0, x0, y1, x1 in _boxes(203, 331, 40, step):
        got = turbo.decode_box(data, (203, 331), (y0, x0, y1, x1), (y1 - y0, x1 - x0),
                               scales=(8,), index=index)
        np.testing.assert_array_equal(got, full[y0:y1, x0:x1], err_msg=f"{(y0, x0, y1, x1)}")


@pytest.mark.parametrize("kind", ["420", "444", "grey"])
def test_indexed_decode_at_every_scale_is_the_fused_decoders(kind: str) -> None:
    data = _jpeg(kind, 240, 317, index=1)
    index = build_index(data)
    rng = np.random.default_rng(5)
    for y0, x0, y1, x1 in _boxes(240, 317, 30, 7):
        out = (int(rng.integers(1, 60)), int(rng.integers(1, 60)))
        box = (y0 + 0.25, x0 + 0.5, float(y1), x1 - 0.25) if y1 - y0 > 1 < x1 - x0 else \
            (float(y0), float(x0), float(y1), float(x1))
        for scales in [(1, 2, 4, 8), (1, 2, 3, 4, 5, 6, 7, 8)]:
            want = turbo.decode_box(data, (240, 317), box, out, scales=scales)
            got = turbo.decode_box(data, (240, 317), box, out, scales=scales, index=index)
            np.testing.assert_array_equal(got, want, err_msg=f"{box} -> {out}, {scales}")


def test_presets_decode_the_same_images_with_the_index(tmp_path: Path) -> None:
    data = _jpeg("420", 375, 500, index=2)
    plain = _file_bytes(data, "a.jpg")
    indexed = _file_bytes(data, "a.jpg", build_index(data))
    for preset in (ImageNetTrain, ImageNetVal):
        a, b = preset(seed=3), preset(seed=3)
        for _ in range(8):
            np.testing.assert_array_equal(a(plain), b(indexed))


def test_index_is_small_and_checks_its_file() -> None:
    data = _jpeg("420", 375, 500)
    index = build_index(data)
    assert index is not None and len(index) < 0.08 * data.size
    info = check_index(data, index)
    assert (info.mcu_cols, info.mcu_rows, info.step) == (32, 24, 4)
    assert info.entries == 8 * 24


def _lies(index: bytes, other: bytes) -> dict[str, bytes]:
    """Indexes that do not fit the file: each names what it breaks. Those that lie about
    one field are sealed again (their own checksum right), so that they reach the check of
    that field; the others are refused by the seal already."""
    head = bytearray(index)
    wrong_version = bytearray(head)
    wrong_version[4] = 3
    wrong_size = bytearray(head)
    wrong_size[8:10] = struct.pack(">H", 999)
    past = bytearray(head)
    past[24:28] = struct.pack(">I", 0xFFFFFF)  # the scan's end far past its bytes
    # The first entry after the header: bit delta 0, then the predictions. A second entry
    # with a delta of 0 is out of order; a prediction of 4000 is out of range.
    out_of_order = bytearray(head)
    at = 40 + 1 + int(head[6])  # entry 1's bit delta (single-byte varints at entry 0)
    out_of_order[at] = 0
    big_pred = bytearray(head[:40]) + b"\x00" + b"\xc0\x3e" + bytes(head[42:])
    return {
        "truncated": bytes(index[:-3]),
        "empty": b"",
        "garbage": b"FLJI" + bytes(60),
        "another file's": other,
        "version": seal(wrong_version),
        "frame": seal(wrong_size),
        "past the data": seal(past),
        "out of order": seal(out_of_order),
        "prediction out of range": seal(big_pred),
        "trailing bytes": index + b"\x00",
        "trailing bytes, sealed": seal(index[:-8] + b"\x00" + index[-8:]),
        "a bit flipped": bytes(head[:50]) + bytes([head[50] ^ 4]) + bytes(head[51:]),
    }


def test_a_lying_index_is_refused_and_the_image_decodes_without_it(
        caplog: pytest.LogCaptureFixture) -> None:
    data = _jpeg("420", 160, 200)
    other = _jpeg("420", 160, 200, index=4)
    index = build_index(data)
    assert index is not None
    want = turbo.decode_box(data, (160, 200), (20, 30, 120, 170), (50, 50))
    for what, lie in _lies(index, build_index(other) or b"").items():
        with pytest.raises(BadIndex):
            check_index(data, lie)
        caplog.clear()
        before = turbo.index_refusals()
        with caplog.at_level(logging.WARNING):
            got = turbo.decode_box(data, (160, 200), (20, 30, 120, 170), (50, 50),
                                   source=f"lie-{what}.jpg", index=lie)
        np.testing.assert_array_equal(got, want, err_msg=what)
        assert turbo.index_refusals() == before + 1, what
        assert any(f"lie-{what}.jpg" in r.getMessage() and "decoded without it" in
                   r.getMessage() for r in caplog.records), what


def test_an_index_with_any_bit_flipped_is_refused() -> None:
    # Bit rot in a stored index (a shard, an LMDB, a side file): a bit flipped in any byte,
    # header or entries, is refused, never decoded by (an edited entry that still passes
    # the entry checks would show other pixels).
    data = _jpeg("420", 160, 200)
    index = build_index(data)
    assert index is not None
    for pos in range(len(index)):
        lie = bytearray(index)
        lie[pos] ^= 1 << (pos % 8)
        with pytest.raises(BadIndex):
            check_index(data, bytes(lie))


def test_forged_entries_never_overrun() -> None:
    # Edits of the entries sealed again (the index's own checksum right, as a forger makes
    # it) pass both checksums and reach the decoder's own checks (and libjpeg's). Each
    # decode gives an image or falls back.
    data = _jpeg("422", 120, 150)
    index = bytearray(build_index(data, 2) or b"")
    rng = np.random.default_rng(11)
    for _ in range(300):
        lie = bytearray(index)
        for _ in range(int(rng.integers(1, 4))):
            lie[int(rng.integers(40, len(lie) - 8))] = int(rng.integers(0, 256))
        box = _boxes(120, 150, 1, int(rng.integers(0, 1 << 30)))[0]
        y0, x0, y1, x1 = box
        out = turbo.decode_box(data, (120, 150), (y0, x0, y1, x1), (16, 16), index=seal(lie))
        assert out.shape == (16, 16, 3) and out.dtype == np.uint8


def test_what_cannot_be_indexed_says_why() -> None:
    img = photo(64, 80, 1)
    assert index_jpeg(encode(img, 90, progressive=True)) == (None, "not a baseline JPEG "
                                                             "(progressive, lossless or "
                                                             "arithmetic-coded)")
    assert "restart markers" in index_jpeg(encode(img, 90, restart=2)).note
    assert "restart markers" in index_jpeg(prepare_jpeg(encode(img, 90))).note
    assert index_jpeg(b"\x89PNG....").note == "not a JPEG"
    cut = encode(img, 90)[:-200]
    with pytest.raises(CorruptImage):
        index_jpeg(cut)


def test_image_folder_brings_each_files_index(tmp_path: Path) -> None:
    (tmp_path / "c0").mkdir()
    a, b = tmp_path / "c0" / "a.jpg", tmp_path / "c0" / "b.jpg"
    a.write_bytes(_jpeg("420", 64, 64).tobytes())
    b.write_bytes(_jpeg("420", 64, 64, index=2).tobytes())
    index_path(a).write_bytes(build_index(a.read_bytes()) or b"")
    folder = ImageFolder(tmp_path, shuffle=False)
    (da, _), (db, _) = list(folder)
    assert folder.paths == [str(a), str(b)]  # the .jpgidx is not an image
    assert isinstance(da, FileBytes) and da.jpeg_index == load_index(a)
    assert db.jpeg_index is None and load_index(b) is None
    again = pickle.loads(pickle.dumps(da))
    assert again.jpeg_index == da.jpeg_index and again.path == str(a)
    off = ImageFolder(tmp_path, shuffle=False, jpeg_index=False)
    assert folder.sample(0)[0].jpeg_index is not None and off.sample(0)[0].jpeg_index is None

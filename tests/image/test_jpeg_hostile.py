"""Hostile and odd JPEGs through the presets: every odd-but-valid kind decodes (as OpenCV
decodes it), every broken one is a CorruptImage that names its file and that ``on_error:
skip`` counts; nothing crashes, nothing allocates what a file merely declares."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import pytest

from feedline.producer.dataflow import (
    ImageFolder,
    MapData,
    MapDataComponent,
    MultiProcessMapData,
    MultiThreadMapData,
    WorkerError,
)
from feedline.producer.dataflow.map_data import ComponentFunc
from feedline.producer.image import CorruptImage, ImageNetTrain, ImageNetVal, decode, turbo
from tests.support import ROOT
from tests.support.jpeg_data import (
    SAMPLING,
    cmyk,
    corrupt_scan,
    encode,
    index_fields,
    index_offsets,
    index_segment,
    many_scans,
    photo,
    restart_markers,
    segments,
    with_exif_orientation,
    with_index,
    with_size,
)

IMG = photo(300, 400, 1)
BASE = encode(IMG, 90)
PROG = encode(IMG, 90, progressive=True)


def odd() -> dict[str, bytes]:
    """Valid files of every kind the fused decoder meets or leaves to OpenCV."""
    grey = cv2.cvtColor(IMG, cv2.COLOR_BGR2GRAY)
    files = {f"sampling-{s}": encode(IMG, 90, s) for s in SAMPLING}
    files |= {f"progressive-{s}": encode(IMG, 90, s, progressive=True) for s in SAMPLING}
    files |= {"grey": encode(grey), "grey-progressive": encode(grey, progressive=True),
              "restart-markers": encode(IMG, restart=1),
              "restart-progressive": encode(IMG, progressive=True, restart=3),
              "cmyk": cmyk(IMG), "ycck": cmyk(IMG, ycck=True),
              "exif-rotated": with_exif_orientation(IMG), "200-scans": many_scans(PROG, 200)}
    return files


def broken() -> dict[str, bytes]:
    """Files that must be refused, each with the reason the error gives."""
    return {
        "empty": b"",
        "header-only": BASE[:200],
        "truncated-in-the-first-rows": BASE[:1200],
        "truncated-progressive": PROG[:len(PROG) // 3],
        "corrupt-huffman": corrupt_scan(BASE, count=64),
        "corrupt-huffman-progressive": corrupt_scan(PROG, count=64),
        "corrupt-restart-intervals": corrupt_scan(encode(IMG, restart=1), count=64),
        "65535x65535": with_size(BASE, 65535, 65535),
        "65535x65535-progressive": with_size(PROG, 65535, 65535),
        "zero-height": with_size(BASE, 0, 400),
        "1000-scans": many_scans(PROG, 1000),
        "soi-then-zeros": b"\xff\xd8" + bytes(500),
        "not-an-image": b"GIF89a" + bytes(100),
    }


@pytest.mark.parametrize("name", sorted(odd()))
def test_odd_jpegs_decode_as_opencv_decodes_them(name: str) -> None:
    """The same images as OpenCV's path (EXIF orientation ignored by both: pixels as
    stored), whichever decoder runs."""
    data = np.frombuffer(odd()[name], np.uint8)
    pairs: list[tuple[Callable[[Any], np.ndarray], Callable[[Any], np.ndarray]]] = [
        (ImageNetTrain(224, seed=2), ImageNetTrain(224, seed=2, reduced_decode=False)),
        (ImageNetVal(), ImageNetVal(reduced_decode=False))]
    for fused, ref in pairs:
        for _ in range(6):
            a, b = fused(data), ref(data)
            assert a.shape == (224, 224, 3) and a.dtype == np.uint8
            assert np.mean(np.abs(a.astype(int) - b)) < 1.0, name


def test_exif_orientation_is_ignored_everywhere() -> None:
    data = with_exif_orientation(IMG)
    assert decode(data).shape == (300, 400, 3)  # OpenCV would rotate it to 400x300
    assert turbo.header(np.frombuffer(data, np.uint8)) == (300, 400)


# Where the fused decoder is stricter than the OpenCV path (which runs only without the
# extension, or for CMYK/YCCK): OpenCV takes libjpeg's warnings about corrupt entropy-coded
# data as recoverable (garbage blocks), and has no scan limit (CPU, not memory).
OPENCV_DECODES = {"1000-scans", "corrupt-huffman", "corrupt-huffman-progressive",
                  "corrupt-restart-intervals"}


@pytest.mark.parametrize("name", sorted(broken()))
def test_broken_jpegs_are_a_clear_sample_error(name: str) -> None:
    data = np.frombuffer(broken()[name], np.uint8)
    presets: list[Callable[[Any], np.ndarray]] = [ImageNetTrain(224, seed=0), ImageNetVal()]
    if name not in OPENCV_DECODES:
        presets.append(ImageNetTrain(224, seed=0, decoder="opencv"))
    for preset in presets:
        with pytest.raises(CorruptImage) as e:
            for _ in range(8):  # random crops: every one of them needs the broken part
                preset(data)
        assert str(e.value), name
    if "65535" in name:
        assert "declares 65535x65535 pixels, over the limit" in str(e.value)


def test_the_scan_limit_names_itself() -> None:
    with pytest.raises(CorruptImage, match="more than 256 scans"):
        ImageNetVal()(many_scans(PROG, 1000))


def test_a_file_damaged_below_the_crop_still_decodes_and_the_rest_is_refused() -> None:
    """Only the rows down to the crop's last are read: a truncated file gives a crop of its
    top and refuses one of its bottom (tf.data's decode_and_crop_jpeg behaves the same)."""
    data = np.frombuffer(BASE[:len(BASE) * 2 // 3], np.uint8)
    full = cv2.imdecode(np.frombuffer(BASE, np.uint8), cv2.IMREAD_COLOR)
    assert full is not None
    np.testing.assert_array_equal(turbo.decode_box(data, (300, 400), (0, 0, 56, 80), (56, 80)),
                                  full[:56, :80])
    with pytest.raises(CorruptImage, match="Premature end of JPEG file"):
        turbo.decode_box(data, (300, 400), (240, 0, 300, 80), (60, 80))


def test_declared_sizes_allocate_nothing(tmp_path: Path) -> None:
    """Files of a few kB that declare 65535x65535 (and, to the fused decoder, 8000x8000
    progressive, under the limit, its data missing) cost a fresh process under 64 MB of
    peak memory. (OpenCV would decode the latter to a grey 8000x8000 image: 192 MB, within
    the limit.)"""
    files = {"huge": with_size(BASE, 65535, 65535), "huge-progressive":
             with_size(PROG, 65535, 65535), "big-progressive": with_size(PROG, 8000, 8000)}
    for name, data in files.items():
        (tmp_path / f"{name}.jpg").write_bytes(data)
    script = (
        "import resource, sys, numpy as np\n"
        "from feedline.producer.image import CorruptImage, ImageNetTrain, ImageNetVal\n"
        "presets = [ImageNetTrain(224), ImageNetVal(), ImageNetTrain(224, decoder='opencv')]\n"
        "for p in presets: p(np.frombuffer(open(sys.argv[1], 'rb').read(), np.uint8))\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "for f in sys.argv[2:]:\n"
        "    for p in presets[:2] if 'big' in f else presets:\n"
        "        for _ in range(5):\n"
        "            try: p(np.frombuffer(open(f, 'rb').read(), np.uint8))\n"
        "            except CorruptImage: pass\n"
        "            else: raise SystemExit(f + ' decoded')\n"
        "print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)\n")
    (tmp_path / "ok.jpg").write_bytes(BASE)
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path / "ok.jpg"),
                          *(str(tmp_path / f"{n}.jpg") for n in files)],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) < 64, f"peak memory grew {out.stdout.strip()} MB"


def _folder(root: Path) -> tuple[list[str], list[str]]:
    """Good and broken files in class folders; returns (good paths, broken paths)."""
    good: list[str] = []
    bad: list[str] = []
    for i, (name, data) in enumerate({**odd(), **broken()}.items()):
        d = root / f"c{i % 3}"
        d.mkdir(parents=True, exist_ok=True)
        p = d / f"{name}.jpg"
        p.write_bytes(data)
        (bad if name in broken() else good).append(str(p))
    return good, bad


@pytest.mark.parametrize("stage", ["inline", "threads", "processes"])
def test_skip_counts_every_broken_file_and_raise_names_it(tmp_path: Path, stage: str) -> None:
    good, bad = _folder(tmp_path)
    aug = ImageNetTrain(224, seed=1)

    def build(on_error: str):
        src = ImageFolder(tmp_path, shuffle=False)
        if stage == "inline":
            return MapDataComponent(src, aug, 0, on_error=on_error)
        if stage == "threads":
            return MultiThreadMapData(src, 2, ComponentFunc(aug, 0), buffer_size=8,
                                      strict=True, on_error=on_error)
        return MultiProcessMapData(src, 2, ComponentFunc(aug, 0), buffer_size=8, strict=True,
                                   on_error=on_error)

    df = build("skip")
    try:
        df.reset_state()
        out = list(df)
        assert len(out) == len(good) and all(dp[0].shape == (224, 224, 3) for dp in out)
        assert df.skipped == len(bad)
    finally:
        getattr(df, "close", lambda: None)()
    df = build("raise")
    try:
        df.reset_state()
        with pytest.raises((CorruptImage, WorkerError)) as e:
            list(df)
        named = [p for p in bad if p in str(e.value)]
        assert named, f"the error names no file: {e.value}"
    finally:
        getattr(df, "close", lambda: None)()


def test_an_error_names_the_file_of_a_path_and_says_bytes_otherwise(tmp_path: Path) -> None:
    p = tmp_path / "broken.jpg"
    p.write_bytes(BASE[:300])
    with pytest.raises(CorruptImage, match=str(p)):
        ImageNetVal()(str(p))
    with pytest.raises(CorruptImage, match="300 bytes"):
        ImageNetVal()(BASE[:300])
    with pytest.raises(CorruptImage, match=str(p)):
        decode(str(p))
    with pytest.raises(CorruptImage, match="broken.png"):  # ImageFolder's bytes carry the path
        next(iter(MapData(ImageFolder(list_file=_list(tmp_path, b"\x89PNG\r\n\x1a\n" +
                                                          bytes(40))), lambda dp: decode(dp[0]))))


def _list(root: Path, data: bytes) -> Path:
    (root / "broken.png").write_bytes(data)
    (root / "list.txt").write_text("broken.png 0\n")
    return root / "list.txt"


def test_threads_decode_concurrently_and_agree_with_one_thread() -> None:
    """The GIL is released inside libjpeg: threads give the same images as one thread."""
    datas = [encode(photo(int(h), int(w), i), 85) for i, (h, w) in
             enumerate([(600, 800), (500, 700), (900, 1200), (333, 444)])]
    items = [[d, i] for i, d in enumerate(datas * 6)]
    from feedline.producer.dataflow import DataFromList

    val = ImageNetVal()
    want = [val(d) for d, _ in items]
    df = MultiThreadMapData(DataFromList(items, shuffle=False), 4, ComponentFunc(val, 0),
                            buffer_size=8, strict=True)
    try:
        df.reset_state()
        got = [dp[0] for dp in df]
    finally:
        df.close()
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)


# ------------------------------------------------------------------ prepared (indexed) files
def _restarts_renumbered(data: bytes, keep_row_starts: bool, new: int | None = None) -> bytes:
    """Every restart marker inside a row (``keep_row_starts``: not those that end a row, so
    the index's own checks pass and the scan walk must find it) renumbered (+1), or its
    second byte replaced by ``new``."""
    scan = segments(data)[-1][1]
    scan += 2 + int.from_bytes(data[scan + 2:scan + 4], "big")
    row_ends = {scan + o - 2 for o in index_offsets(data)} if keep_row_starts else set()
    b = bytearray(data)
    for at in restart_markers(data):
        if at not in row_ends:
            b[at + 1] = new if new is not None else 0xD0 + ((b[at + 1] - 0xD0 + 1) & 7)
    return bytes(b)


def _with_segment(data: bytes, seg: bytes) -> bytes:
    """``seg`` inserted right after SOI."""
    return data[:2] + seg + data[2:]


def prepared_broken() -> dict[str, tuple[bytes, str]]:
    """Indexed files that must be refused, and what the error says."""
    from feedline.producer.image.prepared import prepare_jpeg

    prep = prepare_jpeg(BASE)
    f, offs = index_fields(prep), index_offsets(prep)
    s0, s1 = index_segment(prep)
    seg = prep[s0:s1]
    swapped = offs[:2] + [offs[3], offs[2]] + offs[4:]
    return {
        "index-offset-past-the-scan": (with_index(prep, offsets=[0] + [0xFFFFFFF0] * (
            len(offs) - 1)), "starts at"),
        "index-offset-inside-an-interval": (with_index(prep, offsets=[0] + [o + 5 for o in
                                                                           offs[1:]]),
                                            "restart marker"),
        "index-rows-out-of-order": (with_index(prep, offsets=swapped), "MCU row 2"),
        "index-grid-not-the-frames": (with_index(prep, cols=f["cols"] + 1),
                                      "MCUs for a frame of"),
        "index-version-2": (with_index(prep, version=2), "index version 2"),
        "index-interval-4": (with_index(prep, interval=4), "interval 4"),
        "index-rows-missing": (with_index(prep, offsets=offs[:-1]), "bytes for"),
        "index-scan-length-wrong": (with_index(prep, scan_len=f["scan_len"] - 1),
                                    "no EOI follows"),
        "indexed-file-truncated-in-the-scan": (prep[:len(prep) * 2 // 3], "no EOI follows"),
        "restart-markers-out-of-sequence": (_restarts_renumbered(prep, True), "restart marker"),
        "a-marker-inside-the-scan": (_restarts_renumbered(prep, True, 0xC4),
                                     "marker FFC4 inside the scan"),
        "restart-markers-gone": (_restarts_renumbered(prep, True, 0x00), "intervals, not"),
        "index-on-a-progressive-file": (_with_segment(PROG, seg), "not a baseline"),
        "index-without-restart-markers": (_with_segment(BASE, seg), "restart interval of 0"),
        "two-indexes": (_with_segment(prep, seg), "two MCU indexes"),
        "indexed-frame-9000x9000": (with_size(prep, 9000, 9000), "MCUs for a frame of"),
    }


@pytest.mark.skipif(not turbo.AVAILABLE, reason=turbo.decoder_info())
@pytest.mark.parametrize("name", sorted(prepared_broken() if turbo.AVAILABLE else {}))
def test_broken_indexed_files_are_refused_with_what_is_wrong(name: str) -> None:
    """A lying index, a truncated scan, markers where the index's intervals should be:
    CorruptImage naming the MCU index's complaint, from every crop (each walks rows of the
    scan that the damage is in) and from both presets."""
    data, says = prepared_broken()[name]
    buf = np.frombuffer(data, np.uint8)
    presets: list[Callable[[Any], np.ndarray]] = [ImageNetTrain(224, seed=0), ImageNetVal()]
    for preset in presets:
        for _ in range(4):
            with pytest.raises(CorruptImage, match=says):
                preset(buf)


@pytest.mark.skipif(not turbo.AVAILABLE, reason=turbo.decoder_info())
def test_an_intact_index_on_damaged_entropy_data_is_still_libjpegs_to_judge() -> None:
    """Bytes of the Huffman-coded data overwritten (no marker touched): the index fits, so
    the crop is assembled and libjpeg refuses the data, as it does for any file."""
    from feedline.producer.image.prepared import prepare_jpeg
    from tests.support.jpeg_data import scan_data

    data = bytearray(prepare_jpeg(BASE))
    start, end = scan_data(bytes(data))
    rng = np.random.default_rng(0)
    for pos in rng.integers(start + 1, end - 1, 400):
        if 0xFF not in (data[pos - 1], data[pos], data[pos + 1]):  # markers stay as they are
            data[pos] = int(rng.integers(0, 0xFF))
    with pytest.raises(CorruptImage, match="Corrupt JPEG data|Premature end|Huffman"):
        for _ in range(8):
            ImageNetTrain(224, seed=0)(np.frombuffer(data, np.uint8))

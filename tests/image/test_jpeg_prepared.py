"""Prepared JPEGs (feedline/producer/image/prepared.py, _prepare.c, _mcuindex.c): the
transcode is lossless (every decoder gives the original's pixels), a crop decoded from the
MCU index is exactly a full decode's crop at every scale and sampling, the presets give the
same images from either file, and what cannot be prepared comes back unchanged with the
reason. The hostile cases are in tests/image/test_jpeg_hostile.py."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import cv2
import numpy as np
import pytest

from feedline.producer.image import ImageNetTrain, ImageNetVal, turbo
from feedline.producer.image.decode import CorruptImage
from feedline.producer.image.prepared import is_prepared, prepare, prepare_jpeg
from tests.support import ROOT
from tests.support.jpeg_data import (
    SAMPLING,
    cmyk,
    encode,
    photo,
    restart_markers,
    segments,
    with_exif_orientation,
)

pytestmark = pytest.mark.skipif(not turbo.AVAILABLE, reason=turbo.decoder_info())

KINDS = [*SAMPLING, "grey"]


def _jpeg(kind: str, h: int, w: int, progressive: bool = False, restart: int = 0,
          index: int = 3) -> bytes:
    img = photo(h, w, index)
    if kind == "grey":
        return encode(cv2.cvtColor(img, cv2.COLOR_BGR2GRAY), 88, progressive=progressive,
                      restart=restart)
    return encode(img, 88, kind, progressive, restart)


def _full(data: bytes, scale: int = 8) -> np.ndarray:
    """Every pixel at scale/8, by the extension's plain (unindexed) path."""
    from feedline.producer.image import _jpegturbo  # type: ignore[attr-defined]

    h, w = turbo.header(np.frombuffer(data, np.uint8))
    sh, sw = -(-h * scale // 8), -(-w * scale // 8)
    px, xs, width, _, _ = _jpegturbo.decode(_strip(data), scale, 0, 0, sh, sw, True, 1 << 26,
                                            256)
    assert xs == 0 and width == sw
    return np.frombuffer(px, np.uint8).reshape(sh, sw, 3)


def _strip(data: bytes) -> bytes:
    """The file without its MCU index segment (APP9 "feedline-mcu-index"): decoded the
    ordinary way, every row and column."""
    out, last = bytearray(), 0
    for marker, start, end in segments(data):
        if not (marker == 0xE9 and data[start + 4:start + 22] == b"feedline-mcu-index"):
            out += data[start:end]
        last = end
    return bytes(out + data[last:])  # EOI


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("source", ["baseline", "progressive", "restarts"])
def test_prepared_files_decode_to_the_originals_pixels(kind: str, source: str) -> None:
    """OpenCV (a full libjpeg decode, the index skipped) gives the original's pixels, with
    optimised Huffman tables and without; odd sizes (partial MCUs at the right and bottom)."""
    for h, w in [(203, 301), (64, 48), (9, 17)]:
        data = _jpeg(kind, h, w, source == "progressive", 2 if source == "restarts" else 0)
        want = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_UNCHANGED)
        for optimize in (True, False):
            p = prepare(data, optimize)
            assert p.prepared and p.note == "" and is_prepared(p.data), p.note
            got = cv2.imdecode(np.frombuffer(p.data, np.uint8), cv2.IMREAD_UNCHANGED)
            np.testing.assert_array_equal(got, want, err_msg=f"{kind} {source} {h}x{w}")
            assert turbo.header(np.frombuffer(p.data, np.uint8)) == (h, w)
            assert not is_prepared(data)


def test_other_restart_intervals_are_lossless_and_carry_no_index() -> None:
    """``interval`` (benchmarks/prepare_jpegs.py --intervals measures the choice of 1): the
    same pixels with a marker after every N MCUs or every MCU row (0), and no index, since
    the decoder reads only indexes of one MCU; an interval over 16 bits is an error."""
    from feedline.producer.image import _jpegturbo  # type: ignore[attr-defined]

    data = _jpeg("420", 203, 301)
    want = cv2.imdecode(np.frombuffer(data, np.uint8), 1)
    for interval in (0, 2, 4):
        out, note = _jpegturbo.prepare(data, True, 1 << 26, interval)
        assert note == "" and not is_prepared(out) and restart_markers(out), interval
        np.testing.assert_array_equal(cv2.imdecode(np.frombuffer(out, np.uint8), 1), want)
    rows = len(restart_markers(_jpegturbo.prepare(data, True, 1 << 26, 0)[0]))
    assert rows == -(-203 // 16) - 1  # 4:2:0: 16-pixel MCU rows, a marker between each two
    with pytest.raises(ValueError, match="0..65535"):
        _jpegturbo.prepare(data, True, 1 << 26, 1 << 16)


@pytest.mark.parametrize("kind", KINDS)
def test_a_crop_of_a_prepared_file_is_the_full_decodes_crop_at_every_scale(kind: str) -> None:
    """Every pixel of the region asked for, at every DCT scale, is the full decode's: the
    synthetic JPEG of the MCUs under it has the margin fancy upsampling reads. Regions at
    the edges, one pixel wide and high, and the whole image are among them."""
    from feedline.producer.image import _jpegturbo  # type: ignore[attr-defined]

    h, w = 203, 301
    original = _jpeg(kind, h, w)
    data = prepare_jpeg(original)
    rng = np.random.default_rng(1)
    for m in range(1, 9):
        full = _full(original, m)
        sh, sw = full.shape[:2]
        regions = [(0, 0, sh, sw), (sh - 1, sw - 1, 1, 1), (0, sw - 3, sh, 3), (5, 0, 1, sw)]
        for _ in range(20):
            y0, x0 = int(rng.integers(0, sh)), int(rng.integers(0, sw))
            regions.append((y0, x0, int(rng.integers(1, sh - y0 + 1)),
                            int(rng.integers(1, sw - x0 + 1))))
        for y0, x0, rows, cols in regions:
            px, xs, width, ih, iw = _jpegturbo.decode(data, m, y0, x0, rows, cols, True,
                                                      1 << 26, 256)
            assert (ih, iw) == (h, w) and xs <= x0 and xs + width >= x0 + cols
            region = np.frombuffer(px, np.uint8).reshape(rows, width, 3)
            np.testing.assert_array_equal(region[:, x0 - xs:x0 - xs + cols],
                                          full[y0:y0 + rows, x0:x0 + cols],
                                          err_msg=f"{kind} {m}/8 ({y0}, {x0}) {rows}x{cols}")


def test_the_synthetic_jpeg_is_a_plain_jpeg_of_those_mcus() -> None:
    """What the decoder hands libjpeg, read by OpenCV: the MCU rectangle's pixels (all but
    the edge pixels fancy upsampling takes from outside it, where it is not the image's)."""
    from feedline.producer.image import _jpegturbo  # type: ignore[attr-defined]

    original = _jpeg("420", 203, 301)
    data = prepare_jpeg(original)
    cols, rows, mw, mh, _ = _jpegturbo.index_info(data)
    assert (cols, rows, mw, mh) == (19, 13, 16, 16)
    full = _full(original)
    for r0, r1, c0, c1 in [(0, 13, 0, 19), (2, 5, 3, 9), (12, 13, 18, 19), (0, 1, 5, 6)]:
        syn = _jpegturbo.synthetic(data, r0, r1, c0, c1)
        img = cv2.imdecode(np.frombuffer(syn, np.uint8), cv2.IMREAD_COLOR)
        assert img is not None
        y0, x0 = r0 * 16, c0 * 16
        want = full[y0:min(r1 * 16, 203), x0:min(c1 * 16, 301)]
        assert img.shape == want.shape
        top, left = int(r0 > 0), int(c0 > 0)
        bottom = img.shape[0] - int(r1 < rows)
        right = img.shape[1] - int(c1 < cols)
        np.testing.assert_array_equal(img[top:bottom, left:right], want[top:bottom, left:right])


@pytest.mark.parametrize("size", [(350, 400), (800, 1100)])
def test_presets_give_the_same_images_from_a_prepared_file(size: tuple[int, int]) -> None:
    """ImageNetTrain (every DCT scale the boxes reach, with colour augmentation or not) and
    ImageNetVal: the same arrays from the original and from its prepared copy."""
    original = np.frombuffer(encode(photo(*size, 5), 85), np.uint8)
    data = np.frombuffer(prepare_jpeg(original), np.uint8)
    for jitter in (0.0, 0.4):
        a, b = ImageNetTrain(224, seed=3, color_jitter=jitter), \
            ImageNetTrain(224, seed=3, color_jitter=jitter)
        for _ in range(30):
            np.testing.assert_array_equal(a(original), b(data))
    np.testing.assert_array_equal(ImageNetVal()(original), ImageNetVal()(data))


def _incomplete_progressive() -> bytes:
    """A progressive file without its refinement scans (Ah > 0): valid, but the last bits of
    its coefficients never arrive, so libjpeg smooths its blocks."""
    data = encode(photo(64, 80, 2), 90, progressive=True)
    out, last = bytearray(), 0
    for marker, start, end in segments(data):
        hdr = start + 2 + int.from_bytes(data[start + 2:start + 4], "big")
        if not (marker == 0xDA and data[hdr - 1] >> 4):  # Ah > 0: a refinement scan
            out += data[start:end]
        last = end
    return bytes(out + data[last:])


def test_what_is_not_prepared_comes_back_unchanged_with_the_reason() -> None:
    img = photo(60, 80, 1)
    png = cv2.imencode(".png", img)[1].tobytes()
    baseline = encode(img, 88)
    sof = next(start for marker, start, _ in segments(baseline) if marker == 0xC0)
    cases = {"not a JPEG": png, "CMYK": cmyk(img), "YCCK": cmyk(img, ycck=True),
             "unrefined": _incomplete_progressive(),
             "lossless": baseline[:sof + 1] + b"\xc3" + baseline[sof + 2:],
             "12-bit": baseline[:sof + 4] + b"\x0c" + baseline[sof + 5:]}
    for what, data in cases.items():
        p = prepare(data)
        assert not p.prepared and p.data == data, what
        assert p.note, what
        assert prepare_jpeg(data) == data
    assert "colour space" in prepare(cmyk(img)).note
    assert "unrefined" in prepare(_incomplete_progressive()).note
    assert "SOF type 0xc3" in prepare(cases["lossless"]).note
    assert "precision 12" in prepare(cases["12-bit"]).note


def test_a_quantisation_table_redefined_between_scans_is_left_as_it_is() -> None:
    """A progressive file whose table 0 is redefined after the scan that latched it decodes
    (libjpeg keeps the latched copy) but cannot be written again with one table per slot:
    stored unchanged, with the reason, instead of an error that would drop the image."""
    data = _jpeg("420", 64, 80, progressive=True)
    second_scan = [s for s in segments(data) if s[0] == 0xDA][1][1]
    dqt = b"\xff\xdb" + (67).to_bytes(2, "big") + b"\x00" + bytes([1]) * 64
    redefined = data[:second_scan] + dqt + data[second_scan:]
    np.testing.assert_array_equal(cv2.imdecode(np.frombuffer(redefined, np.uint8), 1),
                                  cv2.imdecode(np.frombuffer(data, np.uint8), 1))
    p = prepare(redefined)
    assert not p.prepared and p.data == redefined
    assert p.note == "a JPEG that redefines a quantisation table between scans"


def test_metadata_is_kept_and_preparing_again_changes_nothing() -> None:
    """EXIF survives (APPn segments are copied), one index only; a prepared file prepared
    again is the same file."""
    data = with_exif_orientation(photo(120, 160, 4))
    once = prepare_jpeg(data)
    assert b"Exif\x00\x00" in once and once.count(b"feedline-mcu-index") == 1
    twice = prepare_jpeg(once)
    assert twice == once
    np.testing.assert_array_equal(cv2.imdecode(np.frombuffer(twice, np.uint8), 1),
                                  cv2.imdecode(np.frombuffer(data, np.uint8), 1))


def test_broken_jpegs_are_a_corrupt_image_naming_the_source() -> None:
    data = _jpeg("420", 100, 120)
    with pytest.raises(CorruptImage, match="broken.jpg: .*Premature end"):
        prepare(data[:len(data) // 2], source="broken.jpg")
    with pytest.raises(CorruptImage, match="over the limit"):
        prepare(data, max_pixels=100 * 119)


def test_without_the_extension_prepared_files_decode_with_opencv(tmp_path: Path) -> None:
    """Where the extension is not built: preparing says it needs it, is_prepared is False,
    and OpenCV decodes a prepared file to the original's images."""
    jpg, prepared = tmp_path / "a.jpg", tmp_path / "b.jpg"
    jpg.write_bytes(encode(photo(300, 400, 6), 85))
    prepared.write_bytes(prepare_jpeg(jpg.read_bytes()))
    script = (
        "import sys\n"
        "sys.modules['feedline.producer.image._jpegturbo'] = None\n"
        "import numpy as np\n"
        "from feedline.producer.image import ImageNetTrain, turbo\n"
        "from feedline.producer.image.prepared import is_prepared, prepare\n"
        "a, b = (np.fromfile(p, np.uint8) for p in sys.argv[1:3])\n"
        "assert not is_prepared(b)\n"
        "try:\n    prepare(a)\nexcept turbo.Unsupported as e:\n    print(e)\n"
        "t1, t2 = ImageNetTrain(224, seed=1), ImageNetTrain(224, seed=1)\n"
        "assert all(np.array_equal(t1(a), t2(b)) for _ in range(5))\n")
    out = subprocess.run([sys.executable, "-c", script, str(jpg), str(prepared)],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "preparing JPEGs needs the compiled extension" in out.stdout


def test_lmdb_build_prepares_jpegs_and_keeps_everything_else(tmp_path: Path) -> None:
    """``feedline lmdb build --prepare-jpeg``: JPEGs stored prepared (their pixels the
    originals'), a PNG, a CMYK JPEG and a broken JPEG stored byte for byte (the broken one
    named in a warning), in order with their labels; the summary counts each kind."""
    from feedline.producer.dataflow import LMDBSerializer

    img = photo(120, 160, 2)
    files = {"c0/a.jpg": encode(img, 90), "c0/b.png": cv2.imencode(".png", img)[1].tobytes(),
             "c1/c.jpg": cmyk(img), "c1/d.jpg": encode(photo(200, 150, 3), 80, "444"),
             "c1/e.jpg": encode(img, 90)[:700]}
    for name, data in files.items():
        (tmp_path / "imgs" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "imgs" / name).write_bytes(data)
    out = tmp_path / "p.lmdb"
    r = subprocess.run([sys.executable, "-m", "feedline.commands", "lmdb", "build",
                        str(tmp_path / "imgs"), str(out), "--prepare-jpeg", "--jobs", "2",
                        "--no-progress"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "wrote 5 images" in r.stdout and "2 JPEGs prepared" in r.stdout, r.stdout
    assert "3 stored as they were" in r.stdout and "not a JPEG" in r.stdout, r.stdout
    assert "e.jpg" in r.stderr and "stored as it is" in r.stderr
    df = LMDBSerializer.load(out)
    df.reset_state()
    stored = list(df)
    assert [dp[1] for dp in stored] == [0, 0, 1, 1, 1]
    for (name, data), (got, _) in zip(sorted(files.items()), stored, strict=True):
        if name.endswith(("a.jpg", "d.jpg")):
            assert is_prepared(got)
            np.testing.assert_array_equal(cv2.imdecode(got, 1),
                                          cv2.imdecode(np.frombuffer(data, np.uint8), 1))
        else:
            assert bytes(got) == data, name


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                    reason="benchmarks/restart_cost.py builds its C harness")
def test_the_restart_cost_benchmark_measures_the_extensions_own_crops(tmp_path: Path) -> None:
    """benchmarks/restart_cost.py (benchmarks/NOTES.md, "What the restart markers cost"):
    its synthetic crops are the extension's (it exits if their pixels differ: its rectangle
    must follow _jpegturbo.c's), and the marker-free copies it times decode to the same pixels
    and are smaller (the markers are all they lose), for every sampling and grey."""
    for i, kind in enumerate(KINDS):
        (tmp_path / f"{kind}.jpg").write_bytes(_jpeg(kind, 500 + 37 * i, 700 - 41 * i,
                                                     index=i))
    run = subprocess.run([sys.executable, "benchmarks/restart_cost.py", str(tmp_path),
                          "--files", "8", "--crops", "6", "--rounds", "1"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"{6 * len(KINDS)} synthetic crops" in run.stdout, run.stdout
    rows = [line.split("|") for line in run.stdout.splitlines()
            if line.startswith("| as built") or line.startswith("| same tables")]
    assert len(rows) == 2, run.stdout
    for row in rows:
        assert 0.5 < float(row[2]) < 1.0, row  # bytes without markers, to with them

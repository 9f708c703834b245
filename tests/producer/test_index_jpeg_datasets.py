"""``feedline convert --index-jpeg`` and ``feedline lmdb build --index-jpeg``, run as a user
runs them: each JPEG stored byte for byte with its side index, the ``webdataset`` and
``lmdb`` sources hand the index to the decoder, and a crop decoded by it is the plain
decode's; an index damaged where it is stored (a flipped byte) is refused, the image
decoded without it and the refusal counted; what cannot be indexed is stored without one."""

from __future__ import annotations

import hashlib
import logging
import subprocess
import sys
import tarfile
from pathlib import Path

import cv2
import lmdb
import numpy as np
import pytest

from feedline.producer.dataflow import LMDBSerializer
from feedline.producer.dataflow.image_folder import FileBytes
from feedline.producer.dataflow.lmdb_serializer import index_key
from feedline.producer.dataflow.webdataset import WebDataset
from feedline.producer.image import ImageNetTrain, turbo
from feedline.producer.image.jpgindex import check_index
from feedline.producer.pipeline import build_pipeline
from tests.support import ROOT
from tests.support.jpeg_data import encode, photo

pytestmark = pytest.mark.skipif(not turbo.AVAILABLE, reason=turbo.decoder_info())


def feedline(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "feedline.commands", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


# name -> bytes, sorted as the folder reads them: baseline JPEGs of each sampling and grey
# (indexed), a progressive JPEG and a PNG (stored without an index).
def _files() -> dict[str, bytes]:
    grey = cv2.cvtColor(photo(240, 360, 5), cv2.COLOR_BGR2GRAY)
    return {"c0/a.jpg": encode(photo(300, 400, 1), 90),
            "c0/b.jpg": encode(photo(333, 501, 2), 85, "444"),
            "c0/c.png": cv2.imencode(".png", photo(60, 80, 3))[1].tobytes(),
            "c1/d.jpg": encode(photo(270, 350, 4), 88, "422"),
            "c1/e.jpg": encode(grey, 90),
            "c1/f.jpg": encode(photo(200, 260, 6), 90, progressive=True)}


INDEXED = {"c0/a.jpg", "c0/b.jpg", "c1/d.jpg", "c1/e.jpg"}


@pytest.fixture
def images(tmp_path: Path) -> Path:
    for name, data in _files().items():
        (tmp_path / "images" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "images" / name).write_bytes(data)
    return tmp_path / "images"


def _shards(out: Path, jpeg_index: bool = True) -> list[list]:
    ds = WebDataset(manifest=str(out / "manifest.json"), shuffle=False, read_ahead=1,
                    jpeg_index=jpeg_index)
    ds.reset_state()
    return [list(dp) for dp in ds]


def _converted(images: Path, out: Path) -> list[list]:
    r = feedline("convert", str(images), str(out), "--index-jpeg", "--workers", "2",
                 "--shard-size", "100KB", "--no-progress")
    assert r.returncode == 0, r.stderr
    assert "indexed 4 JPEGs (" in r.stdout and "stored without an index: " in r.stdout
    assert "not a JPEG: 1" in r.stdout and "not a baseline JPEG" in r.stdout, r.stdout
    return _shards(out)


def _crops_match(data: FileBytes, name: str) -> None:
    """``data`` (a reader's image, with its index) decodes every crop as the plain file:
    at 8/8 a full decode's crop, at the preset's scales the fused decoder's without the
    index, and ImageNetTrain's images with the same seed."""
    plain = np.frombuffer(data.tobytes(), np.uint8)  # the same bytes, no index
    hw = turbo.header(plain)
    full = cv2.imdecode(plain, cv2.IMREAD_COLOR)
    assert full is not None
    rng = np.random.default_rng(len(name))
    for _ in range(12):
        y0, x0 = int(rng.integers(0, hw[0] - 1)), int(rng.integers(0, hw[1] - 1))
        y1, x1 = int(rng.integers(y0 + 1, hw[0] + 1)), int(rng.integers(x0 + 1, hw[1] + 1))
        got = turbo.decode_box(data, hw, (y0, x0, y1, x1), (y1 - y0, x1 - x0), scales=(8,),
                               index=data.jpeg_index)
        np.testing.assert_array_equal(got, full[y0:y1, x0:x1], err_msg=name)
        out = (int(rng.integers(8, 120)), int(rng.integers(8, 120)))
        np.testing.assert_array_equal(
            turbo.decode_box(data, hw, (y0, x0, y1, x1), out, index=data.jpeg_index),
            turbo.decode_box(plain, hw, (y0, x0, y1, x1), out), err_msg=name)
    a, b = ImageNetTrain(224, seed=4), ImageNetTrain(224, seed=4)
    for _ in range(6):
        np.testing.assert_array_equal(a(data), b(plain), err_msg=name)


def test_converted_shards_store_each_jpeg_with_its_index(images: Path, tmp_path: Path):
    before = turbo.index_refusals()
    stored = _converted(images, tmp_path / "out")
    files = _files()
    assert [int(label) for _, label in stored] == [0, 0, 0, 1, 1, 1]
    for (name, original), (data, _) in zip(sorted(files.items()), stored, strict=True):
        # The stored bytes are the original's; the index rides beside them.
        assert hashlib.sha256(data.tobytes()).digest() == hashlib.sha256(original).digest()
        if name in INDEXED:
            check_index(data, data.jpeg_index)
            _crops_match(data, name)
        else:
            assert data.jpeg_index is None, name
    assert turbo.index_refusals() == before  # every index fitted its file
    with tarfile.open(tmp_path / "out" / "shard-000000.tar") as tar:
        assert tar.getnames()[:3] == ["00000000.jpg", "00000000.jpgidx", "00000000.cls"]
    off = _shards(tmp_path / "out", jpeg_index=False)
    assert all(d.jpeg_index is None for d, _ in off)


def test_an_lmdb_stores_each_jpeg_with_its_index(images: Path, tmp_path: Path):
    db = tmp_path / "train.lmdb"
    r = feedline("lmdb", "build", str(images), str(db), "--index-jpeg", "--jobs", "2",
                 "--no-progress")
    assert r.returncode == 0, r.stderr
    assert "wrote 6 images" in r.stdout and "4 JPEGs indexed (" in r.stdout, r.stdout
    assert "2 stored without an index: " in r.stdout, r.stdout
    info = feedline("lmdb", "info", str(db))
    assert "indexes:  4 JPEG side indexes" in info.stdout, info.stdout
    files = _files()
    for shuffle in (False, True):
        df = LMDBSerializer.load(db, shuffle=shuffle)
        df.reset_state()
        got = {bytes(d): d for d, _ in df}
        assert sorted(got) == sorted(files.values())
        for name, original in files.items():
            data = got[original]
            if name in INDEXED:
                check_index(data, data.jpeg_index)
            else:
                assert getattr(data, "jpeg_index", None) is None, name
    df = LMDBSerializer.load(db)
    for i in range(df.samples()):  # exact delivery's access, in the file's (sorted) order
        data, _ = df.sample(i)
        name = sorted(files)[i]
        assert bytes(data) == files[name]
        if name in INDEXED:
            _crops_match(data, name)
    off = LMDBSerializer.load(db, jpeg_index=False)
    assert getattr(off.sample(0)[0], "jpeg_index", None) is None


def test_pipeline_files_take_the_indexes_or_leave_them(images: Path, tmp_path: Path):
    _converted(images, tmp_path / "out")
    db = tmp_path / "train.lmdb"
    assert feedline("lmdb", "build", str(images), str(db), "--index-jpeg",
                    "--no-progress").returncode == 0
    for source in ({"webdataset": {"manifest": str(tmp_path / "out" / "manifest.json"),
                                   "shuffle": False}},
                   {"lmdb": {"path": str(db)}}):
        for on in (True, False):
            (kind, args), = source.items()
            df = build_pipeline({"source": {kind: {**args, "jpeg_index": on}}})
            df.reset_state()
            try:
                first = next(iter(df))[0]
            finally:
                df.close()
            assert (getattr(first, "jpeg_index", None) is not None) == on, (kind, on)


def _flip_in_member(shard: Path, member: str, at: int) -> None:
    """Flips one bit of byte ``at`` of ``member``'s data, in place (bit rot on the disk)."""
    with tarfile.open(shard) as tar:
        info = tar.getmember(member)
    raw = bytearray(shard.read_bytes())
    raw[info.offset_data + at] ^= 0x10
    shard.write_bytes(bytes(raw))


@pytest.mark.parametrize("at", [5, 100, -3])  # the header, an entry, the index's checksum
def test_a_damaged_index_in_a_shard_decodes_right_and_is_counted(
        images: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, at: int):
    stored = _converted(images, tmp_path / "out")
    shard = tmp_path / "out" / "shard-000000.tar"
    size = len(stored[0][0].jpeg_index)
    _flip_in_member(shard, "00000000.jpgidx", at % size)
    (data, _), = _shards(tmp_path / "out")[:1]
    assert data.jpeg_index != stored[0][0].jpeg_index  # the damaged one is what came
    before = turbo.index_refusals()
    a, b = ImageNetTrain(224, seed=9), ImageNetTrain(224, seed=9)
    plain = np.frombuffer(_files()["c0/a.jpg"], np.uint8)
    with caplog.at_level(logging.WARNING):
        for _ in range(5):
            np.testing.assert_array_equal(a(data), b(plain))
    assert turbo.index_refusals() == before + 5  # each decode fell back, and was counted
    warned = [r.getMessage() for r in caplog.records if "decoded without it" in r.getMessage()]
    assert len(warned) == 1 and "shard-000000.tar#00000000.jpg" in warned[0], warned


def test_a_damaged_index_in_an_lmdb_decodes_right_and_is_counted(images: Path,
                                                                  tmp_path: Path):
    db = tmp_path / "train.lmdb"
    assert feedline("lmdb", "build", str(images), str(db), "--index-jpeg",
                    "--no-progress").returncode == 0
    env = lmdb.open(str(db), subdir=False, lock=False)
    with env.begin(write=True) as txn:
        index = bytearray(txn.get(index_key(0)) or b"")
        index[len(index) // 2] ^= 0x01
        txn.put(index_key(0), bytes(index))
    env.close()
    data, _ = LMDBSerializer.load(db).sample(0)
    assert data.jpeg_index == bytes(index)
    before = turbo.index_refusals()
    a, b = ImageNetTrain(224, seed=2), ImageNetTrain(224, seed=2)
    plain = np.frombuffer(_files()["c0/a.jpg"], np.uint8)
    for _ in range(4):
        np.testing.assert_array_equal(a(data), b(plain))
    assert turbo.index_refusals() == before + 4


@pytest.mark.parametrize("command", [["convert", "IMAGES", "OUT"],
                                     ["lmdb", "build", "IMAGES", "OUT.lmdb"]])
def test_prepare_and_index_together_is_a_one_line_error(images: Path, tmp_path: Path,
                                                        command: list[str]):
    args = [str(images) if a == "IMAGES" else str(tmp_path / a) if a.startswith("OUT")
            else a for a in command]
    r = feedline(*args, "--prepare-jpeg", "--index-jpeg")
    assert r.returncode != 0 and r.stderr.count("\n") == 1, r.stderr
    assert "--prepare-jpeg and --index-jpeg: one or the other" in r.stderr
    assert not (tmp_path / "OUT.lmdb").exists() and not (tmp_path / "OUT").exists()

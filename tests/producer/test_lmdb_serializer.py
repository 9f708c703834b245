"""LMDB files: round trip, shuffle, shards, reopening after fork, and `feedline lmdb`."""

from __future__ import annotations

import multiprocessing as mp
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from feedline.producer.dataflow import DataFromList, ImageFolder, LMDBSerializer, MultiProcessRunner
from feedline.producer.dataflow.lmdb_serializer import lmdb_info
from tests.support.jpeg_data import make_folder

ROOT = Path(__file__).resolve().parents[2]


def points(n: int) -> list:
    return [[np.full((3, 2), i, np.int16), i, f"name-{i}".encode()] for i in range(n)]


@pytest.fixture
def db(tmp_path: Path) -> Path:
    path = tmp_path / "data.lmdb"
    assert LMDBSerializer.save(DataFromList(points(37), shuffle=False), path,
                               write_frequency=5, progress=False) == 37
    return path


def test_round_trip_is_exact_and_sequential(db: Path) -> None:
    df = LMDBSerializer.load(db)
    df.reset_state()
    out = list(df)
    assert len(df) == 37 == len(out)
    for i, (arr, label, name) in enumerate(out):
        assert label == i and name == f"name-{i}".encode()
        assert arr.dtype == np.int16 and arr.shape == (3, 2) and (arr == i).all()
    assert [dp[1] for dp in df] == list(range(37)), "a second pass is the same"
    assert lmdb_info(db)["count"] == 37


def test_shuffled_reading_and_shards(db: Path) -> None:
    df = LMDBSerializer.load(db, shuffle=True, seed=2)
    df.reset_state()
    a, b = [dp[1] for dp in df], [dp[1] for dp in df]
    assert sorted(a) == sorted(b) == list(range(37)) and a != b
    seen = []
    for i in range(3):
        for shuffle in (False, True):
            s = LMDBSerializer.load(db, shuffle=shuffle, shard=(i, 3))
            s.reset_state()
            got = [dp[1] for dp in s]
            assert len(got) == len(s) and sorted(got) == list(range(i, 37, 3))
        seen += got
    assert sorted(seen) == list(range(37))


def test_save_refuses_to_overwrite_unless_asked(db: Path) -> None:
    with pytest.raises(FileExistsError):
        LMDBSerializer.save(DataFromList(points(2)), db, progress=False)
    LMDBSerializer.save(DataFromList(points(2)), db, progress=False, overwrite=True)
    assert lmdb_info(db)["count"] == 2


def _child_reads(df, q) -> None:
    q.put([dp[1] for dp in df])


def test_reopen_after_fork(db: Path) -> None:
    df = LMDBSerializer.load(db)
    df.reset_state()
    assert next(iter(df))[1] == 0  # the parent holds the file open
    q = mp.get_context("fork").Queue()
    p = mp.get_context("fork").Process(target=_child_reads, args=(df, q))
    p.start()
    got = q.get(timeout=30)
    p.join(10)
    assert p.exitcode == 0 and got == list(range(37))
    assert [dp[1] for dp in df] == list(range(37)), "the parent's handle still works"
    with MultiProcessRunner(LMDBSerializer.load(db), 2, strict=True) as r:
        r.reset_state()
        assert sorted(dp[1] for dp in r) == list(range(37))


def test_map_size_grows_as_needed(tmp_path: Path, monkeypatch) -> None:
    from feedline.producer.dataflow import lmdb_serializer

    monkeypatch.setattr(lmdb_serializer, "INITIAL_MAP_SIZE", 1 << 16)
    big = [[np.zeros(20000, np.uint8), i] for i in range(20)]
    LMDBSerializer.save(DataFromList(big, shuffle=False), tmp_path / "big.lmdb",
                        write_frequency=7, progress=False)
    df = LMDBSerializer.load(tmp_path / "big.lmdb")
    assert len(df) == 20


def feedline(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "feedline.commands", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_lmdb_build_and_info_commands(tmp_path: Path) -> None:
    paths = make_folder(tmp_path / "imgs", classes=3, per_class=3)
    out = tmp_path / "imgs.lmdb"
    r = feedline("lmdb", "build", str(tmp_path / "imgs"), str(out))
    assert r.returncode == 0, r.stderr
    assert "wrote 9 images" in r.stdout and "9/9" in r.stderr  # the progress bar
    r = feedline("lmdb", "info", str(out))
    assert r.returncode == 0 and "count:    9" in r.stdout
    df = LMDBSerializer.load(out)
    df.reset_state()
    stored = [(bytes(dp[0]), dp[1]) for dp in df]
    folder = ImageFolder(tmp_path / "imgs", shuffle=False)
    folder.reset_state()
    assert stored == [(bytes(d), lab) for d, lab in folder]
    assert stored[0][0] == paths[0].read_bytes() and [s[1] for s in stored] == [0] * 3 + [1] * 3 \
        + [2] * 3
    r = feedline("lmdb", "build", str(tmp_path / "imgs"), str(out))
    assert r.returncode == 1 and "--overwrite" in r.stderr
    r = feedline("lmdb", "info", str(tmp_path / "missing.lmdb"))
    assert r.returncode == 1 and "missing.lmdb" in r.stderr


def test_image_folder_from_class_folders_or_a_list_file(tmp_path: Path) -> None:
    paths = make_folder(tmp_path / "imgs", classes=2, per_class=3)
    df = ImageFolder(tmp_path / "imgs", shuffle=False, read=False)
    df.reset_state()
    assert df.classes == ["c0", "c1"] and len(df) == 6
    assert list(df) == [[str(p), i // 3] for i, p in enumerate(paths)]
    (tmp_path / "imgs" / "val.txt").write_text(
        "# path label\nc1/0001.jpg 7\n\nc0/0000.jpg 3\n")
    lf = ImageFolder(list_file=tmp_path / "imgs" / "val.txt", shuffle=False)
    lf.reset_state()
    got = [(bytes(d), lab) for d, lab in lf]
    assert got == [(paths[4].read_bytes(), 7), (paths[0].read_bytes(), 3)]
    (tmp_path / "bad.txt").write_text("only-a-path.jpg\n")
    with pytest.raises(ValueError, match="bad.txt:1"):
        ImageFolder(list_file=tmp_path / "bad.txt")
    with pytest.raises(ValueError, match="root or list_file"):
        ImageFolder()

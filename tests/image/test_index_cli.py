"""``feedline index`` (feedline/producer/index_cli.py), run as a user runs it: a side index
beside each JPEG of a folder, the JPEGs untouched (sha256), a run resumed keeps what fits,
what cannot be indexed is counted by reason, a corrupt file is named and the rest indexed,
and the folder then decodes through ``image_folder`` to the same images."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from feedline.producer.dataflow.image_folder import ImageFolder
from feedline.producer.image import ImageNetTrain, turbo
from feedline.producer.image.jpgindex import check_index, index_path
from tests.support import ROOT
from tests.support.jpeg_data import encode, photo

pytestmark = pytest.mark.skipif(not turbo.AVAILABLE, reason=turbo.decoder_info())


def feedline(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "feedline.commands", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def _folder(root: Path) -> list[Path]:
    paths = []
    for k in range(2):
        (root / f"c{k}" / "deeper").mkdir(parents=True)
        for n in range(5):
            p = root / f"c{k}" / ("deeper" if n % 2 else "") / f"{n}.jpg"
            p.write_bytes(encode(photo(90 + 17 * n, 120 + 9 * k, n + k), 85))
            paths.append(p)
    return paths


def _sha(paths: list[Path]) -> list[str]:
    return [hashlib.sha256(p.read_bytes()).hexdigest() for p in paths]


def test_index_a_folder_then_decode_it(tmp_path: Path) -> None:
    paths = _folder(tmp_path)
    before = _sha(paths)
    r = feedline("index", str(tmp_path), "--workers", "2", "--no-progress")
    assert r.returncode == 0, r.stderr
    assert f"indexed 10 of 10 JPEGs under {tmp_path}" in r.stdout
    assert _sha(paths) == before  # the JPEGs are byte for byte what they were
    for p in paths:
        check_index(p.read_bytes(), index_path(p).read_bytes())
    plain = ImageFolder(tmp_path, shuffle=False, jpeg_index=False)
    indexed = ImageFolder(tmp_path, shuffle=False)
    a, b = ImageNetTrain(seed=1), ImageNetTrain(seed=1)
    for (x, _), (y, _) in zip(plain, indexed, strict=True):
        assert x.jpeg_index is None and y.jpeg_index is not None
        np.testing.assert_array_equal(a(x), b(y))


def test_a_second_run_keeps_what_fits_and_rebuilds_what_does_not(tmp_path: Path) -> None:
    paths = _folder(tmp_path)
    assert feedline("index", str(tmp_path), "--no-progress").returncode == 0
    index_path(paths[3]).write_bytes(b"FLJI not an index")
    r = feedline("index", str(tmp_path), "--no-progress")
    assert r.returncode == 0, r.stderr
    assert "indexed 10 of 10 JPEGs" in r.stdout and "(9 already were)" in r.stdout
    check_index(paths[3].read_bytes(), index_path(paths[3]).read_bytes())
    assert not list(tmp_path.rglob("*.partial"))


def test_what_is_not_indexed_is_counted_and_named(tmp_path: Path) -> None:
    paths = _folder(tmp_path)
    (tmp_path / "c0" / "progressive.jpg").write_bytes(encode(photo(90, 120), 85,
                                                             progressive=True))
    (tmp_path / "c0" / "cut.jpg").write_bytes(paths[1].read_bytes()[:-300])
    r = feedline("index", str(tmp_path), "--no-progress")
    assert r.returncode == 0, r.stderr
    assert "indexed 10 of 12 JPEGs" in r.stdout
    assert "not indexed, not a baseline JPEG (progressive, lossless or arithmetic-coded): 1" \
        in r.stdout
    assert "corrupt or unreadable: 1" in r.stdout
    assert f"{tmp_path / 'c0' / 'cut.jpg'}:" in r.stderr
    assert not index_path(tmp_path / "c0" / "progressive.jpg").exists()


def test_bad_arguments_are_one_line_errors(tmp_path: Path) -> None:
    for args, says in [([str(tmp_path / "nope")], "not a directory"),
                       ([str(tmp_path)], "no .jpg or .jpeg files"),
                       ([str(tmp_path), "--step", "0"], "--step 0: expected 1..255"),
                       ([str(tmp_path), "--workers", "0"], "--workers 0: expected >= 1")]:
        r = feedline("index", *args, "--no-progress")
        assert r.returncode == 1 and says in r.stderr, (args, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1

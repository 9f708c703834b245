"""``feedline convert`` and ``feedline info``: an image folder or an LMDB as WebDataset shards
(the same bytes whatever the number of workers, sample ``i`` of the source as sample ``i`` of
the shards), a manifest whose counts and checksums hold, and a listing that finds corrupt
records."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

from feedline.producer.dataflow import ImageFolder, LMDBSerializer
from feedline.producer.dataflow.webdataset import WebDataset
from tests.conftest import ROOT
from tests.jpeg_data import make_folder


def feedline(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "feedline.commands", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def shards_of(out: Path) -> list[tuple[bytes, int]]:
    ds = WebDataset(manifest=str(out / "manifest.json"), shuffle=False, read_ahead=1)
    ds.reset_state()
    return [(d.tobytes(), int(i)) for d, i in ds]


def test_an_image_folder_as_shards_in_order_with_a_manifest(tmp_path: Path):
    make_folder(tmp_path / "images", classes=3, per_class=6)
    r1 = feedline("convert", str(tmp_path / "images"), str(tmp_path / "one"), "--shard-size",
                  "30KB", "--no-progress")
    r2 = feedline("convert", str(tmp_path / "images"), str(tmp_path / "two"), "--shard-size",
                  "30KB", "--workers", "2")
    assert r1.returncode == 0 and r2.returncode == 0, r1.stderr + r2.stderr
    assert "100%" in r2.stderr  # the progress bar
    m = json.loads((tmp_path / "one" / "manifest.json").read_text())
    assert m == json.loads((tmp_path / "two" / "manifest.json").read_text())  # same bytes
    assert len(m["shards"]) >= 3 and m["samples"] == 18
    for s in m["shards"]:
        data = (tmp_path / "one" / s["name"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == s["sha256"] and len(data) == s["bytes"]
    folder = ImageFolder(tmp_path / "images", shuffle=False)
    assert shards_of(tmp_path / "one") == [(bytes(folder.sample(i)[0]), folder.sample(i)[1])
                                           for i in range(18)]
    again = feedline("convert", str(tmp_path / "images"), str(tmp_path / "one"))
    assert again.returncode == 1 and "exists (--overwrite replaces it)" in again.stderr


def test_an_lmdb_as_shards(tmp_path: Path):
    make_folder(tmp_path / "images", classes=2, per_class=4)
    LMDBSerializer.save(ImageFolder(tmp_path / "images", shuffle=False), tmp_path / "d.lmdb",
                        progress=False)
    r = feedline("convert", str(tmp_path / "d.lmdb"), str(tmp_path / "out"), "--no-progress")
    assert r.returncode == 0, r.stderr
    folder = ImageFolder(tmp_path / "images", shuffle=False)
    assert shards_of(tmp_path / "out") == [(bytes(folder.sample(i)[0]), folder.sample(i)[1])
                                           for i in range(8)]
    assert (tmp_path / "out" / "shard-000000.tar").is_file()


def test_info_lists_shards_writes_their_manifest_and_names_corrupt_records(tmp_path: Path):
    make_folder(tmp_path / "images", classes=2, per_class=5)
    assert feedline("convert", str(tmp_path / "images"), str(tmp_path / "out"),
                    "--shard-size", "20KB", "--no-progress").returncode == 0
    r = feedline("info", str(tmp_path / "out" / "shard-*.tar"), "--manifest",
                 str(tmp_path / "check.json"))
    assert r.returncode == 0, r.stderr
    assert "10 samples" in r.stdout and "jpg (" in r.stdout and "cls (" in r.stdout
    mine = json.loads((tmp_path / "check.json").read_text())
    theirs = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert [(s["name"], s["samples"], s["sha256"]) for s in mine["shards"]] == \
        [(s["name"], s["samples"], s["sha256"]) for s in theirs["shards"]]
    listed = feedline("info", str(tmp_path / "out" / "manifest.json"))
    assert listed.returncode == 0 and "10 samples" in listed.stdout
    shard = tmp_path / "out" / "shard-000000.tar"
    data = bytearray(shard.read_bytes())
    data[512 * 3 + 7] ^= 0xFF  # somewhere in the first sample's data or the next header
    shard.write_bytes(bytes(data[:len(data) // 2]))
    r = feedline("info", str(shard))
    assert r.returncode == 0 and "corrupt: " in r.stdout and "shard-000000.tar#" in r.stdout


def test_prepare_jpeg_says_when_this_build_lacks_it(tmp_path: Path):
    from feedline.producer import image

    make_folder(tmp_path / "images", classes=1, per_class=2)
    r = feedline("convert", str(tmp_path / "images"), str(tmp_path / "out"), "--prepare-jpeg")
    if hasattr(image, "prepare_jpeg"):  # a build with the transcoder: it is used
        assert r.returncode == 0, r.stderr
    else:
        assert r.returncode == 1
        assert r.stderr.strip() == ("feedline convert: --prepare-jpeg: not available in this "
                                    "build (it needs feedline.producer.image.prepare_jpeg, the "
                                    "lossless restart-interval transcode); convert without it")
        assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_bad_arguments_are_one_line(tmp_path: Path):
    r = feedline("convert", str(tmp_path / "nothing"), str(tmp_path / "out"))
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "no such image folder" in r.stderr
    r = feedline("convert", str(tmp_path), str(tmp_path / "out"), "--shard-size", "big")
    assert r.returncode == 1 and "--shard-size 'big'" in r.stderr
    r = feedline("info", str(tmp_path / "none-*.tar"))
    assert r.returncode == 1 and "matches no file" in r.stderr

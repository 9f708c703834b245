"""``feedline convert`` and ``feedline info``: an image folder or an LMDB as WebDataset shards
(the same bytes whatever the number of workers, sample ``i`` of the source as sample ``i`` of
the shards), a manifest whose counts and checksums hold, and a listing that finds corrupt
records."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import cv2
import numpy as np
import pytest

from feedline.procs import wait_for
from feedline.producer.dataflow import ImageFolder, LMDBSerializer
from feedline.producer.dataflow.webdataset import WebDataset
from feedline.producer.image import ImageNetTrain, is_prepared, turbo
from tests.support import ROOT
from tests.support.jpeg_data import encode, make_folder, photo


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
    assert again.returncode == 1 and "exists (--overwrite replaces" in again.stderr


def samples_of_glob(pattern: str) -> list[int]:
    """The labels of every sample a pipeline reading ``pattern`` (the docs' glob) gets."""
    ds = WebDataset(pattern, fields=("cls",), shuffle=False, read_ahead=1)
    ds.reset_state()
    return [int(d[0]) for d in ds]


def test_overwrite_replaces_the_whole_previous_conversion(tmp_path: Path):
    """Issue 53 finding 9: ``--overwrite`` with a larger ``--shard-size`` left the old
    conversion's extra shards beside the new manifest, and the docs' glob ``shard-*.tar``
    then read 78 of 90 samples twice. Now the shards the old manifest lists that the new
    conversion does not write are removed (and said so); a file no manifest names is never
    removed: the conversion refuses it in one line before writing anything."""
    make_folder(tmp_path / "images", classes=3, per_class=30, seed=1)
    out = tmp_path / "out"
    small = feedline("convert", str(tmp_path / "images"), str(out), "--shard-size", "10KB",
                     "--no-progress")
    assert small.returncode == 0, small.stderr
    before = sorted(p.name for p in out.glob("shard-*.tar"))
    assert len(before) > 4
    big = feedline("convert", str(tmp_path / "images"), str(out), "--shard-size", "1MB",
                   "--no-progress", "--overwrite")
    assert big.returncode == 0, big.stderr
    m = json.loads((out / "manifest.json").read_text())
    assert sorted(p.name for p in out.glob("shard-*.tar")) == [s["name"] for s in m["shards"]]
    assert f"removed {len(before) - len(m['shards'])} shards of the previous" in big.stdout
    labels = samples_of_glob(str(out / "shard-*.tar"))
    assert len(labels) == 90 and sorted(labels) == sorted(i // 30 for i in range(90))

    # A shard this prefix names that no manifest lists: refused, nothing written or removed.
    (out / "shard-000123.tar").write_bytes(b"not ours")
    (out / "notes.txt").write_text("mine")
    state = sorted((p.name, p.stat().st_mtime_ns) for p in out.iterdir())
    r = feedline("convert", str(tmp_path / "images"), str(out), "--shard-size", "10KB",
                 "--no-progress", "--overwrite")
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "shard-000123.tar: a shard that" in r.stderr and "does not list" in r.stderr
    assert sorted((p.name, p.stat().st_mtime_ns) for p in out.iterdir()) == state
    (out / "shard-000123.tar").unlink()
    # Without --overwrite a folder holding a conversion is refused as well.
    r = feedline("convert", str(tmp_path / "images"), str(out), "--prefix", "other",
                 "--no-progress")
    assert r.returncode == 1 and "manifest.json exists (--overwrite replaces" in r.stderr
    assert (out / "notes.txt").read_text() == "mine"


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
                 str(tmp_path / "out" / "check.json"))  # beside them: the same names
    assert r.returncode == 0, r.stderr
    assert "10 samples" in r.stdout and "jpg (" in r.stdout and "cls (" in r.stdout
    mine = json.loads((tmp_path / "out" / "check.json").read_text())
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


@pytest.mark.skipif(not turbo.AVAILABLE, reason=turbo.decoder_info())
def test_prepare_jpeg_shards_decode_to_the_originals_pixels(tmp_path: Path):
    """``--prepare-jpeg`` (two workers): each JPEG is stored prepared (an MCU index) and
    decodes to its original's pixels, whole (OpenCV) and through the fused decoder's crops
    (ImageNetTrain, same seed); a PNG and a broken JPEG are stored byte for byte, the broken
    one named in a warning; sample order and labels as without it."""
    files = {"c0/a.jpg": encode(photo(300, 400, 1), 90), "c0/b.png": cv2.imencode(
        ".png", photo(60, 80, 2))[1].tobytes(), "c1/c.jpg": encode(photo(333, 501, 3), 85,
                                                                    "444", progressive=True),
             "c1/d.jpg": encode(photo(200, 150, 4), 90)[:900]}
    for name, data in files.items():
        (tmp_path / "images" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "images" / name).write_bytes(data)
    r = feedline("convert", str(tmp_path / "images"), str(tmp_path / "out"), "--prepare-jpeg",
                 "--workers", "2", "--shard-size", "100KB", "--no-progress")
    assert r.returncode == 0, r.stderr
    assert "d.jpg" in r.stderr and "stored as it is" in r.stderr, r.stderr
    stored = shards_of(tmp_path / "out")
    assert [label for _, label in stored] == [0, 0, 1, 1]
    for (name, original), (got, _) in zip(sorted(files.items()), stored, strict=True):
        if name in ("c0/a.jpg", "c1/c.jpg"):
            assert is_prepared(got) and got != original, name
            want = cv2.imdecode(np.frombuffer(original, np.uint8), 1)
            np.testing.assert_array_equal(cv2.imdecode(np.frombuffer(got, np.uint8), 1), want)
            a, b = ImageNetTrain(224, seed=5), ImageNetTrain(224, seed=5)
            for _ in range(10):
                np.testing.assert_array_equal(a(np.frombuffer(got, np.uint8)),
                                              b(np.frombuffer(original, np.uint8)))
        else:
            assert got == original, name


def test_prepare_jpeg_without_the_extension_is_a_one_line_error(tmp_path: Path):
    """Where the extension is not built (as after an install without a compiler), the
    transcoder is missing: one line saying so, nothing written."""
    make_folder(tmp_path / "images", classes=1, per_class=2)
    script = ("import runpy, sys\n"
              "sys.modules['feedline.producer.image._jpegturbo'] = None  # as if never built\n"
              "sys.argv = ['feedline', *sys.argv[1:]]\n"
              "runpy.run_module('feedline.commands', run_name='__main__')\n")
    r = subprocess.run([sys.executable, "-c", script, "convert", str(tmp_path / "images"),
                        str(tmp_path / "out"), "--prepare-jpeg"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stderr
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


def _killed_mid_shard(args: list[str], out: Path) -> list[Path]:
    """Run ``feedline convert ARGS`` and kill -9 it while it writes a shard (a partial file
    there); the partial files it left. Tries again (a fresh OUT_DIR content) where the
    shard was renamed before the kill landed."""
    for _ in range(5):
        p = subprocess.Popen([sys.executable, "-m", "feedline.commands", "convert", *args],
                             cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_for(lambda p=p: p.poll() is not None or any(out.glob(".shard-*.partial-*")),
                     60, interval=0.001, what="a partial shard")
        finally:
            p.kill()
            p.wait(10)
        left = sorted(out.glob(".shard-*.partial-*"))
        if left:
            return left
    raise AssertionError("never killed convert while a shard was partial")


def test_an_interrupted_overwrite_leaves_partials_the_next_removes_and_globs_skip(tmp_path):
    """Issue 53, round 2, finding 6: ``convert --overwrite`` killed mid-shard left
    ``.shard-000000.tar.partial-PID``; ``feedline info 'OUT/*.tar*'`` (fsspec's glob takes
    hidden names) read it as a shard, and the next conversion left it there for ever. Now
    the glob skips hidden names, the next conversion removes what a dead one left (and says
    so), and refuses in one line one whose process still runs."""
    images = tmp_path / "images"
    for c in range(2):  # many small files in one shard: seconds of writing to land a kill in
        (images / f"c{c}").mkdir(parents=True)
        for i in range(1500):
            (images / f"c{c}" / f"{i:05d}.jpg").write_bytes(b"\xff\xd8\xff" + bytes(1500))
    out = tmp_path / "out"
    args = [str(images), str(out), "--shard-size", "1GB", "--no-progress"]
    assert feedline("convert", *args).returncode == 0
    left = _killed_mid_shard([*args, "--overwrite"], out)
    info = feedline("info", str(out / "*.tar*"), "--format", "webdataset")
    assert info.returncode == 0, info.stderr
    assert "partial" not in info.stdout and "1 shards, 3000 samples" in info.stdout, info.stdout
    # one whose process runs (a conversion: its command line says so): refused, nothing
    # removed
    writer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)",
                               "feedline", "convert"])
    try:
        running = out / f".shard-000000.tar.partial-{writer.pid}"
        running.write_bytes(b"being written")
        r = feedline("convert", *args, "--overwrite")
    finally:
        writer.kill()
        writer.wait()
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert f"{running}: a shard process {writer.pid} is writing" in r.stderr, r.stderr
    assert running.exists() and all(p.exists() for p in left)
    running.unlink()
    r = feedline("convert", *args, "--overwrite")
    assert r.returncode == 0, r.stderr
    assert f"removed {len(left)} partial shards an interrupted conversion left" in r.stdout
    assert not list(out.glob(".*partial*")), sorted(p.name for p in out.iterdir())
    assert samples_of_glob(str(out / "*.tar*")) == sorted(samples_of_glob(str(out / "*.tar")))


def test_a_partial_of_a_reused_pid_is_removed_not_refused(tmp_path: Path) -> None:
    """The attack review: a partial shard named after this conversion's own PID (a container
    that runs each conversion as the same PID), or after PID 1, was refused as 'a shard
    process N is writing'; the killed conversion's partial stayed for ever. A PID that is
    this process, or a process that is no feedline conversion, is no writer."""
    from feedline.producer import convert_cli

    out = tmp_path / "out"
    out.mkdir()
    mine = out / f".shard-000000.tar.partial-{os.getpid()}"
    init = out / ".shard-000001.tar.partial-1"
    for p in (mine, init):
        p.write_bytes(b"\0" * 512)
    assert sorted(convert_cli._interrupted(out, "shard")) == sorted([mine, init])

"""The demo dataset: real photos from the scikit-image wheel, ImageNet-like JPEGs, no download."""

from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np

from feedline.producer.dataflow import ImageFolder
from feedline.producer.demo_data import build, photo_dir


def test_demo_dataset_is_made_once_from_bundled_photos(tmp_path: Path) -> None:
    assert (photo_dir() / "astronaut.png").is_file()
    out = build(tmp_path / "demo", count=60, progress=False)
    files = sorted(out.rglob("*.jpg"))
    assert len(files) == 60
    images = [cv2.imread(str(f)) for f in files]
    assert all(i is not None for i in images), "every file decodes"
    shapes = [i.shape for i in images if i is not None]
    h, w = np.mean([s[0] for s in shapes]), np.mean([s[1] for s in shapes])
    assert 300 <= h <= 420 and 350 <= w <= 450, (h, w)  # about 400x350, like ImageNet
    assert len({s[:2] for s in shapes}) > 30, "varied sizes"
    df = ImageFolder(out)
    assert len(df) == 60 and len(df.classes) >= 8
    mtimes = [f.stat().st_mtime_ns for f in files]
    build(tmp_path / "demo", count=60, progress=False)
    assert [f.stat().st_mtime_ns for f in files] == mtimes, "second run reuses the files"
    again = build(tmp_path / "other", count=60, progress=False)
    assert [f.read_bytes() for f in sorted(again.rglob("*.jpg"))] == \
        [f.read_bytes() for f in files], "deterministic"

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

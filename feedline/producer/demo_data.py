"""A small ImageNet-like JPEG dataset made from real photos shipped inside scikit-image.

scikit-image's wheel carries a dozen photographs (``skimage/data/*.png|jpg``: astronaut, cat,
coffee, rocket, motorcycle, retina, ...) that it reads without any download (unlike its
``pooch``-fetched extras). :func:`build` cuts random regions out of them, rescales them to
ImageNet-like sizes (about 400x350 on average, some grayscale as in ImageNet) and writes
``OUT/<photo>/<n>.jpg`` at varied JPEG qualities: one class per source photo. Deterministic
for a given ``seed``. Only the files are read: scikit-image is never imported.
Install with the ``demo`` extra: ``pip install '.[demo]'``.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from pathlib import Path

import cv2
import numpy as np
from tqdm import tqdm

from feedline.errors import DataError, Unavailable

# Photographs in the scikit-image wheel (checked against its file list), not synthetic figures.
PHOTOS = ["astronaut.png", "chelsea.png", "coffee.png", "hubble_deep_field.jpg", "ihc.png",
          "motorcycle_left.png", "retina.jpg", "rocket.jpg", "camera.png", "moon.png",
          "coins.png", "grass.png", "gravel.png", "brick.png"]
MARKER = ".complete"


def photo_dir() -> Path:
    """Where scikit-image keeps its bundled images (found without importing it)."""
    spec = importlib.util.find_spec("skimage")
    if spec is None or not spec.submodule_search_locations:
        raise Unavailable("the demo dataset needs scikit-image: pip install 'feedline[demo]'")
    return Path(list(spec.submodule_search_locations)[0]) / "data"


def load_photos() -> dict[str, np.ndarray]:
    """Name -> HxWx3 uint8 BGR image of each bundled photo."""
    d = photo_dir()
    out = {}
    for name in PHOTOS:
        img = cv2.imread(str(d / name), cv2.IMREAD_COLOR)
        if img is not None:
            out[name.rsplit(".", 1)[0]] = img
    if len(out) < 4:
        raise Unavailable(f"expected scikit-image's sample photos in {d}")
    return out


def make_image(src: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """A random region of ``src``, rescaled to an ImageNet-like size (mean ~400x350)."""
    h, w = src.shape[:2]
    area = h * w * rng.uniform(0.25, 1.0)
    ar = float(np.exp(rng.uniform(np.log(0.85), np.log(1.6))))
    cw, ch = min(w, round(np.sqrt(area * ar))), min(h, round(np.sqrt(area / ar)))
    y0, x0 = int(rng.integers(0, h - ch + 1)), int(rng.integers(0, w - cw + 1))
    crop = src[y0:y0 + ch, x0:x0 + cw]
    out_w = int(rng.uniform(300, 500))
    out_h = max(64, round(out_w * ch / cw * rng.uniform(0.9, 1.1)))
    out_h = min(out_h, 600)
    interp = cv2.INTER_AREA if out_w < cw else cv2.INTER_CUBIC
    img = cv2.resize(crop, (out_w, out_h), interpolation=interp)
    if rng.random() < 0.5:
        img = cv2.flip(img, 1)
    return img


def build(out: str | Path, count: int = 256, seed: int = 0, progress: bool = True,
          make: Callable[[np.ndarray, np.random.Generator], np.ndarray] = make_image,
          tag: str = "") -> Path:
    """Write ``count`` JPEGs under ``out/<photo>/``; returns ``out``. Skips the work if a
    complete dataset of that count is already there. ``make(photo, rng)`` draws one image
    from a photo (the demo's recipe by default; ``tag`` names another in the marker)."""
    out = Path(out)
    marker = out / MARKER
    key = f"{tag} {count} {seed}" if tag else f"{count} {seed}"
    if marker.exists() and marker.read_text().strip() == key:
        return out
    photos = load_photos()
    names = sorted(photos)
    rng = np.random.default_rng(seed)
    for name in names:
        (out / name).mkdir(parents=True, exist_ok=True)
    for i in tqdm(range(count), desc=f"making {count} {tag or 'demo'} JPEGs", unit="img",
                  disable=not progress):
        name = names[i % len(names)]
        img = make(photos[name], rng)
        quality = int(rng.integers(75, 96))
        ok, enc = cv2.imencode(".jpg", img, [cv2.IMWRITE_JPEG_QUALITY, quality])
        if not ok:
            raise DataError("JPEG encoding failed")
        # Two processes may build the same set at once (tests in parallel, two demos): each
        # writes its own temporary file; the bytes are the same, the last rename wins.
        tmp = out / name / f".{i:06d}.{os.getpid()}.jpg.tmp"
        tmp.write_bytes(enc.tobytes())
        os.replace(tmp, out / name / f"{i:06d}.jpg")
    marker.write_text(key + "\n")
    return out


def default_dir(cache_home: str | None, count: int, seed: int = 0) -> Path:
    """``$XDG_CACHE_HOME/feedline/demo-jpeg-N-S`` (``~/.cache`` when unset)."""
    base = Path(cache_home) if cache_home else Path.home() / ".cache"
    return base / "feedline" / f"demo-jpeg-{count}-{seed}"

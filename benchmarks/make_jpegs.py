"""Make folders of realistic JPEGs for the pipeline benchmark (no download).

Regions of the real photographs inside scikit-image's wheel, one class folder per photo,
JPEG quality 75-95, in two sets:

- ``--set imagenet`` (default): rescaled to ImageNet-like sizes (about 400x350 on average),
  the demo dataset's recipe (``feedline/producer/demo_data.py``);
- ``--set highres``: about 1000x750 on average (800-1200 wide), the size of modern datasets'
  photos. The sources are 300-1400 pixels, so most regions are enlarged; an enlarged photo is
  smoother than a camera's, and compresses to fewer bits per pixel, which makes entropy
  decoding (the part no decoder can skip) look cheaper than it is. ``--grain`` adds sensor-like
  noise (Gaussian, sigma in grey levels) after the enlargement; the default (6) brings the set
  to the ImageNet-sized set's 1.8 bits per pixel (without it: 1.2).

    python benchmarks/make_jpegs.py data/bench-jpeg --count 1024
    python benchmarks/make_jpegs.py data/bench-jpeg-hr --count 512 --set highres
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import cv2
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from feedline.producer.demo_data import build  # noqa: E402


def highres_image(src: np.ndarray, rng: np.random.Generator, grain: float) -> np.ndarray:
    """A random region of ``src`` (a quarter to all of it) rescaled to 800-1200 wide, aspect
    ratio 4:3 give or take 10%, with Gaussian grain of ``grain`` grey levels."""
    h, w = src.shape[:2]
    area = h * w * rng.uniform(0.25, 1.0)
    ar = float(np.exp(rng.uniform(np.log(0.85), np.log(1.6))))
    cw, ch = min(w, round(np.sqrt(area * ar))), min(h, round(np.sqrt(area / ar)))
    y0, x0 = int(rng.integers(0, h - ch + 1)), int(rng.integers(0, w - cw + 1))
    out_w = int(rng.uniform(800, 1200))
    out_h = round(out_w * 0.75 * rng.uniform(0.9, 1.1))
    crop = src[y0:y0 + ch, x0:x0 + cw]
    interp = cv2.INTER_AREA if out_w < cw else cv2.INTER_CUBIC
    img = cv2.resize(crop, (out_w, out_h), interpolation=interp)
    if grain > 0:
        noise = np.asarray(rng.normal(0.0, grain, img.shape), np.float32)
        img = np.clip(img.astype(np.float32) + noise, 0, 255).astype(np.uint8)
    if rng.random() < 0.5:
        img = cv2.flip(img, 1)
    return img


def build_highres(out: Path, count: int, seed: int, grain: float) -> None:
    """``count`` high-resolution JPEGs under ``out/<photo>/`` (skipped if already made)."""
    build(out, count=count, seed=seed, tag=f"highres {grain}",
          make=lambda src, rng: highres_image(src, rng, grain))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--count", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", choices=["imagenet", "highres"], default="imagenet")
    ap.add_argument("--grain", type=float, default=6.0,
                    help="highres: noise sigma in grey levels (0: none)")
    args = ap.parse_args()
    if args.set == "imagenet":
        build(args.out, count=args.count, seed=args.seed)
    else:
        build_highres(args.out, args.count, args.seed, args.grain)
    files = sorted(args.out.rglob("*.jpg"))
    shapes = []
    for f in files[:512]:
        img = cv2.imread(str(f))
        if img is None:
            raise SystemExit(f"{f}: not a readable JPEG")
        shapes.append(img.shape[:2])
    hw = np.array(shapes)
    size = sum(f.stat().st_size for f in files) / len(files)
    bpp = 8 * size / float((hw[:, 0] * hw[:, 1]).mean())
    print(f"{len(files)} JPEGs in {args.out}: mean {hw[:, 1].mean():.0f}x{hw[:, 0].mean():.0f} "
          f"(WxH), {size / 1e3:.0f} kB each, {bpp:.1f} bits per pixel")


if __name__ == "__main__":
    main()

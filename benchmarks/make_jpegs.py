"""Make a folder of realistic JPEGs for the pipeline benchmark (no download).

Regions of the real photographs inside scikit-image's wheel, rescaled to ImageNet-like sizes
(about 400x350 on average), JPEG quality 75-95, one class folder per photo.

    python benchmarks/make_jpegs.py data/bench-jpeg --count 1024
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import cv2
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from producer.demo_data import build  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--count", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    build(args.out, count=args.count, seed=args.seed)
    files = sorted(args.out.rglob("*.jpg"))
    shapes = []
    for f in files[:512]:
        img = cv2.imread(str(f))
        if img is None:
            raise SystemExit(f"{f}: not a readable JPEG")
        shapes.append(img.shape[:2])
    hw = np.array(shapes)
    size = sum(f.stat().st_size for f in files) / len(files)
    print(f"{len(files)} JPEGs in {args.out}: mean {hw[:, 1].mean():.0f}x{hw[:, 0].mean():.0f} "
          f"(WxH), {size / 1e3:.0f} kB each")


if __name__ == "__main__":
    main()

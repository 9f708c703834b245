"""Where the microseconds of one ImageNetTrain image go, stage by stage, per photo set.

For each folder (original and prepared sets alike), the same RandomResizedCrop boxes are
decoded as the preset decodes them (``ImageNetTrain(224)``: fused decoder, then resample and
flip), and each stage is timed on its own, CPU time per image, best of ``--repeat`` passes:

- ``read``: the file's bytes (``open().read()``, from the page cache);
- ``header``: libjpeg's reading of the frame header (``turbo.header``);
- ``draws+plan``: the box and flip draws (numpy's generator) and the decode plan (Python);
- ``decode``: the extension's region decode at the plan's DCT scale (for a prepared file,
  index checks, the synthetic JPEG of the crop's MCUs, and its decode);
- ``of which entropy``: the same MCUs decoded at 1/8 (the IDCT a DC term, the colour
  conversion of 1/64 of the pixels: what is left is Huffman decoding and libjpeg's set-up);
- ``resample``: the bilinear resample (and flip) to 224x224;
- ``preset``: the whole ``ImageNetTrain.__call__``; ``python`` is what it costs beyond the
  stages above (argument handling, array views, the preset's own logic);
- ``batch``: ``np.stack`` of 64 results, per image.

Pinned to one core::

    python benchmarks/decode_costs.py data/bench-jpeg data/bench-jpeg-prepared \\
        data/bench-jpeg-hr data/bench-jpeg-hr-prepared
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.prepare_jpegs import one_core  # noqa: E402
from feedline.producer.image import ImageNetTrain, turbo  # noqa: E402


def cpu_us(fn: Callable[[int], object], n: int, repeat: int) -> float:
    """Best of ``repeat`` passes of ``fn(i)`` for i < n: CPU microseconds per call."""
    best = float("inf")
    for _ in range(repeat):
        t = time.process_time()
        for i in range(n):
            fn(i)
        best = min(best, time.process_time() - t)
    return best / n * 1e6


def costs(folder: Path, images: int, repeat: int) -> dict[str, float]:
    from feedline.producer.image import _jpegturbo  # type: ignore[attr-defined]

    paths = sorted(folder.rglob("*.jpg"))[:images]
    datas = [np.frombuffer(p.read_bytes(), np.uint8) for p in paths]
    hws = [turbo.header(d) for d in datas]
    pre = ImageNetTrain(224, seed=0)
    boxes, plans, flips = [], [], []
    for h, w in hws:
        y0, x0, ch, cw = pre.crop.sample_box(h, w, pre.rng)
        flips.append(bool(pre.rng.random() < 0.5))
        boxes.append((float(y0), float(x0), float(y0 + ch), float(x0 + cw)))
        plans.append(turbo.plan((h, w), boxes[-1], (224, 224)))
    regions = [_jpegturbo.decode(d, p.scale, p.r0, p.c0, p.r1 - p.r0, p.c1 - p.c0, False,
                                 1 << 26, 256) for d, p in zip(datas, plans, strict=True)]

    def read(i: int) -> object:
        with open(paths[i], "rb") as f:
            return f.read()

    def draws_plan(i: int) -> object:
        h, w = hws[i]
        y0, x0, ch, cw = pre.crop.sample_box(h, w, pre.rng)
        _ = pre.rng.random() < 0.5
        return turbo.plan((h, w), (y0, x0, y0 + ch, x0 + cw), (224, 224))

    def decode(i: int) -> object:
        p = plans[i]
        return _jpegturbo.decode(datas[i], p.scale, p.r0, p.c0, p.r1 - p.r0, p.c1 - p.c0,
                                 False, 1 << 26, 256)

    def entropy(i: int) -> object:
        p, (h, w) = plans[i], hws[i]
        r0, c0 = p.r0 // p.scale, p.c0 // p.scale  # the same rows and columns at 1/8
        r1, c1 = min(-(-h // 8), -(-p.r1 // p.scale)), min(-(-w // 8), -(-p.c1 // p.scale))
        return _jpegturbo.decode(datas[i], 1, r0, c0, r1 - r0, c1 - c0, False, 1 << 26, 256)

    def resample(i: int) -> object:
        px, xs, width, _, _ = regions[i]
        p = plans[i]
        img = np.frombuffer(px, np.uint8).reshape(p.r1 - p.r0, width, 3)[:, p.c0 - xs:]
        y0, x0, y1, x1 = p.box
        return _jpegturbo.resample(img[:, :p.c1 - p.c0], y0 - p.r0, x0 - p.c0,
                                   (y1 - y0) / 224, (x1 - x0) / 224, 224, 224, flips[i])

    outs = [pre(d) for d in datas[:64]]
    n = len(datas)
    out = {"read": cpu_us(read, n, repeat),
           "header": cpu_us(lambda i: turbo.header(datas[i]), n, repeat),
           "draws+plan": cpu_us(draws_plan, n, repeat),
           "decode": cpu_us(decode, n, repeat),
           "of which entropy": cpu_us(entropy, n, repeat),
           "resample": cpu_us(resample, n, repeat),
           "preset": cpu_us(lambda i: pre(datas[i]), n, repeat),
           "batch": cpu_us(lambda i: np.stack(outs), max(1, n // 64), repeat) / 64}
    out["python"] = out["preset"] - out["header"] - out["draws+plan"] - out["decode"] \
        - out["resample"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folders", nargs="+", type=Path)
    ap.add_argument("--images", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--core", type=int, default=(os.cpu_count() or 1) - 1)
    args = ap.parse_args()
    one_core(args.core)
    rows = {str(f): costs(f, args.images, args.repeat) for f in args.folders}
    stages = list(next(iter(rows.values())))
    print(f"{'us per image':<18}" + "".join(f"{Path(f).name[-24:]:>26}" for f in rows))
    for s in stages:
        print(f"{s:<18}" + "".join(f"{r[s]:>26.0f}" for r in rows.values()))


if __name__ == "__main__":
    main()

"""Image quality of the fused decoder: PSNR against a full decode -> crop -> resize.

For each JPEG of a ``make_jpegs.py`` set, ``--crops`` RandomResizedCrop boxes (the preset's
own draws) are turned into 224x224 images four ways, all with the same box:

- ``reference``: OpenCV decodes every pixel, then the box is cropped and resized
  (``ImageNetTrain(reduced_decode=False)``: area averaging above a 2x shrink, else bilinear);
- ``fused``: the fused decoder (``ImageNetTrain()``: only the box's region, DCT-scaled);
- ``opencv-reduced``: OpenCV at 1/2, 1/4, 1/8 when the box allows (``decoder="opencv"``);
- ``tf.data``: ``tf.io.decode_and_crop_jpeg`` then ``tf.image.resize`` (bilinear), as
  ``benchmarks/pipeline.py`` runs it (with ``--tf``).

The same for ``ImageNetVal`` (resize 256, centre crop 224; tf.data: not compared). Reported:
mean, 1st percentile and minimum PSNR in dB over all crops, and the share of crops where the
fused result is bit-identical to the reference (no DCT scaling and a whole-pixel box).

    python benchmarks/jpeg_quality.py data/bench-jpeg data/bench-jpeg-hr --images 256 --tf
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from feedline.producer.image import ImageNetTrain, ImageNetVal, turbo  # noqa: E402


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    """PSNR in dB of two uint8 images (inf where equal)."""
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(255.0 ** 2 / mse)


def tf_crop(data: bytes, box: tuple[int, int, int, int]) -> np.ndarray:
    import tensorflow as tf

    img = tf.io.decode_and_crop_jpeg(data, list(box), channels=3)
    return tf.cast(tf.image.resize(img, [224, 224]), tf.uint8).numpy()


def summary(values: list[float]) -> str:
    v = np.array(values)
    finite = np.where(np.isinf(v), 99.0, v)  # an identical image counts as 99 dB in the mean
    return (f"mean {finite.mean():5.1f}  p1 {np.percentile(finite, 1):5.1f}  "
            f"min {finite.min():5.1f} dB")


def measure(folder: Path, images: int, crops: int, with_tf: bool) -> dict[str, list[float]]:
    files = sorted(folder.rglob("*.jpg"))[:images]
    out: dict[str, list[float]] = {k: [] for k in
                                   ("fused", "opencv-reduced", "tf.data", "fused-vs-tf",
                                    "val-fused", "val-opencv-reduced")}
    ref = ImageNetTrain(224, seed=1, flip=False, reduced_decode=False)
    fused = ImageNetTrain(224, seed=1, flip=False)
    reduced = ImageNetTrain(224, seed=1, flip=False, decoder="opencv")
    boxes = ImageNetTrain(224, seed=1, flip=False)  # the same draws, for tf.data's crop
    val_ref, val_fused = ImageNetVal(reduced_decode=False), ImageNetVal()
    val_reduced = ImageNetVal(decoder="opencv")
    for f in files:
        data = f.read_bytes()
        buf = np.frombuffer(data, np.uint8)
        for _ in range(crops):
            r, a, b = ref(buf), fused(buf), reduced(buf)
            out["fused"].append(psnr(a, r))
            out["opencv-reduced"].append(psnr(b, r))
            if with_tf:
                h, w = turbo.header(buf)
                box = boxes.crop.sample_box(h, w, boxes.rng)
                t = tf_crop(data, box)
                out["tf.data"].append(psnr(t, r))
                out["fused-vs-tf"].append(psnr(t, a))
        v = val_ref(buf)
        out["val-fused"].append(psnr(val_fused(buf), v))
        out["val-opencv-reduced"].append(psnr(val_reduced(buf), v))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sets", nargs="+", type=Path, help="make_jpegs.py folders")
    ap.add_argument("--images", type=int, default=256)
    ap.add_argument("--crops", type=int, default=4, help="train crops per image")
    ap.add_argument("--tf", action="store_true", help="compare with tf.data too")
    args = ap.parse_args()
    for folder in args.sets:
        res = measure(folder, args.images, args.crops, args.tf)
        same = np.mean(np.isinf(res["fused"]))
        print(f"{folder}: {len(res['fused'])} train crops, {len(res['val-fused'])} val images; "
              f"fused identical to the reference in {same:.0%} of train crops")
        for k, v in res.items():
            if v:
                print(f"  {k:<20} {summary(v)}")


if __name__ == "__main__":
    main()

"""Prepare a folder of JPEGs (feedline.producer.image.prepared) and check it: speed, size,
pixel identity.

Writes ``OUT/<same relative path>`` for every ``*.jpg`` under ``SRC`` (``prepare_jpeg``:
lossless transcode, a restart marker after every MCU, optimised Huffman tables, an MCU
index) and reports:

- the preparation's speed: images per CPU-second of this process (one core; reading and
  writing the files not counted), and the size overhead (prepared bytes / original bytes);
- whole files: every prepared file decodes (OpenCV, libjpeg-turbo, every pixel) to exactly
  its original's pixels;
- ``--crops`` random crops (ImageNetTrain's RandomResizedCrop boxes, random files), each
  decoded from the prepared file by the fused decoder (only the MCUs under the crop): at 8/8
  it must equal a full decode of the original, cropped; at the DCT scale the preset picks, the
  fused decoder's region of the original (today's path); and the preset's 224x224 output must
  be identical from either file.

``--intervals N`` compares restart intervals on N of the files: each transcoded (optimised
tables) with a restart marker after every 1, 2, 4 MCUs and every MCU row; for each, the
bytes, the entropy-decoding cost per MCU (a whole decode at 1/8 scale, where the IDCT is a
DC term and almost everything else is Huffman decoding: measured), and the MCUs a
RandomResizedCrop's region needs entropy-decoded (counted over 4000 boxes: today, the rows
down to the region's last, every column; with row intervals, only its rows; with N-MCU
intervals, the intervals holding its columns in its rows).

Pinned to one core. Already prepared files are kept (delete OUT to time it again)::

    python benchmarks/prepare_jpegs.py data/bench-jpeg data/bench-jpeg-prepared --crops 500
    python benchmarks/prepare_jpegs.py data/bench-jpeg-hr data/bench-jpeg-hr-prepared \
        --crops 0 --intervals 64
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import cv2
import numpy as np
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from feedline.producer.image import ImageNetTrain, turbo  # noqa: E402
from feedline.producer.image.prepared import prepare  # noqa: E402


def prepare_folder(src: Path, out: Path, optimize: bool = True, progress: bool = True) -> dict:
    """Prepare every JPEG under ``src`` into ``out`` (files already there are kept); the
    speed (CPU time of the preparations made now) and sizes."""
    files = sorted(src.rglob("*.jpg"))
    if not files:
        raise SystemExit(f"no JPEGs under {src}")
    cpu, made, before, after, unchanged = 0.0, 0, 0, 0, 0
    for f in tqdm(files, desc=f"preparing {src}", unit="img", disable=not progress):
        dst = out / f.relative_to(src)
        data = f.read_bytes()
        if dst.exists():
            result = dst.read_bytes()
        else:
            t = time.process_time()
            p = prepare(data, optimize, source=str(f))
            cpu += time.process_time() - t
            made += 1
            result = p.data
            unchanged += not p.prepared
            dst.parent.mkdir(parents=True, exist_ok=True)
            tmp = dst.with_name(f".{dst.name}.partial-{os.getpid()}")
            tmp.write_bytes(result)
            os.replace(tmp, dst)
        before += len(data)
        after += len(result)
    return {"files": len(files), "prepared_now": made, "unchanged": unchanged,
            "images_per_cpu_s": made / cpu if cpu else None, "bytes_before": before,
            "bytes_after": after, "size_ratio": after / before}


def identical_files(src: Path, out: Path) -> tuple[int, int]:
    """(files whose prepared copy decodes to the original's pixels, files)."""
    same = n = 0
    for f in sorted(src.rglob("*.jpg")):
        a = cv2.imdecode(np.fromfile(f, np.uint8), cv2.IMREAD_COLOR)
        b = cv2.imdecode(np.fromfile(out / f.relative_to(src), np.uint8), cv2.IMREAD_COLOR)
        same += a is not None and b is not None and np.array_equal(a, b)
        n += 1
    return same, n


def check_crops(src: Path, out: Path, crops: int, seed: int = 0) -> dict:
    """Random train crops decoded from prepared files against the originals (see the module
    docstring); counts of identical results."""
    from feedline.producer.image import _jpegturbo  # type: ignore[attr-defined]

    files = sorted(src.rglob("*.jpg"))
    rng = np.random.default_rng(seed)
    boxes = ImageNetTrain(224, seed=seed)
    counts = {"crops": 0, "full_8_8": 0, "fused_scale": 0, "preset": 0}
    scales: dict[str, int] = {}
    for _ in tqdm(range(crops), desc="crops", unit="crop"):
        f = files[int(rng.integers(len(files)))]
        orig = np.fromfile(f, np.uint8)
        prep = np.fromfile(out / f.relative_to(src), np.uint8)
        h, w = turbo.header(orig)
        y0, x0, ch, cw = boxes.crop.sample_box(h, w, boxes.rng)
        full = cv2.imdecode(orig, cv2.IMREAD_COLOR)
        assert full is not None, f
        px, xs, width, _, _ = _jpegturbo.decode(prep, 8, y0, x0, ch, cw, True, 1 << 26, 256)
        region = np.frombuffer(px, np.uint8).reshape(ch, width, 3)[:, x0 - xs:x0 - xs + cw]
        counts["full_8_8"] += bool(np.array_equal(region, full[y0:y0 + ch, x0:x0 + cw]))
        p = turbo.plan((h, w), (y0, x0, y0 + ch, x0 + cw), (224, 224))
        # As decode_box asks: a column more each side (turbo.EDGE), then [c0, c1) compared.
        qc0, qc1 = max(0, p.c0 - turbo.EDGE), min(p.scaled_hw[1], p.c1 + turbo.EDGE)
        regions = []
        for data in (orig, prep):
            px, xs, width, _, _ = _jpegturbo.decode(data, p.scale, p.r0, qc0, p.r1 - p.r0,
                                                    qc1 - qc0, True, 1 << 26, 256)
            img = np.frombuffer(px, np.uint8).reshape(p.r1 - p.r0, width, 3)
            regions.append(img[:, p.c0 - xs:p.c1 - xs])
        counts["fused_scale"] += bool(np.array_equal(regions[0], regions[1]))
        scales[f"{p.scale}/8"] = scales.get(f"{p.scale}/8", 0) + 1
        t1, t2 = ImageNetTrain(224, seed=counts["crops"]), ImageNetTrain(224, seed=counts["crops"])
        counts["preset"] += bool(np.array_equal(t1(orig), t2(prep)))
        counts["crops"] += 1
    return {**counts, "scales": scales}


def _entropy_us_per_mcu(datas: list[bytes], mcus: list[int]) -> float:
    """CPU-microseconds per MCU of whole decodes at 1/8 (best of 3)."""
    from feedline.producer.image import _jpegturbo  # type: ignore[attr-defined]

    best = float("inf")
    for _ in range(3):
        t = time.process_time()
        for d in datas:
            h, w = turbo.header(np.frombuffer(d, np.uint8))
            _jpegturbo.decode(d, 1, 0, 0, -(-h // 8), -(-w // 8), True, 1 << 26, 256)
        best = min(best, time.process_time() - t)
    return best / sum(mcus) * 1e6


def compare_intervals(src: Path, count: int, boxes: int = 4000) -> list[dict]:
    """The table of ``--intervals`` (see the module docstring)."""
    from feedline.producer.image import _jpegturbo  # type: ignore[attr-defined]

    files = sorted(src.rglob("*.jpg"))[:count]
    originals = [f.read_bytes() for f in files]
    grids = []  # (h, w, mcu_w, mcu_h, cols, rows) per file
    for d in originals:
        h, w = turbo.header(np.frombuffer(d, np.uint8))
        cols, rows, mw, mh, _ = _jpegturbo.index_info(_jpegturbo.prepare(d, True, 1 << 26)[0])
        grids.append((h, w, mw, mh, cols, rows))
    rng = np.random.default_rng(0)
    crop = ImageNetTrain(224, seed=0).crop
    regions = []  # per box: (file, MCU rows [a, b), MCU columns [c, d))
    for _ in range(boxes):
        i = int(rng.integers(len(files)))
        h, w, mw, mh, cols, rows = grids[i]
        y0, x0, ch, cw = crop.sample_box(h, w, rng)
        p = turbo.plan((h, w), (y0, x0, y0 + ch, x0 + cw), (224, 224))
        smw, smh = mw * p.scale // 8, mh * p.scale // 8
        regions.append((i, p.r0 // smh, -(-p.r1 // smh), p.c0 // smw, -(-p.c1 // smw)))
    out = []
    for name, interval in [("original", None), ("1 MCU row", 0), ("4 MCUs", 4), ("2 MCUs", 2),
                           ("1 MCU", 1)]:
        datas = originals if interval is None else [
            _jpegturbo.prepare(d, True, 1 << 26, interval)[0] for d in originals]
        mcus = [g[4] * g[5] for g in grids]
        per_mcu = _entropy_us_per_mcu(datas, mcus)
        needed = []
        for i, a, b, c, d in regions:
            cols = grids[i][4]
            if interval is None:
                needed.append(b * cols)  # every row down to the region's last
            elif interval == 0:
                needed.append((b - a) * cols)
            else:  # whole intervals (as if N divided the row: the best case for N > 1)
                needed.append((b - a) * (min(cols, -(-d // interval) * interval)
                                         - c // interval * interval))
        out.append({"variant": name, "bytes": sum(map(len, datas)) / sum(map(len, originals)),
                    "us_per_mcu": per_mcu, "mcus_per_crop": float(np.mean(needed)),
                    "entropy_us_per_crop": per_mcu * float(np.mean(needed)),
                    "bytes_per_image": sum(map(len, datas)) / len(datas)})
    return out


def one_core(core: int) -> None:
    """This process pinned to ``core``, OpenCV single-threaded; an exit that says why where
    the extension is not built (everything measured here is its work)."""
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {core})
    cv2.setNumThreads(1)
    if not turbo.AVAILABLE:
        raise SystemExit(f"needs the compiled extension: {turbo.decoder_info()}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--crops", type=int, default=500, help="random crops to check (0: none)")
    ap.add_argument("--no-optimize", action="store_true", help="standard Huffman tables")
    ap.add_argument("--intervals", type=int, default=0, metavar="N",
                    help="compare restart intervals on N files (0: not)")
    ap.add_argument("--core", type=int, default=(os.cpu_count() or 1) - 1)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    one_core(args.core)
    prep = prepare_folder(args.src, args.out, not args.no_optimize)
    same, n = identical_files(args.src, args.out)
    crops = check_crops(args.src, args.out, args.crops) if args.crops else {}
    speed = prep["images_per_cpu_s"]
    print(f"{args.src}: {prep['files']} files, {prep['prepared_now']} prepared now"
          + (f" at {speed:.0f} images/CPU-s" if speed else "") + f", {prep['unchanged']} "
          f"left as they were; size {prep['size_ratio']:.4f}x the originals "
          f"({prep['bytes_before'] / 1e6:.1f} -> {prep['bytes_after'] / 1e6:.1f} MB)")
    print(f"whole files decoding to the original's pixels: {same} / {n}")
    if crops:
        print(f"crops: {crops['crops']}; prepared == full decode + crop at 8/8: "
              f"{crops['full_8_8']}; == today's fused region at the preset's scale: "
              f"{crops['fused_scale']} (scales {crops['scales']}); preset output identical: "
              f"{crops['preset']}")
    intervals = compare_intervals(args.src, args.intervals) if args.intervals else []
    if intervals:
        base = intervals[0]
        print(f"\n{'restart interval':<18}{'bytes':>8}{'us/MCU':>8}{'MCUs/crop':>11}"
              f"{'entropy us/crop':>17}{'saved us per kB more':>22}")
        for row in intervals:
            saved = base["entropy_us_per_crop"] - row["entropy_us_per_crop"]
            more = (row["bytes_per_image"] - base["bytes_per_image"]) / 1e3
            per_kb = f"{saved / more:.0f}" if more > 0 else "(smaller)"
            print(f"{row['variant']:<18}{row['bytes']:>8.3f}{row['us_per_mcu']:>8.3f}"
                  f"{row['mcus_per_crop']:>11.0f}{row['entropy_us_per_crop']:>17.0f}{per_kb:>22}")
    if args.json:
        args.json.write_text(json.dumps({"prepare": prep, "identical_files": [same, n],
                                         "crops": crops, "intervals": intervals}, indent=1))


if __name__ == "__main__":
    main()

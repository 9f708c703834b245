"""Pipeline benchmark: feedline's ImageNet-style train preprocessing against tf.data's.

Both read the same JPEG files (``benchmarks/make_jpegs.py``: an ImageNet-sized set and a
high-resolution one) and produce batches of 64 224x224x3 uint8 images:

- ``tf.data``: ``read_file -> extract_jpeg_shape -> sample_distorted_bounding_box (area
  0.08-1, ratio 3/4-4/3) -> decode_and_crop_jpeg -> resize 224 (bilinear) ->
  random_flip_left_right -> cast uint8 -> batch 64``, one thread (intra/inter-op 1, private
  threadpool 1, autotune off): the canonical TF ImageNet input on one core.
- ``feedline``: ``ImageFolder -> MapDataComponent(ImageNetTrain(224)) -> BatchData(64)`` in
  one process: the fused decoder (only the crop's region, at a DCT scale M/8) ->
  resize -> flip (OpenCV single-threaded).
- ``feedline-prepared``: the same on the set's prepared copy (``benchmarks/prepare_jpegs.py``:
  lossless transcode with an MCU index, made before the first round if missing), where the
  fused decoder entropy-decodes only the MCUs under the crop. Its ratio is to tf.data on the
  original files, as a dataset prepared once is read that way ever after.
- ``feedline-opencv``: the same with ``decoder="opencv"`` (a whole-image OpenCV decode, at
  1/2, 1/4 or 1/8 when the crop allows): the decoder before the fused one.
- ``feedline-mp1`` / ``feedline-mp2``: the map in 1 / 2 ``MultiProcessMapData`` workers
  (ZeroMQ IPC), the reading and batching in the parent.

Each variant runs in its own fresh process (so TensorFlow's threads never share a process with
forked workers), the one-process variants pinned to one core (``--core``); rounds alternate
between variants and sets. Reported per set and variant:
images/s (wall) and images per CPU-second of the whole process tree (user+sys, workers
included): the per-core figure, independent of how many cores were free on a shared machine.

    python benchmarks/make_jpegs.py data/bench-jpeg --count 1024
    python benchmarks/make_jpegs.py data/bench-jpeg-hr --count 512 --set highres
    python benchmarks/pipeline.py --data imagenet=data/bench-jpeg,highres=data/bench-jpeg-hr \
        --rounds 3 --batches 30 --json benchmarks/results/pipeline_benchmark.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

VARIANTS = ["tf.data", "feedline", "feedline-prepared", "feedline-opencv", "feedline-mp1",
            "feedline-mp2"]
PROCS = {"feedline": 0, "feedline-prepared": 0, "feedline-opencv": 0, "feedline-mp1": 1,
         "feedline-mp2": 2}
BATCH = 64


def cpu_seconds() -> float:
    import psutil

    me = psutil.Process()
    total = sum(me.cpu_times()[:2])
    for c in me.children(recursive=True):
        try:
            total += sum(c.cpu_times()[:2])
        except psutil.Error:
            pass
    return total


def tf_train_crop(data):
    """tf.data's ImageNet train crop of one JPEG (a string tensor): 224x224x3 uint8."""
    import tensorflow as tf

    shape = tf.io.extract_jpeg_shape(data)
    begin, size, _ = tf.image.sample_distorted_bounding_box(
        shape, tf.zeros([0, 0, 4]), area_range=(0.08, 1.0),
        aspect_ratio_range=(3 / 4, 4 / 3), max_attempts=10,
        use_image_if_no_bounding_boxes=True)
    oy, ox, _ = tf.unstack(begin)
    h, w, _ = tf.unstack(size)
    img = tf.io.decode_and_crop_jpeg(data, tf.stack([oy, ox, h, w]), channels=3)
    img = tf.image.resize(img, [224, 224])
    img = tf.image.random_flip_left_right(img)
    return tf.cast(img, tf.uint8)


def tf_iter(files: list[str]):
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)

    def prep(path):
        return tf_train_crop(tf.io.read_file(path))

    opts = tf.data.Options()
    opts.threading.private_threadpool_size = 1
    opts.threading.max_intra_op_parallelism = 1
    opts.autotune.enabled = False
    ds = tf.data.Dataset.from_tensor_slices(files).shuffle(len(files), seed=0).repeat()
    ds = ds.map(prep).batch(BATCH, drop_remainder=True).with_options(opts)
    return iter(ds), None


def feedline_iter(root: str, procs: int, decoder: str):
    import cv2

    from feedline.producer.dataflow import (
        BatchData,
        ImageFolder,
        MapDataComponent,
        MultiProcessMapData,
        RepeatedData,
    )
    from feedline.producer.dataflow.map_data import ComponentFunc
    from feedline.producer.image import ImageNetTrain

    cv2.setNumThreads(1)
    src = RepeatedData(ImageFolder(root, shuffle=True), -1)
    aug = ImageNetTrain(224, seed=0, decoder=decoder)
    if procs == 0:
        df = BatchData(MapDataComponent(src, aug, 0), BATCH)
    else:
        df = BatchData(MultiProcessMapData(src, procs, ComponentFunc(aug, 0), buffer_size=128),
                       BATCH)
    df.reset_state()
    return iter(df), df


def prepared_dir(data: str) -> str:
    """Where a set's prepared copy lives: beside it, ``<folder>-prepared``."""
    return str(Path(data).with_name(Path(data).name + "-prepared"))


def measure(variant: str, data: str, batches: int, warmup: int, core: int) -> dict:
    import os

    if PROCS.get(variant, 0) == 0 and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {core})
    if variant == "feedline-prepared":
        data = prepared_dir(data)
    files = sorted(str(p) for p in Path(data).rglob("*.jpg"))
    if variant == "tf.data":
        it, df = tf_iter(files)
    else:
        decoder = "opencv" if variant == "feedline-opencv" else "auto"
        it, df = feedline_iter(data, PROCS[variant], decoder)
    for _ in range(warmup):
        next(it)
    c0, t0 = cpu_seconds(), time.perf_counter()
    for _ in range(batches):
        b = next(it)
    wall, cpu = time.perf_counter() - t0, cpu_seconds() - c0
    shape = tuple(b[0].shape)
    if df is not None:
        df.close()
    n = batches * BATCH
    from feedline.producer.image import decoder_info

    return {"decoder": "tf.io.decode_and_crop_jpeg" if df is None else (
                "OpenCV" if variant == "feedline-opencv" else decoder_info()),
            "variant": variant, "images": n, "wall_s": wall, "cpu_s": cpu,
            "images_per_s": n / wall, "images_per_cpu_s": n / cpu, "shape": list(shape)}


def parse_sets(spec: str) -> dict[str, str]:
    """``name=folder,name=folder`` (or one folder, named ``imagenet``)."""
    sets = {}
    for part in spec.split(","):
        name, _, folder = part.rpartition("=")
        sets[name or "imagenet"] = folder
    return sets


def summarise(runs: list[dict], variants: list[str]) -> dict[str, dict]:
    summary: dict[str, dict] = {}
    for v in variants:
        rs = [x for x in runs if x["variant"] == v]
        summary[v] = {"images_per_s": statistics.median(x["images_per_s"] for x in rs),
                      "images_per_cpu_s": statistics.median(x["images_per_cpu_s"] for x in rs)}
    base = summary.get("tf.data")
    for s in summary.values():
        s["per_core_vs_tf"] = (s["images_per_cpu_s"] / base["images_per_cpu_s"]
                               if base else float("nan"))
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="imagenet=data/bench-jpeg,highres=data/bench-jpeg-hr",
                    help="name=folder[,name=folder...] of make_jpegs.py sets")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batches", type=int, default=30, help="timed batches of 64 per run")
    ap.add_argument("--warmup", type=int, default=3, help="untimed batches first")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--json", default=None, help="write all results here")
    ap.add_argument("--core", type=int, default=None,
                    help="the core the one-process variants are pinned to (default: the last)")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a single run (child)
    args = ap.parse_args()
    import os

    core = (os.cpu_count() or 1) - 1 if args.core is None else args.core
    if args.one:
        print(json.dumps(measure(args.one, args.data, args.batches, args.warmup, core)))
        return
    sets = parse_sets(args.data)
    for name, folder in sets.items():
        if not any(Path(folder).rglob("*.jpg")):
            raise SystemExit(f"no JPEGs under {folder} ({name}): run benchmarks/make_jpegs.py")
    variants = args.variants.split(",")
    if "feedline-prepared" in variants:
        from benchmarks.prepare_jpegs import prepare_folder

        for name, folder in sets.items():
            made = prepare_folder(Path(folder), Path(prepared_dir(folder)))
            print(f"{name}: prepared copy in {prepared_dir(folder)} "
                  f"({made['size_ratio']:.3f}x the bytes)", flush=True)
    runs: list[dict] = []
    for r in range(args.rounds):
        for name, folder in sets.items():
            for v in variants:
                out = subprocess.run(
                    [sys.executable, __file__, "--one", v, "--data", folder,
                     "--batches", str(args.batches), "--warmup", str(args.warmup),
                     "--core", str(core)],
                    capture_output=True, text=True, check=False, timeout=900)
                if out.returncode != 0:
                    raise SystemExit(f"{v} on {name} failed:\n{out.stderr[-3000:]}")
                res = json.loads(out.stdout.strip().splitlines()[-1])
                res.update(round=r, set=name)
                runs.append(res)
                print(f"round {r}: {name:<9} {v:<16} {res['images_per_s']:7.0f} img/s  "
                      f"{res['images_per_cpu_s']:7.0f} img/CPU-s  ({res['cpu_s']:.1f} CPU-s "
                      f"in {res['wall_s']:.1f} s)", flush=True)
    results = {}
    for name, folder in sets.items():
        set_runs = [x for x in runs if x["set"] == name]
        summary = summarise(set_runs, variants)
        results[name] = {"data": folder, "runs": set_runs, "summary": summary}
        print(f"\n{name} ({folder})\n{'variant':<17}{'img/s':>8}{'img/CPU-s':>11}"
              f"{'vs tf.data per core':>21}")
        for v, s in summary.items():
            print(f"{v:<17}{s['images_per_s']:>8.0f}{s['images_per_cpu_s']:>11.0f}"
                  f"{s['per_core_vs_tf']:>20.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"sets": results, "batches": args.batches,
                                               "rounds": args.rounds}, indent=1))


if __name__ == "__main__":
    main()

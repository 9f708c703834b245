"""Shard benchmark: reading WebDataset shards and decoding + augmenting like the ImageNet
preset, per core, against the image folder, the ``webdataset`` library and tf.data.

One image set (``benchmarks/make_jpegs.py``) in three forms: the folder itself, WebDataset
shards of it (``feedline convert``), and a TFRecord copy (``tf.train.Example`` with
``image/encoded`` and ``image/class/label``, written here). Variants, each making batches of
64 224x224x3 uint8 images with a random-resized crop (area 0.08-1, ratio 3/4-4/3) and a flip:

- ``folder``: ``ImageFolder`` on local disk -> ``ImageNetTrain`` (the fused decoder);
- ``wds-http``: feedline's ``WebDataset`` over HTTP from a server on 127.0.0.1 (another core)
  -> the same map: the shard source against the folder source (the 0.9x criterion);
- ``wds-local``: the same shards from local disk;
- ``wds-opencv``: feedline's ``WebDataset`` (local) with ``ImageNetTrain(decoder="opencv")``;
- ``webdataset-lib``: the ``webdataset`` library (``wds.WebDataset(...).to_tuple``, local
  shards) with the same OpenCV decode and augmentation (``ImageNetTrain(decoder="opencv")``);
- ``tf.data``: ``TFRecordDataset -> parse_single_example -> sample_distorted_bounding_box ->
  decode_and_crop_jpeg -> resize (bilinear) -> random_flip_left_right -> batch``, one thread.

Every run is a fresh process pinned to one core (``os.sched_setaffinity``: all its threads
share it), rounds alternate between variants, and the table gives medians of images per
second and per CPU-second, and each variant's ratio to ``folder`` and to ``wds-local``.

    python benchmarks/make_jpegs.py data/bench-jpeg --count 1024
    flock /tmp/feedline-heavy.lock python benchmarks/shards.py --data data/bench-jpeg --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

VARIANTS = ["folder", "wds-http", "wds-local", "wds-opencv", "webdataset-lib", "tf.data"]
BATCH = 64


def prepare(data: Path, work: Path) -> None:
    """The shards and the TFRecord copy of ``data`` (once; kept in ``work``)."""
    shards = work / "wds"
    if not (shards / "manifest.json").exists():
        subprocess.run([sys.executable, "-m", "feedline.commands", "convert", str(data),
                        str(shards), "--shard-size", "16MB", "--no-progress", "--overwrite"],
                       check=True)
    tfr = work / "tfrecord"
    if not tfr.exists():
        from feedline.producer.dataflow import ImageFolder
        from feedline.producer.shards.tfrecord import encode_example, frame

        tmp = work / "tfrecord.partial"
        tmp.mkdir(parents=True, exist_ok=True)
        src = ImageFolder(data, shuffle=False)
        n = src.samples()
        per = -(-n // 4)
        for k in range(4):
            with open(tmp / f"train-{k:05d}.tfrecord", "wb") as f:
                for i in range(k * per, min(n, (k + 1) * per)):
                    img, label = src.sample(i)
                    f.write(frame(encode_example({"image/encoded": img.tobytes(),
                                                  "image/class/label": int(label)})))
        tmp.rename(tfr)


def feedline_iter(variant: str, data: str, work: Path, url: str):
    import cv2

    from feedline.producer.dataflow import (
        BatchData,
        DataFlow,
        ImageFolder,
        MapDataComponent,
        RepeatedData,
    )
    from feedline.producer.dataflow.webdataset import WebDataset
    from feedline.producer.image import ImageNetTrain

    cv2.setNumThreads(1)
    src: DataFlow
    if variant == "folder":
        src = ImageFolder(data, shuffle=True)
    else:
        where = url if variant == "wds-http" else str(work / "wds")
        src = WebDataset(manifest=f"{where}/manifest.json")
    decoder = "opencv" if variant == "wds-opencv" else "auto"
    df = BatchData(MapDataComponent(RepeatedData(src, -1), ImageNetTrain(224, seed=0,
                                                                         decoder=decoder), 0),
                   BATCH)
    df.reset_state()
    return iter(df)


def wds_lib_iter(work: Path):
    import cv2
    import numpy as np
    import webdataset as wds

    from feedline.producer.image import ImageNetTrain

    cv2.setNumThreads(1)
    urls = sorted(str(p) for p in (work / "wds").glob("*.tar"))
    aug = ImageNetTrain(224, seed=0, decoder="opencv")
    ds = wds.WebDataset(urls, shardshuffle=False, empty_check=False).repeat().to_tuple(
        "jpg", "cls")

    def batches():
        imgs, labels = [], []
        for jpg, cls in ds:
            imgs.append(aug(np.frombuffer(jpg, np.uint8)))
            labels.append(int(cls))
            if len(imgs) == BATCH:
                yield [np.stack(imgs), np.asarray(labels)]
                imgs, labels = [], []
    return batches()


def tf_iter(work: Path):
    import tensorflow as tf

    from benchmarks.pipeline import tf_train_crop

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    files = sorted(str(p) for p in (work / "tfrecord").glob("*.tfrecord"))
    feats = {"image/encoded": tf.io.FixedLenFeature([], tf.string),
             "image/class/label": tf.io.FixedLenFeature([], tf.int64)}

    def prep(rec):
        ex = tf.io.parse_single_example(rec, feats)
        return tf_train_crop(ex["image/encoded"]), ex["image/class/label"]

    opts = tf.data.Options()
    opts.threading.private_threadpool_size = 1
    opts.threading.max_intra_op_parallelism = 1
    opts.autotune.enabled = False
    ds = tf.data.TFRecordDataset(files).repeat().map(prep).batch(BATCH, drop_remainder=True)
    return iter(ds.with_options(opts))


def measure(variant: str, data: str, work: Path, url: str, batches: int, warmup: int,
            cpu: int) -> dict:
    os.sched_setaffinity(0, {cpu})  # before any thread starts: all of them on one core
    if variant == "tf.data":
        it = tf_iter(work)
    elif variant == "webdataset-lib":
        it = wds_lib_iter(work)
    else:
        it = feedline_iter(variant, data, work, url)
    for _ in range(warmup):
        next(it)
    c0, t0 = time.process_time(), time.perf_counter()
    for _ in range(batches):
        b = next(it)
    wall, cpu_s = time.perf_counter() - t0, time.process_time() - c0
    assert tuple(b[0].shape) == (BATCH, 224, 224, 3)
    n = batches * BATCH
    return {"variant": variant, "images": n, "wall_s": wall, "cpu_s": cpu_s,
            "images_per_s": n / wall, "images_per_cpu_s": n / cpu_s}


def table(runs: list[dict], variants: list[str]) -> str:
    """Medians per variant, and the median over rounds of each round's ratio to ``folder``
    and to ``wds-local`` (measured side by side: drift in the machine's load cancels)."""
    def med(v: str, key: str) -> float:
        return statistics.median(x[key] for x in runs if x["variant"] == v)

    def ratio(v: str, base: str) -> str:
        if base not in variants:
            return "-"
        by_round: dict[int, dict[str, float]] = {}
        for x in runs:
            by_round.setdefault(x["round"], {})[x["variant"]] = x["images_per_cpu_s"]
        return f"{statistics.median(r[v] / r[base] for r in by_round.values()):.2f}x"

    lines = ["| variant | img/s (one core) | img/CPU-s | vs folder | vs wds-local |",
             "|---|---|---|---|---|"]
    lines += [f"| {v} | {med(v, 'images_per_s'):.0f} | {med(v, 'images_per_cpu_s'):.0f} | "
              f"{ratio(v, 'folder')} | {ratio(v, 'wds-local')} |" for v in variants]
    return "\n" + "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="data/bench-jpeg", help="an image folder (make_jpegs.py)")
    ap.add_argument("--work", default="data/bench-shards",
                    help="where the shards and the TFRecord copy are made (once)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batches", type=int, default=30, help="timed batches of 64 per run")
    ap.add_argument("--warmup", type=int, default=3, help="untimed batches first")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--cpu", type=int, default=0, help="the core the variants run on")
    ap.add_argument("--json", default=None, help="write all results here")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--url", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    work = Path(args.work)
    if args.one:
        print(json.dumps(measure(args.one, args.data, work, args.url, args.batches,
                                 args.warmup, args.cpu)))
        return
    if not any(Path(args.data).rglob("*.jpg")):
        raise SystemExit(f"no JPEGs under {args.data}: run benchmarks/make_jpegs.py")
    prepare(Path(args.data), work)
    other = next((c for c in sorted(os.sched_getaffinity(0)) if c != args.cpu), args.cpu)
    server = subprocess.Popen(["taskset", "-c", str(other), sys.executable, "-m",
                               "tests.support.shard_server", str(work / "wds")],
                              stdout=subprocess.PIPE, text=True,
                              cwd=Path(__file__).resolve().parent.parent)
    try:
        assert server.stdout is not None
        url = server.stdout.readline().strip()
        variants = args.variants.split(",")
        runs = []
        for r in range(args.rounds):
            for v in variants:
                out = subprocess.run(
                    [sys.executable, __file__, "--one", v, "--data", args.data, "--work",
                     str(work), "--url", url, "--batches", str(args.batches), "--warmup",
                     str(args.warmup), "--cpu", str(args.cpu)],
                    capture_output=True, text=True, timeout=900,
                    env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
                if out.returncode != 0:
                    raise SystemExit(f"{v} failed:\n{out.stderr[-3000:]}")
                res = json.loads(out.stdout.strip().splitlines()[-1]) | {"round": r}
                runs.append(res)
                print(f"round {r}: {v:<15} {res['images_per_s']:7.0f} img/s  "
                      f"{res['images_per_cpu_s']:7.0f} img/CPU-s", flush=True)
    finally:
        server.terminate()
        server.wait(10)
    print(table(runs, variants))
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": runs}, indent=1))


if __name__ == "__main__":
    main()

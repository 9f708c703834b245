"""``feedline convert``: an image folder or an LMDB file as WebDataset shards, with a manifest.

Writes ``OUT_DIR/PREFIX-000000.tar, ...`` of about ``--shard-size`` bytes each (sample
``i`` of the source is sample ``i`` of the shards: ``%08d.jpg`` and ``%08d.cls``), in
``--workers`` processes with a progress bar, and ``OUT_DIR/manifest.json`` (each shard's
sample count, size and sha256): a pipeline's ``source: {webdataset: {manifest: ...}}`` reads
the shards from it, wherever they are copied to (same names beside it).
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
from concurrent.futures import ProcessPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

from feedline.errors import ConfigError, DataNotFound, FeedlineError, Unavailable
from feedline.flags import HelpFormatter

_SOURCE: Any = None  # the dataset, in each worker process (set before the fork)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("convert", help="write an image folder or an LMDB as WebDataset shards",
                       description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("source", metavar="SOURCE",
                   help="an image folder (IMAGE_DIR/<class>/*.jpg) or an LMDB file")
    p.add_argument("out", metavar="OUT_DIR", help="where the shards and manifest.json go")
    p.add_argument("--list-file", default=None,
                   help="lines 'relative/path.jpg LABEL' instead of class sub-folders")
    p.add_argument("--shard-size", default="256MB",
                   help="target bytes per shard (units: KB, MB, GB)")
    p.add_argument("--prefix", default="shard", help="shard file names: PREFIX-000000.tar")
    p.add_argument("--workers", type=int, default=1, help="processes writing shards")
    p.add_argument("--prepare-jpeg", action="store_true",
                   help="transcode each JPEG losslessly to restart intervals with an index "
                   "(decoding then reads only the crop's blocks; pixels never change)")
    p.add_argument("--overwrite", action="store_true", help="replace shards that exist")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def parse_size(text: str) -> int:
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 1 << 10,
             "MIB": 1 << 20, "GIB": 1 << 30}
    t = text.strip().upper()
    num = t.rstrip("KMGIB")
    unit = t[len(num):]
    if unit not in units or not num.replace(".", "", 1).isdigit() or float(num) <= 0:
        raise ConfigError(f"--shard-size {text!r}: expected a size such as 256MB")
    return int(float(num) * units[unit])


def prepare_jpeg_function() -> Any:
    """``prepare_jpeg(data) -> bytes`` where this build has it; a clear error where not."""
    from feedline.producer import image

    fn = getattr(image, "prepare_jpeg", None)
    if fn is None:
        raise Unavailable("--prepare-jpeg: not available in this build (it needs "
                         "feedline.producer.image.prepare_jpeg, the lossless restart-interval "
                         "transcode); convert without it")
    return fn


def open_source(path: str, list_file: str | None) -> Any:
    """The dataset as an indexable source (``samples()``, ``sample(i)``) in sorted order."""
    from feedline.producer.dataflow import ImageFolder, LMDBSerializer

    p = Path(path)
    if p.is_dir():
        return ImageFolder(root=p, list_file=list_file, shuffle=False)
    if p.is_file():
        return LMDBSerializer.load(p, shuffle=False)
    raise DataNotFound(f"{path}: no such image folder or LMDB file")


def _read(i: int) -> tuple[bytes, int]:
    from feedline.producer.shards.writer import as_bytes

    dp = _SOURCE.sample(i)
    return as_bytes(dp[0]), int(dp[1])


def _sizes(src: Any) -> list[int]:
    paths = getattr(src, "paths", None)
    if paths is not None:  # an image folder: the files' sizes, without reading them
        import os

        return [os.path.getsize(p) for p in paths]
    return [len(_read(i)[0]) for i in range(src.samples())]


def run(args: argparse.Namespace) -> int:
    global _SOURCE
    from tqdm import tqdm

    from feedline.producer.shards.manifest import Manifest
    from feedline.producer.shards.writer import ShardJob, plan_shards, write_shard

    def fail(msg: str) -> int:
        print(f"feedline convert: {msg}", file=sys.stderr)
        return 1

    try:
        target = parse_size(args.shard_size)
        transform = prepare_jpeg_function() if args.prepare_jpeg else None
        if args.workers < 1:
            raise ConfigError(f"--workers {args.workers}: expected >= 1")
        _SOURCE = open_source(args.source, args.list_file)
    except (FeedlineError, OSError) as e:
        return fail(str(e))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    jobs = [ShardJob(str(out / f"{args.prefix}-{k:06d}.tar"), r)
            for k, r in enumerate(plan_shards(_sizes(_SOURCE), target))]
    existing = [j.path for j in jobs if Path(j.path).exists()]
    if existing and not args.overwrite:
        return fail(f"{existing[0]} exists (--overwrite replaces it)")
    write = partial(write_shard, read=_read, transform=transform)
    total = sum(len(j.samples) for j in jobs)
    infos = []
    with tqdm(total=total, unit="img", disable=args.no_progress, desc="convert") as bar:
        if args.workers == 1:
            for j in jobs:
                infos.append(write(j))
                bar.update(len(j.samples))
        else:
            fork = multiprocessing.get_context("fork")  # the workers inherit _SOURCE
            with ProcessPoolExecutor(args.workers, mp_context=fork) as pool:
                for info in pool.map(write, jobs):
                    infos.append(info)
                    bar.update(info.samples)
    manifest = Manifest("webdataset", infos)
    tmp = out / ".manifest.json.partial"
    tmp.write_text(manifest.to_json())
    tmp.replace(out / "manifest.json")
    print(f"wrote {total} samples in {len(infos)} shards to {out} "
          f"({sum(i.bytes for i in infos) / 1e6:.1f} MB), manifest {out / 'manifest.json'}")
    return 0

"""``feedline lmdb build|info``: pack image files into one LMDB file, and describe one.

An LMDB of JPEG bytes is read sequentially (one large file instead of a million small ones:
what network file systems and spinning disks want). Each datapoint is ``[jpeg bytes as a
uint8 array, label]``; read it with ``source: {lmdb: {path: OUT.lmdb}}`` and decode in the
pipeline's steps. ``--prepare-jpeg`` stores each JPEG prepared for crop decoding
(:mod:`feedline.producer.image.prepared`: transcoded losslessly, the same pixels);
``--index-jpeg`` stores each JPEG as it is with its side index
(:mod:`feedline.producer.image.jpgindex`), which the ``lmdb`` source hands to the decoder.
"""

from __future__ import annotations

import argparse
import sys
import threading
from collections import Counter
from typing import Any

from feedline.flags import HelpFormatter


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("lmdb", help="pack images into an LMDB file, or describe one",
                       description=__doc__, formatter_class=HelpFormatter)
    cmds = p.add_subparsers(dest="lmdb_command", metavar="ACTION")
    b = cmds.add_parser("build", help="pack IMAGE_DIR/<class>/*.jpg into OUT.lmdb",
                        formatter_class=HelpFormatter,
                        description="Pack the images under IMAGE_DIR (one sub-folder per "
                        "class; labels by sorted folder name)\nor listed in --list-file into "
                        "one LMDB file, with a progress bar.")
    b.add_argument("image_dir", metavar="IMAGE_DIR")
    b.add_argument("out", metavar="OUT.lmdb")
    b.add_argument("--list-file", default=None,
                   help="lines 'relative/path.jpg LABEL' (paths relative to IMAGE_DIR) "
                   "instead of class sub-folders")
    b.add_argument("--shuffle", action="store_true",
                   help="store in a random order (seed 0), so that a sequential read with a "
                   "local shuffle mixes classes")
    b.add_argument("--overwrite", action="store_true", help="replace OUT.lmdb if it exists")
    b.add_argument("--prepare-jpeg", action="store_true",
                   help="store JPEGs prepared for crop decoding: transcoded losslessly (the "
                   "same pixels, every decoder) with a restart marker after every MCU and an "
                   "MCU index, so that the fused decoder entropy-decodes only the blocks a "
                   "crop needs (docs/pipelines.md); other images, and JPEGs that cannot be, "
                   "are stored as they are. Needs the compiled extension")
    b.add_argument("--index-jpeg", action="store_true",
                   help="store each JPEG as it is, byte for byte, with its side index, so "
                   "that the fused decoder entropy-decodes only the blocks a crop needs "
                   "(docs/pipelines.md); images that cannot be indexed are stored without "
                   "one, counted by reason. Needs the compiled extension")
    b.add_argument("--jobs", type=int, default=1, metavar="N",
                   help="threads preparing or indexing JPEGs (libjpeg runs without the GIL)")
    b.add_argument("--no-progress", action="store_true", help="no progress bar")
    b.set_defaults(func=build)
    i = cmds.add_parser("info", help="count and size of an LMDB file",
                        formatter_class=HelpFormatter,
                        description="Print the path, the number of datapoints, the number of "
                        "LMDB entries and the file's size\nof an LMDB file written by "
                        "`feedline lmdb build` (or LMDBSerializer.save).")
    i.add_argument("path", metavar="FILE.lmdb")
    i.set_defaults(func=info)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])


class _Preparing:
    """Counts what preparing the images did (threads share one: a lock guards it)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.kept: Counter[str] = Counter()
        self.prepared = self.before = self.after = 0

    def function(self) -> Any:
        """The map function: image bytes -> the bytes to store (a closure, so that the
        threads' copies of the map function all count here)."""
        import numpy as np

        from feedline.producer.image.decode import CorruptImage
        from feedline.producer.image.prepared import prepare

        def prep(data: Any) -> Any:
            try:
                p = prepare(data, source=data)
            except CorruptImage as e:  # stored as it is: the decoder will say so again
                print(f"feedline lmdb build: warning: {e}; stored as it is", file=sys.stderr)
                with self.lock:
                    self.kept["does not decode"] += 1
                return data
            with self.lock:
                if p.prepared:
                    self.prepared += 1
                    self.before += data.size
                    self.after += len(p.data)
                else:
                    self.kept[p.note] += 1
            return np.frombuffer(p.data, np.uint8) if p.prepared else data

        return prep

    def summary(self) -> str:
        ratio = f" ({self.after / self.before:.3f}x their bytes)" if self.before else ""
        kept = "; ".join(f"{n} {why}" for why, n in self.kept.most_common())
        return f"{self.prepared} JPEGs prepared{ratio}" + (
            f", {sum(self.kept.values())} stored as they were: {kept}" if kept else "")


class _Indexing:
    """Counts what indexing the images did (threads share one: a lock guards it)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.kept: Counter[str] = Counter()
        self.indexed = self.index_bytes = self.image_bytes = 0

    def function(self) -> Any:
        """The map function: a FileBytes -> the same bytes carrying their side index (a
        closure, so that the threads' copies of the map function all count here)."""
        from feedline.producer.dataflow.image_folder import _file_bytes
        from feedline.producer.image.decode import CorruptImage
        from feedline.producer.image.jpgindex import index_jpeg

        def index(data: Any) -> Any:
            try:
                made = index_jpeg(data, source=data)
            except CorruptImage as e:  # stored as it is: the decoder will say so again
                print(f"feedline lmdb build: warning: {e}; stored without an index",
                      file=sys.stderr)
                with self.lock:
                    self.kept["does not decode"] += 1
                return data
            with self.lock:
                if made.jpgidx is None:
                    self.kept[made.note] += 1
                else:
                    self.indexed += 1
                    self.index_bytes += len(made.jpgidx)
                    self.image_bytes += data.size
            return _file_bytes(data, getattr(data, "path", ""), made.jpgidx)

        return index

    def summary(self) -> str:
        share = f" ({100 * self.index_bytes / self.image_bytes:.2f}% of their bytes)" \
            if self.image_bytes else ""
        kept = "; ".join(f"{n} {why}" for why, n in self.kept.most_common())
        return f"{self.indexed} JPEGs indexed{share}" + (
            f", {sum(self.kept.values())} stored without an index: {kept}" if kept else "")


def build(args: argparse.Namespace) -> int:
    from feedline.producer.dataflow import (
        ImageFolder,
        LMDBSerializer,
        MapDataComponent,
        MultiThreadMapData,
    )
    from feedline.producer.dataflow.map_data import ComponentFunc

    if args.jobs < 1:
        print(f"feedline lmdb build: --jobs must be >= 1, got {args.jobs}", file=sys.stderr)
        return 2
    if args.prepare_jpeg and args.index_jpeg:
        print("feedline lmdb build: --prepare-jpeg and --index-jpeg: one or the other (a "
              "prepared JPEG is read by its blocks already and takes no index)",
              file=sys.stderr)
        return 2
    preparing = _Preparing() if args.prepare_jpeg else None
    indexing = _Indexing() if args.index_jpeg else None
    if preparing is not None or indexing is not None:
        from feedline.producer.image import turbo

        if not turbo.AVAILABLE:
            flag = "--prepare-jpeg" if preparing is not None else "--index-jpeg"
            print(f"feedline lmdb build: {flag} needs the compiled extension (the "
                  f"decoder here: {turbo.decoder_info()}); nothing was written",
                  file=sys.stderr)
            return 2
    try:
        # Side indexes already beside the files are not read: --index-jpeg builds its own.
        if args.list_file:
            df: Any = ImageFolder(root=args.image_dir, list_file=args.list_file,
                                  shuffle=args.shuffle, jpeg_index=False)
        else:
            df = ImageFolder(root=args.image_dir, shuffle=args.shuffle, jpeg_index=False)
        counting = preparing if preparing is not None else indexing
        if counting is not None:
            fn = counting.function()
            df = MapDataComponent(df, fn, 0) if args.jobs == 1 else MultiThreadMapData(
                df, args.jobs, ComponentFunc(fn, 0), buffer_size=4 * args.jobs, strict=True)
        try:
            n = LMDBSerializer.save(df, args.out, progress=not args.no_progress,
                                    overwrite=args.overwrite,
                                    jpeg_index=indexing is not None)
        finally:
            getattr(df, "close", lambda: None)()
    except FileExistsError:
        print(f"feedline lmdb build: {args.out} exists (--overwrite replaces it)",
              file=sys.stderr)
        return 1
    except (OSError, ValueError) as e:
        what = f"{e.filename}: {e.strerror}" if isinstance(e, OSError) and e.filename else e
        print(f"feedline lmdb build: {what}; nothing was written to {args.out} (fix or remove "
              "that file and run again)", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"feedline lmdb build: interrupted; nothing was written to {args.out}",
              file=sys.stderr)
        return 130
    done = preparing if preparing is not None else indexing
    print(f"wrote {n} images to {args.out}" + (f": {done.summary()}" if done is not None
                                                else ""))
    return 0


def info(args: argparse.Namespace) -> int:
    from feedline.producer.dataflow.lmdb_serializer import lmdb_info

    try:
        d = lmdb_info(args.path)
    except Exception as e:  # lmdb.Error is not an OSError: report any failure plainly
        print(f"feedline lmdb info: {args.path}: {e}", file=sys.stderr)
        return 1
    print(f"path:     {d['path']}\ncount:    {d['count']}\n"
          f"entries:  {d['entries']}\nsize:     {d['file_bytes'] / 1e6:.1f} MB "
          f"({d['file_bytes']} bytes)" + (f"\nindexes:  {d['jpeg_indexes']} JPEG side indexes"
                                          if d["jpeg_indexes"] is not None else ""))
    return 0

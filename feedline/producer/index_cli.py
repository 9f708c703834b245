"""``feedline index FOLDER``: a side index beside each JPEG of an image folder.

Writes ``PATH.jpgidx`` beside every ``.jpg``/``.jpeg`` under FOLDER (any depth), so that
the fused decoder entropy-decodes only the MCUs under a crop
(:mod:`feedline.producer.image.jpgindex`); the JPEGs are not touched. ``image_folder``
sources pick the indexes up (option ``jpeg_index``, on by default). An index already there
that fits its file is kept (a run cut short resumes); ``--overwrite`` rebuilds them all.
Files that cannot be indexed (progressive, restart markers, ...) are counted by reason and
decode as before; a corrupt JPEG is named, and the others are indexed all the same.
``--workers`` processes, one file each at a time (memory stays one file per worker).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from feedline.errors import FeedlineError

JPEG_EXTENSIONS = (".jpg", ".jpeg")
# Corrupt files named one per line; past these, only counted.
NAMED = 20


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("index", help="write a JPEG side index (PATH.jpgidx) beside each JPEG "
                       "of an image folder, for crop decoding without transcoding",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder", help="image folder (JPEGs at any depth)")
    p.add_argument("--step", type=int, default=None,
                   help="MCUs per index entry within a row (default 4: see "
                   "docs/performance.md)")
    p.add_argument("--workers", type=int, default=1, help="processes building indexes (default: 1)")
    p.add_argument("--overwrite", action="store_true",
                   help="rebuild indexes that are already there and fit their files")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def jpegs(folder: Path) -> Iterator[str]:
    """Every JPEG under folder, in sorted order (directories too)."""
    for dirpath, dirnames, files in os.walk(folder):
        dirnames.sort()
        for f in sorted(files):
            if f.lower().endswith(JPEG_EXTENSIONS):
                yield os.path.join(dirpath, f)


def index_file(path: str, step: int, overwrite: bool) -> tuple[str, str, int, int]:
    """(outcome, detail, index bytes, file bytes) for one file: outcome is "indexed",
    "kept" (a fitting index was there), "skipped" (detail: why not indexable) or "corrupt"
    (detail: the error)."""
    from feedline.producer.image.jpgindex import BadIndex, check_index, index_jpeg, index_path

    try:
        data = Path(path).read_bytes()
    except OSError as e:
        return "corrupt", f"{path}: {e.strerror or e}", 0, 0
    out = index_path(path)
    if not overwrite and out.exists():
        try:
            old = out.read_bytes()
            check_index(data, old)
            return "kept", "", len(old), len(data)
        except (BadIndex, OSError):
            pass  # rebuilt below
    try:
        made = index_jpeg(data, step, source=path)
    except FeedlineError as e:
        return "corrupt", str(e), 0, len(data)
    if made.jpgidx is None:
        out.unlink(missing_ok=True)  # a stale index of an earlier version of the file
        return "skipped", made.note, 0, len(data)
    tmp = out.with_name(out.name + ".partial")
    tmp.write_bytes(made.jpgidx)
    tmp.replace(out)  # never a half-written index beside the file
    return "indexed", "", len(made.jpgidx), len(data)


def _one(job: tuple[str, int, bool]) -> tuple[str, str, int, int]:
    return index_file(*job)


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from feedline.producer.image.jpgindex import AVAILABLE, DEFAULT_STEP

    def fail(msg: str) -> int:
        print(f"feedline index: {msg}", file=sys.stderr)
        return 1

    folder = Path(args.folder)
    step = DEFAULT_STEP if args.step is None else args.step
    if not AVAILABLE:
        return fail("needs the compiled libjpeg-turbo extension (see `feedline --version`); "
                    "install a C compiler and the libjpeg-turbo headers and reinstall")
    if not folder.is_dir():
        return fail(f"{folder}: not a directory")
    if not 1 <= step <= 255:
        return fail(f"--step {step}: expected 1..255 MCUs")
    if args.workers < 1:
        return fail(f"--workers {args.workers}: expected >= 1")
    paths = list(jpegs(folder))
    if not paths:
        return fail(f"{folder}: no .jpg or .jpeg files")
    outcomes: Counter[str] = Counter()
    reasons: Counter[str] = Counter()
    index_bytes = file_bytes = 0
    jobs = ((p, step, args.overwrite) for p in paths)
    with tqdm(total=len(paths), unit="img", disable=args.no_progress, desc="index") as bar:
        if args.workers == 1:
            results: Iterator[tuple[str, str, int, int]] = map(_one, jobs)
            pool = None
        else:
            import multiprocessing

            pool = multiprocessing.get_context("spawn").Pool(args.workers)
            results = pool.imap(_one, jobs, chunksize=16)
        try:
            for outcome, detail, ib, fb in results:
                outcomes[outcome] += 1
                if outcome == "skipped":
                    reasons[detail] += 1
                elif outcome == "corrupt" and outcomes["corrupt"] <= NAMED:
                    tqdm.write(f"feedline index: {detail}: not indexed", file=sys.stderr)
                if outcome in ("indexed", "kept"):
                    index_bytes += ib
                    file_bytes += fb
                bar.update(1)
        finally:
            if pool is not None:
                pool.terminate()
    done = outcomes["indexed"] + outcomes["kept"]
    share = f" ({100 * index_bytes / file_bytes:.2f}% of those files)" if file_bytes else ""
    print(f"indexed {done} of {len(paths)} JPEGs under {folder} ({outcomes['kept']} already "
          f"were), {index_bytes / 1e6:.2f} MB of indexes{share}")
    for why, n in reasons.most_common():
        print(f"  not indexed, {why}: {n} (decoded as before)")
    if outcomes["corrupt"]:
        print(f"  corrupt or unreadable: {outcomes['corrupt']} (named above; decoding them "
              "fails as before)")
    return 0

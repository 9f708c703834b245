"""``feedline convert``: an image folder or an LMDB file as WebDataset shards, with a manifest.

Writes ``OUT_DIR/PREFIX-000000.tar, ...`` of about ``--shard-size`` bytes each (sample
``i`` of the source is sample ``i`` of the shards: ``%08d.jpg`` and ``%08d.cls``), in
``--workers`` processes with a progress bar, and ``OUT_DIR/manifest.json`` (each shard's
sample count, size and sha256): a pipeline's ``source: {webdataset: {manifest: ...}}`` reads
the shards from it, wherever they are copied to (same names beside it).

``--index-jpeg`` stores each JPEG as it is with its side index, a member ``%08d.jpgidx``
(:mod:`feedline.producer.image.jpgindex`): the ``webdataset`` source hands it to the fused
decoder, which then entropy-decodes only the MCUs under a crop. Images that cannot be
indexed (not a JPEG, progressive, ...) are stored without one, counted by reason.

``OUT_DIR`` holds one conversion per prefix: without ``--overwrite`` a folder that already
has this prefix's shards or a ``manifest.json`` is refused; with it, the new conversion
replaces the whole previous one: the shards the old ``manifest.json`` lists that the new one
does not write are removed once the new manifest is in place (only those: never a file the
old manifest does not name). A ``PREFIX-*.tar`` there that no manifest names (not written by
the conversion being replaced) is refused before anything is written, as it would be read
with the new shards by a glob such as ``OUT_DIR/shard-*.tar``.

A shard is written as ``.PREFIX-000000.tar.partial-PID`` and renamed when whole. A conversion
killed on the way leaves such files; the next one into ``OUT_DIR`` removes them (and says
so), unless process ``PID`` still runs: then it is refused in one line naming the file (a
conversion writing the folder now). A glob of the shards never reads them (it skips hidden
names).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
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
    p.add_argument("--index-jpeg", action="store_true",
                   help="store each JPEG as it is with its side index (a member KEY.jpgidx), "
                   "so that decoding reads only the crop's blocks; pixels never change")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the previous conversion in OUT_DIR: its shards, and its "
                   "manifest; shards of it that this one does not write are removed")
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
    """``(bytes, name) -> bytes``: a JPEG prepared for crop decoding (the same pixels), anything
    else and a JPEG that does not decode stored as it is (with a warning: the decoder will
    refuse it again when it is read); a clear error where this build cannot prepare."""
    from feedline.producer import image

    fn = getattr(image, "prepare_jpeg", None)
    if fn is None or not image.turbo.AVAILABLE:
        raise Unavailable("--prepare-jpeg: not available in this build (it needs "
                         "feedline.producer.image.prepare_jpeg, the lossless restart-interval "
                         "transcode); convert without it")
    return partial(_prepare_or_keep, fn)


def _prepare_or_keep(prepare_jpeg: Callable[[bytes], bytes], data: bytes, name: str) -> bytes:
    from feedline.producer.image.decode import CorruptImage

    try:
        return prepare_jpeg(data)
    except CorruptImage as e:
        why = str(e).split(": ", 1)[-1]  # without "N bytes: ": the sample is named instead
        print(f"feedline convert: warning: {name}: {why}; stored as it is", file=sys.stderr)
        return data


def open_source(path: str, list_file: str | None) -> Any:
    """The dataset as an indexable source (``samples()``, ``sample(i)``) in sorted order."""
    from feedline.producer.dataflow import ImageFolder, LMDBSerializer

    p = Path(path)
    if p.is_dir():
        return ImageFolder(root=p, list_file=list_file, shuffle=False)
    if p.is_file():
        return LMDBSerializer.load(p, shuffle=False)
    raise DataNotFound(f"{path}: no such image folder or LMDB file")


def _name(i: int) -> str:
    """Sample ``i`` of the source in a warning: its file, or its number."""
    paths = getattr(_SOURCE, "paths", None)
    return str(paths[i]) if paths is not None else f"sample {i}"


def _read(i: int, prepare: Callable[..., bytes] | None = None) -> tuple[bytes, int]:
    """Sample ``i`` of the source; with ``prepare`` (:func:`prepare_jpeg_function`), its
    image prepared, a warning naming the file (or the sample) where it does not decode."""
    from feedline.producer.shards.writer import as_bytes

    dp = _SOURCE.sample(i)
    data = as_bytes(dp[0])
    if prepare is not None:
        data = prepare(data, _name(i))
    return data, int(dp[1])


@dataclass
class IndexTally:
    """What ``--index-jpeg`` did in one shard (added up over the shards)."""

    indexed: int = 0
    index_bytes: int = 0
    image_bytes: int = 0
    kept: Counter[str] = field(default_factory=Counter)  # not indexed, by reason

    def add(self, other: IndexTally) -> None:
        self.indexed += other.indexed
        self.index_bytes += other.index_bytes
        self.image_bytes += other.image_bytes
        self.kept.update(other.kept)

    def summary(self) -> str:
        share = f" ({100 * self.index_bytes / self.image_bytes:.2f}% of their bytes)" \
            if self.image_bytes else ""
        kept = ", ".join(f"{why}: {n}" for why, n in self.kept.most_common())
        return f"indexed {self.indexed} JPEGs{share}" + (
            f"; stored without an index: {kept}" if kept else "")


def _index_member(tally: IndexTally, i: int, data: bytes) -> dict[str, bytes]:
    """Sample ``i``'s side index member (``{"jpgidx": ...}``), or none where its image is not
    indexable (counted by reason) or does not decode (a warning naming it)."""
    from feedline.producer.image.decode import CorruptImage
    from feedline.producer.image.jpgindex import SUFFIX, index_jpeg

    try:
        made = index_jpeg(data)
    except CorruptImage as e:
        why = str(e).split(": ", 1)[-1]  # without "N bytes: ": the sample is named instead
        print(f"feedline convert: warning: {_name(i)}: {why}; stored without an index",
              file=sys.stderr)
        tally.kept["does not decode"] += 1
        return {}
    if made.jpgidx is None:
        tally.kept[made.note] += 1
        return {}
    tally.indexed += 1
    tally.index_bytes += len(made.jpgidx)
    tally.image_bytes += len(data)
    return {SUFFIX[1:]: made.jpgidx}


def _write(job: Any, prepare: Callable[..., bytes] | None,
           index: bool) -> tuple[Any, IndexTally | None]:
    """One shard written (its ShardInfo) and, with ``index``, what indexing did in it."""
    from feedline.producer.shards.writer import write_shard

    tally = IndexTally() if index else None
    side = partial(_index_member, tally) if tally is not None else None
    return write_shard(job, read=partial(_read, prepare=prepare), side=side), tally


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
    from feedline.producer.shards.writer import ShardJob, plan_shards

    def fail(msg: str) -> int:
        print(f"feedline convert: {msg}", file=sys.stderr)
        return 1

    try:
        target = parse_size(args.shard_size)
        if args.prepare_jpeg and args.index_jpeg:
            raise ConfigError("--prepare-jpeg and --index-jpeg: one or the other (a prepared "
                              "JPEG is read by its blocks already and takes no index)")
        prepare = prepare_jpeg_function() if args.prepare_jpeg else None
        if args.index_jpeg:
            from feedline.producer.image.jpgindex import AVAILABLE
            from feedline.producer.image.turbo import decoder_info

            if not AVAILABLE:
                raise Unavailable(f"--index-jpeg: needs the compiled libjpeg-turbo extension "
                                  f"(the decoder here: {decoder_info()}); convert without it")
        if args.workers < 1:
            raise ConfigError(f"--workers {args.workers}: expected >= 1")
        _SOURCE = open_source(args.source, args.list_file)
    except (FeedlineError, OSError) as e:
        return fail(str(e))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    jobs = [ShardJob(str(out / f"{args.prefix}-{k:06d}.tar"), r)
            for k, r in enumerate(plan_shards(_sizes(_SOURCE), target))]
    try:
        partials = _interrupted(out, args.prefix)
        stale = _previous_conversion(out, args.prefix, {Path(j.path).name for j in jobs},
                                     args.overwrite)
    except ConfigError as e:
        return fail(str(e))
    for p in partials:  # refused by nothing above: a conversion killed on its way left them
        p.unlink(missing_ok=True)
    if partials:
        print(f"removed {len(partials)} partial shards an interrupted conversion left "
              f"({partials[0].name}{', ...' if len(partials) > 1 else ''})")
    write = partial(_write, prepare=prepare, index=args.index_jpeg)
    total = sum(len(j.samples) for j in jobs)
    infos = []
    indexing = IndexTally()
    with tqdm(total=total, unit="img", disable=args.no_progress, desc="convert") as bar, \
            ExitStack() as stack:
        if args.workers == 1:
            done: Any = map(write, jobs)
        else:
            fork = multiprocessing.get_context("fork")  # the workers inherit _SOURCE
            pool = stack.enter_context(ProcessPoolExecutor(args.workers, mp_context=fork))
            done = pool.map(write, jobs)
        for info, tally in done:
            infos.append(info)
            if tally is not None:
                indexing.add(tally)
            bar.update(info.samples)
    manifest = Manifest("webdataset", infos)
    tmp = out / ".manifest.json.partial"
    tmp.write_text(manifest.to_json())
    tmp.replace(out / "manifest.json")
    for old in stale:  # after the new manifest: a conversion cut short keeps the old one whole
        old.unlink(missing_ok=True)
    removed = f"; removed {len(stale)} shards of the previous conversion" if stale else ""
    print(f"wrote {total} samples in {len(infos)} shards to {out} "
          f"({sum(i.bytes for i in infos) / 1e6:.1f} MB), manifest {out / 'manifest.json'}"
          f"{removed}")
    if args.index_jpeg:
        print(indexing.summary())
    return 0


def _interrupted(out: Path, prefix: str) -> list[Path]:
    """The partial shards (``.PREFIX-*.tar.partial-PID``, what :func:`~feedline.producer.
    shards.writer.write_shard` writes before its rename) a conversion killed on its way left
    in ``out``: to remove. ConfigError naming one whose process still runs (a conversion
    writing this folder now)."""
    found = sorted(p for p in out.glob(f".{prefix}-*.tar.partial-*") if p.is_file())
    for p in found:
        pid = p.name.rsplit("-", 1)[-1]
        if pid.isdigit() and _running(int(pid)):
            raise ConfigError(f"{p}: a shard process {pid} is writing (a conversion into "
                              f"{out} now?): wait for it to end or stop it; if no conversion "
                              f"runs, remove {p.name}")
    return found


def _running(pid: int) -> bool:
    """Process ``pid`` is a feedline conversion running now. Not this one (a container that
    runs each conversion as the same PID, or ``exec``, reuses the killed one's), and, where
    /proc says what a process is, not an unrelated process that took the PID."""
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: it runs
        return True
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return True  # no /proc here: it runs, whatever it is
    return b"feedline" in cmdline and b"convert" in cmdline


def _previous_conversion(out: Path, prefix: str, writing: set[str],
                         overwrite: bool) -> list[Path]:
    """The shards of the conversion already in ``out`` that this one (writing the file names
    ``writing``) replaces and does not rewrite: to remove once its manifest is in place.

    ConfigError (one line, what to do) where the folder holds a previous conversion and
    ``overwrite`` is off, or a ``PREFIX-*.tar`` that neither the old ``manifest.json`` nor
    this conversion names: a file this command did not write is never removed, and left
    there it would be read twice over by a glob of the shards.
    """
    from feedline.producer.shards.manifest import ManifestError, parse

    manifest = out / "manifest.json"
    ours = sorted(p for p in out.glob(f"{prefix}-*.tar") if p.is_file())
    if not overwrite:
        there = [p for p in ours if p.name in writing] or ours
        if there:
            raise ConfigError(f"{there[0]} exists (--overwrite replaces the previous "
                              "conversion)")
        if manifest.exists():
            raise ConfigError(f"{manifest} exists (--overwrite replaces that conversion)")
        return []
    listed: set[str] = set()
    if manifest.is_file():
        try:
            old = parse(manifest.read_text(), str(manifest))
        except (ManifestError, OSError, UnicodeDecodeError):
            old = None  # nothing it names is known: a shard of this prefix there is refused
        if old is not None:
            # Only bare names, as convert writes them: a name with a directory or ".." is
            # someone else's file, never removed from here.
            listed = {s.name for s in old.shards if s.name == Path(s.name).name
                      and s.name not in ("", ".", "..")}
    strays = [p for p in ours if p.name not in writing and p.name not in listed]
    if strays:
        raise ConfigError(f"{strays[0]}: a shard that {manifest} does not list (not written "
                          f"by the conversion --overwrite replaces); remove it or convert "
                          f"to another folder")
    return sorted(out / n for n in listed - writing if (out / n).is_file())

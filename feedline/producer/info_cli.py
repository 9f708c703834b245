"""``feedline info URL ...``: what a sharded dataset holds, shard by shard.

Given a manifest (``.json``) it prints the manifest's table without reading a shard. Given
shards (names, globs, braces, anywhere fsspec reads), it reads each one front to back in
bounded memory, counts its samples and fields, checks its records (corrupt ones are counted
and named), and with ``--manifest OUT.json`` writes the manifest a pipeline needs for exact
delivery (each shard's sample count, size and sha256).
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from collections import Counter
from typing import Any

from feedline.flags import HelpFormatter

FORMATS = {".tar": "webdataset", ".tfrecord": "tfrecord", ".tfrecords": "tfrecord",
           ".parquet": "parquet"}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("info", help="list a sharded dataset's shards, samples and fields",
                       description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("urls", nargs="+", metavar="URL",
                   help="a manifest.json, or shards: paths, globs, {000..127} braces, "
                   "http(s)://, s3://, gs://")
    p.add_argument("--format", choices=sorted(set(FORMATS.values())), default=None,
                   help="the shards' format (default: by their extension)")
    p.add_argument("--manifest", default=None, metavar="OUT.json",
                   help="write the shards' manifest here")
    p.set_defaults(func=run)


class _Hashing:
    """A shard stream that hashes what passes through it (skips read, so they hash too)."""

    def __init__(self, stream: Any) -> None:
        self.stream, self.sha = stream, hashlib.sha256()

    @property
    def offset(self) -> int:
        return int(self.stream.offset)

    def read(self, n: int) -> bytes:
        data = self.stream.read(n)
        self.sha.update(data)
        return bytes(data)

    def skip(self, n: int) -> int:
        got = 0
        while got < n:
            part = self.read(min(n - got, 1 << 20))
            if not part:
                break
            got += len(part)
        return got


def places(stream: Any, url: str, fmt: str) -> tuple[int, Counter, list[str]]:
    """(samples, field counts, corrupt records) of a WebDataset or TFRecord shard on
    ``stream`` (a Readable), counted as the source reads them (:func:`~feedline.producer.
    shards.tar.samples`, :meth:`TFRecord.read_stream`): one place per sample or per corrupt
    record standing where one was, so that exact delivery over the manifest finds every
    place where the count says. Raises nothing but the stream's ShardError."""
    from feedline.errors import DataError
    from feedline.producer.shards.records import CorruptRecord
    from feedline.producer.shards.tar import samples
    from feedline.producer.shards.tfrecord import parse_example, records

    fields: Counter = Counter()
    corrupt: list[str] = []
    n = 0
    if fmt == "webdataset":
        for item in samples(stream, url, wanted=()):  # names only: nothing held
            n += 1
            if isinstance(item, CorruptRecord):
                corrupt.append(str(item))
            else:
                fields.update(item[1].keys())
        return n, fields, corrupt
    while True:
        try:
            at = stream.offset
            for rec in records(stream, url):
                n += 1
                try:
                    fields.update(parse_example(rec).keys())
                except DataError as e:  # the source counts it corrupt, in its place
                    corrupt.append(f"{url}#{at}: not a tf.train.Example: {e}")
                at = stream.offset
            return n, fields, corrupt
        except CorruptRecord as e:
            n += 1  # a place, as the source yields it
            corrupt.append(str(e))
            if not e.resumable:
                return n, fields, corrupt


def scan(url: str, fmt: str, loc: Any) -> tuple[int, Counter, int, str, list[str]]:
    """(samples, field counts, bytes, sha256, corrupt records) of one shard (samples as
    :func:`places` counts them). Raises ShardError (the shard cannot be read at all),
    nothing else."""
    from feedline.producer.shards.retry import ShardError
    from feedline.producer.shards.stream import ChunkStream

    with ChunkStream(loc, url) as raw:
        s = _Hashing(raw)
        if fmt == "parquet":
            s.skip(1 << 62)
            import pyarrow.parquet as pq

            fields: Counter = Counter()
            try:
                with loc.fs().open(url, "rb") as f:
                    pf = pq.ParquetFile(f)
                    n = pf.metadata.num_rows
                    fields.update({c: n for c in pf.schema_arrow.names})
            except Exception as e:  # pyarrow's errors on a file that is not Parquet
                raise ShardError(url, f"not a Parquet file ({type(e).__name__}: {e})") from None
            return n, fields, s.offset, s.sha.hexdigest(), []
        n, fields, corrupt = places(s, url, fmt)
        s.skip(1 << 62)  # the rest (end blocks), so that the hash covers the file
        return n, fields, s.offset, s.sha.hexdigest(), corrupt


def run(args: argparse.Namespace) -> int:
    from feedline.producer.shards import manifest as mf
    from feedline.producer.shards.locations import (
        Location,
        LocationError,
        basename,
        expand,
        protocol_of,
    )
    from feedline.producer.shards.retry import ShardError

    try:
        if len(args.urls) == 1 and args.urls[0].endswith(".json"):
            m = mf.read(args.urls[0])
            rows = [(s.name, s.bytes, s.samples, "") for s in m.shards]
            _table(rows, [])
            return 0
        urls = expand(args.urls)
    except (LocationError, mf.ManifestError, OSError) as e:
        print(f"feedline info: {e}", file=sys.stderr)
        return 1
    infos, rows, corrupt = [], [], []
    for url in urls:
        fmt = args.format or next((f for ext, f in FORMATS.items() if url.endswith(ext)), None)
        if fmt is None:
            print(f"feedline info: {url}: unknown format (give --format)", file=sys.stderr)
            return 1
        try:
            n, fields, size, sha, bad = scan(url, fmt, Location(protocol_of(url)))
        except (ShardError, LocationError) as e:
            print(f"feedline info: {e}", file=sys.stderr)
            return 1
        corrupt += bad
        name = mf.relative_name(url, args.manifest) if args.manifest else basename(url)
        infos.append(mf.ShardInfo(name, n, size, sha))
        rows.append((url, size, n, ", ".join(f"{k} ({v})" for k, v in sorted(fields.items()))))
    _table(rows, corrupt)
    if args.manifest:
        kind = args.format or FORMATS.get("." + urls[0].rsplit(".", 1)[-1], "")
        with open(args.manifest, "w") as f:
            f.write(mf.Manifest(kind, infos).to_json())
        print(f"wrote {args.manifest}")
    return 0


def _table(rows: list[tuple[str, int, int, str]], corrupt: list[str]) -> None:
    width = max([5, *(len(r[0]) for r in rows)])
    print(f"{'shard':<{width}}  {'bytes':>12}  {'samples':>8}  fields")
    for name, size, n, fields in rows:
        print(f"{name:<{width}}  {size:>12}  {n:>8}  {fields}")
    print(f"{len(rows)} shards, {sum(r[2] for r in rows)} samples, "
          f"{sum(r[1] for r in rows) / 1e6:.1f} MB")
    for c in corrupt:
        print(f"corrupt: {c}")

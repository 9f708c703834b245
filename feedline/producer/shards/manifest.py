"""A sharded dataset's manifest: its shards, each with its sample count, size and checksum.

``feedline convert`` writes ``manifest.json`` beside the shards it makes, and ``feedline info
URLS --manifest OUT`` writes one for shards made elsewhere. A source reads it to know each
shard's sample count without reading the shard (exact delivery cuts units from the counts
and numbers samples by them), and can take its shard list from it: the shards are the
manifest's ``name``\\ s, relative to the manifest's own location.

    {"format": "webdataset", "version": 1, "samples": 2560,
     "shards": [{"name": "train-000000.tar", "samples": 1280, "bytes": 139264000,
                 "sha256": "9f2c..."}, ...]}
"""

from __future__ import annotations

import json
import posixpath
from dataclasses import asdict, dataclass, field
from typing import Any

from feedline.errors import DataError
from feedline.producer.shards.locations import Location, basename, protocol_of

VERSION = 1


class ManifestError(DataError):
    """A manifest that cannot be read or does not fit its shards; says which and why."""


@dataclass(frozen=True)
class ShardInfo:
    name: str
    samples: int
    bytes: int = 0
    sha256: str = ""


@dataclass
class Manifest:
    format: str
    shards: list[ShardInfo] = field(default_factory=list)
    version: int = VERSION

    @property
    def samples(self) -> int:
        return sum(s.samples for s in self.shards)

    def to_json(self) -> str:
        d: dict[str, Any] = {"format": self.format, "version": self.version,
                             "samples": self.samples,
                             "shards": [asdict(s) for s in self.shards]}
        return json.dumps(d, indent=1) + "\n"

    def counts(self, urls: list[str]) -> list[int]:
        """Each shard's sample count, matched by file name; ManifestError naming a shard
        the manifest does not list."""
        by_name = {basename(s.name): s.samples for s in self.shards}
        out = []
        for u in urls:
            n = by_name.get(basename(u))
            if n is None:
                raise ManifestError(f"{u}: not in the manifest (it lists "
                                    f"{len(by_name)} shards)")
            out.append(n)
        return out


def parse(text: str, where: str) -> Manifest:
    try:
        d = json.loads(text)
        shards = [ShardInfo(str(s["name"]), int(s["samples"]), int(s.get("bytes", 0)),
                            str(s.get("sha256", ""))) for s in d["shards"]]
        if any(s.samples < 0 for s in shards):
            raise ManifestError("a negative sample count")
        return Manifest(str(d.get("format", "")), shards, int(d.get("version", VERSION)))
    except (ValueError, KeyError, TypeError) as e:
        raise ManifestError(f"{where}: not a feedline shard manifest ({type(e).__name__}: "
                            f"{e})") from None


def read(url: str, options: dict[str, Any] | None = None) -> Manifest:
    loc = Location(protocol_of(url), dict(options or {}))
    try:
        with loc.fs().open(url, "rb") as f:
            return parse(f.read().decode("utf-8"), url)
    except (OSError, UnicodeDecodeError) as e:
        raise ManifestError(f"{url}: cannot read the manifest: {e}") from None


def shard_urls(manifest_url: str, m: Manifest) -> list[str]:
    """The shards a manifest lists, as names beside it."""
    base = posixpath.dirname(manifest_url)
    return [s.name if "://" in s.name or s.name.startswith("/")
            else (f"{base}/{s.name}" if base else s.name) for s in m.shards]

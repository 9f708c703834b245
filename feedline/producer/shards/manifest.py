"""A sharded dataset's manifest: its shards, each with its sample count, size and checksum.

``feedline convert`` writes ``manifest.json`` beside the shards it makes, and ``feedline info
URLS --manifest OUT`` writes one for shards made elsewhere. A source reads it to know each
shard's sample count without reading the shard (exact delivery cuts units from the counts
and numbers samples by them), and can take its shard list from it: the shards are the
manifest's ``name``\\ s, relative to the manifest's own location.

Names are unambiguous: a path relative to the manifest (``a/shard-000000.tar`` for a shard
in ``a/`` beside it), or a full URL / absolute path for a shard elsewhere; a manifest that
names a shard twice is refused. Given ``urls`` as well, each url takes the count of the one
shard whose name resolves to it, or else whose name ends it (``.../a/shard-000000.tar``
ends with ``a/shard-000000.tar``); a url that matches none or several, or two urls that
match one shard, is a one-line :class:`ManifestError` saying to write the manifest again.

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
from feedline.producer.shards.locations import Location, protocol_of

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
    url: str = field(default="", compare=False)  # where it was read from (not written)

    @property
    def samples(self) -> int:
        return sum(s.samples for s in self.shards)

    def to_json(self) -> str:
        d: dict[str, Any] = {"format": self.format, "version": self.version,
                             "samples": self.samples,
                             "shards": [asdict(s) for s in self.shards]}
        return json.dumps(d, indent=1) + "\n"

    def counts(self, urls: list[str]) -> list[int]:
        """Each url's sample count: the count of the one shard whose name resolves to it
        (beside the manifest), or else whose relative name ends it. ManifestError for a url
        that matches no shard or several, or two urls that match one shard."""
        resolved = {_norm(u): i for i, u in enumerate(shard_urls(self.url, self))}
        taken: dict[int, str] = {}
        out = []
        for u in urls:
            i = resolved.get(_norm(u))
            if i is None:
                found = [k for k, s in enumerate(self.shards) if _ends(u, s.name)]
                if not found:
                    raise ManifestError(
                        f"{u}: not in the manifest {self._where()} (it lists "
                        f"{len(self.shards)} shards{self._example()}): give the manifest "
                        f"of these shards, or write one with `{_REWRITE}`")
                if len(found) > 1:
                    raise ManifestError(
                        f"{u}: matches {len(found)} shards of the manifest {self._where()} "
                        f"({', '.join(self.shards[k].name for k in found[:3])}): its names "
                        f"must be paths relative to it; write it again with `{_REWRITE}`")
                i = found[0]
            if i in taken:
                raise ManifestError(
                    f"{taken[i]} and {u} both match {self.shards[i].name} of the manifest "
                    f"{self._where()}: its names must be paths relative to it; write it "
                    f"again with `{_REWRITE}`")
            taken[i] = u
            out.append(self.shards[i].samples)
        return out

    def _where(self) -> str:
        return self.url or "(in memory)"

    def _example(self) -> str:
        return f", e.g. {self.shards[0].name}" if self.shards else ""


_REWRITE = "feedline info SHARDS --manifest MANIFEST.json"


def _norm(url: str) -> str:
    if "://" in url:
        proto, rest = url.split("://", 1)
        return f"{proto}://{posixpath.normpath(rest)}" if rest else url
    return posixpath.normpath(url)


def _ends(url: str, name: str) -> bool:
    """``name`` (relative) is the last path components of ``url``."""
    if "://" in name or name.startswith("/"):
        return False
    name = posixpath.normpath(name)
    if name == ".." or name.startswith("../"):
        return False
    u = _norm(url)
    return u == name or u.endswith("/" + name)


def relative_name(shard_url: str, manifest_path: str) -> str:
    """What a manifest at ``manifest_path`` calls the shard at ``shard_url``: its path
    relative to the manifest's folder when the shard is inside it, else the shard's full
    URL (a local shard elsewhere: its absolute path)."""
    import os

    if "://" in shard_url:
        base = posixpath.dirname(manifest_path)
        return shard_url[len(base) + 1:] if base and shard_url.startswith(base + "/") \
            else shard_url
    shard = os.path.abspath(shard_url)
    base = os.path.dirname(os.path.abspath(manifest_path))
    rel = os.path.relpath(shard, base)
    rel = rel.replace(os.sep, "/")
    return shard if rel == ".." or rel.startswith("../") else rel


def parse(text: str, where: str) -> Manifest:
    try:
        d = json.loads(text)
        shards = [ShardInfo(str(s["name"]), int(s["samples"]), int(s.get("bytes", 0)),
                            str(s.get("sha256", ""))) for s in d["shards"]]
        if any(s.samples < 0 for s in shards):
            raise ManifestError("a negative sample count")
        m = Manifest(str(d.get("format", "")), shards, int(d.get("version", VERSION)), where)
    except (ValueError, KeyError, TypeError) as e:
        raise ManifestError(f"{where}: not a feedline shard manifest ({type(e).__name__}: "
                            f"{e})") from None
    seen: set[str] = set()
    for s in m.shards:
        name = _norm(s.name)
        if name in seen:
            raise ManifestError(f"{where}: names the shard {s.name} twice (a manifest's names "
                                f"are paths relative to it, one per shard): write it again "
                                f"with `{_REWRITE}`")
        seen.add(name)
    return m



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

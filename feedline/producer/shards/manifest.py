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
# A shard's sample count, at most (2**40: a TFRecord file of that many empty records is 16
# TB): keeps the sums and offsets of every count far inside int64.
MAX_SHARD_SAMPLES = 1 << 40
# The bytes one record takes at least, by format: a tar member's header (a sample is at
# least one), a TFRecord record's length and CRCs. A count its shard's bytes cannot hold is
# refused (Parquet: none, a column's values can take less than a byte each).
MIN_RECORD_BYTES = {"webdataset": 512, "tfrecord": 16}
MAX_MANIFEST_BYTES = 64 << 20  # a manifest's size, at most (about 400,000 shards)


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
    """The manifest ``text`` (read from ``where``); ManifestError in one line naming the
    field and what it may be. Hostile text is refused, not followed: any nesting (a
    manifest is a map of a list of maps), a count that is not an int from 0 to
    :data:`MAX_SHARD_SAMPLES`, or more samples than the shard's ``bytes`` can hold
    (:data:`MIN_RECORD_BYTES` each)."""
    try:
        d = json.loads(text)
    except RecursionError:
        raise ManifestError(f"{where}: not a feedline shard manifest (JSON nested deeper than "
                            "Python parses; a manifest is a map with a list of shards)") from None
    except ValueError as e:
        raise ManifestError(f"{where}: not a feedline shard manifest (not JSON: {e})") from None
    if not isinstance(d, dict):
        raise ManifestError(f"{where}: not a feedline shard manifest (a JSON map with "
                            f"\"shards\" is, not {_what(d)})")
    fmt = _field(d, "format", where, str, "a format name (webdataset, tfrecord, parquet)", "")
    version = _field(d, "version", where, int, f"the manifest version, {VERSION}", VERSION)
    if version != VERSION:
        raise ManifestError(f"{where}: version: {version!r}; this feedline reads manifests of "
                            f"version {VERSION} (write it again with `{_REWRITE}`)")
    items = d.get("shards")
    if not isinstance(items, list):
        raise ManifestError(f"{where}: shards: expected a list of shards ({{\"name\": ..., "
                            f"\"samples\": ...}}), got {_what(items)}")
    least = MIN_RECORD_BYTES.get(fmt, 0)
    shards = []
    for i, item in enumerate(items):
        at = f"shards[{i}]"
        if not isinstance(item, dict):
            raise ManifestError(f"{where}: {at}: expected a map with name and samples, got "
                                f"{_what(item)}")
        name = _field(item, "name", where, str, "the shard's name", None, at)
        if not name:
            raise ManifestError(f"{where}: {at}.name: expected the shard's name, got \"\"")
        n = _field(item, "samples", where, int, f"the shard's sample count, an int from 0 to "
                   f"{MAX_SHARD_SAMPLES}", None, at, hi=MAX_SHARD_SAMPLES)
        size = _field(item, "bytes", where, int, "the shard's size in bytes, an int >= 0", 0, at)
        sha = _field(item, "sha256", where, str, "the shard's sha256 in hex", "", at)
        if size and least and n > most_records(size, least):
            raise ManifestError(
                f"{where}: {at}.samples: {n} samples in the {size} bytes it says the shard "
                f"has: a {fmt} record takes at least {least}; the manifest does not describe "
                f"its shards: write it again with `{_REWRITE}`")
        shards.append(ShardInfo(name, n, size, sha))
    total = sum(s.samples for s in shards)
    said = _field(d, "samples", where, int, f"the shards' samples in all ({total})", total)
    if said != total:
        raise ManifestError(f"{where}: samples: {said}, but its shards' add up to {total}: "
                            f"write it again with `{_REWRITE}`")
    m = Manifest(fmt, shards, version, where)
    seen: set[str] = set()
    for s in m.shards:
        key = _norm(s.name)
        if key in seen:
            raise ManifestError(f"{where}: names the shard {s.name} twice (a manifest's names "
                                f"are paths relative to it, one per shard): write it again "
                                f"with `{_REWRITE}`")
        seen.add(key)
    return m


def most_records(size: int, least: int) -> int:
    """The places a shard of ``size`` bytes can hold at ``least`` bytes a record: every one
    whole but the last (a record cut short by the shard's end is a place too)."""
    return -(-size // least)


def _field(d: dict[str, Any], key: str, where: str, kind: type, allowed: str, default: Any,
           at: str = "", hi: int | None = None) -> Any:
    """``d[key]``, of type ``kind`` (an int: not a bool, not a float; >= 0, <= ``hi``);
    ``default`` where it is missing (None: required); else ManifestError naming it."""
    name = f"{at}.{key}" if at else key
    if key not in d:
        if default is None:
            raise ManifestError(f"{where}: {name}: missing ({allowed})")
        return default
    v = d[key]
    ok = isinstance(v, kind) and not isinstance(v, bool)
    if ok and kind is int:
        ok = v >= 0 and (hi is None or v <= hi)
    if not ok:
        raise ManifestError(f"{where}: {name}: expected {allowed}, got {_what(v)}")
    return v


def _what(v: Any) -> str:
    """A value as an error shows it: short, with its JSON type."""
    kinds = {bool: "true/false", int: "a number", float: "a number with a fraction",
             str: "a string", list: "a list", dict: "a map", type(None): "null"}
    text = json.dumps(v)[:40] if not isinstance(v, (list, dict)) else ""
    return f"{text} ({kinds.get(type(v), type(v).__name__)})" if text else \
        kinds.get(type(v), type(v).__name__)


def read(url: str, options: dict[str, Any] | None = None) -> Manifest:
    """The manifest at ``url``; ManifestError if it cannot be read, is larger than
    :data:`MAX_MANIFEST_BYTES` or is not one (:func:`parse`)."""
    loc = Location(protocol_of(url), dict(options or {}))
    try:
        with loc.fs().open(url, "rb") as f:
            data = f.read(MAX_MANIFEST_BYTES + 1)
        if len(data) > MAX_MANIFEST_BYTES:
            raise ManifestError(f"{url}: larger than a manifest may be ({MAX_MANIFEST_BYTES} "
                                "bytes): is it one?")
        return parse(data.decode("utf-8"), url)
    except (OSError, UnicodeDecodeError) as e:
        raise ManifestError(f"{url}: cannot read the manifest: {e}") from None


def shard_urls(manifest_url: str, m: Manifest) -> list[str]:
    """The shards a manifest lists, as names beside it."""
    base = posixpath.dirname(manifest_url)
    return [s.name if "://" in s.name or s.name.startswith("/")
            else (f"{base}/{s.name}" if base else s.name) for s in m.shards]

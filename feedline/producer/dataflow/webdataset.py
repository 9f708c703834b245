"""WebDataset: samples from tar shards, members grouped by key (``.jpg``, ``.cls``, ...)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from feedline.errors import ConfigError
from feedline.producer.dataflow.shard_fields import pick, wds_field
from feedline.producer.dataflow.sharded import ShardedSource
from feedline.producer.shards.records import CorruptRecord
from feedline.producer.shards.tar import members, split_key

DEFAULT_FIELDS = ("jpg;jpeg;png;webp", "cls")


class WebDataset(ShardedSource):
    """Yield one datapoint per sample of the tar shards: ``fields`` (member extensions,
    ``;`` between alternatives) in order, by default ``[image bytes, label]`` as
    :class:`~feedline.producer.dataflow.ImageFolder` gives them. A sample is the run of
    consecutive members with one key. Every other argument is
    :class:`~feedline.producer.dataflow.sharded.ShardedSource`'s.

    A member cut short, a header whose checksum is wrong, a sample without one of the
    fields: that sample is a corrupt record (counted, named ``shard#key``), and the rest of
    the shard too when the tar cannot be followed past it.
    """

    format = "webdataset"

    def __init__(self, urls: str | Sequence[str] | None = None, *,
                 fields: Sequence[str] = DEFAULT_FIELDS, **kw: Any) -> None:
        super().__init__(urls, fields=fields, **kw)
        if not self.fields:
            raise ConfigError("fields: at least one member extension")
        self._alts = [spec.split(";") for spec in self.fields]

    def _sample(self, url: str, key: str, members_: dict[str, bytes]) -> list[Any]:
        where = f"{url}#{key}"
        out = []
        for alts, spec in zip(self._alts, self.fields, strict=True):
            for ext in alts:
                data = members_.get(ext)
                if data is not None:
                    out.append(wds_field(ext, data, f"{where}.{ext}"))
                    break
            else:
                pick(members_, spec, where)  # raises: the sample has none of them
        return out

    def _read_from(self, url: str, start: int = 0, end: int | None = None,
                   chunk: int | None = None) -> Iterator[tuple[int | None, Any]]:
        stream = self.stream(url, start, end, chunk)
        try:
            key: str | None = None
            key_at = at = start  # where the sample being gathered / the next member starts
            fields: dict[str, bytes] = {}
            while True:
                try:
                    for name, data in members(stream, url, self.max_sample_bytes):
                        k, ext = split_key(name)
                        if k != key:
                            if key is not None:
                                yield key_at, self._guard(url, key, fields)
                                fields = {}
                            key_at = at
                        key = k
                        fields[ext] = data
                        at = stream.offset  # members() stops after a member's padding
                    break
                except CorruptRecord as e:
                    # The sample read so far stands if it has every field (its members were
                    # whole); the corrupt member takes a place of its own.
                    if key is not None:
                        yield key_at, self._guard(url, key, fields)
                    yield at, e
                    key, fields = None, {}
                    at = stream.offset
                    if not e.resumable:
                        return
            if key is not None:
                yield key_at, self._guard(url, key, fields)
        finally:
            stream.close()

    def _guard(self, url: str, key: str, fields: dict[str, bytes]) -> Any:
        try:
            return self._sample(url, key, fields)
        except CorruptRecord as e:
            return e

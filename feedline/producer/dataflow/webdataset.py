"""WebDataset: samples from tar shards, members grouped by key (``.jpg``, ``.cls``, ...)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from feedline.errors import ConfigError
from feedline.producer.dataflow.base import Named
from feedline.producer.dataflow.image_folder import FileBytes
from feedline.producer.dataflow.shard_fields import pick, wds_field
from feedline.producer.dataflow.sharded import ShardedSource
from feedline.producer.shards.records import CorruptRecord, Readable
from feedline.producer.shards.tar import samples_at

DEFAULT_FIELDS = ("jpg;jpeg;png;webp", "cls")
JPEG_EXTS = ("jpg", "jpeg")
INDEX_EXT = "jpgidx"  # a JPEG's side index beside it (feedline convert --index-jpeg)


class WebDataset(ShardedSource):
    """Yield one datapoint per sample of the tar shards: ``fields`` (member extensions,
    ``;`` between alternatives) in order, by default ``[image bytes, label]`` as
    :class:`~feedline.producer.dataflow.ImageFolder` gives them. A sample is the run of
    consecutive members with one key. Every other argument is
    :class:`~feedline.producer.dataflow.sharded.ShardedSource`'s.

    A member cut short, a header whose checksum is wrong, a sample without one of the
    fields, a sample whose fields hold more than ``max_sample_bytes``: that sample is a
    corrupt record (counted, named ``shard#key``), and the rest of the shard too when the
    tar cannot be followed past it. Members whose extension is not among ``fields`` are
    skipped without being read into memory.

    ``jpeg_index``: a sample's ``jpgidx`` member (``feedline convert --index-jpeg``) comes
    with its JPEG field (its ``jpeg_index``, as an image folder's ``PATH.jpgidx``), for the
    fused decoder; a sample without one decodes as before, and an index that does not fit
    its JPEG (damaged, another file's) is refused by the decoder, which decodes the image
    without it (counted: :func:`feedline.producer.image.turbo.index_refusals`).
    """

    format = "webdataset"

    def __init__(self, urls: str | Sequence[str] | None = None, *,
                 fields: Sequence[str] = DEFAULT_FIELDS, jpeg_index: bool = True,
                 **kw: Any) -> None:
        super().__init__(urls, fields=fields, **kw)
        if not self.fields:
            raise ConfigError("fields: at least one member extension")
        self._alts = [spec.split(";") for spec in self.fields]
        wanted = {ext for alts in self._alts for ext in alts}
        self.jpeg_index = jpeg_index and any(e in wanted for e in JPEG_EXTS)
        self._wanted = frozenset(wanted | ({INDEX_EXT} if self.jpeg_index else set()))

    def _sample(self, url: str, key: str, members_: dict[str, bytes | None]) -> Named:
        where = f"{url}#{key}"
        out = Named(where=where)
        index = members_.get(INDEX_EXT) if self.jpeg_index else None
        for alts, spec in zip(self._alts, self.fields, strict=True):
            for ext in alts:
                data = members_.get(ext)
                if data is not None:
                    value = wds_field(ext, data, f"{where}.{ext}")
                    if index is not None and ext in JPEG_EXTS and isinstance(value, FileBytes):
                        value.jpeg_index = bytes(index)
                    out.append(value)
                    break
            else:
                pick(members_, spec, where)  # raises: the sample has none of them
        return out

    def _read_from(self, url: str, start: int = 0, end: int | None = None,
                   chunk: int | None = None) -> Iterator[tuple[int | None, Any]]:
        stream = self.stream(url, start, end, chunk)
        try:
            yield from self.read_stream_at(stream, url)
        finally:
            stream.close()

    def read_stream(self, stream: Readable, url: str) -> Iterator[Any]:
        """One shard's samples from ``stream`` (:meth:`_read`'s, on any Readable): each a
        datapoint or the CorruptRecord in its place; raises nothing else but the stream's
        ShardError. Members of extensions not in ``fields`` are skipped unread, and a
        sample's fields hold at most ``max_sample_bytes``."""
        for _, item in self.read_stream_at(stream, url):
            yield item

    def read_stream_at(self, stream: Readable, url: str) -> Iterator[tuple[int, Any]]:
        """:meth:`read_stream`'s items, each with the byte of the shard where its first
        member's header starts (where a slice that begins with it seeks to)."""
        for at, item in samples_at(stream, url, self.max_sample_bytes, self._wanted):
            yield at, (item if isinstance(item, CorruptRecord) else self._guard(url, *item))

    def _guard(self, url: str, key: str, fields: dict[str, bytes | None]) -> Any:
        try:
            return self._sample(url, key, fields)
        except CorruptRecord as e:
            return e

"""TFRecord: ``tf.train.Example`` records from TFRecord files, CRCs checked, no TensorFlow."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from feedline.errors import ConfigError, DataError
from feedline.producer.dataflow.base import Named
from feedline.producer.dataflow.shard_fields import feature
from feedline.producer.dataflow.sharded import ShardedSource
from feedline.producer.shards.records import CorruptRecord, Readable
from feedline.producer.shards.tfrecord import parse_example, records

DEFAULT_FIELDS = ("image/encoded", "image/class/label")


class TFRecord(ShardedSource):
    """Yield one datapoint per record: the ``fields`` (feature keys) in order, by default
    ``[image bytes, label]`` from the usual ImageNet keys. A record whose CRC is wrong, that
    does not parse, or that lacks a field is a corrupt record (counted, named
    ``file#offset``); one whose length cannot be trusted loses the rest of its file. Every
    other argument is :class:`~feedline.producer.dataflow.sharded.ShardedSource`'s."""

    format = "tfrecord"

    def __init__(self, urls: str | Sequence[str] | None = None, *,
                 fields: Sequence[str] = DEFAULT_FIELDS, **kw: Any) -> None:
        super().__init__(urls, fields=fields, **kw)
        if not self.fields:
            raise ConfigError("fields: at least one feature key")

    def _read_from(self, url: str, start: int = 0, end: int | None = None,
                   chunk: int | None = None) -> Iterator[tuple[int | None, Any]]:
        stream = self.stream(url, start, end, chunk)
        try:
            yield from self.read_stream_at(stream, url)
        finally:
            stream.close()

    def read_stream(self, stream: Readable, url: str) -> Iterator[Any]:
        """One file's records from ``stream`` (:meth:`_read`'s, on any Readable): each a
        datapoint or the CorruptRecord in its place; raises nothing else but the stream's
        ShardError."""
        for _, item in self.read_stream_at(stream, url):
            yield item

    def read_stream_at(self, stream: Readable, url: str) -> Iterator[tuple[int, Any]]:
        """:meth:`read_stream`'s items, each with the byte of the file where its record
        starts (where a slice that begins with it seeks to)."""
        while True:
            try:
                at = stream.offset
                for data in records(stream, url, self.max_sample_bytes):
                    yield at, self._example(data, f"{url}#{at}")
                    at = stream.offset
                return
            except CorruptRecord as e:
                yield at, e
                if not e.resumable:
                    return

    def _example(self, data: bytes, where: str) -> Any:
        try:
            ex = parse_example(data, self.fields)
        except DataError as e:
            return CorruptRecord(where, f"not a tf.train.Example: {e}", True)
        try:
            return Named([feature(ex[k], k, where) if k in ex else _missing(k, ex, where)
                          for k in self.fields], where)
        except CorruptRecord as e:
            return e


def _missing(key: str, ex: dict[str, Any], where: str) -> Any:
    raise CorruptRecord(where, f"no feature {key!r}", True)

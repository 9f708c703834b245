"""What a record reader raises: a corrupt record, named, with or without a way past it."""

from __future__ import annotations

from typing import Protocol

from feedline.errors import SampleError


class Readable(Protocol):
    """A byte stream read front to back (:class:`~feedline.producer.shards.stream.ChunkStream`)."""

    @property
    def offset(self) -> int: ...

    def read(self, n: int) -> bytes: ...

    def skip(self, n: int) -> int: ...


class CorruptRecord(SampleError):
    """A record that cannot be read (bad CRC, bad header, cut short). ``where`` names it
    (``shard#offset`` or ``shard#key``). ``resumable``: the reader can go on after it (a
    bad CRC over a record whose length is intact); otherwise the rest of the shard is lost
    (a length or header that cannot be trusted, a member cut short by the shard's end)."""

    def __init__(self, where: str, why: str, resumable: bool) -> None:
        super().__init__(f"{where}: {why}")
        self.where, self.why, self.resumable = where, why, resumable

"""One shard read front to back, in chunks a thread fetches ahead: memory is bounded by
the chunk size and the prefetch depth, never by the shard's size.

A :class:`ChunkStream` owns one fetch thread. It opens the shard through its
:class:`~feedline.producer.shards.locations.Location` with no cache (each ``read`` of
``chunk_size`` is one ranged request on an object store or HTTP server) and puts each chunk
on a queue of at most ``prefetch`` chunks; the reader takes them in order. So one open shard
holds at most ``prefetch + 2`` chunks: the queue, the one the thread is putting, the one the
reader is cutting records from.

A server that does not answer byte ranges (``python3 -m http.server``: fsspec reads the first
chunk, then refuses the next) is read as a stream instead: the file is opened again without
ranges and read front to back, the bytes before the offset reached read and dropped a chunk
at a time. Memory is bounded as before; what it costs is that a retry, or a slice that
starts inside the shard, downloads the bytes before it again. The host is remembered (in the
Location, logged once): its other shards are opened as streams at once.

A failed fetch is retried where it failed (the file is opened again at that offset) if it
is transient (:func:`~feedline.producer.shards.retry.is_transient`), with backoff, and
counted in :class:`~feedline.producer.shards.stats.ShardStats`; after ``retry.attempts``
failures in a row, or at once for a permanent one, the reader gets a
:class:`~feedline.producer.shards.retry.ShardError` naming the shard.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from feedline.errors import ConfigError, Stopped
from feedline.producer.shards.locations import Location
from feedline.producer.shards.retry import RetryPolicy, ShardError, ShortRead, is_transient
from feedline.producer.shards.stats import ShardStats

log = logging.getLogger(__name__)
_POLL = 0.1
_EOF = b""


class StreamClosed(Stopped):
    """The stream was closed (its source stopped) while a read waited."""


class ChunkStream:
    """``read(n)``: exactly ``n`` bytes, fewer only at the shard's end."""

    def __init__(self, loc: Location, url: str, *, chunk_size: int = 2 << 20, prefetch: int = 2,
                 retry: RetryPolicy | None = None, stats: ShardStats | None = None,
                 start: int = 0, end: int | None = None,
                 on_size: Callable[[int], None] | None = None) -> None:
        if chunk_size < 1 or prefetch < 1:
            raise ConfigError(f"chunk_size and prefetch must be >= 1, got {chunk_size}, "
                             f"{prefetch}")
        self.loc, self.url = loc, url
        self.chunk_size, self.retry = chunk_size, retry or RetryPolicy()
        self.end = end  # the bytes from ``start`` to ``end`` only (None: to the shard's end)
        self.stats = stats if stats is not None else ShardStats()
        self.size: int | None = None
        self._on_size = on_size  # told the shard's size once the fetch thread knows it
        # The server answers no byte ranges (found by this stream or an earlier one of
        # the location): read without them.
        self._host = urlsplit(url).netloc
        self.streaming = self._host in loc.no_ranges
        self._q: queue.Queue[bytes | ShardError] = queue.Queue(prefetch)
        self._stop = threading.Event()
        self._buf = memoryview(b"")
        self._pos = 0
        self._eof = False
        self.offset = start  # bytes handed to the reader
        self._thread = threading.Thread(target=self._fetch, args=(start,), daemon=True,
                                        name=f"feedline-shard-{url[-40:]}")
        self._thread.start()

    # -- the fetch thread -------------------------------------------------------------
    def _open(self, offset: int) -> Any:
        if self.streaming:
            return self._open_stream(offset)
        f = self.loc.fs().open(self.url, "rb", block_size=self.chunk_size, cache_type="none")
        if self.size is None:
            size = getattr(f, "size", None)
            self.size = int(size) if isinstance(size, int) else None
            if self.size is not None and self._on_size is not None:
                self._on_size(self.size)  # before the first chunk: the reader sees it first
        if offset:
            f.seek(offset)
        return f

    def _open_stream(self, offset: int) -> Any:
        """The shard opened without byte ranges, read up to ``offset`` (a chunk at a time,
        dropped): a stream cannot seek."""
        f = self.loc.fs().open(self.url, "rb", block_size=0)
        try:
            while offset:
                n = len(_read_full(f, min(offset, self.chunk_size), self._stop))
                if not n:
                    raise ShortRead(f"the stream ended {offset} bytes before its offset")
                self.stats.add(bytes_read=n)
                offset -= n
        except BaseException:
            _close(f)
            raise
        return f

    def _fetch(self, offset: int) -> None:
        f = None
        failures = 0
        try:
            while not self._stop.is_set():
                try:
                    n = self.chunk_size if self.end is None else \
                        max(0, min(self.chunk_size, self.end - offset))
                    if not n:
                        data = b""  # at ``end``: the stream ends here
                    else:
                        if f is None:
                            f = self._open(offset)
                        data = _read_full(f, n, self._stop) if self.streaming else f.read(n)
                    if self.size is not None:
                        want = min(n, self.size - offset)
                        if len(data) < want:
                            raise ShortRead(f"{len(data)} of {want} bytes at offset {offset}")
                except Exception as e:  # every failure of a read is judged below, none lost
                    if f is not None:
                        _close(f)
                        f = None
                    if not self.streaming and _no_ranges(e):
                        self.streaming = True  # not a failure: the same bytes, unranged
                        self.loc.no_ranges.add(self._host)
                        log.info("shard %s: the server answers no byte ranges; reading it as "
                                 "a stream (a retry reads it again from the start)", self.url)
                        continue
                    failures += 1
                    if not is_transient(e) or failures >= self.retry.attempts:
                        why = f"{type(e).__name__}: {e}" + (
                            f" (after {failures} tries)" if is_transient(e) else "")
                        self._put(ShardError(self.url, why))
                        return
                    self.stats.add(retries=1)
                    log.warning("shard %s: %s: %s; try %d of %d at offset %d", self.url,
                                type(e).__name__, e, failures + 1, self.retry.attempts, offset)
                    if not self.retry.wait(failures, self._stop):
                        return
                    continue
                failures = 0
                offset += len(data)
                self.stats.add(bytes_read=len(data))
                if not self._put(bytes(data)) or not data:
                    return
        finally:
            if f is not None:
                _close(f)

    def _put(self, item: bytes | ShardError) -> bool:
        while not self._stop.is_set():
            try:
                self._q.put(item, timeout=_POLL)
                return True
            except queue.Full:
                pass
        return False

    # -- the reader -------------------------------------------------------------------
    def _next_chunk(self) -> bool:
        while True:
            if self._stop.is_set():
                raise StreamClosed(self.url)
            try:
                item = self._q.get(timeout=_POLL)
                break
            except queue.Empty:
                continue
        if isinstance(item, ShardError):
            self._eof = True
            raise item
        if not item:
            self._eof = True
            return False
        self._buf, self._pos = memoryview(item), 0
        return True

    def read(self, n: int) -> bytes:
        if n <= len(self._buf) - self._pos:  # the usual case: inside the current chunk
            out = bytes(self._buf[self._pos:self._pos + n])
            self._pos += n
            self.offset += n
            return out
        parts = bytearray(self._buf[self._pos:])
        self._pos = len(self._buf)
        while len(parts) < n and not self._eof and self._next_chunk():
            take = min(n - len(parts), len(self._buf))
            parts += self._buf[:take]
            self._pos = take
        self.offset += len(parts)
        return bytes(parts)

    def skip(self, n: int) -> int:
        """Read past ``n`` bytes without keeping them; returns how many there were."""
        left = n
        while left:
            have = len(self._buf) - self._pos
            if have == 0:
                if self._eof or not self._next_chunk():
                    break
                continue
            step = min(have, left)
            self._pos += step
            left -= step
        self.offset += n - left
        return n - left

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._buf = memoryview(b"")

    def __enter__(self) -> ChunkStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _close(f: Any) -> None:
    try:
        f.close()
    except Exception:  # closing a broken connection may fail again: nothing to keep
        pass


def _no_ranges(e: BaseException) -> bool:
    """fsspec's HTTP file, past its first chunk, on a server that answers a ranged GET with
    the whole file (200)."""
    return isinstance(e, ValueError) and "support range requests" in str(e)


def _read_full(f: Any, n: int, stop: threading.Event) -> bytes:
    """``n`` bytes of a stream, fewer only at its end: a stream's read returns what has
    arrived."""
    parts: list[bytes] = []
    got = 0
    while got < n and not stop.is_set():
        data = f.read(n - got)
        if not data:
            break
        parts.append(data)
        got += len(data)
    return b"".join(parts)

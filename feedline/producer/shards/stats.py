"""What a sharded source counts: plain ints a metrics collector reads at scrape time.

Written by the source's reader threads (each increment under one lock: a few per chunk or
record, never per byte), read from any thread. The names of failed shards and of corrupt
records are kept for the log and for ``feedline info``, the last :data:`KEEP` of each.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field

KEEP = 32


@dataclass
class ShardStats:
    retries: int = 0  # transient failures retried
    failed_shards: int = 0  # shards given up on after every retry
    corrupt_records: int = 0  # records skipped: bad CRC, truncated member, bad header
    shards_read: int = 0  # shards read to their end
    bytes_read: int = 0
    failed: deque[str] = field(default_factory=lambda: deque(maxlen=KEEP))
    corrupt: deque[str] = field(default_factory=lambda: deque(maxlen=KEEP))
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **counts: int) -> None:
        with self._lock:
            for k, v in counts.items():
                setattr(self, k, getattr(self, k) + v)

    def shard_failed(self, name: str) -> None:
        with self._lock:
            self.failed_shards += 1
            self.failed.append(name)

    def record_corrupt(self, where: str) -> None:
        with self._lock:
            self.corrupt_records += 1
            self.corrupt.append(where)

    def __getstate__(self) -> dict:  # picklable (a source sent to a forked worker)
        return {k: v for k, v in self.__dict__.items() if k != "_lock"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

"""LMDBSerializer: save a DataFlow into one LMDB file and load it back as a DataFlow.

Layout (tensorpack-compatible keys): datapoint ``i`` under the key ``b"%08d" % i``, its value
:func:`feedline.producer.dataflow.serialize.dumps` (msgpack; arrays as raw bytes; never pickle), and
``b"__len__"`` holding the count as ASCII. One file (``subdir=False``), plus LMDB's
``-lock`` file beside it.

JPEG side indexes (``feedline lmdb build --index-jpeg``, ``save(..., jpeg_index=True)``):
datapoint ``i``'s image's index under ``b"jpgidx/%08d" % i``, after every datapoint's key
(a cursor reads the datapoints as before), and ``b"__jpgidx__"`` holding how many there are.
:class:`LMDBData` hands each to its datapoint's image (component 0, as its ``jpeg_index``),
for the fused decoder.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import lmdb
import numpy as np

from feedline.errors import DataError, DataNotFound, OutputExists
from feedline.producer.dataflow.base import DataFlow, as_dataflow
from feedline.producer.dataflow.image_folder import _file_bytes
from feedline.producer.dataflow.serialize import dumps, loads
from feedline.producer.dataflow.shard import check_shard, shard_positions
from feedline.producer.dataflow.worker import make_rng

LEN_KEY = b"__len__"
INDEXES_KEY = b"__jpgidx__"
INITIAL_MAP_SIZE = 1 << 30


def key(i: int) -> bytes:
    return b"%08d" % i


def index_key(i: int) -> bytes:
    """Where datapoint ``i``'s JPEG side index is (sorted after every datapoint's key)."""
    return b"jpgidx/%08d" % i


def _image_index(dp: Any) -> bytes | None:
    """The side index a datapoint's image (component 0) carries, if any."""
    if isinstance(dp, (list, tuple)) and dp:
        index = getattr(dp[0], "jpeg_index", None)
        if isinstance(index, (bytes, bytearray, memoryview)):
            return bytes(index)
    return None


class LMDBSerializer:
    """``save(df, path)`` and ``load(path, ...)``, as in tensorpack."""

    @staticmethod
    def save(df: Iterable[Any], path: str | Path, write_frequency: int = 1000,
             progress: bool = True, overwrite: bool = False, jpeg_index: bool = False) -> int:
        """Write every datapoint of one pass of ``df``; returns the count. ``jpeg_index``:
        also the side index each datapoint's image carries (component 0's ``jpeg_index``,
        as :class:`~feedline.producer.dataflow.ImageFolder` and ``feedline lmdb build
        --index-jpeg`` give it), under :func:`index_key`.

        Commits every ``write_frequency`` datapoints (memory stays bounded) and grows the
        map as needed. Refuses to replace an existing file unless ``overwrite``. Writes to a
        temporary file next to ``path`` and renames it onto ``path`` once complete, so a run
        that fails or is interrupted half way leaves nothing behind (and an overwritten file
        stays intact until its replacement is whole).
        """
        path = Path(path)
        stale = _READERS.pop((os.path.realpath(path), os.getpid()), None)
        if stale is not None:
            stale.close()
        if path.exists() and not overwrite:
            raise OutputExists(f"{path} exists (pass overwrite=True to replace it)")
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.partial-{os.getpid()}")
        df = as_dataflow(df)
        df.reset_state()
        try:
            total: int | None = len(df)
        except (NotImplementedError, TypeError):
            total = None
        env = lmdb.open(str(tmp), subdir=False, map_size=INITIAL_MAP_SIZE, meminit=False,
                        map_async=True, lock=True)
        count = indexes = 0
        pending: list[tuple[bytes, bytes]] = []

        def flush(extra: list[tuple[bytes, bytes]] = ()) -> None:  # type: ignore[assignment]
            items = pending + list(extra)
            while True:
                try:
                    with env.begin(write=True) as txn:
                        for k, v in items:
                            txn.put(k, v)
                    break
                except lmdb.MapFullError:
                    env.set_mapsize(env.info()["map_size"] * 2)
            pending.clear()

        done = False
        try:
            from tqdm import tqdm  # here, not at the top: every producer imports this module

            with tqdm(total=total, unit="dp", desc=f"writing {path.name}",
                      disable=not progress) as bar:
                for dp in df:
                    pending.append((key(count), dumps(dp)))
                    index = _image_index(dp) if jpeg_index else None
                    if index is not None:
                        pending.append((index_key(count), index))
                        indexes += 1
                    count += 1
                    bar.update(1)
                    if len(pending) >= write_frequency:
                        flush()
                flush([(LEN_KEY, str(count).encode())] +
                      ([(INDEXES_KEY, str(indexes).encode())] if jpeg_index else []))
            env.sync()
            done = True
        finally:
            env.close()
            Path(f"{tmp}-lock").unlink(missing_ok=True)
            if done:
                Path(f"{path}-lock").unlink(missing_ok=True)  # the replaced file's
                os.replace(tmp, path)
            else:
                tmp.unlink(missing_ok=True)
        return count

    @staticmethod
    def load(path: str | Path, shuffle: bool = False, seed: int = 0,
             shard: tuple[int, int] = (0, 1), jpeg_index: bool = True) -> LMDBData:
        return LMDBData(path, shuffle=shuffle, seed=seed, shard=shard, jpeg_index=jpeg_index)


# py-lmdb refuses to open one file twice in a process, and a handle must not cross a fork:
# one read-only handle per (file, process), shared by every reader of that file there.
_READERS: dict[tuple[str, int], lmdb.Environment] = {}


def open_reader(path: str | Path) -> lmdb.Environment:
    """This process's read-only handle on ``path`` (opened on first use)."""
    k = (os.path.realpath(path), os.getpid())
    env = _READERS.get(k)
    if env is None:
        if not Path(path).is_file():
            raise DataNotFound(f"no LMDB file at {path}")
        for old in [o for o in _READERS if o[1] != os.getpid()]:
            # Inherited through fork: unusable here, and py-lmdb refuses a second open of
            # the same file while it is registered. Closing unmaps it in this process only
            # (read-only, lock=False: no shared lock table to disturb).
            _READERS.pop(old).close()
        env = lmdb.open(str(path), subdir=False, readonly=True, lock=False, max_readers=256)
        _READERS[k] = env
    return env


def lmdb_info(path: str | Path) -> dict[str, Any]:
    """Count and sizes of a file written by :meth:`LMDBSerializer.save`."""
    path = Path(path)
    with open_reader(path).begin() as txn:
        raw = txn.get(LEN_KEY)
        indexes = txn.get(INDEXES_KEY)
        stat = txn.stat()
    return {"path": str(path), "count": int(raw) if raw is not None else None,
            "entries": stat["entries"], "file_bytes": path.stat().st_size,
            "jpeg_indexes": int(indexes) if indexes is not None else None}


class LMDBData(DataFlow):
    """The datapoints of an LMDB file written by :meth:`LMDBSerializer.save`.

    ``shuffle=False`` reads sequentially with a cursor (fast on disks and network file
    systems); ``shuffle=True`` reads in a random order (a function of (seed, epoch, worker)),
    random access. ``shard`` keeps positions ``p % count == index``. The file is opened in
    ``reset_state()`` and reopened when used in another process than the one that opened it
    (LMDB handles must not cross a fork).

    ``jpeg_index``: in a file written with side indexes, a datapoint's image (component 0)
    comes with its index (its ``jpeg_index``, the array remembering ``FILE#i`` as its
    path), for the fused decoder; one without decodes as before, and an index that does not
    fit its JPEG (damaged, another file's) is refused by the decoder, which decodes the
    image without it (counted: :func:`feedline.producer.image.turbo.index_refusals`).
    """

    def __init__(self, path: str | Path, shuffle: bool = False, seed: int = 0,
                 shard: tuple[int, int] = (0, 1), jpeg_index: bool = True) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise DataNotFound(f"no LMDB file at {self.path}")
        self.shuffle, self.seed = shuffle, seed
        self.set_shard(*shard)
        self._epoch = 0
        info = lmdb_info(self.path)
        self._size = int(info["count"] or 0)
        self.jpeg_index = jpeg_index and bool(info["jpeg_indexes"])

    def _load(self, txn: lmdb.Transaction, i: int, value: bytes) -> Any:
        """Datapoint ``i`` from its stored ``value``, its image with its side index."""
        dp = loads(value)
        if self.jpeg_index:
            index = txn.get(index_key(i))
            if index is not None and isinstance(dp, list) and dp and \
                    isinstance(dp[0], np.ndarray) and dp[0].dtype == np.uint8:
                dp[0] = _file_bytes(dp[0].reshape(-1), f"{self.path}#{i}", bytes(index))
        return dp

    def set_shard(self, index: int, count: int) -> None:
        self.shard = check_shard(index, count)

    def __len__(self) -> int:
        return len(shard_positions(self._size, self.shard))

    def _open(self) -> lmdb.Environment:
        return open_reader(self.path)

    def reset_state(self) -> None:
        self._open()
        self._epoch = 0

    def sample(self, i: int) -> Any:
        """Datapoint ``i`` of the whole file: exact delivery's access."""
        with self._open().begin() as txn:
            value = txn.get(key(i))
            if value is None:
                raise DataError(f"{self.path}: datapoint {i} is missing")
            return self._load(txn, i, value)

    def samples(self) -> int:
        return self._size

    def __iter__(self) -> Iterator[Any]:
        env = self._open()
        epoch = self._epoch
        self._epoch += 1
        positions = shard_positions(self._size, self.shard)
        with env.begin() as txn:
            if self.shuffle:
                order = list(positions)
                make_rng(self.seed, epoch).shuffle(order)
                for i in order:
                    value = txn.get(key(i))
                    if value is None:
                        raise DataError(f"{self.path}: datapoint {i} is missing")
                    yield self._load(txn, i, value)
                return
            index, count = self.shard
            cur = txn.cursor()
            if not cur.set_key(key(index)):
                return
            for i in positions:
                if cur.key() != key(i):
                    cur.set_key(key(i))
                yield self._load(txn, i, cur.value())
                for _ in range(count):
                    if not cur.next():
                        break

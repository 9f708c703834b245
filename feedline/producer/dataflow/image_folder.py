"""ImageFolder: image files and integer labels, from class sub-folders or a list file."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from feedline.errors import ConfigError, DataError, DataNotFound
from feedline.producer.dataflow.base import DataFlow, content_digest
from feedline.producer.dataflow.shard import check_shard, shard_positions
from feedline.producer.dataflow.worker import make_rng

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp")


class FileBytes(np.ndarray):
    """A file's bytes as a 1-D uint8 array that remembers the file's ``path``, so that a
    decoder's error can name it, and its side index (``jpeg_index``: the bytes of
    ``PATH.jpgidx``, or None; :mod:`feedline.producer.image.jpgindex`), which the fused
    decoder uses. Pickles (to worker processes) as the plain array, out of band, plus the
    path and the index."""

    path: str
    jpeg_index: bytes | None

    def __array_finalize__(self, obj: object) -> None:
        self.path = getattr(obj, "path", "")
        self.jpeg_index = getattr(obj, "jpeg_index", None)

    def __reduce__(self) -> tuple:
        return _file_bytes, (self.view(np.ndarray), self.path, self.jpeg_index)


def _file_bytes(data: np.ndarray, path: str, jpeg_index: bytes | None = None) -> FileBytes:
    out = data.view(FileBytes)
    out.path = path
    out.jpeg_index = jpeg_index
    return out


def _read(path: str, jpeg_index: bool) -> FileBytes:
    with open(path, "rb") as f:
        data = np.frombuffer(f.read(), np.uint8)
    index = None
    if jpeg_index:
        from feedline.producer.image.jpgindex import load_index
        index = load_index(path)
    return _file_bytes(data, path, index)


def scan_folder(root: str | Path, extensions: Sequence[str] = IMAGE_EXTENSIONS,
                ) -> tuple[list[str], list[int], list[str]]:
    """``root/<class>/<file>`` -> (paths, labels, class names); classes sorted by name.

    Order is deterministic (sorted), which sharding relies on.
    """
    root = Path(root)
    if not root.is_dir():
        raise DataNotFound(f"not a directory: {root}")
    classes = sorted(d.name for d in root.iterdir() if d.is_dir())
    if not classes:
        raise DataError(f"{root}: no class sub-folders")
    exts = tuple(e.lower() for e in extensions)
    paths, labels = [], []
    for label, name in enumerate(classes):
        for dirpath, dirnames, files in os.walk(root / name):
            dirnames.sort()
            for f in sorted(files):
                if f.lower().endswith(exts):
                    paths.append(os.path.join(dirpath, f))
                    labels.append(label)
    if not paths:
        raise DataError(f"{root}: no image files with extensions {exts}")
    return paths, labels, classes


def read_list_file(list_file: str | Path, root: str | Path | None = None,
                   ) -> tuple[list[str], list[int]]:
    """Lines ``relative/path.jpg LABEL`` (paths relative to ``root``, default: the file's dir)."""
    list_file = Path(list_file)
    base = Path(root) if root is not None else list_file.parent
    paths, labels = [], []
    for n, line in enumerate(list_file.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.rsplit(None, 1)
        if len(parts) != 2 or not parts[1].lstrip("-").isdigit():
            raise DataError(f"{list_file}:{n}: expected 'PATH LABEL', got {line!r}")
        paths.append(str(base / parts[0]))
        labels.append(int(parts[1]))
    return paths, labels


class ImageFolder(DataFlow):
    """Yield ``[data, label]`` for each image: ``data`` is the file's bytes as a uint8 array
    (``read=True``, decode later, e.g. in parallel workers) or its path (``read=False``).

    Images come from ``root/<class>/...`` (labels by sorted class name) or from a
    ``list_file``. ``shuffle`` reorders each pass as a function of ``(seed, epoch, worker)``;
    ``shard`` keeps positions ``p % count == index`` of the sorted list. ``jpeg_index``:
    each file's side index ``PATH.jpgidx`` (``feedline index``) comes with its bytes where
    it exists, for the fused decoder.
    """

    def __init__(self, root: str | Path | None = None, list_file: str | Path | None = None,
                 shuffle: bool = True, seed: int = 0, shard: tuple[int, int] = (0, 1),
                 read: bool = True, jpeg_index: bool = True) -> None:
        if root is None and list_file is None:
            raise ConfigError("ImageFolder needs root or list_file")
        self._root = None if root is None else str(root)
        self._list_file = None if list_file is None else str(list_file)
        self._identity: str | None = None
        if list_file is not None:
            self.paths, self.labels = read_list_file(list_file, root)
            self.classes: list[str] = []
        else:
            assert root is not None
            self.paths, self.labels, self.classes = scan_folder(root)
        self.shuffle, self.seed, self.read = shuffle, seed, read
        self.jpeg_index = jpeg_index
        self.set_shard(*shard)
        self._epoch = 0

    def set_shard(self, index: int, count: int) -> None:
        self.shard = check_shard(index, count)

    def __len__(self) -> int:
        return len(shard_positions(len(self.paths), self.shard))

    def reset_state(self) -> None:
        self._epoch = 0

    def sample(self, i: int) -> list:
        """Image ``i`` of the whole (unsharded, unshuffled) list: exact delivery's access."""
        path = self.paths[i]
        if not self.read:
            return [path, self.labels[i]]
        return [_read(path, self.jpeg_index), self.labels[i]]

    def samples(self) -> int:
        return len(self.paths)

    def identity(self) -> str:
        """The images' names (relative to the root, so hosts that mount it elsewhere agree)
        and labels, for exact delivery's fingerprint; not their bytes."""
        if self._identity is None:
            base = self._root or (os.path.dirname(os.path.abspath(self._list_file))
                                  if self._list_file else None)
            names = [os.path.relpath(p, base) if base else str(p) for p in self.paths]
            self._identity = content_digest([names, [int(x) for x in self.labels]])
        return self._identity

    def __iter__(self) -> Iterator[list]:
        idx = list(shard_positions(len(self.paths), self.shard))
        if self.shuffle:
            make_rng(self.seed, self._epoch).shuffle(idx)
        self._epoch += 1
        for i in idx:
            path = self.paths[i]
            if self.read:
                data: object = _read(path, self.jpeg_index)
            else:
                data = path
            yield [data, self.labels[i]]

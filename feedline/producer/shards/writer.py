"""Writing a dataset as WebDataset shards, in parallel, the same bytes whatever the workers.

The plan is made first, from the samples' sizes alone (:func:`plan_shards`): consecutive
samples go to one shard until it reaches the target size, so the shard boundaries do not
depend on how many processes write. Each shard is then written by one worker
(:func:`write_shard`): members ``%08d.EXT`` (the sample's place in the dataset) and
``%08d.cls``, fixed metadata, to a temporary name renamed into place when whole, with its
sha256. Sample ``i`` of the source is sample ``i`` of the shards, in order, so exact
delivery numbers it the same in both (identical bytes per sample id).
"""

from __future__ import annotations

import hashlib
import os
import tarfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from feedline.producer.shards.manifest import ShardInfo
from feedline.producer.shards.tar import BLOCK, write_sample

_MAGIC = ((b"\xff\xd8\xff", "jpg"), (b"\x89PNG", "png"), (b"RIFF", "webp"), (b"BM", "bmp"))


def image_ext(data: bytes) -> str:
    """The member extension of an encoded image, by its magic bytes (``bin`` if unknown)."""
    for magic, ext in _MAGIC:
        if data.startswith(magic):
            return ext
    return "bin"


def member_bytes(size: int) -> int:
    """What a member of ``size`` bytes takes in a tar: its header and padding."""
    return BLOCK + size + (-size % BLOCK)


def plan_shards(sizes: Sequence[int], target: int) -> list[range]:
    """Consecutive runs of samples of about ``target`` bytes each (at least one sample)."""
    out, start, acc = [], 0, 0
    for i, n in enumerate(sizes):
        acc += member_bytes(n) + member_bytes(8)  # the image and its label
        if acc >= target:
            out.append(range(start, i + 1))
            start, acc = i + 1, 0
    if start < len(sizes):
        out.append(range(start, len(sizes)))
    return out


@dataclass(frozen=True)
class ShardJob:
    path: str
    samples: range


def write_shard(job: ShardJob, read: Callable[[int], tuple[bytes, int]],
                transform: Callable[[bytes], bytes] | None = None,
                side: Callable[[int, bytes], dict[str, bytes]] | None = None) -> ShardInfo:
    """Write samples ``job.samples`` (``read(i)`` -> (image bytes, label)) as one shard.
    ``side(i, image bytes)``: more members of sample ``i`` by extension (a side index:
    ``{"jpgidx": ...}``), written after the image and before the label."""
    path = Path(job.path)
    tmp = path.with_name(f".{path.name}.partial-{os.getpid()}")
    try:
        with open(tmp, "wb") as f, tarfile.open(fileobj=f, mode="w",
                                                format=tarfile.USTAR_FORMAT) as tar:
            for i in job.samples:
                data, label = read(i)
                if transform is not None:
                    data = transform(data)
                fields = {image_ext(data): data}
                if side is not None:
                    fields.update(side(i, data))
                fields["cls"] = str(int(label)).encode()
                write_sample(tar, f"{i:08d}", fields)
        digest = hashlib.sha256()
        with open(tmp, "rb") as done:
            while block := done.read(1 << 20):
                digest.update(block)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return ShardInfo(path.name, len(job.samples), path.stat().st_size, digest.hexdigest())


def as_bytes(x: Any) -> bytes:
    """A datapoint's image component (a uint8 array or bytes) as bytes."""
    return x if isinstance(x, bytes) else bytes(memoryview(x).cast("B"))

"""Shards for the tests: small WebDataset and TFRecord files with known contents, and the map
functions the test pipelines use."""

from __future__ import annotations

import hashlib
import tarfile
from pathlib import Path

import numpy as np

from feedline.producer.shards.tar import write_sample
from feedline.producer.shards.tfrecord import encode_example, frame


def payload(i: int, nbytes: int = 3000) -> bytes:
    """Sample ``i``'s bytes: different for every sample."""
    return np.random.default_rng(i).integers(0, 256, nbytes, dtype=np.uint8).tobytes()


def make_wds(root: Path, shards: int, per_shard: int, nbytes: int = 3000,
             prefix: str = "train") -> list[Path]:
    """``shards`` tar files of ``per_shard`` samples: ``%08d.bin`` (payload) and ``.cls``
    (the sample's id); ids run 0.. across the shards in order."""
    root.mkdir(parents=True, exist_ok=True)
    out = []
    for s in range(shards):
        p = root / f"{prefix}-{s:06d}.tar"
        with tarfile.open(p, "w") as t:
            for k in range(per_shard):
                i = s * per_shard + k
                write_sample(t, f"{i:08d}", {"bin": payload(i, nbytes), "cls": b"%d" % i})
        out.append(p)
    return out


def make_tfrecords(root: Path, files: int, per_file: int, nbytes: int = 3000) -> list[Path]:
    root.mkdir(parents=True, exist_ok=True)
    out = []
    for s in range(files):
        p = root / f"train-{s:05d}.tfrecord"
        with open(p, "wb") as f:
            for k in range(per_file):
                i = s * per_file + k
                f.write(frame(encode_example({"image/encoded": payload(i, nbytes),
                                              "image/class/label": i})))
        out.append(p)
    return out


def digest(data: np.ndarray | bytes) -> str:
    raw = data.tobytes() if isinstance(data, np.ndarray) else data
    return hashlib.blake2b(raw, digest_size=8).hexdigest()


def id_and_digest(dp: list) -> list:
    """``[bytes, id]`` -> ``[id as int64, the bytes' 16-byte digest as uint8]``: what a
    test's consumer checks (the wire carries numbers only)."""
    data, i = dp
    h = hashlib.blake2b(np.asarray(data).tobytes(), digest_size=16).digest()
    return [np.int64(i), np.frombuffer(h, np.uint8)]

"""Exact slices (``exact: {unit_size: N}``) read only their own bytes (issue 53, finding 11):
a slice starts reading at its first record, where an earlier read of the shard found it,
and stops at the next slice's first byte, so an epoch over HTTP fetches about the shard's
size, not a read from byte 0 per slice. Measured with a real HTTP server that counts the
body bytes it sends."""

from __future__ import annotations

import hashlib
import threading
from functools import partial
from pathlib import Path

import numpy as np

from feedline.producer.exact import build_exact
from feedline.producer.shards.manifest import Manifest, ShardInfo
from tests.support.shard_server import RangeHandler, serve
from tests.support.shard_support import make_tfrecords, make_wds, payload


class Counting(RangeHandler):
    """The range server, counting what it sends (body bytes) and its GETs."""

    sent = 0
    gets = 0
    lock = threading.Lock()

    def do_GET(self) -> None:
        with self.lock:
            type(self).gets += 1
        super().do_GET()

    def copyfile(self, source, outputfile):  # type: ignore[no-untyped-def]
        left = getattr(self, "_left", None)
        with self.lock:
            type(self).sent += left if left is not None else 0
        return super().copyfile(source, outputfile)


class One(Counting):  # a count of its own per test
    sent = gets = 0


class Two(Counting):
    sent = gets = 0


def _manifest(root: Path, fmt: str, names: list[str], counts: list[int]) -> None:
    """What ``feedline convert`` and ``feedline info --manifest`` write: counts and sizes."""
    (root / "manifest.json").write_text(Manifest(fmt, [
        ShardInfo(n, c, (root / n).stat().st_size)
        for n, c in zip(names, counts, strict=True)]).to_json())


def _epoch(pipe, epoch: int) -> dict[int, bytes]:
    out: dict[int, bytes] = {}
    for u in range(pipe.source.units()):
        for _, b in pipe.batches(epoch, u):
            if b is None:
                continue
            for i, d in zip(np.asarray(b[0]), np.asarray(b[1]), strict=True):
                assert int(i) not in out, f"sample {int(i)} twice"
                out[int(i)] = d.tobytes()
    return out


def _cfg(url: str, fmt: str, fields: list[str]) -> dict:
    return {"delivery": "exact", "seed": 2, "exact": {"unit_size": 4},
            "source": {fmt: {"manifest": f"{url}/manifest.json", "fields": fields}},
            "steps": [{"map": {"function": "tests.support.shard_support:id_and_digest",
                               "component": None}}, {"batch": {"batch_size": 2}}]}


def test_ten_slices_of_a_shard_over_http_fetch_about_the_shard_once_per_epoch(tmp_path):
    """Before: 10 slices of a 6.8 MB shard fetched 9.0x its size in every epoch (each slice
    read the shard from byte 0, and the chunks fetched ahead past its end). After: 1.8x in
    the first (where the slices start is found as they are read; 1.5x is the least for this
    order), 1.0x in each after."""
    make_wds(tmp_path, shards=1, per_shard=40, nbytes=170_000)
    shard = tmp_path / "train-000000.tar"
    size = shard.stat().st_size
    _manifest(tmp_path, "webdataset", [shard.name], [40])
    want = {i: hashlib.blake2b(payload(i, 170_000), digest_size=16).digest()
            for i in range(40)}
    handler = One
    with serve(partial(handler, directory=str(tmp_path))) as url:  # type: ignore[arg-type]
        pipe = build_exact(_cfg(url, "webdataset", ["bin", "cls"]))
        assert pipe.source.units() == 10  # type: ignore[union-attr]
        fetched = []
        for epoch in range(3):
            before = handler.sent
            assert _epoch(pipe, epoch) == want
            fetched.append((handler.sent - before) / size)
    # the first epoch finds where the slices start as it goes; then each byte once
    assert fetched[0] < 2.0, fetched
    assert all(f < 1.1 for f in fetched[1:]), fetched


def test_tfrecord_slices_read_from_their_own_records_give_every_sample(tmp_path: Path):
    """The same for TFRecord files, two of them, in slices that start mid-file: every
    sample's bytes, in three epochs, each epoch's order its own."""
    paths = make_tfrecords(tmp_path, files=2, per_file=10, nbytes=20_000)
    _manifest(tmp_path, "tfrecord", [p.name for p in paths], [10, 10])
    want = {i: hashlib.blake2b(payload(i, 20_000), digest_size=16).digest()
            for i in range(20)}
    size = sum(p.stat().st_size for p in paths)
    handler = Two
    with serve(partial(handler, directory=str(tmp_path))) as url:  # type: ignore[arg-type]
        pipe = build_exact(_cfg(url, "tfrecord", ["image/encoded", "image/class/label"]))
        for epoch in range(3):
            before = handler.sent
            assert _epoch(pipe, epoch) == want
            if epoch:
                assert handler.sent - before < 1.1 * size


def test_slices_over_s3_read_from_their_own_records_give_every_sample(tmp_path: Path):
    """The same over S3 (moto's standalone server: no S3-compatible server installs here):
    slices that start at a byte an earlier read found, through s3fs, every sample's bytes,
    and from the second epoch on the bytes read are the shards' size (the source's count)."""
    import pytest

    moto_server = pytest.importorskip("moto.server")
    boto3 = pytest.importorskip("boto3")
    pytest.importorskip("s3fs")
    paths = make_wds(tmp_path, shards=2, per_shard=12, nbytes=30_000)
    _manifest(tmp_path, "webdataset", [p.name for p in paths], [12, 12])
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        client = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="test",
                              aws_secret_access_key="test", region_name="us-east-1")
        client.create_bucket(Bucket="data")
        for p in [*paths, tmp_path / "manifest.json"]:
            client.upload_file(str(p), "data", f"wds/{p.name}")
        cfg = _cfg("s3://data/wds", "webdataset", ["bin", "cls"])
        cfg["source"]["webdataset"]["storage_options"] = {
            "key": "test", "secret": "test", "endpoint_url": endpoint,
            "client_kwargs": {"region_name": "us-east-1"}}
        pipe = build_exact(cfg)
        want = {i: hashlib.blake2b(payload(i, 30_000), digest_size=16).digest()
                for i in range(24)}
        size = sum(p.stat().st_size for p in paths)
        for epoch in range(3):
            before = pipe.source.stats.bytes_read  # type: ignore[union-attr]
            assert _epoch(pipe, epoch) == want
            if epoch:
                assert pipe.source.stats.bytes_read - before <= size  # type: ignore[union-attr]
    finally:
        server.stop()

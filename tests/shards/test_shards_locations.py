"""Where shards live: names from lists, globs and braces; read from a local disk, over HTTP
from a real server on 127.0.0.1, and from S3 through moto's standalone server.

S3: no S3-compatible server installs here, so moto's server (``ThreadedMotoServer``, a real
HTTP endpoint on 127.0.0.1 speaking the S3 REST API) stands in for one; the reads go through
s3fs and botocore as they would against AWS.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from feedline.producer.dataflow.webdataset import WebDataset
from feedline.producer.shards.locations import LocationError, expand
from feedline.producer.shards.stream import ChunkStream
from tests.support.shard_server import file_server
from tests.support.shard_support import make_wds, payload

FIELDS = ["bin", "cls"]


def read(ds) -> list[tuple[int, bytes]]:
    ds.reset_state()
    return sorted((int(i), d.tobytes()) for d, i in ds)


def expected(n: int) -> list[tuple[int, bytes]]:
    return [(i, payload(i)) for i in range(n)]


def test_expand_lists_globs_and_braces(tmp_path: Path):
    make_wds(tmp_path, shards=4, per_shard=1)
    names = [str(p) for p in sorted(tmp_path.glob("*.tar"))]
    assert expand(str(tmp_path / "train-{000000..000003}.tar")) == names
    assert expand(str(tmp_path / "train-*.tar")) == names
    assert expand([names[2], str(tmp_path / "train-00000[01].tar")]) == \
        [names[2], names[0], names[1]]
    with pytest.raises(LocationError, match="named twice"):
        expand([names[0], str(tmp_path / "*.tar")])
    with pytest.raises(LocationError, match="matches no file"):
        expand(str(tmp_path / "val-*.tar"))


def test_http_shards_give_the_same_samples_as_local_ones(tmp_path: Path):
    make_wds(tmp_path, shards=3, per_shard=5)
    with file_server(str(tmp_path)) as url:
        ds = WebDataset(f"{url}/train-{{000000..000002}}.tar", fields=FIELDS, chunk_size=4096)
        assert read(ds) == expected(15)
        total = sum(p.stat().st_size for p in tmp_path.glob("*.tar"))
        # every byte but, perhaps, a shard's end padding (the reader stops at the end block)
        assert ds.stats.retries == 0 and total - 3 * 10240 < ds.stats.bytes_read <= total
        # a glob over HTTP reads the server's directory listing
        assert len(WebDataset(f"{url}/train-*.tar", fields=FIELDS).urls) == 3


def test_a_missing_http_shard_fails_at_once_and_is_named(tmp_path: Path):
    make_wds(tmp_path, shards=2, per_shard=3)
    with file_server(str(tmp_path)) as url:
        ds = WebDataset([f"{url}/train-000000.tar", f"{url}/nope.tar",
                         f"{url}/train-000001.tar"], fields=FIELDS)
        assert read(ds) == expected(6)  # training: the others are read
        assert ds.stats.failed_shards == 1 and list(ds.stats.failed) == [f"{url}/nope.tar"]
        assert ds.stats.retries == 0  # a 404 is not retried


def test_memory_per_open_shard_is_bounded_by_chunks(tmp_path: Path):
    make_wds(tmp_path, shards=1, per_shard=40, nbytes=20000)
    shard = str(next(tmp_path.glob("*.tar")))
    from feedline.producer.shards.locations import Location

    s = ChunkStream(Location("file"), shard, chunk_size=10000, prefetch=2)
    try:
        import time
        time.sleep(0.3)  # the fetch thread fills what it may, and no more
        assert s._q.qsize() <= 2 and s.stats.bytes_read <= 3 * 10000
        assert len(s.read(25000)) == 25000 and s.offset == 25000
    finally:
        s.close()


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    moto_server = pytest.importorskip("moto.server")
    boto3 = pytest.importorskip("boto3")
    pytest.importorskip("s3fs")
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    client = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="test",
                          aws_secret_access_key="test", region_name="us-east-1")
    client.create_bucket(Bucket="data")
    root = tmp_path_factory.mktemp("s3src")
    for p in make_wds(root, shards=3, per_shard=4):
        client.upload_file(str(p), "data", f"wds/{p.name}")
    yield {"key": "test", "secret": "test", "endpoint_url": endpoint,
           "client_kwargs": {"region_name": "us-east-1"}}
    server.stop()


def test_s3_shards_through_moto_give_the_same_samples(s3):
    ds = WebDataset("s3://data/wds/train-*.tar", fields=FIELDS, storage_options=s3,
                    chunk_size=5000)
    assert ds.urls == [f"s3://data/wds/train-{k:06d}.tar" for k in range(3)]
    assert read(ds) == expected(12)
    ds = WebDataset("s3://data/wds/train-{000000..000001}.tar", fields=FIELDS,
                    storage_options=s3)
    assert read(ds) == expected(8)


def test_a_missing_s3_shard_is_named(s3):
    ds = WebDataset(["s3://data/wds/train-000000.tar", "s3://data/wds/gone.tar"],
                    fields=FIELDS, storage_options=s3)
    assert read(ds) == expected(4)
    assert list(ds.stats.failed) == ["s3://data/wds/gone.tar"] and ds.stats.retries == 0

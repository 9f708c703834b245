"""Training sources whose every shard fails (issue 53, finding 6): a wrong name (404), a
bucket emptied under the producer (S3 NoSuchKey). (A server that does not answer byte ranges,
``python3 -m http.server``, is read as a stream: its test is here too.) With claims or without, the
producer stops at the end of a dataset's worth of failures with one line that names the
shards and says what to check, and the trainer raises it; a dataset with only some shards
failing goes on as before (they are skipped)."""

from __future__ import annotations

import http.server
from collections import Counter
from functools import partial
from pathlib import Path

import pytest
import yaml

from feedline.consumer import ConsumerOptions, RemoteDataZMQ
from feedline.errors import ProducerError
from feedline.procs import wait_for
from feedline.producer.dataflow.sharded import ShardsFailed
from feedline.producer.dataflow.webdataset import WebDataset
from feedline.transport.link import LinkConfig
from tests.support.shard_server import file_server, serve
from tests.support.shard_support import make_wds

LIVENESS = ("--heartbeat-interval", "0.2", "--heartbeat-timeout", "1.5")
FAST = LinkConfig(heartbeat_interval=0.2, heartbeat_timeout=1.5)
FIELDS = ["bin", "cls"]


class EpochsOfClaims:
    """Claims as the broker hands them to a lone producer: every shard of epoch 0, then of
    epoch 1, ... for ``epochs`` epochs (then None: finished)."""

    def __init__(self, shards: int, epochs: int) -> None:
        self.left = [(e, u) for e in range(epochs) for u in range(shards)]
        self.given = 0

    def claim(self) -> tuple[int, int] | None:
        if not self.left:
            return None
        self.given += 1
        return self.left.pop(0)


class NoRanges(http.server.SimpleHTTPRequestHandler):
    """What ``python3 -m http.server`` is: no byte ranges (a 200 with the whole file)."""

    gets: Counter = Counter()

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        type(self).gets[self.path] += 1
        super().do_GET()


def test_claimed_shards_that_all_404_end_the_producer_and_the_trainer_is_told(
        broker_proc, daemons, endpoints, tmp_path):
    """Before: the producer went through epochs of failing claims for ever (~100 GETs and
    WARNING lines a second) and the trainer timed out naming nobody."""
    make_wds(tmp_path / "shards", shards=2, per_shard=3, nbytes=200)
    broker_proc()
    counting = type("Counting", (NoRanges,), {"gets": Counter()})
    with serve(partial(counting, directory=str(tmp_path / "shards"))) as url:
        cfg = {"stream": "train", "epochs": None,
               "source": {"webdataset": {"urls": f"{url}/gone-{{000000..000003}}.tar",
                                         "fields": FIELDS}},
               "steps": [{"batch": {"batch_size": 3, "remainder": True}}]}
        path = tmp_path / "train.yaml"
        path.write_text(yaml.safe_dump(cfg))
        p = daemons("feedline.producer", "--config", path, "--broker", endpoints.ingress,
                    *LIVENESS, name="producer")
        with RemoteDataZMQ(endpoints.egress, stream="train", timeout=30,
                           options=ConsumerOptions(link=FAST)) as src, \
                pytest.raises(ProducerError) as err:
            next(iter(src))
        wait_for(lambda: not p.alive(), 20, what="the producer to stop")
    text = str(err.value).splitlines()[0]
    assert "every one of the 4 shards this producer reads failed" in text, text
    assert f"{url}/gone-" in text and "check that the shards are where urls" in text
    assert p.proc.returncode != 0
    assert "ShardsFailed" in p.log_text() or "every one of the 4 shards" in p.log_text()
    # a try of each shard (and of those already open beside the last), not epoch after
    # epoch of them: before, ~100 a second for as long as it ran
    assert sum(counting.gets.values()) <= 16, counting.gets


def test_a_server_without_byte_ranges_is_read_as_a_stream(tmp_path: Path):
    """Shards larger than a chunk behind ``python3 -m http.server``, which answers a ranged
    GET with the whole file. Before: each shard failed at its second chunk, and every pass
    served the first chunk's samples of each shard, a WARNING per shard, for ever, with
    claims or without. Now the stream reads such a shard without ranges, front to back:
    every sample, at most three GETs per shard a pass (two ranged, then the stream; fewer
    once the host is known to answer no ranges), never a retry."""
    make_wds(tmp_path, shards=3, per_shard=8, nbytes=3000)  # ~50 KB each
    handler = type("NoRanges3", (NoRanges,), {"gets": Counter()})
    with serve(partial(handler, directory=str(tmp_path))) as url:  # type: ignore[arg-type]
        urls = f"{url}/train-{{000000..000002}}.tar"
        static = WebDataset(urls, fields=FIELDS, chunk_size=16384, claim=False)
        static.reset_state()
        assert sorted(int(i) for _, i in static) == list(range(24))
        claimed = WebDataset(urls, fields=FIELDS, chunk_size=16384)
        claimed.reset_state()
        feed = EpochsOfClaims(3, epochs=2)
        claimed.attach(feed)
        got = [int(i) for _ in range(2) for _, i in claimed]
    assert sorted(got) == sorted(list(range(24)) * 2)
    assert static.stats.failed_shards == claimed.stats.failed_shards == 0
    # three passes over three shards: no retries, no spinning (the shards a source opens
    # at once, read_ahead of them, may each find the host out before it is remembered)
    gets: Counter = handler.gets  # type: ignore[attr-defined]
    assert sum(gets.values()) <= 3 * 3 * 3, gets
    assert static.stats.retries == claimed.stats.retries == 0


def test_a_bucket_emptied_under_a_claiming_producer_ends_it(tmp_path: Path):
    """The shards read in epoch 0, deleted before epoch 1 (S3 NoSuchKey; here HTTP 404s of
    a real server): the source stops once every shard failed since the last that was read,
    naming them. Before: epochs of claims that read nothing, for ever."""
    moto_server = pytest.importorskip("moto.server")
    boto3 = pytest.importorskip("boto3")
    pytest.importorskip("s3fs")
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        client = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="test",
                              aws_secret_access_key="test", region_name="us-east-1")
        client.create_bucket(Bucket="data")
        for p in make_wds(tmp_path, shards=3, per_shard=2, nbytes=100):
            client.upload_file(str(p), "data", f"wds/{p.name}")
        opts = {"key": "test", "secret": "test", "endpoint_url": endpoint,
                "client_kwargs": {"region_name": "us-east-1"}}
        ds = WebDataset("s3://data/wds/train-*.tar", fields=FIELDS, storage_options=opts)
        ds.reset_state()
        feed = EpochsOfClaims(3, epochs=40)
        ds.attach(feed)
        assert sorted(int(i) for _, i in ds) == list(range(6))  # epoch 0: every sample
        for k in range(3):
            client.delete_object(Bucket="data", Key=f"wds/train-{k:06d}.tar")
        with pytest.raises(ShardsFailed, match="FileNotFoundError") as err:
            for _ in range(40):
                list(ds)
    finally:
        server.stop()
    assert "every one of the 3 shards" in str(err.value)
    assert feed.given <= 8, feed.given  # epoch 1's claims, then the end; not 40 epochs


def test_some_shards_failing_are_skipped_epoch_after_epoch(tmp_path: Path):
    """Only a part failing is not the end: the rest is served every epoch, as documented."""
    make_wds(tmp_path / "shards", shards=3, per_shard=2, nbytes=100)
    (tmp_path / "shards" / "train-000001.tar").unlink()
    with file_server(str(tmp_path / "shards")) as url:
        ds = WebDataset(f"{url}/train-{{000000..000002}}.tar", fields=FIELDS)
        ds.reset_state()
        ds.attach(EpochsOfClaims(3, epochs=4))
        got = [sorted(int(i) for _, i in ds) for _ in range(4)]
    assert got == [[0, 1, 4, 5]] * 4
    assert ds.stats.failed_shards == 4 and ds.finished


def test_a_run_whose_claims_all_failed_ends_with_the_error_not_quietly(tmp_path: Path):
    """Two producers, one epoch, every shard 404: each is handed half of the list, so
    neither tried them all. Before: each finished its run quietly, 0 batches sent, and the
    trainer waited. Now the end of the run says what failed."""
    make_wds(tmp_path, shards=1, per_shard=2, nbytes=100)
    with file_server(str(tmp_path)) as url:
        ds = WebDataset(f"{url}/gone-{{000000..000003}}.tar", fields=FIELDS)
        ds.reset_state()
        ds.attach(EpochsOfClaims(2, epochs=1))  # units 0 and 1 here; the others elsewhere
        with pytest.raises(ShardsFailed, match=r"every shard this producer was handed "
                                               r"\(2 of 4\) failed") as err:
            list(ds)
    assert "gone-" in str(err.value) and ds.finished


def test_a_static_share_that_all_fails_ends_once_every_shard_it_may_get_failed(tmp_path):
    """A static ``shard: {index, count}``: unshuffled, its share is fixed, and that share
    failing is the end; shuffled, it is another set of shards each epoch, so only all of them
    failing is."""
    make_wds(tmp_path, shards=4, per_shard=2, nbytes=100)
    for k in (1, 3):
        (tmp_path / f"train-{k:06d}.tar").unlink()
    urls = str(tmp_path / "train-{000000..000003}.tar")
    fixed = WebDataset(urls, fields=FIELDS, shuffle=False, claim=False)
    fixed.set_shard(1, 2)  # shards 1 and 3: both gone
    fixed.reset_state()
    with pytest.raises(ShardsFailed, match="every one of the 2 shards"):
        list(fixed)
    drawn = WebDataset(urls, fields=FIELDS, seed=3, claim=False)
    drawn.set_shard(1, 2)
    drawn.reset_state()
    got = sorted(int(i) for _ in range(6) for _, i in drawn)  # never the end: 0 and 2 live
    assert got and set(got) <= {0, 1, 4, 5}

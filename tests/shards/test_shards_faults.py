"""Shards over HTTP through a proxy that injects faults (503s, connections reset mid-body,
stalls past the read timeout, a slow link): every retry and every skipped shard is counted
in the producer's metrics and named in its log; no fault stops the other shards."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml

from feedline.consumer import ConsumerOptions, RemoteDataZMQ
from feedline.procs import free_port, wait_for
from feedline.producer.dataflow.webdataset import WebDataset
from feedline.producer.exact import build_exact
from feedline.producer.shards.retry import RetryPolicy, ShardError
from feedline.scrape import scrape
from feedline.transport.link import LinkConfig
from tests.support.shard_server import Plan, fault_proxy, file_server
from tests.support.shard_support import make_wds, payload

LIVENESS = ("--heartbeat-interval", "0.2", "--heartbeat-timeout", "1.5")
FAST = LinkConfig(heartbeat_interval=0.2, heartbeat_timeout=1.5)


def test_every_fault_is_retried_counted_and_loses_nothing(tmp_path: Path):
    make_wds(tmp_path, shards=4, per_shard=10, nbytes=8000)
    # The read timeout is well above what a read of 16 KB on a loaded machine takes (at
    # 0.5 s, CI once timed out a second read of the stalled shard: 6 retries, not 5).
    plan = Plan(stall=3.0)
    plan.add("train-000000", "503", 2)
    plan.add("train-000001", "reset", 2)  # half a chunk, then a TCP reset
    plan.add("train-000002", "stall", 1)  # silent past the 2 s read timeout
    with file_server(str(tmp_path)) as url, fault_proxy(url, plan) as proxy:
        ds = WebDataset(f"{proxy}/train-{{000000..000003}}.tar", fields=["bin", "cls"],
                        chunk_size=16384, timeout=2.0)
        ds.reset_state()
        got = sorted((int(i), d.tobytes()) for d, i in ds)
    assert got == [(i, payload(i, 8000)) for i in range(40)]
    assert plan.injected == {"503": 2, "reset": 2, "stall": 1}
    assert ds.stats.retries == 5 and ds.stats.failed_shards == 0


def test_a_shard_that_keeps_failing_is_skipped_in_training_and_an_error_in_exact(tmp_path):
    make_wds(tmp_path, shards=3, per_shard=4)
    plan = Plan()
    plan.add("train-000001", "503", -1)
    with file_server(str(tmp_path)) as url, fault_proxy(url, plan) as proxy:
        src = {"urls": f"{proxy}/train-{{000000..000002}}.tar", "fields": ["bin", "cls"],
               "retries": 3}
        from feedline.producer.pipeline import build_pipeline

        with build_pipeline({"source": {"webdataset": src}}) as df:
            df.reset_state()
            got = sorted(int(dp[1]) for dp in df)
        ws = next(s for s in _stages(df) if isinstance(s, WebDataset))
        assert got == [0, 1, 2, 3, 8, 9, 10, 11]
        assert ws.stats.failed_shards == 1 and ws.stats.retries == 2
        assert list(ws.stats.failed) == [f"{proxy}/train-000001.tar"]


def _stages(df):
    from feedline.producer.dataflow.base import stages

    return list(stages(df))


def test_a_producer_counts_retries_and_skipped_shards_in_its_metrics(broker_proc, daemons,
                                                                    endpoints, tmp_path):
    make_wds(tmp_path / "shards", shards=6, per_shard=5, nbytes=20000)
    broker_proc()
    # 10 tries of one request, a fault every 4th and 7th GET: a live shard never runs out
    plan = Plan(every=[("503", 4), ("reset", 7)])
    plan.add("train-000004", "503", -1)  # this one never comes back
    metrics = free_port()
    with file_server(str(tmp_path / "shards")) as url, fault_proxy(url, plan) as proxy:
        cfg = {"stream": "train", "epochs": None,
               "source": {"webdataset": {"urls": f"{proxy}/train-{{000000..000005}}.tar",
                                         "fields": ["bin", "cls"], "chunk_size": 8192,
                                         "retries": 10}},
               "steps": [{"map": {"function": "tests.support.shard_support:id_and_digest",
                                  "component": None}},
                         {"batch": {"batch_size": 5, "remainder": True}}]}
        path = tmp_path / "train.yaml"
        path.write_text(yaml.safe_dump(cfg))
        p = daemons("feedline.producer", "--config", path, "--broker", endpoints.ingress,
                    "--metrics-port", str(metrics), *LIVENESS, name="producer")
        seen: list[int] = []
        with RemoteDataZMQ(endpoints.egress, stream="train", timeout=60,
                           options=ConsumerOptions(link=FAST)) as src:
            it = iter(src)
            while len(seen) < 25:  # the first epoch: every sample but the dead shard's
                ids, _ = next(it)
                seen += [int(i) for i in np.asarray(ids)]
            with plan.lock:  # no more faults: the counts settle
                plan.every.clear()
                plan.rules.clear()

            def settled() -> bool:
                s = scrape(metrics)
                counts = [s.total(f"feedline_producer_{n}_total") for n in
                          ("shard_retries", "shards_failed")]
                # every GET that failed was retried and counted, but the dead shard's last
                return counts == [plan.total() - 1, 1]
            wait_for(settled, 30, what="the producer's counters to match the proxy's")
        assert p.alive()
    assert sorted(seen[:25]) == [i for i in range(30) if not 20 <= i < 25]
    assert plan.total() >= 10, plan.injected
    assert f"could not read shard {proxy}/train-000004.tar" in p.log_text()


def test_exact_delivery_names_a_shard_that_keeps_failing(broker_proc, daemons, endpoints,
                                                         tmp_path):
    make_wds(tmp_path / "shards", shards=3, per_shard=4)
    from feedline.producer.shards.manifest import Manifest, ShardInfo

    (tmp_path / "shards" / "manifest.json").write_text(Manifest(
        "webdataset", [ShardInfo(f"train-{k:06d}.tar", 4) for k in range(3)]).to_json())
    plan = Plan()
    plan.add("train-000002", "503", -1)
    with file_server(str(tmp_path / "shards")) as url, fault_proxy(url, plan) as proxy:
        cfg = {"delivery": "exact", "stream": "val", "epochs": 1,
               "source": {"webdataset": {"manifest": f"{proxy}/manifest.json",
                                         "fields": ["bin", "cls"], "retries": 2}},
               "steps": [{"batch": {"batch_size": 2}}]}
        pipe = build_exact(cfg)
        with pytest.raises(ShardError, match="train-000002.tar"):
            for u in range(pipe.source.units()):  # type: ignore[union-attr]
                list(pipe.batches(0, u))


def test_a_missing_shard_is_named_once_then_rate_limited_and_all_counted(tmp_path, caplog):
    """A brace list naming 5 shards where the folder holds 3 (a re-conversion shrank it):
    each missing shard is named once, as not read (not "the rest" of it) with the likely
    cause; its failures in later epochs are counted, not logged one line each."""
    import logging

    make_wds(tmp_path, shards=3, per_shard=2)
    epochs = 20
    with file_server(str(tmp_path)) as url:
        ds = WebDataset(f"{url}/train-{{000000..000004}}.tar", fields=["bin", "cls"],
                        retry=RetryPolicy(attempts=1))
        ds.reset_state()
        with caplog.at_level(logging.WARNING, "feedline.producer.dataflow.sharded"):
            for _ in range(epochs):
                assert sorted(int(i) for _, i in ds) == list(range(6))
    lines = [r.getMessage() for r in caplog.records
             if r.name == "feedline.producer.dataflow.sharded"]
    assert ds.stats.failed_shards == 2 * epochs
    for k in (3, 4):
        first = [m for m in lines if f"train-00000{k}.tar" in m]
        assert first[0].startswith(f"could not read shard {url}/train-00000{k}.tar: "
                                   "FileNotFoundError"), first[0]
        assert first[0].endswith("is the urls list (or the manifest) stale?"), first[0]
    assert not any("skipped the rest" in m for m in lines), lines
    # two first lines, then at most one a minute: the 38 repeats are not 38 lines
    assert len(lines) <= 3, lines


def test_a_shard_cut_short_is_named_with_the_samples_read(tmp_path, caplog):
    import logging

    make_wds(tmp_path, shards=2, per_shard=20, nbytes=3000)
    plan = Plan()
    plan.add("train-000001", "pass", 1)  # its first chunk arrives, then never another
    plan.add("train-000001", "503", -1)
    with file_server(str(tmp_path)) as url, fault_proxy(url, plan) as proxy:
        ds = WebDataset(f"{proxy}/train-{{000000..000001}}.tar", fields=["bin", "cls"],
                        chunk_size=16384, prefetch=1, read_ahead=1, retry=RetryPolicy(attempts=1),
                        shuffle=False)
        ds.reset_state()
        with caplog.at_level(logging.WARNING, "feedline.producer.dataflow.sharded"):
            got = [int(i) for _, i in ds]
    n = len(got) - 20
    assert 0 < n < 20 and got[20:] == list(range(20, 20 + n))
    msgs = [r.getMessage() for r in caplog.records if "train-000001" in r.getMessage()]
    assert any(m.startswith(f"skipped the rest of shard {proxy}/train-000001.tar after "
                            f"{n} samples: ") for m in msgs), msgs

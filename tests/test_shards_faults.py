"""Shards over HTTP through a proxy that injects faults (503s, connections reset mid-body,
stalls past the read timeout, a slow link): every retry and every skipped shard is counted
in the producer's metrics and named in its log; no fault stops the other shards."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml

from feedline.consumer import RemoteDataZMQ
from feedline.link import LinkConfig
from feedline.procs import free_port, wait_for
from feedline.producer.dataflow.webdataset import WebDataset
from feedline.producer.exact import build_exact
from feedline.producer.shards.retry import ShardError
from feedline.scrape import scrape
from tests.shard_server import Plan, fault_proxy, file_server
from tests.shard_support import make_wds, payload

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
               "steps": [{"map": {"function": "tests.shard_support:id_and_digest",
                                  "component": None}},
                         {"batch": {"batch_size": 5, "remainder": True}}]}
        path = tmp_path / "train.yaml"
        path.write_text(yaml.safe_dump(cfg))
        p = daemons("feedline.producer", "--config", path, "--broker", endpoints.ingress,
                    "--metrics-port", str(metrics), *LIVENESS, name="producer")
        seen: list[int] = []
        with RemoteDataZMQ(endpoints.egress, stream="train", timeout=60, link=FAST) as src:
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
    assert f"skipped the rest of shard {proxy}/train-000004.tar" in p.log_text()


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

"""Pipeline stage rates and skipped samples: feedline_producer_stage_datapoints_total{stage}
and feedline_producer_skipped_datapoints_total{stage}, counted in the producer's process at
each stage's output, in every parallel mode, and served by a producer daemon."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from feedline.procs import free_port, wait_for
from feedline.producer.dataflow import BatchData, CountData, ImageFolder, MapDataComponent
from feedline.producer.image import ImageNetVal
from feedline.producer.metrics import StageMetrics
from feedline.producer.pipeline import build_pipeline, pipeline_stages
from feedline.scrape import scrape as metrics_scrape
from tests.support.jpeg_data import make_folder

HERE = "tests.producer.test_stage_metrics"  # as pipeline files name its functions

STAGES = "feedline_producer_stage_datapoints_total"
SKIPPED = "feedline_producer_skipped_datapoints_total"
CORRUPT = 3


def registry_for(df) -> CollectorRegistry:
    registry = CollectorRegistry()
    StageMetrics(registry, pipeline_stages(df))
    return registry


def series(registry: CollectorRegistry, name: str) -> dict[str, float]:
    """stage -> value of one of the two families."""
    return {s.labels["stage"]: s.value for m in registry.collect() for s in m.samples
            if s.name == name}


def keep_even(dp) -> bool:
    return dp[0] % 2 == 0


def plus_one(x):
    return x + 1


@pytest.mark.parametrize("mode", ["none", "thread", "process", "runner"])
def test_every_stage_of_a_yaml_pipeline_is_counted_exactly(mode: str) -> None:
    """source 20 -> map 20 -> filter 10 -> batch 10/3 = 3 (remainder dropped), twice; in
    runner mode the source, map and filter run in the workers (strict: one shard each) and
    their counts reach this process with the results."""
    cfg = {"source": {"list": {"items": [[i, i] for i in range(20)]}},
           "parallel": {"mode": mode, "workers": 2, "strict": True, "buffer_size": 4},
           "steps": [{"map": {"function": f"{HERE}:plus_one", "component": 1}},
                     {"filter": {"function": f"{HERE}:keep_even"}},
                     {"batch": {"batch_size": 3}}]}
    df = build_pipeline(cfg)
    registry = registry_for(df)
    assert series(registry, STAGES) == {"source:list": 0, "0:map": 0, "1:filter": 0,
                                        "2:batch": 0}
    with df:
        df.reset_state()
        batches = [b for _ in range(2) for b in df]
    assert len(batches) == 6
    assert series(registry, STAGES) == {"source:list": 40, "0:map": 40, "1:filter": 20,
                                        "2:batch": 6}
    # The map and batch stages can skip (a batch: a sample that does not stack); none did.
    assert series(registry, SKIPPED) == {"0:map": 0, "2:batch": 0}


def test_fused_map_steps_are_one_stage_and_contracts_hold() -> None:
    """Consecutive map steps run as one function: one stage, labelled with both steps. The
    counting stages keep len() and reset_state() of what they wrap."""
    cfg = {"source": {"list": {"items": [[i] for i in range(10)]}},
           "steps": [{"map": {"function": f"{HERE}:plus_one"}},
                     {"map": {"function": f"{HERE}:plus_one"}},
                     {"batch": {"batch_size": 3, "remainder": True}}]}
    df = build_pipeline(cfg)
    assert [s.name for s in pipeline_stages(df)] == ["source:list", "0-1:map+map", "2:batch"]
    assert isinstance(df, CountData) and isinstance(df.ds, BatchData)
    assert len(df) == 4
    df.reset_state()
    assert [list(b[0]) for b in df] == [[2, 3, 4], [5, 6, 7], [8, 9, 10], [11]]
    assert series(registry_for(df), STAGES) == {"source:list": 10, "0-1:map+map": 10,
                                                "2:batch": 4}


@pytest.fixture
def corrupt_images(tmp_path: Path) -> Path:
    """15 good JPEGs in 3 classes and CORRUPT undecodable ones."""
    root = tmp_path / "imgs"
    make_folder(root, classes=3, per_class=5)
    for k in range(CORRUPT):
        (root / f"c{k}" / f"zz-corrupt-{k}.jpg").write_bytes(b"\xff\xd8\xff\xe0" + b"\0" * 64)
    return root


@pytest.mark.parametrize("mode, strict", [("none", False), ("thread", False),
                                          ("process", False), ("runner", True)])
def test_skipped_corrupt_jpegs_are_exported_from_every_mode(
    corrupt_images: Path, mode: str, strict: bool
) -> None:
    """With 2 worker processes (process, runner) the skips happen in the workers and must
    reach the parent's metric: exactly CORRUPT, not 0, not once per worker."""
    cfg = {"source": {"image_folder": {"root": str(corrupt_images)}}, "on_error": "skip",
           "parallel": {"mode": mode, "workers": 2, "strict": strict, "buffer_size": 4},
           "steps": [{"imagenet_val": {"size": 16, "resize": 20}}, {"batch": {"batch_size": 5}}]}
    df = build_pipeline(cfg)
    registry = registry_for(df)
    with df:
        df.reset_state()
        batches = list(df)
    assert sum(len(b[1]) for b in batches) == 15
    assert series(registry, SKIPPED) == {"0:imagenet_val": CORRUPT, "1:batch": 0}
    assert series(registry, STAGES) == {"source:image_folder": 15 + CORRUPT,
                                        "0:imagenet_val": 15, "1:batch": 3}


def corrupt_factory(root: str) -> BatchData:
    return BatchData(MapDataComponent(ImageFolder(root, shuffle=False), ImageNetVal(16, 20),
                                      on_error="skip"), 5)


def test_a_factory_pipeline_is_one_stage_with_its_skips(corrupt_images: Path) -> None:
    df = build_pipeline({"factory": f"{HERE}:corrupt_factory",
                         "args": {"root": str(corrupt_images)}})
    registry = registry_for(df)
    df.reset_state()
    assert len(list(df)) == 3
    assert series(registry, STAGES) == {"factory": 3}
    assert series(registry, SKIPPED) == {"factory": CORRUPT}


def scrape(port: int) -> dict[str, dict[str, float]]:
    """family sample name -> {stage: value} for the two stage families."""
    got = metrics_scrape(port, timeout=5)
    if got.error:
        raise OSError(got.error)
    return {name: got.by_label(name, "stage") for name in (STAGES, SKIPPED)}


def test_a_producer_daemon_serves_stage_series_and_logs_skips(
    corrupt_images: Path, tmp_path: Path, broker_proc, daemons, endpoints
) -> None:
    broker_proc()
    cfg = tmp_path / "pipeline.yaml"
    cfg.write_text(
        f"source: {{image_folder: {{root: {corrupt_images}}}}}\n"
        "on_error: skip\n"
        "parallel: {mode: process, workers: 2, buffer_size: 4}\n"
        "steps:\n"
        "  - imagenet_val: {size: 16, resize: 20}\n"
        "  - batch: {batch_size: 5}\n")
    port = free_port()
    producer = daemons("feedline.producer", "--config", cfg, "--broker", endpoints.ingress,
                       "--id", "p0",
                       "--metrics-port", port, "--metrics-addr", "127.0.0.1",
                       "--heartbeat-interval", "0.2", "--heartbeat-timeout", "1.5",
                       "--log-interval", "0.01", name="producer")

    def a_whole_pass() -> bool:
        assert producer.alive(), producer.log_text()
        try:
            got = scrape(port)
        except OSError:  # not serving yet
            return False
        # Workers are unordered: the corrupt files may all be skipped before the batches of
        # the pass are out, so wait for both.
        return (got.get(SKIPPED, {}).get("0:imagenet_val", 0) >= CORRUPT
                and got.get(STAGES, {}).get("1:batch", 0) >= 3)

    # Sends until the broker's buffer is full (no trainer): at least one whole pass.
    wait_for(a_whole_pass, 60, interval=0.1, what="a pass of the pipeline scraped")
    got = scrape(port)
    assert set(got[STAGES]) == {"source:image_folder", "0:imagenet_val", "1:batch"}
    assert set(got[SKIPPED]) == {"0:imagenet_val", "1:batch"}
    st, sk = got[STAGES], got[SKIPPED]["0:imagenet_val"]
    # Every datapoint read came out of the map or was skipped (results in flight aside).
    assert st["0:imagenet_val"] + sk <= st["source:image_folder"]

    def logged_skips() -> list[int]:
        """The skip counts of the rate lines ("p0: 7 batches, ... MB/s, 3 skipped")."""
        return [int(ln.rsplit(", ", 1)[1].split()[0]) for ln in producer.log_text().splitlines()
                if "batches/s" in ln and ln.endswith(" skipped")]

    wait_for(lambda: any(n >= CORRUPT for n in logged_skips()), 30, what="a rate line")
    assert logged_skips() == sorted(logged_skips())

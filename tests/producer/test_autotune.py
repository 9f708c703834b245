"""``parallel: auto``: the CPU budget read from real files in the cgroup formats, the
hill-climb on synthetic rate curves (pure), and AutoMapData running real threads and forked
processes: every datapoint exactly once across switches of kind and count; what the
pipeline file says and refuses; what the producer's start-up line and metrics show."""

from __future__ import annotations

import logging
import os
import random
import threading
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest

from feedline.producer.dataflow import DataFromList
from feedline.producer.dataflow.auto_map_data import AutoMapData
from feedline.producer.dataflow.autotune import (
    AutoWorkers,
    ModeTuner,
    Tuner,
    TunerConfig,
    cgroup_quota,
    cpu_budget,
)
from feedline.producer.metrics import StageMetrics
from feedline.producer.pipeline import (
    ConfigError,
    build_pipeline,
    parallel_summary,
    pipeline_stages,
)


# ---------------------------------------------------------------------------- CPU budget
def cgroup(tmp: Path, proc: str, files: dict[str, str]) -> tuple[Path, Path]:
    root = tmp / "cgroup"
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    (tmp / "self-cgroup").write_text(proc)
    return root, tmp / "self-cgroup"


def test_cgroup_v2_quota(tmp_path: Path) -> None:
    root, proc = cgroup(tmp_path, "0::/kubepods/pod1/c1\n",
                        {"kubepods/pod1/c1/cpu.max": "150000 100000\n"})
    assert cgroup_quota(root, proc) == 1.5
    assert cpu_budget(root, proc).workers == min(2, len(os.sched_getaffinity(0)))
    root, proc = cgroup(tmp_path / "b", "0::/\n", {"cpu.max": "max 100000\n"})
    assert cgroup_quota(root, proc) is None


def test_cgroup_v1_quota(tmp_path: Path) -> None:
    root, proc = cgroup(tmp_path, "4:memory:/x\n3:cpu,cpuacct:/docker/abc\n",
                        {"cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "50000\n",
                         "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000\n"})
    assert cgroup_quota(root, proc) == 0.5
    budget = cpu_budget(root, proc)
    assert (budget.cores, budget.source, budget.workers) == (0.5, "cgroup quota", 1)
    root, proc = cgroup(tmp_path / "b", "3:cpu,cpuacct:/\n",
                        {"cpu,cpuacct/cpu.cfs_quota_us": "-1\n",
                         "cpu,cpuacct/cpu.cfs_period_us": "100000\n"})
    assert cgroup_quota(root, proc) is None


def test_no_cgroup_means_the_affinity(tmp_path: Path) -> None:
    budget = cpu_budget(tmp_path / "none", tmp_path / "none")
    assert budget.cores == len(os.sched_getaffinity(0)) and budget.source == "affinity"


# ---------------------------------------------------------------------------- the climb
def curve(best: int, per: float = 100.0):
    """Rate at k workers: linear up to ``best`` (the CPUs), a little worse beyond."""
    return lambda k: per * min(k, best) * (0.97 ** max(0, k - best))


def climb(tuner: Tuner, rate_at, periods: int, demand: float = float("inf"),
          noise: float = 0.0, seed: int = 0) -> list[int]:
    """Run the tuner against a stage whose consumer takes ``demand``/s at most."""
    rng = random.Random(seed)
    ks = []
    for _ in range(periods):
        k = tuner.k
        capacity = rate_at(k)
        rate = min(capacity, demand) * (1 + rng.uniform(-noise, noise))
        wait = max(0.0, 1 - demand / capacity) if capacity > demand else 0.6
        tuner.observe(rate, 0.0 if capacity > demand * 1.2 else wait)
        ks.append(tuner.k)
    return ks


@settings(max_examples=100, deadline=None)
@given(best=st.integers(1, 8), start=st.integers(1, 10), seed=st.integers(0, 10**6))
def test_the_climb_finds_the_best_count_and_stays_near_it(best: int, start: int,
                                                          seed: int) -> None:
    """A bottleneck stage climbs to the count where the rate stops rising, whatever it
    starts from, under 3% noise; it then spends at least 80% of its periods there."""
    t = Tuner(TunerConfig(lo=1, hi=10), start)
    ks = climb(t, curve(best), 200, noise=0.03, seed=seed)
    late = ks[100:]
    assert late.count(best) >= 0.8 * len(late), (best, ks)


def test_a_bottleneck_at_the_top_of_its_range_rarely_tries_fewer() -> None:
    """Two CPUs, a stage that could use four: once at 2, a try of 1 that was slower waits
    the longest backoff (each such try cost the python-map benchmark half its rate for two
    periods, every few seconds)."""
    t = Tuner(TunerConfig(lo=1, hi=2, max_backoff=32), start=1)
    ks = climb(t, curve(4), 120, noise=0.03)
    tries = [i for i, k in enumerate(ks) if k == 1 and i > 0]
    assert ks[0] == 2 and tries, ks
    assert all(b - a > 32 for a, b in zip(tries, tries[1:], strict=False)), ks


def test_a_stage_that_is_not_the_bottleneck_gives_workers_back() -> None:
    t = Tuner(TunerConfig(lo=1, hi=8), start=4)
    ks = climb(t, curve(8), 60, demand=150.0)  # downstream takes 150/s: 2 workers do
    assert ks[-1] == 2 and max(ks[20:]) <= 3, ks


def test_a_changed_load_is_explored_again() -> None:
    t = Tuner(TunerConfig(lo=1, hi=8), start=1)
    climb(t, curve(2), 60)
    assert t.k == 2
    ks = climb(t, curve(6, per=60.0), 80)  # the stage got costlier per datapoint, more CPUs
    assert ks[-1] == 6, ks


def test_the_mode_is_measured_and_processes_must_win_clearly() -> None:
    m = ModeTuner(("thread", "process"), {"thread": 3, "process": 2}, start=2)
    seen = []
    for rate in ({"thread": 100.0, "process": 180.0}[m.mode] for _ in range(4)):
        seen.append(m.observe(rate, 0.5))
    assert m.mode == "process" and seen[-1] == ("process", 2), seen
    m = ModeTuner(("thread", "process"), {"thread": 3, "process": 2}, start=2)
    for _ in range(4):
        m.observe({"thread": 100.0, "process": 103.0}[m.mode], 0.5)
    assert m.mode == "thread"  # 3% better is not worth the copies


# ------------------------------------------------------------------------- AutoMapData
def square(x: int) -> int:
    return x * x


def test_every_datapoint_once_across_switches_of_kind_and_count(caplog) -> None:
    """Tiny periods and a tuner told to switch often: 3 passes of 3000 datapoints through
    threads and processes alike, nothing lost, nothing twice."""
    modes = ModeTuner(("thread", "process"), {"thread": 3, "process": 2}, start=2, periods=1)
    auto = AutoWorkers(modes, buffer=16, min_period=0.02, max_period=0.05)
    m = AutoMapData(DataFromList(list(range(3000))), square, 3, 2, auto, 16)
    kinds = set()
    with caplog.at_level(logging.INFO, "feedline.producer.dataflow.parallel_map"):
        try:
            m.reset_state()
            for _ in range(3):
                got = []
                for x in m:
                    got.append(x)
                    kinds.add((m.mode, m.active))
                assert sorted(got) == [i * i for i in range(3000)]
        finally:
            m.close()
    assert {k for k, _ in kinds} == {"thread", "process"}, kinds
    assert "kept" in caplog.text


# ---------------------------------------------------------------------------- pipelines
IMAGES = {"image_folder": {"root": "/nonexistent"}}


def test_pipeline_files_say_auto_and_are_refused_where_it_cannot_work(tmp_path: Path) -> None:
    from feedline.producer.pipeline import _parallel

    steps = [{"imagenet_train": {"size": 32}}, {"batch": {"batch_size": 2}}]
    assert _parallel({"steps": steps})["workers"] == "auto"  # the presets' default
    assert _parallel({"steps": [{"batch": {"batch_size": 2}}]})["mode"] == "none"
    assert _parallel({"steps": steps, "parallel": "auto"})["mode"] == "auto"
    assert _parallel({"parallel": {"mode": "process", "workers": "auto"}})["mode"] == "process"
    assert _parallel({"steps": steps, "parallel": {"mode": "none"}})["mode"] == "none"
    for bad, needle in (({"mode": "runner", "workers": "auto"}, "mode: runner"),
                        ({"workers": "auto", "strict": True}, "strict"),
                        ({"workers": "many"}, "expected an int")):
        with pytest.raises(ConfigError, match=needle):
            _parallel({"parallel": bad})


def test_a_preset_pipeline_starts_tuned_and_says_so(tmp_path: Path) -> None:
    from tests.support.jpeg_data import make_folder

    if cpu_budget().workers < 2:
        pytest.skip("one CPU here: auto runs no workers (the next test)")

    root = tmp_path / "img"
    make_folder(root, classes=2, per_class=12)
    df = build_pipeline({"source": {"image_folder": {"root": str(root)}},
                         "steps": [{"imagenet_train": {"size": 32}},
                                   {"batch": {"batch_size": 4}}]})
    try:
        df.reset_state()
        batches = [b for _, b in zip(range(3), df, strict=False)]
        assert len(batches) == 3 and batches[0][0].shape == (4, 32, 32, 3)
        summary = parallel_summary(df)
        assert summary.startswith("0:imagenet_train ") and "auto: threads or processes" in \
            summary and "CPUs by" in summary, summary
        registry = CollectorRegistry()
        StageMetrics(registry, pipeline_stages(df))
        text = generate_latest(registry).decode()
        assert 'feedline_producer_stage_workers{mode="thread",stage="0:imagenet_train"}' in text
    finally:
        df.close()
    fake = build_pipeline({"source": {"fake": {"shapes": [[2]], "size": 4}},
                           "steps": [{"batch": {"batch_size": 2}}]})
    assert parallel_summary(fake) == ""


def test_on_one_cpu_auto_runs_the_map_steps_in_the_producers_thread(tmp_path: Path) -> None:
    """One CPU (here: this process's affinity narrowed while the pipeline is built, as
    ``taskset -c 0`` would): no worker can run beside the producer's thread, so auto starts
    none, says so, and reports no workers."""
    from tests.support.jpeg_data import make_folder

    root = tmp_path / "img"
    make_folder(root, classes=2, per_class=4)
    cfg = {"source": {"image_folder": {"root": str(root)}},
           "steps": [{"imagenet_train": {"size": 32}}, {"batch": {"batch_size": 4}}]}
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(before)})
    try:
        df = build_pipeline(cfg)
    finally:
        os.sched_setaffinity(0, before)
    threads = threading.active_count()
    try:
        df.reset_state()
        batches = [b for _, b in zip(range(2), df, strict=False)]
        assert len(batches) == 2 and batches[0][0].shape == (4, 32, 32, 3)
        assert threading.active_count() == threads, "no worker thread was started"
        summary = parallel_summary(df)
        assert summary == "0:imagenet_train in the producer's thread (auto: 1 CPU by " \
                          "affinity)", summary
        registry = CollectorRegistry()
        StageMetrics(registry, pipeline_stages(df))
        text = generate_latest(registry).decode()
        assert 'feedline_producer_stage_workers{mode="none",stage="0:imagenet_train"} 0.0' \
            in text
    finally:
        df.close()

"""Parallel stages with real threads and forked processes: exact sets, order, bounds, errors."""

from __future__ import annotations

import os
import signal
import threading

import numpy as np
import pytest

from feedline.producer.dataflow import (
    CountData,
    DataFlow,
    DataFromGenerator,
    DataFromList,
    MapData,
    MultiProcessMapData,
    MultiProcessRunner,
    MultiThreadMapData,
    SampleError,
    WorkerError,
    get_worker,
    make_rng,
)

N = 60


def double(x: int) -> int:
    return 2 * x


class Noisy:
    """A seeded map function: x -> (x, a draw from its rng)."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.rng = make_rng(seed, 0)

    def reseed(self, epoch: int) -> None:
        self.rng = make_rng(self.seed, epoch)

    def __call__(self, x: int) -> tuple[int, int]:
        return x, int(self.rng.integers(1 << 30))


def corrupt_on_7(x: int) -> int:
    if x == 7:
        raise SampleError("corrupt datapoint 7")
    return x


def fails_on_5(x: int) -> int:
    if x == 5:
        raise KeyError("boom-five")
    return x


class PidSource(DataFlow):
    """Yields (i, pid of the process that called reset_state, pid iterating)."""

    def __init__(self, n: int) -> None:
        self.n, self.shard = n, (0, 1)
        self.reset_pid: int | None = None

    def set_shard(self, index: int, count: int) -> None:
        self.shard = (index, count)

    def __len__(self) -> int:
        return len(range(self.shard[0], self.n, self.shard[1]))

    def reset_state(self) -> None:
        self.reset_pid = os.getpid()

    def __iter__(self):
        for i in range(self.shard[0], self.n, self.shard[1]):
            yield (i, self.reset_pid, os.getpid())


def run(df) -> list:
    with df:
        df.reset_state()
        return [list(df) for _ in range(2)]


MAPPERS = [MultiThreadMapData, MultiProcessMapData]


@pytest.mark.parametrize("stage", MAPPERS, ids=["threads", "processes"])
@pytest.mark.parametrize("workers", [1, 2, 4])
def test_strict_map_yields_every_input_once_in_order(stage, workers) -> None:
    df = stage(DataFromList(list(range(N)), shuffle=False), workers, double, buffer_size=8,
               strict=True)
    for epoch in run(df):
        assert epoch == [2 * i for i in range(N)]
    assert len(df) == N


@pytest.mark.parametrize("stage", MAPPERS, ids=["threads", "processes"])
@pytest.mark.parametrize("workers", [1, 2, 4])
def test_unordered_map_yields_the_exact_set(stage, workers) -> None:
    df = stage(DataFromList(list(range(N)), shuffle=True), workers, double, buffer_size=8)
    for epoch in run(df):
        assert sorted(epoch) == [2 * i for i in range(N)]


@pytest.mark.parametrize("workers", [1, 2, 4])
def test_strict_runner_yields_every_datapoint_once(workers) -> None:
    df = MultiProcessRunner(DataFromList(list(range(N)), shuffle=True), workers, strict=True)
    for epoch in run(df):
        assert sorted(epoch) == list(range(N))


def test_runner_resets_each_copy_after_fork_in_its_own_process() -> None:
    df = MultiProcessRunner(PidSource(40), 2, strict=True)
    [epoch, _] = run(df)
    assert sorted(i for i, _, _ in epoch) == list(range(40))
    pids = {(reset, it) for _, reset, it in epoch}
    assert len(pids) == 2 and all(r == i != os.getpid() for r, i in pids)


def test_unordered_runner_pass_is_len_datapoints() -> None:
    df = MultiProcessRunner(DataFromList(list(range(20)), shuffle=True), 2, queue_size=4)
    for epoch in run(df):
        assert len(epoch) == 20 and set(epoch) <= set(range(20))
    with pytest.raises(ValueError, match="shardable"):
        MultiProcessRunner(MapData(DataFromGenerator(lambda: iter([1])), double), 2,
                           strict=True)


def test_map_workers_see_their_identity_and_seeded_randomness_is_reproducible() -> None:
    def make():
        return MultiProcessMapData(DataFromList(list(range(N)), shuffle=False), 2, Noisy(5),
                                   buffer_size=8, strict=True)

    first, second = run(make()), run(make())
    assert first == second, "same seed, same worker layout: same datapoints"
    assert first[0] != first[1], "each epoch draws anew"
    t = run(MultiThreadMapData(DataFromList(list(range(N)), shuffle=False), 2, Noisy(5),
                               buffer_size=8, strict=True))
    assert t == first, "threads and processes seed worker k alike"


def test_worker_sees_its_index() -> None:
    df = MultiProcessMapData(DataFromList(list(range(8)), shuffle=False), 4,
                             lambda x: (x, get_worker().index, get_worker().count),
                             buffer_size=4, strict=True)
    [epoch, _] = run(df)
    assert epoch == [(i, i % 4, 4) for i in range(8)]


@pytest.mark.parametrize("stage", MAPPERS, ids=["threads", "processes"])
def test_a_worker_exception_surfaces_in_the_parent_with_its_traceback(stage) -> None:
    df = stage(DataFromList(list(range(N)), shuffle=False), 2, fails_on_5, buffer_size=4)
    with df, pytest.raises(WorkerError) as info:
        df.reset_state()
        list(df)
    assert "boom-five" in str(info.value) and "fails_on_5" in info.value.remote_traceback
    assert "Traceback" in info.value.remote_traceback


def test_a_runner_exception_surfaces_in_the_parent() -> None:
    df = MultiProcessRunner(MapData(DataFromList(list(range(N)), shuffle=False), fails_on_5), 2,
                            strict=True)
    with df, pytest.raises(WorkerError, match="boom-five"):
        df.reset_state()
        list(df)


@pytest.mark.parametrize("stage", MAPPERS, ids=["threads", "processes"])
def test_skip_policy_counts_corrupt_datapoints(stage) -> None:
    df = stage(DataFromList(list(range(20)), shuffle=False), 2, corrupt_on_7, buffer_size=4,
               strict=True, on_error="skip")
    epochs = run(df)
    assert epochs[0] == [i for i in range(20) if i != 7] and df.skipped == 2


def test_a_runner_adds_what_its_copies_counted_to_its_own_stages() -> None:
    """Skips (and CountData counts) happen in the runner's worker processes; they travel
    with the results, so the stages under the runner read the workers' sum, per pass."""
    source = CountData(DataFromList(list(range(20)), shuffle=False), "source")
    inner = MapData(source, corrupt_on_7, on_error="skip")
    df = MultiProcessRunner(inner, 2, strict=True)
    epochs = run(df)
    assert sorted(epochs[0]) == sorted(epochs[1]) == [i for i in range(20) if i != 7]
    assert inner.skipped == 2 and source.count == 40


def test_a_killed_worker_is_reported_not_waited_for() -> None:
    df = MultiProcessMapData(DataFromList(list(range(N)), shuffle=False), 2, double,
                             buffer_size=4, strict=True)
    with df:
        df.reset_state()
        it = iter(df)
        next(it)
        os.kill(df._procs[1].pid, signal.SIGKILL)
        with pytest.raises(WorkerError, match="died"):
            list(it)


class Counting(DataFlow):
    def __init__(self, n: int) -> None:
        self.n, self.read = n, 0

    def __iter__(self):
        for i in range(self.n):
            self.read += 1
            yield i


@pytest.mark.parametrize("stage", MAPPERS, ids=["threads", "processes"])
def test_in_flight_datapoints_are_bounded_by_buffer_size(stage) -> None:
    src = Counting(200)
    df = stage(src, 2, double, buffer_size=6)
    with df:
        df.reset_state()
        yielded = 0
        for _ in df:
            yielded += 1
            assert src.read - yielded <= 6
        assert yielded == 200


def test_abandoned_pass_is_drained_and_the_next_pass_is_complete() -> None:
    df = MultiProcessMapData(DataFromList(list(range(N)), shuffle=False), 2, double,
                             buffer_size=8, strict=True)
    with df:
        df.reset_state()
        it = iter(df)
        assert [next(it) for _ in range(3)] == [0, 2, 4]
        it.close()  # type: ignore[attr-defined]  # a generator: close() abandons the pass
        assert list(df) == [2 * i for i in range(N)]


def test_close_stops_worker_processes_and_threads() -> None:
    df = MultiProcessMapData(DataFromList([np.zeros(3)]), 3, double, buffer_size=3)
    df.reset_state()
    procs = list(df._procs)
    assert all(p.is_alive() for p in procs)
    df.close()
    assert not any(p.is_alive() for p in procs)
    before = threading.active_count()
    t = MultiThreadMapData(DataFromList([1]), 3, double, buffer_size=3)
    t.reset_state()
    assert threading.active_count() == before + 3
    t.close()
    assert threading.active_count() == before

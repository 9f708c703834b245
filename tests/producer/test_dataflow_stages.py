"""Contracts of the single-process stages: length, passes, order, exact sets, reset."""

from __future__ import annotations

import numpy as np
import pytest

from feedline.producer.dataflow import (
    BatchData,
    DataFromGenerator,
    DataFromList,
    FilterData,
    LocallyShuffleData,
    MapData,
    MapDataComponent,
    RepeatedData,
    SampleError,
    TestDataSpeed,
)
from feedline.producer.dataflow.serialize import dumps, loads


def run(df) -> list:
    df.reset_state()
    return list(df)


def test_data_from_list_order_len_and_shuffle_per_epoch() -> None:
    df = DataFromList(list(range(50)), shuffle=False)
    assert len(df) == 50 and run(df) == list(range(50))
    sh = DataFromList(list(range(50)), shuffle=True, seed=3)
    sh.reset_state()
    e0, e1 = list(sh), list(sh)
    assert sorted(e0) == sorted(e1) == list(range(50))
    assert e0 != e1, "each pass draws a new order"
    again = DataFromList(list(range(50)), shuffle=True, seed=3)
    again.reset_state()
    assert [list(again), list(again)] == [e0, e1], "the order is a function of (seed, epoch)"


def test_shards_of_a_list_cover_it_exactly_once() -> None:
    items = list(range(23))
    got = []
    for i in range(4):
        df = DataFromList(items, shuffle=True, shard=(i, 4))
        out = run(df)
        assert len(out) == len(df)
        got += out
    assert sorted(got) == items
    with pytest.raises(ValueError, match="index"):
        DataFromList(items, shard=(4, 4))


def test_data_from_generator_function_and_one_shot_iterator() -> None:
    df = DataFromGenerator(lambda: iter(range(5)), size=5)
    assert len(df) == 5 and run(df) == list(range(5)) and list(df) == list(range(5))
    once = DataFromGenerator(iter(range(3)))
    assert run(once) == [0, 1, 2]
    with pytest.raises(RuntimeError, match="once"):
        list(once)
    with pytest.raises(NotImplementedError):
        len(once)


def test_batch_data_stacks_and_counts() -> None:
    src = DataFromList([[np.full((2, 3), i, np.uint8), i, float(i)] for i in range(10)],
                       shuffle=False)
    b = BatchData(src, 4)
    out = run(b)
    assert len(b) == 2 == len(out)
    img, lab, f = out[1]
    assert img.shape == (4, 2, 3) and img.dtype == np.uint8 and img[0, 0, 0] == 4
    assert lab.dtype == np.int32 and lab.tolist() == [4, 5, 6, 7] and f.dtype == np.float32
    r = BatchData(src, 4, remainder=True)
    assert len(r) == 3 and [len(x[1]) for x in run(r)] == [4, 4, 2]
    lists = run(BatchData(src, 5, use_list=True))
    assert isinstance(lists[0][0], list) and len(lists[0][0]) == 5
    d = run(BatchData(DataFromList([{"a": i} for i in range(4)], shuffle=False), 2))
    assert d[1]["a"].tolist() == [2, 3]
    ragged = DataFromList([[np.zeros(i + 1)] for i in range(4)], shuffle=False)
    with pytest.raises(ValueError, match="use_list"):
        run(BatchData(ragged, 2))


def test_map_filter_and_component() -> None:
    src = DataFromList([[i, i * 10] for i in range(6)], shuffle=False)
    m = MapData(src, lambda dp: None if dp[0] == 2 else [dp[0] + 1, dp[1]])
    assert len(m) == 6 and [dp[0] for dp in run(m)] == [1, 2, 4, 5, 6]
    orig = [[i, i * 10] for i in range(3)]
    c = MapDataComponent(DataFromList(orig, shuffle=False), lambda x: x + 1, index=1)
    assert run(c) == [[0, 1], [1, 11], [2, 21]]
    assert orig == [[0, 0], [1, 10], [2, 20]], "the input datapoints are not modified"
    f = FilterData(src, lambda dp: dp[0] % 2 == 0)
    assert [dp[0] for dp in run(f)] == [0, 2, 4]
    with pytest.raises(NotImplementedError):
        len(f)


def _bad_on_3(x: int) -> int:
    if x == 3:
        raise SampleError("corrupt 3")
    return x


def test_map_error_policy_skip_counts_raise_raises() -> None:
    src = DataFromList(list(range(6)), shuffle=False)
    skip = MapData(src, _bad_on_3, on_error="skip")
    assert run(skip) == [0, 1, 2, 4, 5] and skip.skipped == 1
    with pytest.raises(SampleError):
        run(MapData(src, _bad_on_3))
    # Only SampleError is skippable: a bug is never swallowed.
    with pytest.raises(ZeroDivisionError):
        run(MapData(src, lambda x: 1 // 0, on_error="skip"))
    with pytest.raises(ValueError, match="on_error"):
        MapData(src, _bad_on_3, on_error="ignore")


def test_locally_shuffle_yields_each_exactly_once_and_is_seeded() -> None:
    src = DataFromList(list(range(100)), shuffle=False)
    ls = LocallyShuffleData(src, 16, seed=1)
    ls.reset_state()
    a, b = list(ls), list(ls)
    assert sorted(a) == sorted(b) == list(range(100)) and a != list(range(100)) and a != b
    ls2 = LocallyShuffleData(src, 16, seed=1)
    ls2.reset_state()
    assert list(ls2) == a


def test_repeated_data() -> None:
    r = RepeatedData(DataFromList([1, 2], shuffle=False), 3)
    assert len(r) == 6 and run(r) == [1, 2] * 3
    inf = RepeatedData(DataFromList([1], shuffle=False), -1)
    it = iter(inf)
    assert [next(it) for _ in range(5)] == [1] * 5
    with pytest.raises(NotImplementedError):
        len(inf)


def test_test_data_speed_returns_the_rate() -> None:
    rate = TestDataSpeed(DataFromList(list(range(10))), size=200, disable_progress=True).start()
    assert rate > 0
    with pytest.raises(ValueError, match="nothing"):
        TestDataSpeed(DataFromList([]), size=5, disable_progress=True).start()


def test_serialize_round_trip_refuses_objects() -> None:
    dp: list = [np.arange(12, dtype=np.float16).reshape(3, 4), 7, b"\xff\xd8", "s", {"k": [1.5]},
          np.int64(3), np.zeros((0, 2), bool)]
    out: list = loads(dumps(dp))
    assert np.array_equal(out[0], dp[0]) and out[0].dtype == np.float16
    assert out[1:5] == [7, b"\xff\xd8", "s", {"k": [1.5]}]
    assert out[5] == 3 and out[5].shape == () and out[6].shape == (0, 2)
    with pytest.raises(TypeError):
        dumps([np.array([object()])])

"""The DataFlow contract as bases and Protocols: as_dataflow, stages, Shardable, Counted,
Reseedable (issue 11, item 5)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from feedline.producer.dataflow import (
    BatchData,
    CountData,
    Counted,
    DataFlow,
    DataFromIterable,
    DataFromList,
    LMDBSerializer,
    MapData,
    MapDataComponent,
    MultiProcessRunner,
    ProxyDataFlow,
    Reseedable,
    Shardable,
    TestDataSpeed,
    as_dataflow,
    stages,
)
from feedline.producer.dataflow.base import UnknownLength
from feedline.producer.dataflow.map_data import reseed
from feedline.producer.dataflow.shard import source_of
from feedline.producer.pipeline import ConfigError, build_pipeline, pipeline_stages


class Foreign:
    """A DataFlow that does not derive from ours (as RemoteDataZMQ, or tensorpack's)."""

    def __init__(self, n: int, closes: bool = True) -> None:
        self.n, self.resets, self.closes = n, 0, 0
        if closes:
            self.close = self._close

    def reset_state(self) -> None:
        self.resets += 1

    def _close(self) -> None:
        self.closes += 1

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.n))


def test_as_dataflow_of_a_list_is_a_dataflow_with_its_length_and_passes() -> None:
    items = [1, 2, 3]
    df = as_dataflow(items)
    assert isinstance(df, DataFromIterable) and df.iterable is items
    df.reset_state()
    assert len(df) == 3 and list(df) == items and list(df) == items, "every pass"
    df.close()


def test_as_dataflow_keeps_a_dataflow_as_it_is() -> None:
    df = DataFromList([1, 2])
    assert as_dataflow(df) is df


def test_as_dataflow_of_a_generator_has_no_length_one_pass_and_closes_it() -> None:
    def gen() -> Iterator[int]:
        yield from range(5)

    g = gen()
    df = as_dataflow(g)
    with pytest.raises(UnknownLength):
        len(df)
    with pytest.raises(TypeError):  # what list() tolerates
        len(df)
    it = iter(df)
    assert next(it) == 0
    df.close()  # a generator's close(): as the getattr-based proxy did
    assert list(g) == []


def test_as_dataflow_of_a_foreign_dataflow_calls_its_reset_state_and_close() -> None:
    src = Foreign(4)
    df = as_dataflow(src)
    df.reset_state()
    df.close()
    assert (src.resets, src.closes) == (1, 1)
    assert list(df) == [0, 1, 2, 3]
    no_close = Foreign(2, closes=False)  # tensorpack's DataFlow: reset_state, no close
    df = as_dataflow(no_close)
    df.reset_state()
    df.close()
    assert no_close.resets == 1


def test_as_dataflow_refuses_what_is_not_iterable() -> None:
    with pytest.raises(TypeError, match="iterable of datapoints is needed, not int"):
        as_dataflow(42)  # type: ignore[arg-type]


def test_a_proxy_wraps_a_plain_iterable_once_and_forwards_the_contract() -> None:
    src = Foreign(6)
    m = MapData(src, lambda x: x * 10)  # type: ignore[arg-type]  # wrapped, at run time
    assert isinstance(m.ds, DataFromIterable) and m.ds.iterable is src
    m.reset_state()
    assert list(m) == [0, 10, 20, 30, 40, 50]
    m.close()
    assert (src.resets, src.closes) == (1, 1)
    batches = BatchData([[i] for i in range(4)], 2, use_list=True)  # type: ignore[arg-type]
    assert list(batches) == [[[0, 1]], [[2, 3]]]


def test_stages_walk_a_pipeline_output_first_to_its_source() -> None:
    source = DataFromList(list(range(8)), shuffle=False)
    counted = CountData(source, "source")
    mapped = MapData(counted, lambda x: x)
    batched = BatchData(mapped, 2)
    assert list(stages(batched)) == [batched, mapped, counted, source]
    assert list(stages(source)) == [source]
    assert source_of(batched) is source
    assert pipeline_stages(batched) == [counted]


def test_a_shardable_source_is_a_protocol() -> None:
    assert isinstance(DataFromList([1]), Shardable)
    assert not isinstance(as_dataflow([1]), Shardable)
    with pytest.raises(ValueError, match="needs a shardable source, not DataFromIterable"):
        MultiProcessRunner(MapData(as_dataflow([1, 2]), lambda x: x), 2, strict=True)


def test_count_data_refuses_skips_that_count_nothing() -> None:
    m = MapData(DataFromList([1]), lambda x: x)
    assert isinstance(m, Counted) and not isinstance(DataFromList([1]), Counted)
    assert CountData(m, "0:map", skips=[m]).skipped == 0
    with pytest.raises(TypeError, match="skips must be stages that count what they skip"):
        CountData(m, "0:map", skips=[DataFromList([1])])  # type: ignore[list-item]


class Random:
    """A map function that draws random numbers: reseeded per pass."""

    def __init__(self) -> None:
        self.epochs: list[int] = []

    def reseed(self, epoch: int) -> None:
        self.epochs.append(epoch)

    def __call__(self, dp: Any) -> Any:
        return dp


def test_reseed_is_for_reseedable_functions_only() -> None:
    f = Random()
    assert isinstance(f, Reseedable) and not isinstance(len, Reseedable)
    reseed(len, 3)  # a plain function: nothing to do
    m = MapDataComponent(DataFromList([[1], [2]], shuffle=False), f, 0)
    m.reset_state()
    for _ in range(3):
        assert list(m) == [[1], [2]]
    assert f.epochs == [0, 1, 2], "ComponentFunc forwards reseed to the function it wraps"


def plain_list(n: int) -> list[list[int]]:
    return [[i] for i in range(n)]


def not_a_dataflow(n: int) -> int:
    return n


def test_a_factory_may_return_a_plain_iterable_not_a_non_iterable() -> None:
    df = build_pipeline({"factory": "tests.test_dataflow_contracts:plain_list",
                         "args": {"n": 3}})
    df.reset_state()
    assert list(df) == [[0], [1], [2]]
    assert [s.name for s in pipeline_stages(df)] == ["factory"]
    with pytest.raises(ConfigError, match="returned a int, not a DataFlow"):
        build_pipeline({"factory": "tests.test_dataflow_contracts:not_a_dataflow",
                        "args": {"n": 3}})


def test_tools_take_a_plain_iterable_and_reset_a_foreign_one(tmp_path: Path) -> None:
    src = Foreign(5)
    assert TestDataSpeed(src, size=20, disable_progress=True).start() > 0
    assert src.resets == 1
    gen = ([i] for i in range(7))
    assert LMDBSerializer.save(gen, tmp_path / "g.lmdb", progress=False) == 7
    assert isinstance(as_dataflow(LMDBSerializer.load(tmp_path / "g.lmdb")), DataFlow)


def test_a_proxy_of_a_proxy_keeps_the_dataflow_it_was_given() -> None:
    inner = MapData(DataFromList([1, 2]), lambda x: x)
    outer = ProxyDataFlow(inner)
    assert outer.ds is inner

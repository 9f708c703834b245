"""The DataFlow contract as bases and Protocols: as_dataflow, stages, Shardable, Counted,
Reseedable (issue 11, item 5); and one contract suite run over every public stage (issue 23,
part 5): test_the_dataflow_contract."""

from __future__ import annotations

import hashlib
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import psutil
import pytest

from feedline.procs import wait_for
from feedline.producer.dataflow import (
    BatchData,
    CountData,
    Counted,
    DataFlow,
    DataFromGenerator,
    DataFromIterable,
    DataFromList,
    FakeData,
    FilterData,
    ImageFolder,
    LMDBData,
    LMDBSerializer,
    LocallyShuffleData,
    MapData,
    MapDataComponent,
    MultiProcessMapData,
    MultiProcessRunner,
    MultiThreadMapData,
    Parquet,
    ProxyDataFlow,
    RepeatedData,
    Reseedable,
    Shardable,
    TestDataSpeed,
    TFRecord,
    WebDataset,
    as_dataflow,
    stages,
)
from feedline.producer.dataflow.base import UnknownLength
from feedline.producer.dataflow.map_data import ComponentFunc, reseed
from feedline.producer.dataflow.shard import source_of
from feedline.producer.image import ImageNetTrain, decode
from feedline.producer.pipeline import ConfigError, build_pipeline, pipeline_stages
from tests.support.jpeg_data import make_folder


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
    df = build_pipeline({"factory": "tests.producer.test_dataflow_contracts:plain_list",
                         "args": {"n": 3}})
    df.reset_state()
    assert list(df) == [[0], [1], [2]]
    assert [s.name for s in pipeline_stages(df)] == ["factory"]
    with pytest.raises(ConfigError, match="returned a int, not a DataFlow"):
        build_pipeline({"factory": "tests.producer.test_dataflow_contracts:not_a_dataflow",
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


# --------------------------------------------------------------------- the contract suite
# One helper checks the DataFlow contract (feedline/producer/dataflow/base.py) of every
# public stage, as torchdata checks every node: each case below builds one stage over real
# data (JPEG files in class folders, an LMDB file written from them), and
# test_every_public_stage_has_a_contract_case fails when a stage joins the public list
# without one.

# Public names of the DataFlow package that are DataFlow classes but not stages to check:
NOT_STAGES = {
    "DataFlow": "the abstract base: its __iter__ raises NotImplementedError",
}


@dataclass(frozen=True)
class Data:
    """The real data the cases read: ``root/c<k>/<n>.jpg`` (12 JPEGs, 3 classes) and an LMDB
    file of the same ``[bytes, label]`` datapoints."""

    root: Path
    lmdb: Path
    records: list


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Data:
    root = tmp_path_factory.mktemp("contract") / "images"
    make_folder(root, classes=3, per_class=4, sizes=(40, 80))
    records = [[np.asarray(b).copy(), label] for b, label in ImageFolder(root, shuffle=False)]
    lmdb = root.parent / "images.lmdb"
    assert LMDBSerializer.save(records, lmdb, progress=False) == len(records) == 12
    return Data(root, lmdb, records)


def folder(d: Data) -> ImageFolder:
    """The source under every transform: the image folder in its sorted order."""
    return ImageFolder(d.root, shuffle=False)


def pixels(dp: list) -> list:
    """A map function without randomness: the image decoded at 1/2 scale."""
    return [decode(dp[0], reduce=2), dp[1]]


def not_c1(dp: list) -> bool:
    return bool(dp[1] != 1)


def labels_of(d: Data) -> Iterator[list]:
    for label in (0, 1, 2):
        yield from ([r[0], r[1]] for r in d.records if r[1] == label)


@dataclass(frozen=True)
class Case:
    """A public stage over real data: ``build(data, seed)``. ``length``: ``known`` (len is
    what one pass yields) or ``unknown`` (len raises UnknownLength, a TypeError). ``seeded``:
    its output depends on the seed (and on the pass). ``ordered``: two runs yield the same
    order (else the same datapoints in another order: parallel stages that merge workers)."""

    stage: type
    build: Callable[[Data, int], DataFlow]
    length: str = "known"
    seeded: bool = False
    ordered: bool = True
    shardable: bool = False
    variant: str = ""

    @property
    def id(self) -> str:
        return self.stage.__name__ + (f"[{self.variant}]" if self.variant else "")


CASES = [
    # sources
    Case(DataFromList, lambda d, s: DataFromList(d.records, shuffle=True, seed=s),
         seeded=True, shardable=True),
    Case(DataFromIterable, lambda d, s: as_dataflow(d.records)),
    Case(DataFromGenerator, lambda d, s: DataFromGenerator(lambda: labels_of(d)),
         length="unknown"),
    Case(FakeData, lambda d, s: FakeData([[4, 3], [1]], size=12, dtype=["uint8", "int32"],
                                         domain=(0, 255), seed=s), seeded=True),
    Case(ImageFolder, lambda d, s: ImageFolder(d.root, shuffle=True, seed=s), seeded=True,
         shardable=True),
    Case(LMDBData, lambda d, s: LMDBData(d.lmdb, shuffle=True, seed=s), seeded=True,
         shardable=True),
    Case(LMDBData, lambda d, s: LMDBData(d.lmdb, shuffle=False), shardable=True,
         variant="sequential"),
    Case(WebDataset, lambda d, s: WebDataset(manifest=shards(d, "wds"), seed=s), seeded=True,
         shardable=True),
    Case(TFRecord, lambda d, s: TFRecord(manifest=shards(d, "tfrecord"), seed=s), seeded=True,
         shardable=True),
    Case(Parquet, lambda d, s: Parquet(shards(d, "parquet"), seed=s), seeded=True,
         shardable=True),
    # transforms, over the image folder
    Case(ProxyDataFlow, lambda d, s: ProxyDataFlow(folder(d))),
    Case(BatchData, lambda d, s: BatchData(MapData(folder(d), pixels_resized), 5,
                                           remainder=True)),
    Case(CountData, lambda d, s: CountData(folder(d), "source")),
    Case(FilterData, lambda d, s: FilterData(folder(d), not_c1), length="unknown"),
    Case(LocallyShuffleData, lambda d, s: LocallyShuffleData(folder(d), 5, seed=s),
         seeded=True),
    Case(MapData, lambda d, s: MapData(folder(d), pixels)),
    Case(MapDataComponent, lambda d, s: MapDataComponent(folder(d), ImageNetTrain(32, seed=s)),
         seeded=True),
    Case(RepeatedData, lambda d, s: RepeatedData(folder(d), 2)),
    Case(MultiThreadMapData, lambda d, s: MultiThreadMapData(
        folder(d), 3, ComponentFunc(ImageNetTrain(32, seed=s)), buffer_size=6, strict=True),
         seeded=True),
    Case(MultiThreadMapData, lambda d, s: MultiThreadMapData(folder(d), 3, pixels),
         ordered=False, variant="unordered"),
    Case(MultiProcessMapData, lambda d, s: MultiProcessMapData(
        folder(d), 2, ComponentFunc(ImageNetTrain(32, seed=s)), buffer_size=6, strict=True,
        chunk=2), seeded=True),
    Case(MultiProcessRunner, lambda d, s: MultiProcessRunner(
        MapDataComponent(folder(d), ImageNetTrain(32, seed=s)), 2, strict=True),
         seeded=True, ordered=False),
]


def shards(d: Data, kind: str) -> str:
    """The records as six shards of two (written once per module): the manifest's path
    (Parquet: a glob; its footers count)."""
    from feedline.producer.shards.manifest import Manifest, ShardInfo
    from feedline.producer.shards.tfrecord import encode_example, frame
    from feedline.producer.shards.writer import ShardJob, write_shard

    out = d.root.parent / kind
    if not out.exists():
        tmp = d.root.parent / f"{kind}.partial"
        tmp.mkdir()
        infos = []
        for k in range(6):
            recs = d.records[2 * k:2 * k + 2]
            if kind == "wds":
                infos.append(write_shard(ShardJob(str(tmp / f"s-{k}.tar"), range(2 * k, 2 * k + 2)),
                                         lambda i: (d.records[i][0].tobytes(), d.records[i][1])))
            elif kind == "tfrecord":
                (tmp / f"s-{k}.tfrecord").write_bytes(b"".join(frame(encode_example(
                    {"image/encoded": r[0].tobytes(), "image/class/label": int(r[1])}))
                    for r in recs))
                infos.append(ShardInfo(f"s-{k}.tfrecord", 2))
            else:
                import pyarrow as pa
                import pyarrow.parquet as pq

                pq.write_table(pa.table({"image": [r[0].tobytes() for r in recs],
                                         "label": [int(r[1]) for r in recs]}),
                               tmp / f"s-{k}.parquet")
        (tmp / "manifest.json").write_text(Manifest(kind, infos).to_json())
        tmp.rename(out)
    return str(out / ("s-*.parquet" if kind == "parquet" else "manifest.json"))


def pixels_resized(dp: list) -> list:
    """Decoded and resized to one shape, so that BatchData can stack a batch."""
    return [cv2.resize(decode(dp[0]), (16, 16)), dp[1]]


def fingerprint(x: Any) -> Any:
    """A hashable, comparable value of a datapoint (arrays by dtype, shape and bytes)."""
    if isinstance(x, np.ndarray):
        return (x.dtype.str, x.shape, hashlib.sha1(np.ascontiguousarray(x).tobytes()).hexdigest())
    if isinstance(x, dict):
        return tuple(sorted((k, fingerprint(v)) for k, v in x.items()))
    if isinstance(x, (list, tuple)):
        return tuple(fingerprint(v) for v in x)
    if isinstance(x, np.generic):
        return x.item()
    return x


def one_pass(df: DataFlow) -> list:
    return [fingerprint(dp) for dp in df]


def same(case: Case, a: list, b: list) -> bool:
    return a == b if case.ordered else Counter(a) == Counter(b)


def workers() -> int:
    """Threads of this process plus its child processes (what a parallel stage starts)."""
    return threading.active_count() + len(psutil.Process().children(recursive=True))


def run(case: Case, d: Data, seed: int = 0, passes: int = 1,
        shard: tuple[int, int] | None = None) -> tuple[list[list], int | None]:
    """Build, (shard,) reset, iterate ``passes`` passes and close: the passes and ``len``
    (None where unknown)."""
    df = case.build(d, seed)
    try:
        if shard is not None:
            df.set_shard(*shard)  # type: ignore[attr-defined]  # a Shardable case
        df.reset_state()
        try:
            n: int | None = len(df)
        except UnknownLength:
            n = None
        return [one_pass(df) for _ in range(passes)], n
    finally:
        df.close()


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_the_dataflow_contract(case: Case, data: Data) -> None:
    """Claim, for every public stage over real data: reset_state and close are idempotent
    (a second reset starts no second set of workers and gives the same pass; close twice,
    or before any reset, is harmless and stops every worker); len is what a pass yields, or
    raises UnknownLength (a TypeError: list() still works) where the stage documents none;
    Shardable sources (and only they) split into shards that are disjoint and cover the
    data; the same seed gives the same output, pass after pass, and for seeded stages
    another seed or another pass gives other output."""
    before = workers()
    (first,), n = run(case, data)
    assert first, "a pass yields something"

    # reset_state, twice: the same pass, the same workers
    df = case.build(data, 0)
    try:
        df.reset_state()
        started = workers()
        df.reset_state()
        assert workers() == started, "a second reset_state started more workers"
        assert same(case, one_pass(df), first), "reset_state twice changed the first pass"
    finally:
        df.close()
        df.close()
    wait_for(lambda: workers() <= before, 10, what="close() to stop the stage's workers")
    never_started = case.build(data, 0)
    never_started.close()
    never_started.close()

    # len, or its documented absence
    if case.length == "known":
        assert n == len(first), f"len {n}, a pass yielded {len(first)}"
    else:
        assert n is None
        df = case.build(data, 0)
        with pytest.raises(TypeError):
            len(df)
        df.reset_state()
        assert same(case, [fingerprint(dp) for dp in list(df)], first), "list() still works"
        df.close()

    # shards: disjoint and covering
    assert isinstance(case.build(data, 0), Shardable) == case.shardable
    if case.shardable:
        whole = Counter(first)
        for count in (2, 3):
            parts = [run(case, data, shard=(i, count)) for i in range(count)]
            got = [Counter(p[0]) for p, _ in parts]
            assert sum(got, Counter()) == whole, f"{count} shards do not cover the data"
            assert all(not (a & b) for i, a in enumerate(got) for b in got[i + 1:]), \
                f"{count} shards overlap"
            assert [k for _, k in parts] == [sum(c.values()) for c in got], "len of a shard"

    # seeds: the same seed, the same output; another seed or pass, another output
    passes, _ = run(case, data, seed=7, passes=2)
    again, _ = run(case, data, seed=7, passes=2)
    assert all(same(case, a, b) for a, b in zip(passes, again, strict=True)), \
        "the same seed gave other output"
    if case.seeded:
        other, _ = run(case, data, seed=8, passes=1)
        assert not same(case, other[0], passes[0]), "the seed changes nothing"
        assert not same(case, passes[1], passes[0]), "every pass is the same"


def test_every_public_stage_has_a_contract_case() -> None:
    """Claim: every DataFlow class in the package's public list (feedline.producer.dataflow,
    and feedline.producer.image, whose presets are map functions, not stages) has a case in
    CASES or is named in NOT_STAGES with the reason; a new public stage fails here until
    it gets one."""
    import feedline.producer.dataflow as dataflow
    import feedline.producer.image as image

    # By the class's own name: an alias (tensorpack's MultiProcessRunnerZMQ) is the class
    # it names, covered by that class's case.
    public = {getattr(module, name).__name__ for module in (dataflow, image)
              for name in module.__all__
              if isinstance(getattr(module, name), type)
              and issubclass(getattr(module, name), DataFlow)}
    covered = {c.stage.__name__ for c in CASES}
    assert public - covered - set(NOT_STAGES) == set(), "public stages without a contract case"
    assert covered <= public, "a case for a stage that is not public"

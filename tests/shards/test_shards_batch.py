"""Odd samples that the shard readers pass and the batch step cannot stack (issue 53, round 2,
finding 4), with real producers and a broker on 127.0.0.1: a ``.cls`` past int64, a
``.json`` member deeper than the wire carries, a Parquet null, a TFRecord label of another
shape than the others. Under ``on_error: skip`` each is one counted record named in the
producer's log (``shard#key`` and why) and every other sample is served; under ``raise`` the
producer stops with one line naming the sample. Before: the producer died at the batch step
(OverflowError, EncodeError, TypeError, "cannot stack") and the trainer got a ProducerError."""

from __future__ import annotations

import tarfile
from pathlib import Path

import numpy as np
import pytest
import yaml

from feedline.consumer import ConsumerOptions, RemoteDataZMQ
from feedline.errors import DataError, ProducerError
from feedline.procs import wait_for
from feedline.producer.dataflow import BatchData, DataFromList
from feedline.producer.exact import build_exact
from feedline.producer.pipeline import build_pipeline
from feedline.producer.shards.manifest import Manifest, ShardInfo
from feedline.producer.shards.tar import write_sample
from feedline.producer.shards.tfrecord import encode_example, frame
from feedline.transport.link import LinkConfig
from tests.support.shard_support import payload

LIVENESS = ("--heartbeat-interval", "0.2", "--heartbeat-timeout", "1.5")
FAST = LinkConfig(heartbeat_interval=0.2, heartbeat_timeout=1.5)
N = 12  # samples per shard; the odd one is ODD
ODD = 5
DEEP = b"[" * 20 + b"]" * 20  # the reader took 64 levels, the wire carries 16 in all


def _wds(path: Path, odd: dict[str, bytes]) -> None:
    with tarfile.open(path, "w") as t:
        for i in range(N):
            fields = {"bin": payload(i, 300), "cls": b"%d" % i, "json": b'{"id": %d}' % i}
            if i == ODD:
                fields.update(odd)
            write_sample(t, f"{i:04d}", fields)


def _tfrecord(path: Path) -> int:
    """N records; record ODD's label is two ints, the others' one. Returns its offset."""
    at = 0
    with open(path, "wb") as f:
        for i in range(N):
            if i == ODD:
                at = f.tell()
            f.write(frame(encode_example({"image/encoded": payload(i, 300),
                                          "image/class/label": [i, i] if i == ODD else i})))
    return at


def _parquet(path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"image": [payload(i, 300) for i in range(N)],
                             "label": [None if i == ODD else i for i in range(N)]}), path,
                   row_group_size=5)


def _pipelines(root: Path, on_error: str) -> dict[str, dict]:
    """stream -> pipeline: each reads one shard with one odd sample."""
    def cfg(stream: str, source: dict, use_list: bool = False) -> dict:
        return {"stream": stream, "epochs": 1, "on_error": on_error, "source": source,
                "steps": [{"batch": {"batch_size": 4, "remainder": True,
                                     "use_list": use_list}}]}
    return {
        "cls": cfg("cls", {"webdataset": {"urls": str(root / "cls.tar"),
                                          "fields": ["bin", "cls"]}}),
        "json": cfg("json", {"webdataset": {"urls": str(root / "json.tar"),
                                            "fields": ["json", "cls"]}}, use_list=True),
        "tfrecord": cfg("tfrecord", {"tfrecord": {"urls": str(root / "t.tfrecord")}}),
        "parquet": cfg("parquet", {"parquet": {"urls": str(root / "p.parquet")}}),
    }


def _shards(root: Path) -> int:
    root.mkdir()
    _wds(root / "cls.tar", {"cls": b"%d" % 2**70})
    _wds(root / "json.tar", {"json": DEEP})
    _parquet(root / "p.parquet")
    return _tfrecord(root / "t.tfrecord")


def _labels(batch) -> list[int]:
    return [int(x) for x in np.asarray(batch[1])]


def test_each_odd_sample_is_named_skipped_and_the_others_served(broker_proc, daemons,
                                                                endpoints, tmp_path):
    at = _shards(tmp_path / "d")
    root = tmp_path / "d"
    broker_proc()
    producers = {}
    for stream, cfg in _pipelines(root, "skip").items():
        path = tmp_path / f"{stream}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        producers[stream] = daemons("feedline.producer", "--config", path, "--broker",
                                    endpoints.ingress, "--id", stream, *LIVENESS, name=stream)
    want = sorted(set(range(N)) - {ODD})
    for stream in producers:
        got: list[int] = []
        with RemoteDataZMQ(endpoints.egress, stream=stream, timeout=30,
                           options=ConsumerOptions(link=FAST)) as src:
            for batch in src:
                got += _labels(batch)
                if len(got) >= len(want):
                    break
        assert sorted(got) == want, stream
    for p in producers.values():
        wait_for(lambda p=p: not p.alive(), 30, what="the producers to end their epoch")
    logs = {s: p.log_text() for s, p in producers.items()}
    assert all("Traceback" not in text for text in logs.values()), logs
    # the readers: corrupt records, named shard#key.ext, with why
    assert f"corrupt record {root}/cls.tar#{ODD:04d}.cls: field cls: {2**70} does not fit " \
           "int64" in logs["cls"], logs["cls"]
    assert f"corrupt record {root}/json.tar#{ODD:04d}.json: JSON nested deeper than " \
           "14 levels" in logs["json"], logs["json"]
    # the batch step: skipped datapoints, named shard#place, with why
    assert f"skipped a datapoint: sample {root}/t.tfrecord#{at} component 1 is an int64 " \
           "array of shape (2,) where the others in its batch have an int" \
           in logs["tfrecord"], logs["tfrecord"]
    assert f"skipped a datapoint: sample {root}/p.parquet#1:0 component 1 is None (a " \
           "missing value) where the others in its batch have an int" \
           in logs["parquet"], logs["parquet"]


def test_under_raise_the_producer_stops_with_one_line_naming_the_sample(
        broker_proc, daemons, endpoints, tmp_path):
    at = _shards(tmp_path / "d")
    root = tmp_path / "d"
    broker_proc()
    cfg = _pipelines(root, "raise")["tfrecord"]
    path = tmp_path / "raise.yaml"
    path.write_text(yaml.safe_dump(cfg))
    p = daemons("feedline.producer", "--config", path, "--broker", endpoints.ingress,
                "--id", "p", *LIVENESS, name="p")
    with RemoteDataZMQ(endpoints.egress, stream="tfrecord", timeout=30,
                       options=ConsumerOptions(link=FAST)) as src, \
            pytest.raises(ProducerError) as err:
        for _ in src:
            pass
    wait_for(lambda: not p.alive(), 30, what="the producer to stop")
    assert p.proc.returncode != 0
    last = p.log_text().strip().splitlines()[-1]
    assert "Traceback" not in p.log_text(), p.log_text()
    assert last.startswith("feedline producer p: BatchData: sample ") and \
        f"{root}/t.tfrecord#{at} component 1 is an int64 array of shape (2,)" in last and \
        "on_error: skip" in last, last
    assert f"t.tfrecord#{at}" in str(err.value)


def test_batch_data_fills_the_batch_again_and_counts_what_it_skipped():
    """In-process, the rules: the odd one (the minority kind, an int past int64, a datapoint
    of another structure) is skipped and the batch filled from the next ones; a component on
    which no kind holds half of a batch is ragged: a DataError saying use_list, skip or not."""
    from feedline.producer.dataflow.base import Named

    dps = [Named([np.zeros(3), i], f"s#{i}") for i in range(8)]
    dps[2] = Named([np.zeros(4), 2], "s#2")  # another shape
    dps[5] = Named([np.zeros(3), 2**64], "s#5")  # past int64
    dps[6] = Named([np.zeros(3)], "s#6")  # a component missing
    b = BatchData(DataFromList(dps, shuffle=False), 2, remainder=True, on_error="skip")
    out = list(b)
    assert [_labels(x) for x in out] == [[0, 1], [3, 4], [7]] and b.skipped == 3
    with pytest.raises(DataError, match=r"sample s#2 component 0 is a float64 array of shape "
                                        r"\(4,\) where the others in its batch have a float64 "
                                        r"array of shape \(3,\)"):
        list(BatchData(DataFromList(dps, shuffle=False), 4))
    ragged = DataFromList([[np.zeros(i + 1)] for i in range(4)], shuffle=False)
    with pytest.raises(DataError, match="use_list"):
        list(BatchData(ragged, 4, on_error="skip"))
    # dicts agree whatever the order of their keys; one without a key is the odd one
    d = BatchData(DataFromList([{"a": 1, "b": 2}, {"b": 3, "a": 4}, {"a": 5}], shuffle=False),
                  3, remainder=True, on_error="skip")
    assert [{k: v.tolist() for k, v in x.items()} for x in d] == [{"a": [1, 4], "b": [2, 3]}]
    assert d.skipped == 1
    # a tie (one of each in a batch of two) goes to the kind of the batch before
    tie = DataFromList([[1], [2], [3], [None]], shuffle=False)
    t = BatchData(tie, 2, on_error="skip", remainder=True)
    assert [x[0].tolist() for x in t] == [[1, 2], [3]] and t.skipped == 1


def test_a_map_step_keeps_the_samples_name_and_the_pipeline_counts_the_skip(tmp_path: Path):
    """The name survives a map step on a component, in worker processes too (pickled), so
    that the batch step after it names the sample where it was read."""
    from feedline.producer.dataflow.base import Named
    from feedline.producer.dataflow.map_data import ComponentFunc

    at = _tfrecord(tmp_path / "t.tfrecord")
    named = ComponentFunc(first_byte, 0)(Named([np.zeros(2), 1], "t#1"))
    assert isinstance(named, Named) and named.where == "t#1"
    cfg = {"on_error": "skip", "source": {"tfrecord": {"urls": str(tmp_path / "t.tfrecord")}},
           "parallel": {"mode": "process", "workers": 2, "strict": True},
           "steps": [{"map": {"function": "tests.shards.test_shards_batch:first_byte"}},
                     {"batch": {"batch_size": 4, "remainder": True}}]}
    with build_pipeline(cfg) as df:
        df.reset_state()
        labels = sorted(i for b in df for i in _labels(b))
    assert labels == sorted(set(range(N)) - {ODD})
    assert df.skipped == 1 and isinstance(df.ds, BatchData)  # type: ignore[attr-defined]
    with pytest.raises(DataError, match=f"sample {tmp_path}/t.tfrecord#{at} component 1"):
        with build_pipeline({**cfg, "on_error": "raise"}) as df:
            df.reset_state()
            list(df)


def first_byte(x):
    """A map function on component 0 (image bytes -> their first byte, as an array)."""
    return np.asarray(x[:1])


def test_exact_delivery_leaves_an_odd_sample_out_of_its_batch_or_names_it(tmp_path: Path):
    """The same under delivery: exact (no tie-break by an earlier batch there: a unit's
    batches are a function of the unit alone)."""
    at = _tfrecord(tmp_path / "t.tfrecord")
    (tmp_path / "m.json").write_text(Manifest("tfrecord", [ShardInfo("t.tfrecord", N)]).to_json())
    cfg = {"delivery": "exact", "on_error": "skip", "exact": {"unit_size": 6},
           "source": {"tfrecord": {"manifest": str(tmp_path / "m.json")}},
           "steps": [{"batch": {"batch_size": 3}}]}
    pipe = build_exact(cfg)
    got = sorted(i for u in range(2) for _, b in pipe.batches(0, u) if b is not None
                 for i in _labels(b))
    assert got == sorted(set(range(N)) - {ODD}) and pipe.skipped == 1
    pipe = build_exact({**cfg, "on_error": "raise"})
    with pytest.raises(DataError, match=f"sample {tmp_path}/t.tfrecord#{at} component 1"):
        for u in range(2):
            list(pipe.batches(0, u))


def test_a_tie_with_no_earlier_batch_says_why_it_cannot_choose() -> None:
    """The attack review: an exact producer with ``batch_size: 2`` and one sample a byte
    longer stopped with "cannot stack ... use use_list=True for ragged data", though the data
    is not ragged. The error now says it is a tie and what to do."""
    from feedline.errors import DataError
    from feedline.producer.dataflow.batch_data import odd_samples

    with pytest.raises(DataError, match="half of its 2 values are .* no earlier batch says"):
        odd_samples([[np.zeros(4, np.uint8)], [np.zeros(5, np.uint8)]], None)


def test_a_batch_the_wire_cannot_carry_is_skipped_under_skip(broker_proc, daemons, endpoints,
                                                              tmp_path):
    """The attack review: one 80 KB ``.json`` caption among 24 samples, batched with
    ``use_list: true`` as the docs say for JSON: the batch's header is over the wire's 64 KiB
    and the producer stopped (``EncodeError``), the trainer got ``ProducerError``. Under
    ``on_error: skip`` the batch is skipped, named and counted; the others are served."""
    shard = tmp_path / "s.tar"
    with tarfile.open(shard, "w") as t:
        for i in range(24):
            caption = "x" * (80_000 if i == 7 else 20)
            write_sample(t, f"{i:04d}", {"json": b'{"c": "%s"}' % caption.encode(),
                                         "cls": b"%d" % i})
    cfg = tmp_path / "p.yaml"
    cfg.write_text(yaml.safe_dump({
        "source": {"webdataset": {"urls": str(shard), "fields": ["json", "cls"]}},
        "on_error": "skip", "epochs": 1,
        "steps": [{"batch": {"batch_size": 4, "use_list": True}}]}))
    broker_proc()
    p = daemons("feedline.producer", "--config", cfg, "--broker", endpoints.ingress,
                *LIVENESS, name="p")
    labels: list[int] = []
    with RemoteDataZMQ(endpoints.egress, timeout=30, options=ConsumerOptions(link=FAST)) as src:
        for batch in src:
            labels += [int(x) for x in batch[1]]
            if len(labels) >= 20:
                break
    wait_for(lambda: not p.alive(), 30, what="the producer to end its epoch")
    assert p.proc.returncode == 0, p.log_text()[-3000:]
    assert sorted(labels) == sorted(set(range(24)) - {4, 5, 6, 7}), labels
    text = p.log_text()
    assert "which the wire cannot carry" in text and "1 skipped that the wire cannot carry" \
        in text, text[-3000:]


def test_a_list_of_another_length_is_an_odd_sample() -> None:
    """The attack review: JSON boxes of 4 numbers, one of 5, without ``use_list``, under
    ``on_error: skip``: the batch step stopped the producer ("cannot stack ...
    inhomogeneous shape"), every list being of one kind whatever its length. The one of
    another length is now the odd sample, skipped and named."""
    from feedline.producer.dataflow.batch_data import odd_samples

    boxes = [[[1.0, 2.0, 3.0, 4.0]] for _ in range(4)]
    boxes[2] = [[1.0, 2.0, 3.0, 4.0, 5.0]]
    odd = odd_samples(boxes, {})
    assert [i for i, _ in odd] == [2]
    assert "a list of 5 values where the others in its batch have a list of 4" in odd[0][1]


def test_a_sample_odd_on_one_component_does_not_decide_another() -> None:
    """The shard fuzzer's finding (CI, stop 60): three TFRecord samples, the third odd on
    component 0, the second on component 1. Setting the third aside first left a tie of
    one int and one array on component 1, and the batch step stopped the producer though
    each component had a majority. Each component's kind is now the majority's over every
    well-structured sample: the second and the third are skipped, each named for its own
    component, and the first is served."""
    from feedline.producer.dataflow.batch_data import odd_samples

    dps = [[b"a", 1], [b"b", np.zeros(2, np.int64)], [1.5, 2]]
    odd = odd_samples(dps, {})
    assert [i for i, _ in odd] == [1, 2]
    assert "component 1 is an int64 array of shape (2,)" in odd[0][1]
    assert "component 0 is a float" in odd[1][1]
    b = BatchData(DataFromList(dps, shuffle=False), 3, remainder=True, on_error="skip")
    batches = list(b)
    assert b.skipped == 2 and [list(x[1]) for x in batches] == [[1]]


def test_a_source_of_plain_numbers_batches_into_one_component() -> None:
    """The new-user review: ``items: [1, 2, 3, 4]`` (no list per sample) stopped the
    producer with a raw TypeError ("object of type 'int' has no len()"). A datapoint that
    is neither a list nor a dict is one component; an odd one is skipped and named."""
    batches = list(BatchData(DataFromList([1, 2, 3, 4], shuffle=False), 2))
    assert [b[0].tolist() for b in batches] == [[1, 2], [3, 4]]
    b = BatchData(DataFromList([np.zeros(2), np.zeros(3), np.ones(2)], shuffle=False), 3,
                  remainder=True, on_error="skip")
    assert [x[0].tolist() for x in b] == [[[0.0, 0.0], [1.0, 1.0]]] and b.skipped == 1
    assert BatchData.aggregate([5, 6])[0].tolist() == [5, 6]

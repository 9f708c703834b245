"""An exact stream whose pipeline was replaced while a trainer of the old one was still
connected (the attack review of issue 53): the old dataset's batches and the new one's have
keys of the same shape, (epoch, unit, index).

- Before: a batch of the new pipeline delivered to the old trainer was counted taken before
  the trainer raised "its producers were replaced", so the broker settled it and the new
  job's epoch ended without it (104 of 128 samples, 3 of 3); and the old trainer's unsettled
  batches, served again, reached the new job's trainer as the new dataset's (4 old samples,
  then the same error, 2 of 4).
- Now: the old trainer raises before the batch counts (served again, to the new job, once it
  closes), and a batch of a pipeline the coordinator does not serve is never servable.
"""

from __future__ import annotations

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from feedline.consumer.io import Delivery, Shared
from feedline.errors import FeedlineError
from feedline.exact.coordinator import Coordinator, ExactPlan
from feedline.protocol import wire

OLD, NEW = 0x0DD, 0x0E3


def batch(pipeline: int, unit: int, index: int) -> wire.Batch:
    return wire.Batch(producer="p", session=1, seq=index, epoch=0,
                      datapoint=[np.zeros(2, np.uint8)], nbytes=2, wire_bytes=64, unit=unit,
                      index=index, pipeline=pipeline)


def test_the_old_trainer_raises_before_a_new_pipelines_batch_counts_as_taken() -> None:
    shared = Shared("c", 1, 8, 1 << 30, "val", "raise", CollectorRegistry(), slots=64)
    shared.io.registration = 1
    assert shared.took(Delivery(1, batch(OLD, 0, 0), 64))
    assert shared.model.taken == 1
    with pytest.raises(FeedlineError, match="now serves another pipeline"):
        shared.took(Delivery(1, batch(NEW, 0, 1), 64))
    # Not reported taken: the broker serves it again to a consumer of the new pipeline.
    assert shared.model.taken == 1
    assert not shared.exact.seen(0, 0, 1)


def test_a_batch_of_a_replaced_pipeline_is_not_servable() -> None:
    c = Coordinator("val", ExactPlan(dataset_size=8, unit_size=4, epochs=1, fingerprint=NEW))
    assert c.servable((0, 0, 0), NEW) and c.servable((0, 0, 0))  # 0: not said, as before
    assert not c.servable((0, 0, 0), OLD)
    assert c.of_plan(NEW) and c.of_plan(0) and not c.of_plan(OLD)


def test_the_fingerprint_follows_the_dataset_not_only_its_length(tmp_path) -> None:
    """The new-user review: a list source with other items of the same count, an image
    folder with a file renamed, a sharded source with another shard had the fingerprint of
    the old dataset, so a cursor of the old one resumed the new one without a word. Each
    source now says which dataset it is (``identity()``), and the fingerprint holds it."""
    from feedline.producer.dataflow import DataFromList, ImageFolder
    from feedline.producer.exact import ExactPipeline

    def fp(source) -> int:
        return ExactPipeline(source, [], 1).fingerprint

    assert fp(DataFromList([[1], [2]])) == fp(DataFromList([[1], [2]]))
    assert fp(DataFromList([[1], [2]])) != fp(DataFromList([[1], [3]]))
    assert fp(DataFromList([[np.zeros(2)]])) != fp(DataFromList([[np.ones(2)]]))
    for cls in ("a", "b"):
        (tmp_path / "imgs" / cls).mkdir(parents=True)
        (tmp_path / "imgs" / cls / "x.jpg").write_bytes(b"\xff\xd8")
    before = fp(ImageFolder(tmp_path / "imgs"))
    (tmp_path / "imgs" / "b" / "x.jpg").rename(tmp_path / "imgs" / "b" / "y.jpg")
    assert fp(ImageFolder(tmp_path / "imgs")) != before
    # Where the folder is mounted does not matter: names are relative to the root.
    (tmp_path / "imgs").rename(tmp_path / "moved")
    (tmp_path / "moved" / "b" / "y.jpg").rename(tmp_path / "moved" / "b" / "x.jpg")
    assert fp(ImageFolder(tmp_path / "moved")) == before

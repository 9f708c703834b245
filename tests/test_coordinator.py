"""Exact delivery's coordinator and cursor on their own (no sockets): units, de-duplication,
settlement, epochs, producers lost mid-unit, the journal across a restart, and resuming from
a checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest

from feedline.codec import DecodeError
from feedline.cursor import Cursor
from feedline.serving.coordinator import Assignment, Coordinator, ExactPlan
from feedline.serving.exact_streams import ExactConfig, ExactStreams, Refusal
from feedline.serving.journal import Journal

PLAN = ExactPlan(dataset_size=10, unit_size=4, epochs=2)  # units 0 1 2: 4, 4, 2 samples


def run_unit(c: Coordinator, owner: bytes, batches: int, settle: bool = True) -> Assignment:
    a = c.request(owner)
    assert isinstance(a, Assignment), a
    for i in range(a.start, batches):
        assert c.accept((a.epoch, a.unit, i))
    c.unit_done(owner, a.epoch, a.unit, batches)
    if settle:
        for i in range(batches):
            c.settle((a.epoch, a.unit, i))
    return a


def restart(path: Path) -> Coordinator:
    """The coordinator a restarted broker makes from the journal at ``path``."""
    return Coordinator("val", PLAN, Journal(path), Journal(path).read("val"))


def test_units_are_handed_out_once_and_an_epoch_ends_when_every_batch_is_taken():
    c = Coordinator("val", PLAN)
    assert [run_unit(c, b"p", 2, settle=False).unit for _ in range(3)] == [0, 1, 2]
    assert c.request(b"q") == "busy", "every unit is out; the epoch is not over"
    ended = []
    for u in range(3):
        for i in range(2):
            ended += c.settle((0, u, i))
    assert ended == [0] and c.epoch == 1
    for _ in range(3):
        run_unit(c, b"p", 2)
    assert c.finished and c.request(b"p") == "finished"


def test_duplicates_and_stale_batches_are_dropped():
    c = Coordinator("val", PLAN)
    a = c.request(b"p")
    assert isinstance(a, Assignment)
    assert c.accept((0, a.unit, 0)) and not c.accept((0, a.unit, 0))
    assert not c.accept((1, a.unit, 1)), "another epoch"
    assert not c.accept((0, 99, 0)), "no such unit"
    assert c.duplicates == 3


def test_a_lost_producer_s_unit_goes_to_another_from_the_first_missing_batch():
    c = Coordinator("val", PLAN)
    a = c.request(b"dead")
    assert isinstance(a, Assignment)
    for i in (0, 1):  # it got two batches here before it died
        c.accept((0, a.unit, i))
    c.release(b"dead")
    b = c.request(b"alive")
    assert isinstance(b, Assignment) and (b.unit, b.start) == (a.unit, 2)
    # The dead producer comes back and sends batch 1 again: dropped; batch 2 twice: once.
    assert not c.accept((0, a.unit, 1))
    assert c.accept((0, a.unit, 2)) and not c.accept((0, a.unit, 2))


def test_a_unit_whose_batches_did_not_all_arrive_is_produced_again():
    c = Coordinator("val", PLAN)
    a = c.request(b"p")
    assert isinstance(a, Assignment)
    c.accept((0, a.unit, 0))
    c.accept((0, a.unit, 2))  # batch 1 was lost on the way (a reconnect dropped it)
    c.unit_done(b"p", 0, a.unit, 3)
    again = c.request(b"q")
    assert isinstance(again, Assignment) and (again.unit, again.start) == (a.unit, 1)


def test_empty_batches_count_as_taken():
    c = Coordinator("val", ExactPlan(4, 4, 1))
    a = c.request(b"p")
    assert isinstance(a, Assignment)
    c.accept((0, 0, 0))
    c.unit_done(b"p", 0, 0, 2, empty=[1])  # every sample of batch 1 was corrupt
    assert c.settle((0, 0, 0)) == [0] and c.finished


def test_the_journal_brings_a_restarted_broker_back_to_where_it_was(tmp_path: Path):
    path = tmp_path / "val.exact.jsonl"
    c = Coordinator("val", PLAN, Journal(path))
    run_unit(c, b"p", 2)  # unit 0 done
    a = c.request(b"p")
    assert isinstance(a, Assignment)
    c.accept((0, a.unit, 0))
    c.settle((0, a.unit, 0))
    c.commit()
    again = restart(path)  # the broker restarted
    assert again.epoch == 0 and set(again.done) == {0}
    b = again.request(b"q")
    assert isinstance(b, Assignment) and (b.unit, b.start) == (a.unit, 1)
    # A torn last line (the broker died while writing) is ignored, what came before stands.
    with open(path, "a") as f:
        f.write('0badf00d {"settled": [1, [')
    assert set(restart(path).done) == {0}


def test_a_journal_of_another_plan_is_not_applied(tmp_path: Path):
    streams = ExactStreams(ExactConfig(tmp_path))
    c = streams.join("val", PLAN, 0.0)
    assert isinstance(c, Coordinator)
    run_unit(c, b"p", 2)
    c.commit()
    other = ExactStreams(ExactConfig(tmp_path)).join("val", ExactPlan(100, 4, 2), 0.0)
    assert isinstance(other, Coordinator) and other.done == {}


def test_consumers_reports_restore_what_the_journal_had_not_written_yet():
    c = Coordinator("val", PLAN)  # no journal: everything of the epoch was lost
    report = Cursor.of("val", 0, {0: {0, 1}, 1: {0}})
    c.journal = Journal(Path("/nonexistent/val.exact.jsonl"))  # as restored from one
    assert c.merge(report) == ([], False)
    c.journal = None
    a = c.request(b"p")
    assert isinstance(a, Assignment) and (a.unit, a.start) == (0, 2)


def test_resuming_from_a_checkpoint_sets_the_epoch_to_it():
    c = Coordinator("val", PLAN)
    for _ in range(3):
        run_unit(c, b"p", 2, settle=False)
    for key in [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)]:
        c.settle(key)  # the job took these, but its checkpoint has only unit 0
    ckpt = Cursor.of("val", 0, {0: {0, 1}})
    assert c.resume(ckpt) == (False, [])
    a = c.request(b"p")
    assert isinstance(a, Assignment) and (a.unit, a.start) == (1, 0), "unit 1 again"
    c.accept((0, 1, 0))
    c.settle((0, 1, 0))
    c.resume(ckpt)  # the job crashed again and resumes from the same checkpoint
    assert c.units[1].settled == 0, "what was taken after the checkpoint is served again"


def test_exact_streams_refuse_a_second_plan_and_keep_early_cursors():
    streams = ExactStreams()
    early = Cursor.of("val", 0, {0: {0}})
    early.resume = True
    assert streams.cursor(b"c1", "val", early.encode(), 0.0) is None  # no producer: kept
    c = streams.join("val", PLAN, 0.0)
    assert isinstance(c, Coordinator) and c.units[0].settled == 1
    streams.attach("val", exact=True)
    assert isinstance(streams.join("val", ExactPlan(11, 4), 0.0), Refusal)


def test_a_cursor_survives_bytes_and_dicts_and_refuses_garbage():
    c = Cursor.of("val", 3, {0: {0, 5, 9}, 7: set(range(100))}, pipeline=77)
    c.resume = True
    back = Cursor.decode(c.encode())
    assert (back.stream, back.epoch, back.taken, back.pipeline, back.resume) == \
        (c.stream, c.epoch, c.taken, 77, True)
    assert Cursor.from_dict(c.to_dict()).taken == c.taken
    merged = Cursor.merge([Cursor.of("val", 3, {0: {1}}), back, Cursor.of("val", 2, {9: {9}})])
    assert merged.taken[0] == {0, 1, 5, 9} and 9 not in merged.taken
    for bad in (b"", b"XXXX" + c.encode()[4:], c.encode() + b"x", c.encode()[:-1],
                b"FLC2" + b"\0" * 9 + b"\xff\xff\xff\xff"):
        with pytest.raises(DecodeError):
            Cursor.decode(bad)

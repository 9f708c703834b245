"""Exact delivery's coordinator, journal and cursor on their own (no sockets): units,
de-duplication, settlement, epochs and runs, producers lost mid-unit, the journal across a
restart (a torn record, a corrupt one, a disk that fails), and cursors (compact, canonical,
tied to their pipeline)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from feedline.errors import ConfigError, DecodeError
from feedline.exact.coordinator import Assignment, Coordinator, ExactPlan
from feedline.exact.cursor import MAX_CURSOR_BYTES, Cursor
from feedline.exact.journal import Journal, JournalCorrupt, JournalStale

PLAN = ExactPlan(dataset_size=10, unit_size=4, epochs=2, fingerprint=7)  # units 0 1 2: 4 4 2


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


def restart(path: Path, plan: ExactPlan = PLAN, now: float = 0.0) -> Coordinator:
    """The coordinator a restarted broker makes from the journal at ``path``."""
    return Coordinator("val", plan, Journal(path), Journal(path).read("val"), 5.0, now)


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


def test_a_producer_started_after_the_run_starts_the_next_one():
    """A second job: its producer was never given a unit; the one that served the run was."""
    c = Coordinator("val", ExactPlan(4, 4, 1, 7))
    run_unit(c, b"old", 1)
    assert c.finished and c.request(b"old") == "finished"
    a = c.request(b"new", first=True)
    assert isinstance(a, Assignment) and a.epoch == 1 and not c.finished
    assert c.complete(0) and not c.complete(1)


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


def test_settled_batches_are_not_servable():
    c = Coordinator("val", PLAN)
    run_unit(c, b"p", 2, settle=False)
    c.settle((0, 0, 0))
    assert not c.servable((0, 0, 0)) and c.servable((0, 0, 1))
    assert not c.servable((1, 0, 1)), "another epoch"


# -- the journal -------------------------------------------------------------------------

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
    b = again.request(b"q", now=10.0)
    assert isinstance(b, Assignment) and (b.unit, b.start) == (a.unit, 1)


def test_a_restart_at_the_start_of_an_epoch_waits_for_the_reports(tmp_path: Path):
    """Finding 10: the journal holds only the new epoch's first records; consumers may have
    taken batches of it since. The restarted coordinator waits for their reports all the
    same (it skipped that wait when its journal held two records)."""
    path = tmp_path / "val.exact.jsonl"
    c = Coordinator("val", PLAN, Journal(path))
    for _ in range(3):
        run_unit(c, b"p", 2)
    assert c.epoch == 1 and len(Journal(path).read("val")) <= 3
    again = restart(path, now=100.0)
    assert again.recovering(102.0) and again.request(b"q", 102.0) == "busy"
    assert not again.recovering(106.0)


def test_a_torn_last_record_is_left_out_and_its_unit_is_done_by_its_batches(tmp_path: Path):
    """Finding 13: the broker died writing the record that marks a unit done; the unit's
    batches are all settled in the journal. It is done after the restart (it never was), and
    the cut-short line is gone from the file (the next record starts a line of its own)."""
    path = tmp_path / "val.exact.jsonl"
    c = Coordinator("val", PLAN, Journal(path))
    run_unit(c, b"p", 2)
    data = path.read_bytes()
    assert data.rstrip().endswith(b'{"done":[0,2]}')
    path.write_bytes(data[:-8])  # the last write cut short
    again = restart(path, now=-10.0)  # its recovery wait is over at 0
    assert set(again.done) == {0} and path.read_bytes().endswith(b"\n")
    run_unit(again, b"q", 2)
    assert set(again.done) == {0, 1}


def test_a_corrupt_record_is_one_line_naming_the_file(tmp_path: Path):
    """Finding 12: one byte of a record in the middle is wrong (not UTF-8, or a digit that
    still parses): refused by its checksum, in one line naming the file and what to do."""
    path = tmp_path / "val.exact.jsonl"
    c = Coordinator("val", PLAN, Journal(path))
    run_unit(c, b"p", 2)
    run_unit(c, b"p", 2)
    good = path.read_bytes()
    at = good.index(b'{"settled":[0,[[0,') + 18  # the run's length: 2
    for bad in (0xFF, ord("9")):
        path.write_bytes(good[:at] + bytes([bad]) + good[at + 1:])
        with pytest.raises(JournalCorrupt, match=str(path)) as e:
            Journal(path).read("val")
        assert "delete" in str(e.value) and "\n" not in str(e.value)


def test_records_written_before_checksums_are_read(tmp_path: Path):
    path = tmp_path / "val.exact.jsonl"
    path.write_text('{"plan":[10,4,2]}\n{"epoch":0}\n{"done":[0,2]}\n{"settled":[1,[0]]}\n')
    again = restart(path)
    assert set(again.done) == {0} and again.units[1].settled == 1


def test_a_journal_that_cannot_be_written_is_marked_stale_until_it_can(tmp_path: Path):
    """Finding 11's mechanism: a write fails (here the directory is a file), delivery goes
    on, the journal says why and a restart would be refused; once it can be written again, it
    is written whole and the mark goes."""
    state = tmp_path / "state"
    state.mkdir()
    path = state / "val.exact.jsonl"
    c = Coordinator("val", PLAN, Journal(path))
    run_unit(c, b"p", 2)
    path.unlink()
    state.rmdir()
    state.write_text("not a directory")  # every write fails now
    a = c.request(b"p")
    assert isinstance(a, Assignment)
    c.accept((0, a.unit, 0))
    c.settle((0, a.unit, 0))
    c.commit(1.0)
    assert c.journal is not None and c.journal.error is not None
    assert str(state) in c.journal.error
    state.unlink()
    state.mkdir()
    (state / "val.exact.jsonl.stale").touch()  # as the failed write left it
    with pytest.raises(JournalStale, match="rename it"):
        Journal(path).read("val")
    c.commit(100.0)  # the next attempt: written whole
    assert c.journal.error is None and not (state / "val.exact.jsonl.stale").exists()
    assert restart(path).units[a.unit].settled == 1


# -- what consumers say ----------------------------------------------------------------

def test_a_report_restores_what_the_journal_had_not_written_yet(tmp_path: Path):
    c = restart(tmp_path / "val.exact.jsonl")  # a journal that lost the epoch's last moments
    ended, lost = c.merge(Cursor.of("val", 0, {0: {0, 1}, 1: {0}}))
    assert (ended, lost) == ([], False)
    a = c.request(b"p", now=10.0)
    assert isinstance(a, Assignment) and (a.unit, a.start) == (0, 2)


def test_without_a_journal_a_report_of_batches_never_served_is_a_lost_position():
    c = Coordinator("val", PLAN)  # --exact-ephemeral, restarted: it knows nothing
    assert c.merge(Cursor.of("val", 0, {0: {0}}))[1]
    assert c.merge(Cursor.of("val", 3))[1], "a later epoch than this broker's"


def test_resuming_from_a_checkpoint_sets_the_epoch_to_it_every_time():
    c = Coordinator("val", PLAN)
    for _ in range(3):
        run_unit(c, b"p", 2, settle=False)
    for key in [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)]:
        c.settle(key)  # the job took these, but its checkpoint has only unit 0
    ckpt = Cursor.of("val", 0, {0: {0, 1}}, pipeline=7)
    assert c.resume(ckpt) == (False, [])
    a = c.request(b"p")
    assert isinstance(a, Assignment) and (a.unit, a.start) == (1, 0), "unit 1 again"
    c.accept((0, 1, 0))
    c.settle((0, 1, 0))
    c.resume(ckpt)  # the job crashed again and resumes from the same checkpoint
    assert c.units[1].settled == 0, "what was taken after the checkpoint is served again"


# -- cursors ---------------------------------------------------------------------------

def test_a_cursor_survives_bytes_and_dicts_and_refuses_garbage():
    c = Cursor.of("val", 3, {0: {0, 5, 9}, 7: set(range(100))}, pipeline=77)
    c.resume = True
    back = Cursor.decode(c.encode())
    assert (back.stream, back.epoch, back.taken, back.pipeline, back.resume) == \
        (c.stream, c.epoch, c.taken, 77, True)
    assert Cursor.from_dict(c.to_dict()).taken == c.taken
    assert Cursor.from_dict({"stream": "val", "epoch": 3, "taken": {"7": [1, 2]}}).taken == \
        {7: {1, 2}}, "lists of indices, as to_dict wrote them before"
    for bad in (b"", b"XXXX" + c.encode()[4:], c.encode() + b"x", c.encode()[:-1],
                b"FLC2" + b"\0" * 9 + b"\xff\xff\xff\xff"):
        with pytest.raises(DecodeError):
            Cursor.decode(bad)
    with pytest.raises(DecodeError, match="units beyond"):
        Cursor.decode(c.encode(), max_units=5)
    with pytest.raises(ConfigError):
        Cursor.from_dict({"stream": "val", "epoch": 0, "taken": {"0": [[0, 1 << 30]]}})


def test_merging_is_the_same_in_any_order_and_names_the_same_request():
    """Every rank merges the ranks' cursors itself: the same cursor, the same ident."""
    parts = [Cursor.of("val", 3, {0: {1}}, pipeline=9), Cursor.of("val", 3, {0: {0, 5}}),
             Cursor.of("val", 2, {9: {9}}, pipeline=9)]
    a, b = Cursor.merge(parts), Cursor.merge(parts[::-1])
    assert a.taken == {0: {0, 1, 5}} and a.pipeline == 9 and a.ident() == b.ident()
    assert Cursor.from_dict(a.to_dict()).ident() == a.ident()
    with pytest.raises(ConfigError, match="different pipelines"):
        Cursor.merge([parts[0], Cursor.of("val", 3, {0: {2}}, pipeline=8)])


def test_a_merged_cursor_is_small_whatever_the_dataset():
    """Whole units up to where the epoch is, and a few in progress: a few bytes per unit in
    progress, for an epoch of a million batches as for one of ten."""
    big = Cursor("val", 0, {u: (1 << 1024) - 1 for u in range(1000)}, pipeline=1)
    rng = random.Random(0)
    for u in (1000, 1001, 1002):
        big.bits[u] = rng.getrandbits(1024)
    assert big.count() > 1_000_000 and len(big.encode()) < 500
    scattered = Cursor("val", 0, {u: rng.getrandbits(1024) for u in range(600)})
    assert len(scattered.encode()) > MAX_CURSOR_BYTES  # one rank's of many: merge first


@given(st.dictionaries(st.integers(0, 300), st.integers(1, (1 << 200) - 1), max_size=40),
       st.integers(0, 1 << 40), st.integers(0, (1 << 63) - 1))
@settings(max_examples=200, deadline=None)
def test_cursor_bytes_round_trip(bits: dict[int, int], epoch: int, pipeline: int) -> None:
    c = Cursor("val", epoch, dict(bits), pipeline)
    back = Cursor.decode(c.encode())
    assert (back.bits, back.epoch, back.pipeline) == (c.bits, epoch, pipeline)
    assert back.ident() == c.ident() and Cursor.from_dict(c.to_dict()).ident() == c.ident()


@given(st.data())
@settings(max_examples=300, deadline=None)
def test_a_cursor_from_the_network_decodes_or_is_refused(data: st.DataObject) -> None:
    """A consumer's HELLO carries a cursor: whatever its bytes, the decoder gives a cursor
    within its bounds or raises DecodeError, nothing else."""
    good = Cursor("val", 2, {0: 0b1011, 5: 1 << 70, 6: 1 << 70}, 9).encode()
    raw = data.draw(st.one_of(
        st.binary(max_size=200),
        st.builds(lambda i, b: good[:i] + bytes([b]) + good[i + 1:],
                  st.integers(0, len(good) - 1), st.integers(0, 255)),
        st.builds(lambda i: good[:i], st.integers(0, len(good)))))
    try:
        got = Cursor.decode(raw, max_units=64)
    except DecodeError:
        return
    assert all(0 <= u < 64 and b > 0 for u, b in got.bits.items())


def test_a_cursor_of_few_bytes_cannot_decode_to_gigabytes():
    """Runs are a few bytes each for up to a million bits: 12,000 groups of one full-length
    run are refused before they are made (they would take 1.5 GB)."""
    from feedline.exact.cursor import _varint

    body = [b"FLC2", b"\0", b"\0" * 8, _varint(0), _varint(3), b"val", _varint(12000)]
    body += [_varint(0) + _varint(1) + b"\0" + _varint(1) + _varint(0) + _varint((1 << 20) - 1)
             for _ in range(12000)]
    with pytest.raises(DecodeError, match="more than a cursor may hold"):
        Cursor.decode(b"".join(body))


def test_a_consumer_s_report_fits_a_registration_whatever_it_took():
    """What a consumer reports when it registers again is the batches it took last, as many
    as a registration carries (the oldest go first: a journal has those)."""
    from feedline.exact.keeper import report

    rng = random.Random(3)
    recent = [(rng.randrange(200_000), rng.randrange(1024)) for _ in range(20_000)]
    data = report(Cursor("val", 4, pipeline=3), recent)
    got = Cursor.decode(data)
    assert len(data) <= MAX_CURSOR_BYTES and (got.epoch, got.pipeline) == (4, 3)
    kept = set(got.keys())
    assert (4, *recent[-1]) in kept and len(kept) < len(set(recent))

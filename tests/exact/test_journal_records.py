"""An exact stream's journal records (``feedline.exact.journal``): one class per kind, the
bytes each writes pinned against the JSON object every broker before them wrote, a journal
written as those brokers wrote it restored to the same coordinator state, and a record whose
checksum holds but which is of no kind (or not as its kind writes it) read as a line that
fails (corrupt, or left out if it is the last).

The old brokers' bytes are made here from the JSON objects they wrote (``old_line``,
``old_snapshot``); the tests that drive a coordinator use only its API and the journal's, so
they run against any version."""

from __future__ import annotations

import json
import random
import zlib
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from feedline.exact.coordinator import Assignment, Coordinator, ExactPlan
from feedline.exact.cursor import Cursor
from feedline.exact.journal import (
    EpochBegun,
    HostLaunch,
    Journal,
    JournalCorrupt,
    Planned,
    Record,
    RunEnds,
    RunFinished,
    Settled,
    UnitDone,
    UnitTotal,
    decode,
)
from feedline.exact.streams import ExactConfig, ExactStreams

PLAN = ExactPlan(dataset_size=10, unit_size=4, epochs=2, fingerprint=7)  # units 0 1 2: 4 4 2
BATCHES = {0: 3, 1: 2, 2: 1}  # each unit's batches


def old_line(obj: dict[str, Any]) -> bytes:
    """A record's line as every broker with checksums wrote it."""
    body = json.dumps(obj, separators=(",", ":")).encode()
    return b"%08x %s\n" % (zlib.crc32(body), body)


def old_file(objs: list[dict[str, Any]]) -> bytes:
    return b"".join(old_line(o) for o in objs)


def old_runs(b: int) -> list[list[int]]:
    """``[start, length]`` of each run of set bits, as the old brokers wrote settled batches."""
    out: list[list[int]] = []
    i = 0
    while b >> i:
        if b >> i & 1:
            if out and out[-1][0] + out[-1][1] == i:
                out[-1][1] += 1
            else:
                out.append([i, 1])
        i += 1
    return out


def old_snapshot(c: Coordinator) -> list[dict[str, Any]]:
    """The JSON objects an old broker's coordinator wrote for its whole state (a rewrite)."""
    p = c.plan
    recs: list[dict[str, Any]] = [
        {"plan": [p.dataset_size, p.unit_size, p.epochs, p.fingerprint]},
        {"epoch": c.epoch}, {"end": c.end}]
    if c.finished:
        recs.append({"finished": True})
    recs += [{"done": [u, total]} for u, total in sorted(c.done.items())]
    for u, q in sorted(c.units.items()):
        if q.settled:
            recs.append({"settled": [u, old_runs(q.settled)]})
        if q.total is not None:
            recs.append({"total": [u, q.total]})
    return recs


def state(c: Coordinator) -> tuple:
    """What a journal holds of a coordinator."""
    return (c.epoch, c.end, c.finished, dict(c.done),
            {u: (q.settled, q.total) for u, q in c.units.items()
             if q.settled or q.total is not None})


def restored(path: Path) -> Coordinator:
    return Coordinator("val", PLAN, Journal(path), Journal(path).read("val"), 5.0)


# -- each kind ----------------------------------------------------------------------------

KINDS: list[tuple[Record, dict[str, Any]]] = [
    (Planned(PLAN), {"plan": [10, 4, 2, 7]}),
    (Planned(ExactPlan(10, 4)), {"plan": [10, 4, 0, 0]}),
    (EpochBegun(0), {"epoch": 0}),
    (EpochBegun(3), {"epoch": 3}),
    (RunEnds(5), {"end": 5}),
    (RunEnds(0), {"end": 0}),
    (RunFinished(), {"finished": True}),
    (UnitDone(2, 4), {"done": [2, 4]}),
    (Settled(1, 0b1011), {"settled": [1, [[0, 2], [3, 1]]]}),
    (Settled(0, 1 << 40), {"settled": [0, [[40, 1]]]}),
    (UnitTotal(0, 3), {"total": [0, 3]}),
    (HostLaunch(0x1234, 3), {"launch": [0x1234, 3]}),
]


@pytest.mark.parametrize(("record", "obj"), KINDS, ids=lambda x: type(x).__name__)
def test_each_record_writes_the_bytes_of_its_json_object(tmp_path: Path, record: Record,
                                                         obj: dict[str, Any]):
    """Appended or rewritten, a record's line is byte for byte the line the old brokers wrote
    for its JSON object, and reads back as the same record."""
    assert record.encode() == obj and decode(obj) == record
    path = tmp_path / "val.exact.jsonl"
    j = Journal(path)
    assert j.rewrite([record])
    assert path.read_bytes() == old_line(obj)
    j.add(record)
    assert j.commit()
    assert path.read_bytes() == old_line(obj) * 2
    assert Journal(path).read("val") == [record, record]


@pytest.mark.parametrize(("obj", "record"), [
    ({"plan": [10, 4]}, Planned(ExactPlan(10, 4))),  # before runs
    ({"plan": [10, 4, 2]}, Planned(ExactPlan(10, 4, 2))),  # before fingerprints
    ({"settled": [1, [0, 3, 4]]}, Settled(1, 0b11001)),  # before runs of settled batches
    ({"settled": [1, []]}, Settled(1, 0)),
])
def test_the_older_forms_are_read(obj: dict[str, Any], record: Record):
    assert decode(obj) == record


def test_a_coordinator_writes_the_bytes_it_always_wrote(tmp_path: Path):
    """A unit's batch count, its settled batches and the unit done, appended; the epoch's end
    and the run's, rewritten: each write is the bytes of the JSON objects the old brokers
    wrote."""
    path = tmp_path / "val.exact.jsonl"
    c = Coordinator("val", PLAN, Journal(path))
    head: list[dict[str, Any]] = [{"plan": [10, 4, 2, 7]}, {"epoch": 0}, {"end": 2}]
    assert path.read_bytes() == old_file(head)
    a = c.request(b"p")
    assert isinstance(a, Assignment) and a.unit == 0
    for i in range(3):
        c.accept((0, 0, i))
    c.unit_done(b"p", 0, 0, 3)
    c.settle((0, 0, 0))
    c.settle((0, 0, 2))
    c.commit()
    tail: list[dict[str, Any]] = [{"total": [0, 3]}, {"settled": [0, [[0, 1], [2, 1]]]}]
    assert path.read_bytes() == old_file(head + tail)
    c.settle((0, 0, 1))  # unit 0 done: written at once
    tail += [{"settled": [0, [[1, 1]]]}, {"done": [0, 3]}]
    assert path.read_bytes() == old_file(head + tail)
    for epoch in (0, 1):
        for u in (1, 2) if epoch == 0 else (0, 1, 2):
            a = c.request(b"p")
            assert isinstance(a, Assignment) and (a.epoch, a.unit) == (epoch, u)
            c.unit_done(b"p", epoch, u, BATCHES[u])
            for i in range(BATCHES[u]):
                c.settle((epoch, u, i))
        if epoch == 0:  # the next epoch: rewritten
            assert path.read_bytes() == old_file(
                [{"plan": [10, 4, 2, 7]}, {"epoch": 1}, {"end": 2}])
    assert c.finished
    assert path.read_bytes() == old_file([
        {"plan": [10, 4, 2, 7]}, {"epoch": 1}, {"end": 2}, {"finished": True},
        {"done": [0, 3]}, {"done": [1, 2]}, {"done": [2, 1]}])
    assert [json.loads(line.split(b" ", 1)[1]) for line in path.read_bytes().splitlines()] \
        == old_snapshot(c)


def drive(c: Coordinator, rng: random.Random, steps: int) -> None:
    """Producers asking, making, finishing and losing units, batches settled, commits, a
    resume now and then, and a new run once the run is served, at random."""
    held: dict[bytes, Assignment] = {}
    for _ in range(steps):
        owner, r = rng.choice([b"a", b"b"]), rng.random()
        a = held.get(owner)
        if c.finished and r < 0.05:  # a second job's producer: the next run
            held.clear()
            assert isinstance(c.request(owner, first=True), Assignment)
        elif a is None or a.epoch != c.epoch or r < 0.2:
            got = c.request(owner)
            if isinstance(got, Assignment):
                held[owner] = got
        elif r < 0.35:
            c.unit_done(owner, a.epoch, a.unit, BATCHES[a.unit], empty=[0] if r < 0.22 else [])
            del held[owner]
        elif r < 0.8:
            u = rng.choice([u for u in range(3) if u not in c.done] or [0])
            c.settle((c.epoch, u, rng.randrange(BATCHES[u])))
        elif r < 0.9:
            c.commit()
        elif r < 0.97:
            c.release(owner)
            del held[owner]
        else:
            taken = {u: set(rng.sample(range(BATCHES[u]), rng.randrange(BATCHES[u] + 1)))
                     for u in range(3)}
            c.resume(Cursor.of("val", max(c.epoch - rng.randrange(2), 0), taken))
            held.clear()
    c.commit()


@pytest.mark.parametrize("checksums", [True, False], ids=["checksums", "before-checksums"])
@pytest.mark.parametrize("seed", range(12))
def test_a_journal_written_as_before_restores_the_same_state(tmp_path: Path, seed: int,
                                                             checksums: bool):
    """A coordinator driven at random; the journal an old broker wrote for its state (its
    JSON objects, with or without checksums), then the records it appends, restores to the
    same state, as the journal this one wrote does; and this one's file is the old brokers'
    lines of its records."""
    rng = random.Random(seed)
    path = tmp_path / "val.exact.jsonl"
    live = Coordinator("val", PLAN, Journal(path))
    for n in range(6):
        drive(live, rng, 30)
        data = path.read_bytes()
        objs = [json.loads(line.split(b" ", 1)[1]) for line in data.splitlines()]
        assert data == old_file(objs)
        copy = tmp_path / f"copy-{n}.exact.jsonl"
        copy.write_bytes(data)
        assert state(restored(copy)) == state(live)
        for name, recs in (("snapshot", old_snapshot(live)), ("appended", objs)):
            old = tmp_path / f"{name}-{n}.exact.jsonl"
            old.write_bytes(b"".join(old_line(o) if checksums else json.dumps(o).encode() + b"\n"
                                     for o in recs))
            assert state(restored(old)) == state(live), name


# -- what is no record --------------------------------------------------------------------

MALFORMED: list[Any] = [
    {"foo": 1}, {"epoch": 1, "end": 2}, {}, [1], 3, None,
    {"epoch": True}, {"epoch": -1}, {"epoch": 1.5}, {"epoch": "1"}, {"end": [2]},
    {"finished": False}, {"finished": 1},
    {"done": "x"}, {"done": [1]}, {"done": [-1, 2]}, {"done": [1, 2, 3]}, {"total": [0, None]},
    {"settled": [0, [[0, 0]]]}, {"settled": [0, [[0, 1], 3]]}, {"settled": [0, [3, [0, 1]]]},
    {"settled": [0, 5]}, {"settled": [0]}, {"settled": [0, [[-1, 2]]]},
    {"settled": [0, [[0, 1 << 40]]]},
    {"plan": [10]}, {"plan": [10, 0]}, {"plan": [0, 4]}, {"plan": [10, 4, 2, 7, 9]},
    {"plan": [10, 4, -2]}, {"plan": "10,4"},
    # The attack review: an epoch past what a cursor carries refused every producer's HELLO
    # with an OverflowError that named no journal.
    {"epoch": 10**30}, {"done": [0, 1 << 63]},
]


@pytest.mark.parametrize("obj", MALFORMED, ids=lambda o: json.dumps(o)[:40])
def test_a_record_of_no_kind_or_malformed_is_refused(obj: Any):
    with pytest.raises(JournalCorrupt) as e:
        decode(obj)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("obj", MALFORMED, ids=lambda o: json.dumps(o)[:40])
def test_a_line_that_checks_but_is_no_record_is_a_corrupt_journal(tmp_path: Path, obj: Any):
    """Its checksum holds, but it is no record: in the middle, the journal is corrupt (one line
    naming the file and the line); the last, it is left out as one cut short. Before: it was
    read, and the coordinator skipped it or raised a TypeError, ValueError or DecodeError."""
    path = tmp_path / "val.exact.jsonl"
    good = [old_line({"plan": [10, 4, 2, 7]}), old_line({"epoch": 1})]
    bad = b"%08x %s\n" % (zlib.crc32(json.dumps(obj).encode()), json.dumps(obj).encode())
    path.write_bytes(good[0] + bad + good[1])
    with pytest.raises(JournalCorrupt, match="corrupt at line 2: delete the file") as e:
        Journal(path).read("val")
    assert str(path) in str(e.value) and "\n" not in str(e.value)
    path.write_bytes(good[0] + good[1] + bad)
    assert Journal(path).read("val") == [Planned(PLAN), EpochBegun(1)]
    assert path.read_bytes() == good[0] + good[1]


def test_a_broker_restores_its_plan_from_a_journal_written_before_fingerprints(tmp_path: Path):
    """A consumer first after a restart: the stream's plan is its journal's first record."""
    path = tmp_path / "val.exact.jsonl"
    path.write_bytes(old_line({"plan": [10, 4, 2]}) + old_line({"epoch": 1}) +
                     old_line({"end": 2}) + old_line({"done": [0, 3]}))
    c = ExactStreams(ExactConfig(tmp_path)).load("val", 0.0)
    assert c is not None and c.plan == ExactPlan(10, 4, 2) and (c.epoch, c.done) == (1, {0: 3})


JSON = st.recursive(st.none() | st.booleans() | st.integers(-3, 1 << 70) | st.text(max_size=3),
                    lambda xs: st.lists(xs, max_size=4)
                    | st.dictionaries(st.sampled_from(["plan", "epoch", "end", "finished",
                                                       "done", "settled", "total", "x"]),
                                      xs, max_size=2), max_leaves=12)


@settings(max_examples=300, deadline=None)
@given(JSON)
def test_anything_is_a_record_or_refused_in_one_line(raw: Any):
    """Hostile JSON: a record that writes back as it was read, or :class:`JournalCorrupt` in
    one line, never another error."""
    try:
        record = decode(raw)
    except JournalCorrupt as e:
        assert "\n" not in str(e)
    else:
        assert decode(record.encode()) == record


@pytest.mark.parametrize("obj", [{"done": [999, 4]}, {"settled": [3, [[0, 1]]]},
                                 {"total": [7, 2]}])
def test_a_record_of_a_unit_beyond_the_plan_is_a_corrupt_journal(tmp_path: Path, obj: Any):
    """The attack review: a checksummed "done" of unit 999 (of 3) was trusted and counted,
    the epoch ended early and the consumer got 24 of 32 samples without a word. A record of
    a unit the plan does not have is refused in one line."""
    path = tmp_path / "val.exact.jsonl"
    lines = [old_line({"plan": [10, 4, 2, 7]}), old_line({"epoch": 0}), old_line(obj)]
    path.write_bytes(b"".join(lines) + old_line({"epoch": 0}))
    with pytest.raises(JournalCorrupt, match="names unit") as e:
        restored(path)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("d", [{"stream": "val", "epoch": -1},
                               {"stream": "val", "epoch": 0, "taken": {"-1": [0]}},
                               {"stream": "val", "epoch": 0, "pipeline": -1},
                               {"stream": "val", "epoch": 0, "pipeline": 1 << 70},
                               {"stream": "val", "epoch": 1 << 70}])
def test_a_dict_cursor_out_of_bounds_is_one_config_error(d: dict) -> None:
    """The attack review: ``resume={"epoch": -1}`` hung the process (a varint of a negative
    number never ends) and a 70-bit fingerprint raised a bare struct.error."""
    from feedline.errors import ConfigError

    with pytest.raises(ConfigError, match="not a cursor"):
        Cursor.from_dict(d).encode()


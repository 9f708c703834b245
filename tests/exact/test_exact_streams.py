"""A broker's exact streams on their own (no sockets): a resume applied once per job however
many ranks send it and again when the job crashes again, cursors of another pipeline, cursors
that wait for their stream's first producer (bounded), the stream limit and the reclaiming of
unused streams, one delivery mode and one pipeline per stream, and what a broker without a
state directory does."""

from __future__ import annotations

from pathlib import Path

import pytest

from feedline.errors import Refusal
from feedline.exact.coordinator import Assignment, Coordinator, ExactPlan
from feedline.exact.cursor import Cursor
from feedline.exact.streams import MAX_PENDING, ExactConfig, ExactStreams

PLAN = ExactPlan(dataset_size=8, unit_size=4, epochs=1, fingerprint=5)  # 2 units of 4


def streams(tmp_path: Path | None = None, **kw: object) -> ExactStreams:
    return ExactStreams(ExactConfig(tmp_path, **kw))  # type: ignore[arg-type]


def resume_of(taken: dict[int, set[int]], epoch: int = 0, pipeline: int = 5,
              stream: str = "val") -> bytes:
    c = Cursor.of(stream, epoch, taken, pipeline=pipeline)
    c.resume = True
    return c.encode()


def take(c: Coordinator, *keys: tuple[int, int]) -> None:
    for u, i in keys:
        c.accept((c.epoch, u, i))
        c.settle((c.epoch, u, i))


def test_a_resume_is_applied_once_per_job_and_again_for_the_next(tmp_path: Path):
    """Findings 1 and 2: ranks of one job send the same cursor (each merged it itself): the
    epoch is set to it once. When that job is gone and a new one resumes from the same
    checkpoint (it crashed again), it is set again."""
    s = streams(tmp_path)
    c = s.join("val", PLAN, 0.0)
    take(c, (0, 0), (0, 1), (0, 2))
    ckpt = resume_of({0: {0, 1}})
    alive = {b"rank0", b"rank1"}
    s.cursor(b"rank0", "val", ckpt, 1.0, lambda xs: [x for x in xs if x in alive])
    assert c.units[0].settled == 0b11
    take(c, (0, 2), (1, 0))  # rank 0 goes on
    got = s.cursor(b"rank1", "val", ckpt, 2.0, lambda xs: [x for x in xs if x in alive])
    assert got is not None and not got.resumed and c.units[0].settled == 0b111, \
        "the second rank's resume is the same request: no second roll-back"
    alive.clear()  # the job crashed again; its restart resumes from the same checkpoint
    got = s.cursor(b"rank0-again", "val", ckpt, 3.0, lambda xs: [x for x in xs if x in alive])
    assert got is not None and got.resumed and c.units[0].settled == 0b11
    assert 1 not in c.units or c.units[1].settled == 0


def test_a_cursor_of_another_pipeline_is_refused(tmp_path: Path):
    """Finding 3: the seed (or the batch size, the dataset...) changed: another fingerprint."""
    s = streams(tmp_path)
    s.join("val", PLAN, 0.0)
    with pytest.raises(Refusal, match="another pipeline") as e:
        s.cursor(b"c", "val", resume_of({0: {0}}, pipeline=6), 0.0)
    assert e.value.reason == "cursor_mismatch"


def test_cursors_wait_for_their_stream_bounded_and_are_judged_when_it_comes():
    s = streams()
    refused: list[tuple[bytes, str]] = []
    s.refuse = lambda ident, reason, detail: refused.append((ident, reason))
    assert s.cursor(b"good", "val", resume_of({0: {0}}), 0.0) is None
    assert s.cursor(b"bad", "val", resume_of({0: {0}}, pipeline=9), 0.0) is None
    c = s.join("val", PLAN, 0.0)
    assert c.units[0].settled == 1 and refused == [(b"bad", "cursor_mismatch")]
    for i in range(MAX_PENDING):
        name = f"s{i % 3}"
        assert s.cursor(b"%d" % i, name, resume_of({0: {0}}, stream=name), 0.0) is None
    with pytest.raises(Refusal, match="cursors wait"):
        s.cursor(b"one-more", "s0", resume_of({0: {0}}, stream="s0"), 0.0)
    s.forget(b"0")
    assert s.cursor(b"one-more", "s0", resume_of({0: {0}}, stream="s0"), 0.0) is None


def test_an_ephemeral_stream_that_lost_its_position_says_so():
    """Finding 6, ``--exact-ephemeral``: a report of batches this broker never served."""
    s = streams()
    s.join("val", PLAN, 0.0)
    report = Cursor.of("val", 0, {1: {2}}, pipeline=5).encode()
    with pytest.raises(Refusal, match="lost stream 'val'.s position") as e:
        s.cursor(b"c", "val", report, 0.0)
    assert "--state-dir" in e.value.detail


def test_without_a_state_dir_an_exact_producer_is_refused():
    """Finding 6: unless exact streams are allowed in memory only."""
    with pytest.raises(Refusal, match="--state-dir") as e:
        streams(ephemeral=False).join("val", PLAN, 0.0)
    assert e.value.reason == "no_state_dir"
    assert isinstance(streams(ephemeral=True).join("val", PLAN, 0.0), Coordinator)


def test_streams_are_bounded_and_unused_ones_reclaimed(tmp_path: Path):
    """Finding 14: at most ``max_streams`` streams have state; one nobody uses for ``idle``
    seconds is reclaimed, its journal with it if it never served a batch (and kept if it
    did: the stream goes on from it when its producers come back)."""
    s = streams(tmp_path, max_streams=3, idle=10.0)
    for name in ("a", "b", "c"):
        s.join(name, PLAN, 0.0)
    with pytest.raises(Refusal, match="--max-streams") as e:
        s.join("d", PLAN, 0.0)
    assert e.value.reason == "too_many_streams"
    take(s.streams["a"], (0, 0))
    s.reclaim(5.0, busy={"b"})
    assert set(s.streams) == {"a", "b", "c"}, "not unused long enough yet"
    s.reclaim(11.0, busy={"b"})
    assert set(s.streams) == {"b"}
    assert (tmp_path / "a.exact.jsonl").exists() and not (tmp_path / "c.exact.jsonl").exists()
    back = s.join("a", PLAN, 12.0)
    assert back.units[0].settled == 1, "restored from its journal"


def test_one_delivery_mode_and_one_pipeline_per_stream(tmp_path: Path):
    """Finding 17: an exact producer on a training stream is refused, and a training producer
    on an exact one; a producer of another pipeline is refused while the stream's are there,
    and replaces it once they left."""
    s = streams(tmp_path)
    s.attach("train", exact=False)
    with pytest.raises(Refusal, match="training mode"):
        s.join("train", PLAN, 0.0)
    assert s.get("train") is None, "the training stream is untouched"
    s.join("val", PLAN, 0.0)
    s.attach("val", exact=True)
    with pytest.raises(Refusal, match="is exact"):
        s.training_may_join("val")
    other = ExactPlan(8, 4, 1, fingerprint=6)
    with pytest.raises(Refusal, match="another pipeline"):
        s.join("val", other, 0.0)
    s.detach("val", exact=True)
    replaced = s.join("val", other, 0.0)
    assert replaced.plan.fingerprint == 6 and replaced.epoch == 0
    with pytest.raises(Refusal, match="training mode"):
        s.cursor(b"c", "train", resume_of({0: {0}}, stream="train"), 0.0)


def test_a_second_job_starts_the_next_run(tmp_path: Path):
    """Finding 7 at the coordinator: a producer that was never given a unit asks on a served
    stream; a new run begins (with the journal saying so across a restart)."""
    s = streams(tmp_path)
    c = s.join("val", ExactPlan(4, 4, 1, 5), 0.0)
    a = c.request(b"p")
    assert isinstance(a, Assignment)
    c.accept((0, 0, 0))
    c.unit_done(b"p", 0, 0, 1)
    c.settle((0, 0, 0))
    assert c.finished
    again = streams(tmp_path).join("val", ExactPlan(4, 4, 1, 5), 0.0)  # a broker restart
    assert again.finished and again.request(b"q", 10.0, first=True) == Assignment(1, 0, 0)


def test_a_producer_told_busy_gets_its_unit_as_soon_as_there_is_one():
    """At an epoch's end the producers that finished their units are told ``busy``; when the
    last batch is taken the next epoch begins, and they are sent a unit then (numbered as
    their request), instead of finding out at their next try."""
    from feedline.protocol import messages as m
    from feedline.serving.handout import Units
    from feedline.serving.peers import Peer

    s = streams()
    c = s.join("val", ExactPlan(4, 4, 2, 5), 0.0)
    sent: list[tuple[bytes, m.Message]] = []
    units = Units(s, lambda ident, msg: sent.append((ident, msg)) or 0, 1, lambda *_: None)
    a, b = (Peer(ident, ident.decode(), 1, 1, "val") for ident in (b"a", b"b"))
    units.message(a, c, m.UnitRequest(registration=1, ask=1))
    units.message(b, c, m.UnitRequest(registration=1, ask=7))
    assert [type(msg).__name__ for _, msg in sent] == ["Unit", "UnitWait"]
    units.push(0.0, {b"a": a, b"b": b}.get)
    assert len(sent) == 2, "nothing new: no second answer"
    c.accept((0, 0, 0))
    units.message(a, c, m.UnitDone(epoch=0, unit=0, batches=1, registration=1))
    c.settle((0, 0, 0))  # epoch 0 is complete: epoch 1 begins
    units.push(0.0, {b"a": a, b"b": b}.get)
    ident, msg = sent[-1]
    assert ident == b"b" and isinstance(msg, m.Unit) and (msg.epoch, msg.ask) == (1, 7)


def test_another_pipeline_is_said_in_samples_units_and_fingerprint(tmp_path: Path, caplog):
    """A pipeline replacing a departed one, or refused beside a registered one, is named in a
    user's words. Before: ``ExactPlan(dataset_size=7, unit_size=1, epochs=1, fingerprint=...)``,
    where ``dataset_size`` was a sharded source's unit count and ``unit_size=1`` matched
    nothing in the user's file."""
    s = streams(tmp_path)
    sharded = ExactPlan(dataset_size=7, unit_size=1, epochs=1, fingerprint=0xab)
    s.join("vsh", sharded, 0.0)
    s.attach("vsh", True)
    other = ExactPlan(dataset_size=56, unit_size=8, epochs=1, fingerprint=0xcd)
    with pytest.raises(Refusal) as refused:
        s.join("vsh", other, 0.0)
    assert "56 samples in 7 units of 8, fingerprint cd" in refused.value.detail
    assert "7 work units (single samples, or a sharded source's shards or slices), " \
        "fingerprint ab" in refused.value.detail
    s.detach("vsh", True)  # its producers left: the other pipeline replaces it
    with caplog.at_level("WARNING", logger="feedline.exact.streams"):
        s.join("vsh", other, 0.0)
    text = caplog.text
    assert "a producer of another pipeline (56 samples in 7 units of 8, fingerprint cd) " \
        "replaces the one whose producers left (7 work units" in text, text
    assert "ExactPlan(" not in text and "dataset_size" not in text

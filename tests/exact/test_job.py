"""The job coordinator of a stream served by several hosts (feedline/exact/job.py), scene by
scene, with the hosts' side played by real :class:`~feedline.exact.member.JobMember` objects
and a real journal: what each rule of the module's docstring promises."""

from __future__ import annotations

from pathlib import Path

import pytest

from feedline.exact.cursor import Cursor
from feedline.exact.job import JobCoordinator, JobRefused, Message
from feedline.exact.journal import Journal
from feedline.exact.member import Answer, Change, JobMember
from feedline.exact.plan import ExactPlan, NoUnit

PLAN = ExactPlan(4, 1, 2, 0xABC)


def talk(jc: JobCoordinator, members: dict[str, JobMember], msg: Message | None,
         now: float = 0.0) -> dict[str, Change]:
    """The coordinator takes ``msg``; every view it answers goes to its host."""
    assert msg is not None
    out = {}
    views = jc.handle(msg, now)
    jc.commit()
    for v in views:
        out[v.host] = members[v.host].view(v)
    return out


def hosts(jc: JobCoordinator, *names: str) -> dict[str, JobMember]:
    ms = {n: JobMember(n, "s", PLAN, 1) for n in names}
    for m in ms.values():
        talk(jc, ms, m.join(readers=1))
    return ms


def test_a_unit_is_open_at_one_host_and_moves_only_when_given_back(tmp_path: Path) -> None:
    jc = JobCoordinator("s", PLAN, Journal(tmp_path / "s.job"))
    ms = hosts(jc, "a", "b")
    got = talk(jc, ms, ms["a"].ask())["a"].opened
    assert [u for u, _, _ in got] == [0]
    for _ in range(3):  # b gets the others, never a's
        (u, _, _), = talk(jc, ms, ms["b"].ask())["b"].opened
        assert u != 0
    assert talk(jc, ms, ms["b"].ask())["b"].wait is NoUnit.BUSY  # every unit open somewhere
    # a gives unit 0 back with batches 0 and 2 taken there: b gets it with those taken.
    talk(jc, ms, ms["a"].back(0, 0b101))
    (u, gen, taken), = talk(jc, ms, ms["b"].ask())["b"].opened
    assert (u, gen, taken) == (0, 2, 0b101)
    assert not ms["b"].deliverable(0, 0, 0) and ms["b"].deliverable(0, 0, 1)
    assert not ms["a"].deliverable(0, 0, 1)  # not a's any more


def test_the_epoch_ends_for_every_host_when_the_last_unit_is_done() -> None:
    jc = JobCoordinator("s", PLAN)
    ms = hosts(jc, "a", "b")
    for host in "abab":
        talk(jc, ms, ms[host].ask())
    for m in ms.values():
        for u in sorted(m.open):
            changes = talk(jc, ms, m.done(u, 1))
    assert set(changes) == {"a", "b"}  # the last Done's views: both hosts hear
    assert all(c.ended == [0] for c in changes.values())
    assert jc.epoch == 1 and ms["a"].epoch == ms["b"].epoch == 1


def test_old_and_repeated_messages_change_nothing() -> None:
    jc = JobCoordinator("s", PLAN)
    ms = hosts(jc, "a")
    ask = ms["a"].ask()
    talk(jc, ms, ask)
    assert jc.handle(ask, 0.0) == []  # the same Ask again: no second unit
    assert len(jc.hosts["a"].open) == 1


def test_an_answer_older_than_a_give_back_does_not_hand_the_unit_back() -> None:
    jc = JobCoordinator("s", PLAN)
    ms = hosts(jc, "a")
    talk(jc, ms, ms["a"].ask())
    late = jc.handle(ms["a"].beat(1), 0.0)  # a view that lists unit 0 as a's, held back
    back = ms["a"].back(0, 0)
    talk(jc, ms, back)
    for v in late:
        ms["a"].view(v)
    assert 0 not in ms["a"].open


def test_the_coordinator_restarts_from_its_journal_with_the_hosts_units(tmp_path: Path) -> None:
    path = tmp_path / "s.job"
    jc = JobCoordinator("s", PLAN, Journal(path))
    ms = hosts(jc, "a", "b")
    talk(jc, ms, ms["a"].ask())
    talk(jc, ms, ms["b"].ask())
    talk(jc, ms, ms["a"].done(0, 1))
    jc2 = JobCoordinator("s", PLAN, Journal(path), now=10.0)
    with pytest.raises(JobRefused) as e:
        jc2.handle(ms["b"].beat(1), 10.0)
    assert e.value.reason == "not_registered"
    ch = talk(jc2, ms, ms["b"].join(readers=1), 10.0)["b"]
    assert ch.closed == [] and ms["b"].open == {1: (1, 0)}  # b's unit is still b's
    assert jc2.units[0].state.value == "done" and jc2.job == jc.job


def test_wrong_configurations_are_one_line_errors() -> None:
    jc = JobCoordinator("s", PLAN)
    other = JobMember("x", "s", ExactPlan(4, 1, 2, 0xDEF), 1)
    with pytest.raises(JobRefused) as e:
        jc.handle(other.join(), 0.0)
    assert e.value.reason == "pipeline_mismatch" and "same pipeline" in e.value.text
    assert "\n" not in e.value.text
    stray = JobMember("y", "s", PLAN, 1)
    stray.job = 12345  # served another coordinator (this one lost its journal, or a second)
    with pytest.raises(JobRefused) as e:
        jc.handle(stray.join(), 0.0)
    assert e.value.reason == "position_lost" and "empty --state-dir" in e.value.text


def test_the_ranks_of_one_launch_resume_once_and_a_relaunch_resumes_again() -> None:
    jc = JobCoordinator("s", PLAN)
    ms = hosts(jc, "a", "b")
    cursor = Cursor("s", 0, {0: 1}, PLAN.fingerprint, resume=True)
    talk(jc, ms, ms["a"].resume(cursor, 0), 1.0)
    assert jc.launch == 2 and jc.units[0].taken == 1
    # b's rank, same cursor: a's count is older than it, so a is asked again first.
    ch = talk(jc, ms, ms["b"].resume(cursor, 0), 2.0)
    assert ch["b"].wait is NoUnit.BUSY and ch["a"].probe
    talk(jc, ms, ms["a"].beat(1), 2.5)  # a's rank is there: b's is of the same launch
    assert talk(jc, ms, ms["b"].resume(cursor, 0), 3.0)["b"].wait is None
    assert jc.launch == 2
    # Every rank killed, the job started again from the same checkpoint: a new launch.
    talk(jc, ms, ms["a"].beat(0), 4.0)
    talk(jc, ms, ms["b"].beat(0), 4.0)
    ch = talk(jc, ms, ms["a"].resume(cursor, 0), 5.0)
    assert jc.launch == 3 and ch["a"].new_launch


def test_a_resume_the_coordinator_never_took_is_sent_again(tmp_path: Path) -> None:
    """The model's finding: a rank's resume reached a coordinator that had just restarted
    (refused: the host had not joined it again); the answer to the host's Join, newer than
    the resume, must not admit the rank under the old launch (it would take the epoch its
    checkpoint passed). The host sends the resume again; its own answer admits the rank."""
    path = tmp_path / "s.job"
    jc = JobCoordinator("s", PLAN, Journal(path))
    ms = hosts(jc, "a")
    a = ms["a"]
    jc2 = JobCoordinator("s", PLAN, Journal(path), now=10.0, timeout=1.0)
    cursor = Cursor("s", 1, {}, PLAN.fingerprint, resume=True)
    msg = a.resume(cursor, 0)
    with pytest.raises(JobRefused) as e:
        jc2.handle(msg, 10.0)
    assert e.value.reason == "not_registered"
    views = jc2.handle(a.join(readers=0), 10.0)
    a.view(views[0])
    assert a.answer(views[0], msg.seq, resume=True) is Answer.AGAIN
    assert a.launch == 1 and a.epoch == 0  # still the old launch: admitting now would be wrong
    again = a.resume(cursor, 0)
    views = jc2.handle(again, 12.0)
    a.view(views[0])
    assert a.answer(views[0], again.seq, resume=True) is Answer.ADMITTED
    assert (a.launch, a.epoch) == (2, 1)
    # A beat is answered by any view that took it into account; an older view decides nothing.
    beat = a.beat(1)
    old = views[0]
    views = jc2.handle(beat, 13.0)
    a.view(views[0])
    assert a.answer(old, beat.seq, resume=False) is Answer.PENDING
    assert a.answer(views[0], beat.seq, resume=False) is Answer.ADMITTED


def test_cost_per_unit_is_a_few_messages_whatever_the_number_of_hosts() -> None:
    """Claim: serving an epoch costs the coordinator an Ask and a Done per unit plus the
    hosts' beats: no message per batch, none per host per unit."""
    plan = ExactPlan(200, 1, 1, 1)
    jc = JobCoordinator("s", plan)
    ms = {f"h{i}": JobMember(f"h{i}", "s", plan, 1) for i in range(50)}
    for m in ms.values():
        jc.handle(m.join(readers=1), 0.0)
    start = jc.messages
    while not jc.finished:
        for m in ms.values():
            for v in jc.handle(m.ask(), 0.0):
                ms[v.host].view(v)
            for u in list(m.open):
                done = m.done(u, 5)
                assert done is not None
                for v in jc.handle(done, 0.0):
                    ms[v.host].view(v)
    asks_and_dones = jc.messages - start
    assert asks_and_dones <= 2 * plan.units + len(ms) * 5

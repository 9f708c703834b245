"""A job served by several hosts resumed from its checkpoint, host side (feedline/exact/scope.py
and feedline/exact/streams.py), scene by scene: each host is a real
:class:`~feedline.exact.streams.ExactStreams` with its stream's coordinator, talking to a
real :class:`~feedline.exact.job.JobCoordinator` through the messages it queues (no sockets);
its consumers are idents, its broker's callbacks (refuse, applied, probe) recorded. What
the rules of the modules' docstrings promise: a consumer's resume goes to the job and the
consumer is served nothing until the job's answer admits it; the job's other ranks join the
launch; a new launch refuses the older launch's consumers, in one line, and voids what a
host's journal holds of the older one. One scene wires a host to a real broker's consumer
side (its buffer and dispatch, no sockets)."""

from __future__ import annotations

from pathlib import Path

import pytest
import zmq
from prometheus_client import CollectorRegistry

from feedline.broker.buffer import Buffer
from feedline.broker.egress import ConsumerSide
from feedline.errors import Refusal
from feedline.exact.cursor import Cursor
from feedline.exact.job import JobCoordinator, JobRefused, View
from feedline.exact.plan import Assignment, ExactPlan
from feedline.exact.scope import AGAIN_AFTER, BEAT
from feedline.exact.streams import Applied, ExactConfig, ExactStreams
from feedline.protocol import messages as m
from feedline.protocol.wire import DEFAULT_LIMITS
from feedline.serving.budget import Budget
from feedline.serving.metrics import BrokerMetrics

PLAN = ExactPlan(4, 1, 2, 0xABC)  # four units of one sample each, two epochs
STREAM = "s"


class Host:
    """One broker of the job: its exact streams, and what it told its consumers."""

    def __init__(self, name: str, state_dir: Path | None = None, now: float = 0.0) -> None:
        self.streams = ExactStreams(ExactConfig(state_dir=state_dir, coordinator="tcp://job:1",
                                                host=name))
        self.refused: dict[bytes, tuple[str, str]] = {}
        self.applied: dict[bytes, Applied] = {}
        self.connected: set[bytes] = set()  # consumers whose connection is open
        self.voided = 0
        self.streams.refuse = lambda ident, reason, detail: self.refused.__setitem__(
            ident, (reason, detail))
        self.streams.applied = lambda ident, stream, a: self.applied.__setitem__(ident, a)
        self.streams.probe = lambda idents: [x for x in idents if x in self.connected]
        self.streams.void = lambda stream: setattr(self, "voided", self.voided + 1)
        self.c = self.streams.join(STREAM, PLAN, now)

    def register(self, ident: bytes, cursor: Cursor | None, now: float) -> Applied | None:
        """A consumer's HELLO (with its cursor, if any), as the broker's egress makes it."""
        self.connected.add(ident)
        got = None
        if cursor is not None:
            got = self.streams.cursor(ident, STREAM, cursor.encode(), now,
                                      self.streams.probe)
        self.streams.reader(STREAM, ident, 1)
        return got


def pump(jc: JobCoordinator, hosts: dict[str, Host], now: float) -> None:
    """Every message the hosts queued taken by the job, every answer taken by its host, until
    nothing is left (each turn's views first, then what they made the hosts send)."""
    for _ in range(20):
        sent = False
        for h in hosts.values():
            job = h.c.job
            assert job is not None
            for msg in job.drain():
                sent = True
                try:
                    views: list[View] = jc.handle(msg, now)
                except JobRefused as e:
                    h.streams.job_refused(h.c, e, now)
                    continue
                jc.commit()
                for v in views:
                    hosts[v.host].streams.job_view(hosts[v.host].c, v, now)
        if not sent:
            return
    raise AssertionError("the hosts and the job never went quiet")


def tick(jc: JobCoordinator, hosts: dict[str, Host], now: float) -> None:
    """A tick of every host's link (beats, resumes due again), then the messages."""
    for h in hosts.values():
        job = h.c.job
        assert job is not None
        h.streams.job_tick(h.c, now)
        job.tick(now, job.readers(h.c.readers))
    pump(jc, hosts, now)


def checkpoint() -> Cursor:
    """The job's merged cursor: of epoch 0, unit 1 taken."""
    return Cursor(STREAM, 0, {1: 1}, PLAN.fingerprint, True)


def job_of(*names: str) -> tuple[JobCoordinator, dict[str, Host]]:
    jc = JobCoordinator(STREAM, PLAN, timeout=5.0)
    hosts = {n: Host(n) for n in names}
    pump(jc, hosts, 0.0)
    return jc, hosts


def test_a_resume_goes_to_the_job_and_its_consumer_waits_for_the_answer() -> None:
    jc, hosts = job_of("a", "b")
    a = hosts["a"]
    assert a.register(b"r0", checkpoint(), 1.0) is None  # not applied here: the job's
    assert a.streams.waits(b"r0", STREAM)  # served nothing meanwhile
    assert b"r0" not in a.applied
    pump(jc, hosts, 1.0)
    assert jc.launch == 2 and jc.units[1].taken == 1  # the job set its epoch to the cursor
    assert not a.streams.waits(b"r0", STREAM) and b"r0" in a.applied
    got = a.applied[b"r0"]
    assert got.resumed and got.epoch == 0
    job = a.c.job
    assert job is not None and job.launch_of[b"r0"] == 2
    assert a.c.units[1].settled == 1  # the host's own takes match the job's
    assert not a.refused


def test_every_rank_on_every_host_joins_the_launch_the_first_began() -> None:
    """Three ranks: two at host a (the second before a heard the answer to the first), one
    at host b. One launch; b's rank waits for a's count (the probe) and comes again."""
    jc, hosts = job_of("a", "b")
    a, b = hosts["a"], hosts["b"]
    a.register(b"r0", checkpoint(), 1.0)
    a.register(b"r1", checkpoint(), 1.0)
    pump(jc, hosts, 1.0)
    assert jc.launch == 2 and set(a.applied) == {b"r0", b"r1"}
    b.register(b"r2", checkpoint(), 1.5)
    pump(jc, hosts, 1.5)
    assert b.streams.waits(b"r2", STREAM)  # answered busy: a counts its ranks first
    now = 1.5 + AGAIN_AFTER
    tick(jc, hosts, now)
    assert not b.streams.waits(b"r2", STREAM) and b"r2" in b.applied
    assert jc.launch == 2, "a rank of the launch began another"
    assert not a.refused and not b.refused


def test_a_new_launch_elsewhere_refuses_the_older_launchs_consumers_in_one_line() -> None:
    jc, hosts = job_of("a", "b")
    a, b = hosts["a"], hosts["b"]
    a.register(b"old", None, 1.0)  # a rank of the job's first launch
    job = a.c.job
    assert job is not None and job.launch_of[b"old"] == 1
    b.register(b"new", checkpoint(), 2.0)  # the job restarted from its checkpoint, on b
    pump(jc, hosts, 2.0)
    assert jc.launch == 2 and b"new" in b.applied
    tick(jc, hosts, 2.0 + BEAT)  # a's beat is answered: it hears of the launch
    reason, detail = a.refused[b"old"]
    assert reason == "relaunched" and "restarted from a checkpoint elsewhere" in detail
    assert "\n" not in detail
    assert a.voided == 1  # what a buffered of the older launch goes
    assert not b.refused
    # Registered again (its connection came back), it is refused at once.
    a.streams.forget(b"old")
    with pytest.raises(Refusal) as e:
        a.register(b"old", Cursor(STREAM, 0, {0: 1}, PLAN.fingerprint), 3.0)
    assert e.value.reason == "relaunched"


def test_a_rank_whose_host_has_ranks_of_the_launch_counts_them() -> None:
    """The job restarted twice from the same checkpoint: the second restart's rank, on a host
    whose ranks of the first restart are gone (their connections closed), begins a launch;
    one sent while they are connected joins theirs."""
    jc, hosts = job_of("a")
    a = hosts["a"]
    a.register(b"r0", checkpoint(), 1.0)
    pump(jc, hosts, 1.0)
    a.register(b"r1", checkpoint(), 2.0)  # r0 still connected: the same launch
    pump(jc, hosts, 2.0)
    assert jc.launch == 2 and b"r1" in a.applied
    a.connected -= {b"r0", b"r1"}  # the job crashed
    a.register(b"r2", checkpoint(), 9.0)
    pump(jc, hosts, 9.0)
    assert jc.launch == 3 and b"r2" in a.applied


def test_a_cursor_the_job_refuses_refuses_its_consumer_not_the_host() -> None:
    jc, hosts = job_of("a")
    a = hosts["a"]
    a.register(b"r0", checkpoint(), 1.0)
    a.streams.job_refused(a.c, JobRefused("cursor_mismatch", "another pipeline: resume from "
                                          "a checkpoint of this pipeline"), 1.0)
    assert a.refused[b"r0"][0] == "cursor_mismatch"
    job = a.c.job
    assert job is not None and job.joined and job.refused is None
    assert not a.streams.waits(b"r0", STREAM)


def test_a_cursor_of_another_pipeline_is_refused_by_the_host_at_once() -> None:
    jc, hosts = job_of("a")
    a = hosts["a"]
    with pytest.raises(Refusal) as e:
        a.register(b"r0", Cursor(STREAM, 0, {1: 1}, 0xDEF, True), 1.0)
    assert e.value.reason == "cursor_mismatch" and "\n" not in e.value.detail
    job = a.c.job
    assert job is not None and not job.outbox


def test_a_resume_lost_on_the_way_is_sent_again() -> None:
    jc, hosts = job_of("a")
    a = hosts["a"]
    a.register(b"r0", checkpoint(), 1.0)
    job = a.c.job
    assert job is not None
    job.drain()  # lost
    tick(jc, hosts, 1.0 + BEAT)  # the beat's answer is past it: sent again, and taken
    assert b"r0" in a.applied and jc.launch == 2


def _unit_opened(jc: JobCoordinator, hosts: dict[str, Host], h: Host, now: float,
                 owner: bytes = b"p") -> int:
    """Producer ``owner`` at ``h`` asks until the job opened a unit there: that unit."""
    for _ in range(2):
        got = h.c.request(owner, now)
        if isinstance(got, Assignment):
            return got.unit
        pump(jc, hosts, now)
    raise AssertionError(f"no unit opened at {h.c.job and h.c.job.member.host}: {got}")


def test_a_host_back_on_its_journal_under_a_later_launch_serves_what_the_older_took(
        tmp_path: Path) -> None:
    """Host a's consumer took a batch under launch 1, after the job's checkpoint; everything
    is killed. The job restarts from the checkpoint at b (launch 2) before a is back; a comes
    back on its journal, and its first view of the job is already of launch 2 (it never saw
    the launch change). What a's journal holds is launch 1's: the batch is not taken for
    launch 2 (the checkpoint does not hold it), and a serves it when its unit is open there
    again. (Before, a restarted host knew no launch, so that first view voided nothing: the
    batch stayed settled there and the epoch ended without it.)"""
    jc = JobCoordinator(STREAM, PLAN, timeout=5.0)
    hosts = {"a": Host("a", tmp_path / "a"), "b": Host("b", tmp_path / "b")}
    pump(jc, hosts, 0.0)
    a = hosts["a"]
    a.register(b"r0", None, 1.0)
    u = _unit_opened(jc, hosts, a, 1.0)
    assert u != 1, "the checkpoint holds unit 1"
    key = (0, u, 0)
    assert a.c.accept(key)
    assert a.c.settle(key) == []  # r0 took it, after the checkpoint
    a.c.commit()
    del hosts["a"]  # kill -9 of a (its journal stays), and of every rank
    b = hosts["b"]
    b.register(b"r1", checkpoint(), 2.0)
    pump(jc, hosts, 2.0)
    assert jc.launch == 2 and b"r1" in b.applied
    a = hosts["a"] = Host("a", tmp_path / "a", now=3.0)
    assert a.c.units[u].settled == 1  # its journal: launch 1's take
    pump(jc, hosts, 3.0)
    job = a.c.job
    assert job is not None and job.member.launch == 2
    assert u not in a.c.done and (u not in a.c.units or not a.c.units[u].settled), \
        "launch 1's take stands under launch 2"
    opened = [_unit_opened(jc, hosts, a, 3.0, b"p%d" % n) for n in range(PLAN.units - 1)]
    assert u in opened
    assert a.c.servable(key) and a.c.accept(key)


class BrokerHost(Host):
    """A host whose exact streams are wired to a real broker's consumer side (its buffer,
    its dispatch), as feedline.broker wires them; what it sends its consumers is recorded."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.sent: list[tuple[bytes, m.Message]] = []
        self.side = ConsumerSide(self._send, Buffer(), BrokerMetrics(CollectorRegistry()),
                                 DEFAULT_LIMITS, Budget(64, 1 << 26), 16, 1, lambda *_: None,
                                 exact=self.streams)

    def _send(self, ident: bytes, frames: list) -> int:
        self.sent.append((ident, m.decode(frames[0])))
        return 0

    def hello(self, ident: bytes, cursor: Cursor, now: float) -> None:
        self.side.on_message(ident, [zmq.Frame(m.encode(m.ConsumerHello(
            consumer=ident.decode(), session=1, window=8, max_bytes=1 << 24, registration=1,
            stream=STREAM, cursor=cursor.encode())))], -1, now)


def test_an_epoch_end_queued_before_a_new_launch_is_not_the_new_launchs() -> None:
    """Host a queued an EPOCH_END of the launch it knew (a view said the job's epoch 0
    ended: the host had restarted behind it) and has not sent it yet (a restarted host
    serves nothing for a grace period; or it waits behind batches). A rank of the job
    restarted from its checkpoint (epoch 0) registers at a and waits for the job's answer;
    the resume begins launch 2, whose view voids what a holds of launch 1. The rank, admitted
    now, must not be sent that END: it would end the rank's epoch 0 without any of it (as in
    tests/exact/test_job_hosts.py, where the rank went on to wait for the others' epoch)."""
    jc = JobCoordinator(STREAM, PLAN, timeout=5.0)
    a = BrokerHost("a")
    hosts: dict[str, Host] = {"a": a}
    pump(jc, hosts, 0.0)
    a.side.epoch_end(STREAM, 0)  # queued, not dispatched yet
    a.hello(b"r0", checkpoint(), 1.0)
    assert a.streams.waits(b"r0", STREAM)
    pump(jc, hosts, 1.0)
    job = a.c.job
    assert jc.launch == 2 and job is not None and job.launch_of[b"r0"] == 2
    assert not a.streams.waits(b"r0", STREAM)  # admitted under launch 2
    a.sent.clear()
    a.side.dispatch(2.0)
    ends = [msg for ident, msg in a.sent if ident == b"r0" and isinstance(msg, m.EpochEnd)]
    assert not ends, f"launch 1's end went to a rank of launch 2: {ends}"

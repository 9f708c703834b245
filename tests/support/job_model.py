"""The model of one exact stream served by several hosts (:class:`JobModel`): a Hypothesis
rule-based state machine drives the real :class:`feedline.exact.job.JobCoordinator` (with
its real journal, in a tmpfs directory) and one real :class:`feedline.exact.member.JobMember`
per host, with a host's delivery played in miniature (producers make a unit's batches into
the host's buffer, the host delivers them to its consumers, says a unit is done or gives it
back). What tests/exact/test_job_model.py checks is said in its docstring."""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from feedline.exact.cursor import Cursor
from feedline.exact.job import JobCoordinator, JobRefused, Message, View
from feedline.exact.journal import Journal
from feedline.exact.member import Answer, JobMember
from feedline.exact.plan import ExactPlan

Key = tuple[int, int, int]
STREAM = "s"
HOSTS = 3
UNITS = 5
EPOCHS = 3
TIMEOUT = 5.0
_SHM = "/dev/shm" if os.path.isdir("/dev/shm") else None


def batches_of(unit: int) -> int:
    return 1 + unit % 3  # units of 1, 2 and 3 batches


@dataclass
class Rank:
    """A training process's consumer at a host."""

    launch: int  # the model's launch (job restart) it belongs to
    admitted: int = 0  # the coordinator's launch it was admitted under; 0: not yet
    after: int = 0  # the seq of its registration (a beat or a resume)
    resume: Cursor | None = None  # its resume=, until admitted
    alive: bool = True
    epoch_ends: list[int] = field(default_factory=list)
    keys: list[Key] = field(default_factory=list)  # what it took


@dataclass
class Host:
    name: str
    member: JobMember
    session: int = 1
    up: bool = True
    cut: bool = False  # partitioned: what it sends and is sent is lost
    joined: bool = False  # its Join was answered by this coordinator
    buffer: set[Key] = field(default_factory=set)  # made, not delivered (lost in a crash)
    # The host's own journal (its coordinator's, feedline.exact.coordinator): the batches
    # taken here, and the (job, launch) they were taken under; it survives a restart.
    settled: set[Key] = field(default_factory=set)
    journal_launch: tuple[int, int] = (0, 0)
    ranks: list[Rank] = field(default_factory=list)


class JobModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="feedline-job-model-", dir=_SHM))
        self.path = self.dir / "s.job.jsonl"
        self.plan = ExactPlan(UNITS, 1, EPOCHS, 0xF00D)
        self.now = 100.0
        self.jc: JobCoordinator | None = JobCoordinator(STREAM, self.plan, Journal(self.path),
                                                        timeout=TIMEOUT, now=self.now)
        self.to_jc: list[tuple[str, Message]] = []
        self.to_host: list[View] = []
        self.hosts = {f"h{i}": Host(f"h{i}", JobMember(f"h{i}", STREAM, self.plan, 1))
                      for i in range(HOSTS)}
        # The truth: per model launch, what its ranks took, and what it resumed from.
        self.launch = 1
        self.base: dict[int, Cursor] = {1: Cursor(STREAM, 0)}
        self.took: dict[int, list[Key]] = {1: []}
        self.checkpoints: list[Cursor] = [Cursor(STREAM, 0)]
        self.refused_ranks = 0

    def teardown(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)

    # -- the network ----------------------------------------------------------------------
    def _send(self, h: Host, msg: Message | None) -> None:
        if msg is not None and h.up and not h.cut:
            self.to_jc.append((h.name, msg))

    @initialize(ranks=st.lists(st.integers(0, HOSTS - 1), min_size=1, max_size=4))
    def start(self, ranks: list[int]) -> None:
        for h in self.hosts.values():
            self._send(h, h.member.join())
        for i in ranks:
            self._add_rank(self.hosts[f"h{i}"], None)

    def _add_rank(self, h: Host, resume: Cursor | None) -> None:
        r = Rank(self.launch, resume=resume)
        h.ranks.append(r)
        self._register(h, r)

    def _register(self, h: Host, r: Rank) -> None:
        """``r``'s registration at ``h``, as a consumer's HELLO: a resume (with the host's
        consumers of its current launch, counted as a host probes them) or a beat."""
        msg: Message
        if r.resume is not None:
            alive = sum(1 for x in h.ranks if x.alive and x.admitted == h.member.launch
                        and x.admitted)
            msg = h.member.resume(r.resume, alive)
        else:
            msg = h.member.beat(self._readers(h))
        r.after = msg.seq
        self._send(h, msg)

    def _readers(self, h: Host) -> int:
        return sum(1 for r in h.ranks if r.alive and (r.admitted == h.member.launch
                                                      or not r.admitted))

    @precondition(lambda self: self.to_jc and self.jc is not None)
    @rule(data=st.data())
    def jc_takes(self, data: st.DataObject) -> None:
        """The coordinator takes one message (any of those in flight: reordering)."""
        self._jc_take(data.draw(st.integers(0, len(self.to_jc) - 1)))

    def _jc_take(self, n: int) -> None:
        assert self.jc is not None
        name, msg = self.to_jc.pop(n)
        try:
            views = self.jc.handle(msg, self.now)
        except JobRefused as e:
            assert e.reason == "not_registered", e.text
            self.hosts[name].joined = False
            event("job: a host is told to join again")
            return
        self.jc.commit()  # durable before any answer leaves
        self.to_host += views

    @precondition(lambda self: self.to_host)
    @rule(data=st.data())
    def host_takes(self, data: st.DataObject) -> None:
        self._host_take(data.draw(st.integers(0, len(self.to_host) - 1)))

    def _host_take(self, n: int) -> None:
        v = self.to_host.pop(n)
        h = self.hosts[v.host]
        if not h.up or h.cut:
            return
        if v.session == h.member.session:
            h.joined = True
        before = (h.member.epoch, h.member.finished)
        ch = h.member.view(v)
        # What the host's coordinator does with it (Coordinator.job_view): a new launch or
        # epoch voids what it settled, a unit no longer open here its batches'.
        if ch.new_launch or (h.member.epoch, h.member.finished) != before:
            h.settled.clear()
        for u in ch.closed:
            h.settled = {k for k in h.settled if k[1] != u}
        if h.member.launch:
            h.journal_launch = (h.member.job, h.member.launch)
        if ch.new_launch:
            # Every unit of the older launch is void: its buffered batches go, and its
            # consumers are refused (they are of the launch before).
            h.buffer = {k for k in h.buffer if h.member.deliverable(*k)}
            for r in h.ranks:
                if r.alive and r.admitted and r.admitted != h.member.launch:
                    r.alive = False
                    if r.launch == self.launch:
                        self.refused_ranks += 1
                        event("job: a rank of the current launch refused")
        for r in h.ranks:
            if r.alive and ch.ended and r.admitted == h.member.launch:
                r.epoch_ends += ch.ended
                for e in ch.ended:
                    self._check_complete(r.launch, e)
                    event("job: a rank told an epoch ended")
        if ch.closed:
            h.buffer = {k for k in h.buffer if h.member.deliverable(*k)}
        for r in h.ranks:
            if not r.alive or r.admitted:
                continue
            answer = h.member.answer(v, r.after, r.resume is not None)
            if answer is Answer.AGAIN:
                self._register(h, r)  # lost, refused or BUSY: sent again
                event("job: a resume sent again")
            elif answer is Answer.ADMITTED:
                r.admitted, r.resume = h.member.launch, None
        if ch.probe:
            self._send(h, h.member.beat(self._readers(h)))

    @precondition(lambda self: self.to_jc or self.to_host)
    @rule(data=st.data(), to_jc=st.booleans())
    def lose(self, data: st.DataObject, to_jc: bool) -> None:
        q: list = self.to_jc if to_jc and self.to_jc else self.to_host or self.to_jc
        q.pop(data.draw(st.integers(0, len(q) - 1)))

    @precondition(lambda self: self.to_jc)
    @rule(data=st.data())
    def repeat(self, data: st.DataObject) -> None:
        """A message delivered twice (sent again after a reconnect)."""
        self.to_jc.append(self.to_jc[data.draw(st.integers(0, len(self.to_jc) - 1))])

    # -- a host's own work ------------------------------------------------------------------
    def _host(self, data: st.DataObject) -> Host:
        return self.hosts[data.draw(st.sampled_from(sorted(self.hosts)))]

    def _admitted(self, h: Host) -> list[Rank]:
        return [r for r in h.ranks if r.alive and r.admitted and r.admitted == h.member.launch]

    @rule(data=st.data())
    def ask(self, data: st.DataObject) -> None:
        """A host with consumers asks for a unit for a producer (one without any gives its
        units back instead: nobody would take their batches)."""
        h = self._host(data)
        if not h.joined:
            self._send(h, h.member.join(self._readers(h)))
        elif self._admitted(h):
            self._send(h, h.member.ask())
        else:
            for u in sorted(h.member.open):
                h.buffer = {k for k in h.buffer if k[1] != u}
                self._send(h, h.member.back(u, self._unit_taken(h, u)))

    @rule(data=st.data())
    def beat(self, data: st.DataObject) -> None:
        h = self._host(data)
        if h.up:
            self._send(h, h.member.beat(self._readers(h)) if h.joined
                       else h.member.join(self._readers(h)))

    @rule(data=st.data())
    def make(self, data: st.DataObject) -> None:
        """A producer of the host makes the next batch of a unit open there."""
        h = self._host(data)
        if not h.up or not h.member.open:
            return
        u = data.draw(st.sampled_from(sorted(h.member.open)))
        for i in range(batches_of(u)):
            key = (h.member.epoch, u, i)
            if h.member.deliverable(*key) and key not in h.buffer \
                    and not self._taken_here(h, key):
                h.buffer.add(key)
                return

    def _taken_here(self, h: Host, key: Key) -> bool:
        return key in h.settled

    @rule(data=st.data())
    def deliver(self, data: st.DataObject) -> None:
        h = self._host(data)
        ranks = self._admitted(h)
        if not h.up or not h.buffer or not ranks:
            return
        key = data.draw(st.sampled_from(sorted(h.buffer)))
        self._deliver(h, key, data.draw(st.sampled_from(ranks)))

    def _deliver(self, h: Host, key: Key, r: Rank) -> None:
        h.buffer.discard(key)
        if not h.member.deliverable(*key) or self._taken_here(h, key):
            return
        r.keys.append(key)
        h.settled.add(key)
        self.took.setdefault(r.launch, []).append(key)
        epoch, u, _ = key
        taken = self._unit_taken(h, u)
        total = (1 << batches_of(u)) - 1
        if taken & total == total:
            self._send(h, h.member.done(u, batches_of(u)))

    def _unit_taken(self, h: Host, u: int) -> int:
        got = h.member.open.get(u)
        bits = got[1] if got else 0
        for e, uu, i in h.settled:
            if e == h.member.epoch and uu == u:
                bits |= 1 << i
        return bits

    @rule(data=st.data())
    def give_back(self, data: st.DataObject) -> None:
        """The host has no producer left for a unit: what it buffered of it goes, and the
        coordinator hears what its consumers took of it."""
        h = self._host(data)
        if not h.up or not h.member.open:
            return
        u = data.draw(st.sampled_from(sorted(h.member.open)))
        h.buffer = {k for k in h.buffer if k[1] != u}
        self._send(h, h.member.back(u, self._unit_taken(h, u)))

    # -- faults -----------------------------------------------------------------------------
    @rule(data=st.data())
    def host_restarts(self, data: st.DataObject) -> None:
        """kill -9 of the host's broker, started again: its buffer is lost, its journal (what
        it settled, and the launch that was of) stays and the member is restored from it as
        feedline.exact.streams restores it (not its open units: the coordinator's view says
        them), its consumers register again."""
        h = self._host(data)
        old = h.member
        h.session += 1
        m = JobMember(h.name, STREAM, self.plan, h.session)
        if h.journal_launch != (0, 0):
            m.restore(*h.journal_launch, old.epoch, old.finished)
        h.member, h.buffer, h.joined, h.up = m, set(), False, True
        self._send(h, m.join(self._readers(h)))
        for r in h.ranks:  # those not admitted yet register again, with the new broker
            if r.alive and not r.admitted:
                self._register(h, r)

    @rule(data=st.data())
    def partition(self, data: st.DataObject) -> None:
        h = self._host(data)
        h.cut = not h.cut
        event("job: a host cut off" if h.cut else "job: a host back")

    @rule(dt=st.sampled_from([0.5, 2.0, TIMEOUT + 1]))
    def time_passes(self, dt: float) -> None:
        self.now += dt

    @rule(torn=st.booleans())
    def coordinator_restarts(self, torn: bool) -> None:
        """kill -9 of the coordinator, started again from its journal (its last line torn,
        or not): what it had not committed is lost with it."""
        self.jc = None
        if torn and self.path.exists():
            # It died writing a record nobody was answered on: half a line at the end.
            with open(self.path, "ab") as f:
                f.write(b'0badc0de {"junit":[1,"op')
        self.jc = JobCoordinator(STREAM, self.plan, Journal(self.path), timeout=TIMEOUT,
                                 now=self.now)
        event("job: the coordinator restarted")

    @rule(data=st.data(), world=st.lists(st.integers(0, HOSTS - 1), min_size=1, max_size=4))
    def job_restarts(self, data: st.DataObject, world: list[int]) -> None:
        """Every rank killed; the job starts again from one of its checkpoints on another
        number of hosts and ranks."""
        cursor = data.draw(st.sampled_from(self.checkpoints))
        for h in self.hosts.values():
            for r in h.ranks:
                r.alive = False
            h.ranks = []
        self.launch += 1
        self.base[self.launch] = cursor
        self.took[self.launch] = []
        res = Cursor(cursor.stream, cursor.epoch, dict(cursor.bits), cursor.pipeline, True)
        for i in world:
            self._add_rank(self.hosts[f"h{i}"], res)
        event(f"job: restarted on {len(set(world))} hosts x {len(world)} ranks")

    @rule()
    def checkpoint(self) -> None:
        """The ranks of the current launch save their cursors (merged at save time)."""
        ranks = [r for h in self.hosts.values() for r in h.ranks
                 if r.alive and r.launch == self.launch and r.admitted]
        if not ranks:
            return
        base = self.base[self.launch]
        keys = self.took[self.launch]
        ended = [e + 1 for r in ranks for e in r.epoch_ends]
        epoch = max([base.epoch, *(k[0] for k in keys), *ended])
        c = Cursor(STREAM, epoch, pipeline=self.plan.fingerprint)
        if base.epoch == epoch:
            c.bits = dict(base.bits)
        for e, u, i in keys:
            if e == epoch:
                c.add(u, i)
        self.checkpoints.append(c)

    @precondition(lambda self: any(r.alive for h in self.hosts.values() for r in h.ranks))
    @rule()
    def run_to_the_end(self) -> None:
        """Faults stop: every host back, messages in order, every host at work, until the
        epoch ends (nothing may be stranded: a unit open at a host that never finishes it)."""
        for h in self.hosts.values():
            h.cut = False
        if self.jc is not None and self.jc.finished:
            return  # every epoch of the run served: nothing more to end
        start = (self.jc.launch, self.jc.epoch, self.jc.finished) if self.jc else None
        for _ in range(60):
            self.now += 1.0
            for h in self.hosts.values():
                self.to_jc.append((h.name, h.member.join(self._readers(h)) if not h.joined
                                   else h.member.beat(self._readers(h))))
                if h.joined and self._admitted(h):
                    self.to_jc.append((h.name, h.member.ask()))
            self._drain()
            for h in self.hosts.values():
                if not self._admitted(h):
                    for u in sorted(h.member.open):
                        h.buffer = {k for k in h.buffer if k[1] != u}
                        self._send(h, h.member.back(u, self._unit_taken(h, u)))
                for u in sorted(h.member.open):
                    for i in range(batches_of(u)):
                        key = (h.member.epoch, u, i)
                        if h.member.deliverable(*key) and not self._taken_here(h, key):
                            h.buffer.add(key)
                ranks = self._admitted(h)
                for n, key in enumerate(sorted(h.buffer)):
                    if ranks:
                        self._deliver(h, key, ranks[n % len(ranks)])
            self._drain()
            assert self.jc is not None
            if start is None or (self.jc.launch, self.jc.epoch, self.jc.finished) != start:
                event("job: an epoch ended (run to the end)")
                return
        units = [(u, s.state.value, s.host) for u, s in enumerate(self.jc.units)] \
            if self.jc is not None else []
        raise AssertionError(f"stranded: the epoch does not end ({units})")

    def _drain(self) -> None:
        """Every message in flight taken, in order, and their answers (a bounded number of
        rounds: a resume told to come again comes again in the next one)."""
        for _ in range(8):
            if not (self.to_jc or self.to_host):
                return
            while self.to_jc:
                self._jc_take(0)
            while self.to_host:
                self._host_take(0)

    # -- what must hold -----------------------------------------------------------------------
    def _check_complete(self, launch: int, epoch: int) -> None:
        base = self.base[launch]
        got = {k for k in self.took[launch] if k[0] == epoch}
        if base.epoch == epoch:
            got |= set(base.keys())
        want = {(epoch, u, i) for u in range(UNITS) for i in range(batches_of(u))}
        assert got == want, (f"launch {launch}: epoch {epoch} ended without "
                             f"{sorted(want - got)}")

    @invariant()
    def nothing_twice(self) -> None:
        for launch, keys in self.took.items():
            assert len(keys) == len(set(keys)), (
                f"launch {launch} took twice: {sorted(k for k in keys if keys.count(k) > 1)}")
            base = self.base[launch]
            again = [k for k in keys if k[0] == base.epoch and base.has(k[1], k[2])]
            assert not again, f"launch {launch} took again what it resumed from: {again}"
            assert all(k[0] >= base.epoch for k in keys), "an epoch before the checkpoint's"

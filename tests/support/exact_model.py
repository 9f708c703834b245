"""The model of exact delivery that a Hypothesis rule-based state machine drives
(:class:`ExactModel`): what tests/exact/test_coordinator_model.py checks and
fuzz/model_soak.py soaks. What it plays and checks is said in that test's docstring."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from feedline.exact.coordinator import Assignment, Coordinator, ExactPlan
from feedline.exact.cursor import Cursor
from feedline.exact.journal import Journal
from feedline.exact.keeper import CursorKeeper
from feedline.exact.keeper import report as keeper_report

Key = tuple[int, int, int]
WINDOW = 2
GRACE = 2.0
_SHM = "/dev/shm" if os.path.isdir("/dev/shm") else None


@dataclass
class Consumer:
    reg: int = 1
    registered: bool = True  # the broker has this registration
    paused: bool = False
    restarted: bool = False  # the broker restarted since it last registered
    queue: list[tuple[Key, int]] = field(default_factory=list)  # delivered, not taken
    unacked: list[Key] = field(default_factory=list)  # taken, TAKEN not processed
    # Its cursor: what it took of its epoch, as a consumer keeps it (feedline.exact.keeper).
    keeper: CursorKeeper = field(default_factory=lambda: CursorKeeper("val", WINDOW))


@dataclass
class Producer:
    ident: bytes
    session: int = 0
    # The run it registered in: the coordinator's ``end`` then (None: it registered on a
    # finished stream, a newcomer). A producer of a run is never given a later run's unit.
    run: int | None = None
    given: bool = False
    unit: tuple[int, int, int, int] | None = None  # epoch, unit, next index, batches
    empty: list[int] = field(default_factory=list)
    # When it started (time.monotonic(); None: it does not say, an older producer): with the
    # job (before any run was served), or when it registers.
    started: float | None = None


class ExactModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="feedline-model-", dir=_SHM))
        self.path = self.dir / "val.exact.jsonl"

    def teardown(self) -> None:
        try:
            if getattr(self, "coord", None) is not None:
                self.drain()
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)

    # -- set-up ---------------------------------------------------------------------------
    @initialize(size=st.integers(2, 13), unit=st.integers(1, 5), batch=st.integers(1, 3),
                epochs=st.sampled_from([0, 1, 2, 3]), skipping=st.booleans())
    def setup(self, size: int, unit: int, batch: int, epochs: int, skipping: bool) -> None:
        self.plan = ExactPlan(size, unit, epochs, fingerprint=1)
        self.batch, self.skipping = batch, skipping
        self.now = 0.0
        self.coord = Coordinator("val", self.plan, Journal(self.path))
        self.buffer: list[Key] = []
        self.inflight: dict[int, list[Key]] = {0: []}  # the broker's, per registered consumer
        self.orphans: dict[int, list[Key]] = {}
        self.consumers = {0: Consumer()}
        # The consumers registered during the run being (or last) served, and whether one
        # not of them registered since it was served: the model's own account of the rule.
        self.run_consumers: set[int] = set()
        self.came_since = False
        self._reads(0)
        self.producers: dict[int, Producer] = {}
        self.ids = 0
        self.t0 = time.monotonic()  # the job's start: before any run is served
        self.served_known = False  # this coordinator served its run (not: restored so)
        self._enlist(Producer(b"p0", 0, started=self.t0))
        self.ids = 1
        self.job: dict[int, set[tuple[int, int]]] = {}  # what the job took, per epoch
        self.ended: set[int] = set()
        self.checkpoints: list[tuple[int, frozenset[tuple[int, int]]]] = [(0, frozenset())]
        self.writes = 0  # journal writes seen
        self._seen = self._stat()
        self.last_write_start = -1  # where the last append began (-1: a rewrite)
        self.kill_write = -10  # the journal write count at the last consumer kill

    # -- the pipeline's facts -----------------------------------------------------------
    def batches(self, u: int) -> int:
        n = min(self.plan.unit_size, self.plan.dataset_size - u * self.plan.unit_size)
        return -(-n // self.batch)

    def empty(self, e: int, u: int, j: int) -> bool:
        return self.skipping and (e * 7 + u * 3 + j) % 5 == 4

    def keys(self, e: int) -> set[tuple[int, int]]:
        return {(u, j) for u in range(self.plan.units) for j in range(self.batches(u))
                if not self.empty(e, u, j)}

    # -- bookkeeping --------------------------------------------------------------------
    def _stat(self) -> tuple[int, int]:
        try:
            st_ = self.path.stat()
            return st_.st_ino, st_.st_size
        except FileNotFoundError:
            return 0, 0

    def _wrote(self) -> None:
        now = self._stat()
        if now != self._seen:
            self.writes += 1
            # An append (same file, grown) can be torn; a rewrite replaces the file whole.
            self.last_write_start = self._seen[1] if now[0] == self._seen[0] else -1
            self._seen = now

    def _ended(self, epochs: list[int]) -> None:
        for e in epochs:
            event("an epoch ended")
            assert self.job.get(e, set()) == self.keys(e), (
                f"epoch {e} ended: lost {sorted(self.keys(e) - self.job.get(e, set()))}, "
                f"foreign {sorted(self.job.get(e, set()) - self.keys(e))}")
            self.ended.add(e)
        if epochs and self.coord.finished:  # its run served now, in this coordinator's life
            self.served_known = True

    def _requeue(self, items: list[Key]) -> None:
        self.buffer[:0] = [k for k in items if self.coord.servable(k)]

    # -- the ordinary flow: one rule, a run of small steps ----------------------------------
    @rule(data=st.data(), steps=st.integers(1, 12))
    def work(self, data: st.DataObject, steps: int) -> None:
        """Producers ask for units and make batches (one, or the rest of a unit; one may be
        lost on the way), the broker delivers, consumers take (one or all they hold) and
        acknowledge, time passes: ``steps`` of these, each of a peer drawn at random. (One
        rule, so that Hypothesis, which enables a random subset of rules per example, always
        lets the stream move.)"""
        for _ in range(steps):
            moves = self._moves()
            if not moves:
                return
            name, i = data.draw(st.sampled_from(moves))
            if name == "ask":
                self._ask(i)
            elif name == "make":
                self._make(i, lose=data.draw(st.booleans()), burst=data.draw(st.booleans()))
            elif name == "deliver":
                self._deliver(i)
            elif name == "take":
                self.take_from(i)
                while data.draw(st.booleans()) and self.consumers[i].queue:
                    self.take_from(i)
            elif name == "ack":
                self._ack(i)
            else:
                self._tick()

    def _moves(self) -> list[tuple[str, int]]:
        out = [("ask", i) for i, p in self.producers.items() if p.unit is None]
        out += [("make", i) for i, p in self.producers.items() if p.unit is not None]
        if self.buffer and not self.coord.recovering(self.now):
            out += [("deliver", i) for i, c in self.consumers.items()
                    if c.registered and len(self.inflight[i]) < WINDOW]
        out += [("take", i) for i, c in self.consumers.items() if c.queue and not c.paused]
        out += [("ack", i) for i, c in self.consumers.items()
                if c.unacked and c.registered and not c.paused]
        if self._may_tick():
            out.append(("tick", -1))
        return out

    def _enlist(self, p: Producer) -> None:
        """It registers (a HELLO): the broker enlists it with the stream's coordinator."""
        self.coord.enlist(p.ident, p.session, p.started)
        # Of the run being served, or, on a served stream, of that run if it started before
        # it was served (when the coordinator knows when that was); else a newcomer.
        early = self.served_known and p.started == self.t0
        p.run = None if self.coord.finished and not early else self.coord.end
        if self.coord.finished and early:
            event("a producer started with the job registers once its run was served")
        self.producers[p.session] = p

    def _reads(self, i: int, resumed: bool = False) -> None:
        """Consumer ``i`` registers (its HELLO; ``resumed``: with the resume cursor the broker
        just applied): the broker tells the coordinator."""
        self.coord.read_by(b"c%d" % i, i, resumed)
        if not self.coord.finished:
            self.run_consumers.add(i)
        elif i not in self.run_consumers:
            self.came_since = True

    def _unreads(self, i: int) -> None:
        self.coord.unread(b"c%d" % i)

    def _run_opens(self) -> None:
        """A run is served (again): the consumers and producers registered now are of it."""
        self.run_consumers = set(self._registered())
        self.came_since = False
        for q in self.producers.values():
            q.run = self.coord.end

    def _ask(self, i: int) -> None:
        p = self.producers[i]
        served, end = self.coord.finished, self.coord.end
        late = not self.came_since and bool(self.run_consumers & set(self._registered()))
        if p.started is not None and self.served_known:
            late = p.started == self.t0  # it started before the run was served
        got = self.coord.request(p.ident, self.now, first=not p.given)
        if served and not p.given and p.run is None:
            # A producer that came after the run was served is of it exactly when it is late.
            assert (got == "finished") == late, (
                f"{p.ident!r} (started {p.started}) told {got!r}; late: {late} (consumers of "
                f"the run {sorted(self.run_consumers)}, registered {self._registered()}, "
                f"one came since: {self.came_since}; served in this life: "
                f"{self.served_known})")
            if late:
                event("a late producer of the served run is told it is finished")
        if served and not self.coord.finished:
            self._run_opens()
            event("a new run")
            # A new run begins only when no producer of the served run is attached.
            stayed = [q.ident for q in self.producers.values() if q.run == end]
            assert not stayed, f"a new run while {stayed} of the served run are attached"
        if isinstance(got, Assignment):
            # ... and a producer of a run is never given a later run's unit.
            assert p.run is None or not p.run or got.epoch < p.run, (
                f"{p.ident!r}, of the run ending before epoch {p.run}, given {got}")
            p.given = True
            p.unit, p.empty = (got.epoch, got.unit, got.start, self.batches(got.unit)), []
        elif got == "finished":
            if not p.given:
                event("a producer of the run never given a unit ends with it")
            del self.producers[i]  # it exits
        self._wrote()

    def _make(self, i: int, lose: bool, burst: bool) -> None:
        """The unit's next batch (``burst``: all the rest of it; ``lose``: the first of them
        lost on the way, a reconnect), or, all made, UNIT_DONE."""
        p = self.producers[i]
        assert p.unit is not None
        e, u, j, n = p.unit
        if j < n:
            for k in range(j, n if burst else j + 1):
                if self.empty(e, u, k):
                    p.empty.append(k)
                elif not (lose and k == j) and self.coord.accept((e, u, k)):
                    self.buffer.append((e, u, k))
            p.unit = (e, u, n if burst else j + 1, n)
            return
        self._ended(self.coord.unit_done(p.ident, e, u, n, p.empty))
        p.unit = None
        self._wrote()

    def _deliver(self, i: int) -> None:
        """The broker sends buffered batches to a consumer with room (up to its window)."""
        while self.buffer and len(self.inflight[i]) < WINDOW:
            key = self.buffer.pop(0)
            self.inflight[i].append(key)
            self.consumers[i].queue.append((key, self.consumers[i].reg))

    def _ack(self, i: int) -> None:
        """Its TAKEN reaches the broker: what it took is settled."""
        c = self.consumers[i]
        for key in c.unacked:
            self.inflight[i].remove(key)
            self._ended(self.coord.settle(key))
        c.unacked = []
        self._wrote()

    def _may_tick(self) -> bool:
        """The recovery wait after a restart is a heartbeat timeout: the live consumers have
        registered again (with their reports) before it ends."""
        return self.now + 1.0 < self.coord.recovering_until or not any(
            not c.registered and not c.paused for c in self.consumers.values())

    def _tick(self) -> None:
        self.now += 1.0
        self.coord.commit(self.now)
        self._wrote()

    @precondition(lambda self: self.producers)
    @rule(data=st.data())
    def producer_dies(self, data: st.DataObject) -> None:
        i = data.draw(st.sampled_from(sorted(self.producers)))
        self.coord.release(self.producers.pop(i).ident)

    @precondition(lambda self: len(self.producers) < 3)
    @rule(start=st.sampled_from(["now", "with the job", "unsaid"]))
    def producer_starts(self, start: str) -> None:
        """A fresh producer (on a served stream: a second job's, or one of the job that was
        slow to come up), started now, with the job, or not saying when."""
        started = {"now": time.monotonic(), "with the job": self.t0}.get(start)
        self._enlist(Producer(b"p%d" % self.ids, self.ids, started=started))
        self.ids += 1

    # -- consumers ----------------------------------------------------------------------
    def _registered(self) -> list[int]:
        return [i for i, c in self.consumers.items() if c.registered]

    @precondition(lambda self: any(c.registered for c in self.consumers.values()))
    @rule(data=st.data())
    def pause_past_the_timeout(self, data: st.DataObject) -> None:
        i = data.draw(st.sampled_from(self._registered()))
        c = self.consumers[i]
        c.paused, c.registered = True, False
        self._unreads(i)
        self.orphans.setdefault(i, []).extend(self.inflight.pop(i))

    @precondition(lambda self: any(c.paused for c in self.consumers.values()))
    @rule(data=st.data())
    def wake(self, data: st.DataObject) -> None:
        i = data.draw(st.sampled_from([i for i, c in self.consumers.items() if c.paused]))
        self.consumers[i].paused = False

    @precondition(lambda self: any(not c.registered and not c.paused
                                   for c in self.consumers.values()))
    @rule(data=st.data())
    def register_again(self, data: st.DataObject) -> None:
        i = data.draw(st.sampled_from([i for i, c in self.consumers.items()
                                       if not c.registered and not c.paused]))
        self._register_again(i)

    def _register_again(self, i: int) -> None:
        """Its HELLO reports what it took of its epoch; what its earlier registration was sent
        is served again, but what is settled now."""
        c = self.consumers[i]
        c.reg += 1
        self._unreads(i)
        self._reads(i)
        if c.keeper.recent:
            # What its HELLO carries: the batches it took last, as much as a registration
            # holds (a resume cursor is applied by job_resumes, once, as the broker does).
            report = Cursor.decode(keeper_report(c.keeper.cursor, list(c.keeper.recent)))
            ended, lost = self.coord.merge(report)
            assert not lost, "a journaled coordinator never loses the position"
            self.buffer = [k for k in self.buffer if self.coord.servable(k)]
            self._ended(ended)
        c.unacked, c.registered, c.restarted = [], True, False
        self.inflight[i] = []
        self._requeue(self.orphans.pop(i, []))
        self._wrote()

    @precondition(lambda self: any(not c.restarted for c in self.consumers.values()))
    @rule(data=st.data())
    def consumer_killed(self, data: st.DataObject) -> None:
        """Not one that has not registered again since a broker restart: a consumer killed
        together with the broker takes its report with it (docs/reliability.md)."""
        self._kill(data.draw(st.sampled_from([i for i, c in self.consumers.items()
                                              if not c.restarted])))

    def _kill(self, i: int) -> None:
        """kill -9: what it took and did not acknowledge dies with it (the rule of
        docs/reliability.md); its connection closes, what it held is served again."""
        c = self.consumers.pop(i)
        self._unreads(i)
        for e, u, j in c.unacked:
            self.job.get(e, set()).discard((u, j))
        self._requeue(self.inflight.pop(i, []) + self.orphans.pop(i, []))
        self.kill_write = self.writes

    @precondition(lambda self: len(self.consumers) < 3)
    @rule()
    def consumer_starts(self) -> None:
        self.consumers[self.ids] = Consumer()
        self.inflight[self.ids] = []
        self._reads(self.ids)
        self.ids += 1

    # -- the journal, restarts, checkpoints ----------------------------------------------
    @precondition(lambda self: not any(c.paused for c in self.consumers.values())
                  and self.writes > self.kill_write)
    @rule(torn=st.floats(0.0, 1.0) | st.none())
    def broker_restarts(self, torn: float | None) -> None:
        """kill -9 and a restart with the same state dir; with ``torn``, the last append was
        cut short (only when no consumer that might have acknowledged it was killed: a killed
        consumer cannot report, docs/reliability.md)."""
        event("broker restarts")
        if torn is not None and self.last_write_start >= 0 \
                and self.writes > self.kill_write + 1:
            event("... its last record cut short")
            size = self.path.stat().st_size
            cut = self.last_write_start + int(torn * (size - self.last_write_start - 1))
            os.truncate(self.path, cut)
        journal = Journal(self.path)
        self.coord = Coordinator("val", self.plan, journal, journal.read("val"), GRACE,
                                 self.now)
        self.served_known = False  # when it was served is not in the journal
        self._seen = self._stat()
        self.run_consumers, self.came_since = set(), False  # in memory only
        self.buffer, self.orphans = [], {}  # producers go on with their units
        for q in list(self.producers.values()):  # ... and register again
            self._enlist(q)
        for c in self.consumers.values():  # they register again (register_again)
            c.registered, c.restarted = False, True
        self.inflight = {i: [] for i in self.consumers}

    @rule()
    def checkpoint(self) -> None:
        """The job saves its cursor: the merged cursor of its processes (the latest epoch)."""
        e = max(self.job, default=0)
        self.checkpoints.append((e, frozenset(self.job.get(e, set()))))

    @rule(data=st.data())
    def job_resumes(self, data: st.DataObject) -> None:
        """The job crashed (every consumer killed) and restarts from a checkpoint, any."""
        e, taken = data.draw(st.sampled_from(self.checkpoints))
        for i in list(self.consumers):
            self._kill(i)
        self.job = {k: v for k, v in self.job.items() if k < e}
        self.job[e] = set(taken)
        self.ended = {k for k in self.ended if k < e}
        _, ended = self.coord.resume(Cursor.of("val", e, _units(taken), pipeline=1))
        for q in self.producers.values():  # the run is open again: every producer is of it
            q.run = self.coord.end
        self.buffer = [k for k in self.buffer if self.coord.servable(k)]
        self.coord.holding(set(self.buffer))
        self._ended(ended)
        c = Consumer()
        c.keeper.resume_from(Cursor.of("val", e, _units(taken), pipeline=1))
        self.consumers[self.ids] = c
        self.inflight[self.ids] = []
        self._run_opens()  # the run is open again (resume), with its consumers
        self._reads(self.ids, resumed=True)
        self.ids += 1
        self._wrote()

    @invariant()
    def coordinator_consistent(self) -> None:
        if not hasattr(self, "coord"):
            return
        for u, p in self.coord.units.items():
            assert p.settled & ~p.accepted == 0 and u not in self.coord.done

    @rule(one_more=st.booleans(), start=st.sampled_from(["now", "with the job", "unsaid"]))
    def served_to_the_end(self, one_more: bool, start: str) -> None:
        """Mid-way, everything woken and run to the epoch's (or the run's) end: so that what
        follows a served run (its producers asking, late ones, a second job's) is drawn too.
        ``one_more``: a producer registers first, as the last units go out (one of the run
        that may never be given a unit)."""
        if one_more and len(self.producers) < 3:
            self.producer_starts(start)
        self.drain()

    # -- the end: nothing is stranded ---------------------------------------------------
    def drain(self) -> None:
        """Wake everything and run to the end of the epoch (or the run): it must end."""
        for i, c in self.consumers.items():
            c.paused = False
            if not c.registered:
                self._register_again(i)
        if not self.consumers:
            self.consumer_starts()
        if not self.producers:
            self.producer_starts("now")
        goal = self.coord.epoch
        for _ in range(8 * (self.plan.units + 4)):
            if self.coord.finished or goal in self.ended:
                return
            self.now = max(self.now, self.coord.recovering_until)
            self._tick()
            for i in list(self.producers):
                if i in self.producers:
                    if self.producers[i].unit is None:
                        self._ask(i)
                    while i in self.producers and self.producers[i].unit is not None:
                        self._make(i, lose=False, burst=True)
            for i, c in self.consumers.items():
                self._deliver(i)
                while c.queue:
                    self.take_from(i)
                self._ack(i)
        raise AssertionError(f"stranded: epoch {self.coord.epoch} never ended "
                             f"(units done {sorted(self.coord.done)}, buffer {self.buffer})")

    def take_from(self, i: int) -> None:
        """The consumer's iterator takes its next batch (``feedline.consumer.io.Shared.took``)."""
        c = self.consumers[i]
        key, reg = c.queue.pop(0)
        if reg != c.reg:
            return  # delivered under a registration the broker dropped: it serves it again
        c.unacked.append(key)  # counted taken either way (its credit)
        e, u, j = key
        if c.keeper.seen(e, u, j):
            return  # taken before (served again after a restart): not given to the model
        c.keeper.take(e, u, j, pipeline=1)
        got = self.job.setdefault(e, set())
        assert (u, j) not in got, f"{key} taken twice"
        got.add((u, j))


def _units(taken: frozenset[tuple[int, int]]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for u, j in taken:
        out.setdefault(u, []).append(j)
    return out

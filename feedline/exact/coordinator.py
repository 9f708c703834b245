"""Exact delivery: the coordinator of one stream's epochs and work units (no sockets).

The dataset (``dataset_size`` samples) is cut into units of ``unit_size``; an epoch is done
when every batch of every unit has been *settled*: taken by a consumer (reported by TAKEN).
The coordinator hands units to producers that ask, one epoch at a time; takes a unit back
from a producer that is gone (its next owner starts at the first batch the broker does not
have); accepts each batch ``(epoch, unit, index)`` once (a re-run unit's batches that are
already here are dropped); records a unit's batch count when its producer says it is done
(a unit whose batches did not all arrive goes back to be produced again from the first one
missing); and moves to the next epoch when every unit is settled.

Runs: a plan of ``epochs`` epochs is served, then the stream is *finished* (its producers are
told so and exit). A run's producers are those registered (:meth:`Coordinator.enlist`) while
it was served, by their session: each of them is told the run is finished, whether or not it
was ever given a unit. A producer that registers after the run was served and was never
given a unit is told which run it is of by when it started (its HELLO says how long ago,
``age_ms``): one started before the run was served is a *late* producer of it (it lost the
race to a faster one of its job) and is told it is finished; one started after it starts the
next run, from the next epoch number (a second job gets whole epochs again), once no producer
of the served run is attached any more; until then it is told ``busy`` (the last job's
producers are on their way out). The moment a run was served is kept in memory only: on a
stream restored finished from its journal, and for a producer that does not say when it
started (an older one), a consumer decides instead: such a producer is late while a consumer
of the run (one registered while it was served) is still registered and no other consumer
registered since (the job just served is still there and asked for nothing more), and starts
the next run otherwise. (A consumer's ``epoch()`` call sends nothing: the broker knows
consumers by their registrations only.) (One that joins a run only, ``--join-run``: a fleet's
scale-up, asks as if it had had units, and is told the stream is finished.)

Its state survives a broker restart through a journal (:mod:`feedline.exact.journal`): the
plan, the epoch, each unit done, and the settled batches (written every tick, at each unit's
end and whenever :data:`RECORDS_PER_COMMIT` settled batches wait, fsync'd). What the last
moments lost is given back by the consumers: each reports the batches it took last when it
registers again (:meth:`Coordinator.merge`). A job restarted from its checkpoint sets the epoch
to exactly its cursor (:meth:`Coordinator.resume`).
"""

from __future__ import annotations

import logging
import time
from typing import assert_never

from feedline.exact.cursor import Cursor
from feedline.exact.job import View
from feedline.exact.journal import (
    EpochBegun,
    HostLaunch,
    JobBegun,
    JobUnit,
    Journal,
    JournalCorrupt,
    Planned,
    Record,
    RunEnds,
    RunFinished,
    Settled,
    UnitDone,
    UnitTotal,
)
from feedline.exact.member import Change
from feedline.exact.plan import Assignment, ExactPlan, Key, NoUnit, UnitProgress
from feedline.exact.scope import JobScope

__all__ = ["RECORDS_PER_COMMIT", "Assignment", "Coordinator", "ExactPlan", "Key",
           "UnitProgress"]

log = logging.getLogger(__name__)
# Settled batches the journal may lack, at most (then it is written at once): with a
# consumer's window, what a consumer reports when it registers again (feedline.consumer.io).
RECORDS_PER_COMMIT = 1024
# Sessions kept as a run's producers, at most: beyond, those not attached go (a producer of
# the run that comes back after that is taken for a newcomer).
MAX_MEMBERS = 4096
_RETRY = 5.0  # seconds between attempts to write a failed journal again


class Coordinator:
    """One exact stream's epochs and units. ``records``: its journal's, already read and of
    this plan (a restart); ``grace``: after a restart, seconds during which nothing is handed
    out (the consumers report what they took first)."""

    def __init__(self, stream: str, plan: ExactPlan, journal: Journal | None = None,
                 records: list[Record] | None = None, grace: float = 0.0,
                 now: float = 0.0) -> None:
        self.stream, self.plan, self.journal = stream, plan, journal
        self.epoch = 0
        self.end = plan.epochs  # the run ends before this epoch; 0: never
        self.finished = False
        self.units: dict[int, UnitProgress] = {}
        self.done: dict[int, int] = {}  # units done this epoch -> their batch count
        self._next = 0  # units below this were assigned at least once this epoch
        self._unsaved: dict[int, int] = {}  # unit -> settled bits not yet journaled
        self._unsaved_n = 0  # batches in it
        self._retry_at = 0.0
        self.duplicates = 0
        # The run's producers (sessions registered while it was served) and the producers
        # attached now (ident -> session): what decides whether a newcomer on a finished
        # stream starts the next run. In memory only: after a restart, every producer that
        # registers again on a finished stream is a newcomer.
        self.members: set[int] = set()
        self.attached: dict[bytes, int] = {}
        # When each attached producer started (a time.monotonic() reading; absent: it did not
        # say), and when the run was last served (None: not in this process's life): a
        # producer started before that moment is of that run, however late it registers.
        self.started: dict[bytes, float] = {}
        self.served_at: float | None = None
        # The consumers registered now (ident -> session), the sessions of those registered
        # while the run was served, and whether one not of them registered since it was:
        # what tells a late producer of the run just served from the next job's.
        self.readers: dict[bytes, int] = {}
        self.run_readers: set[int] = set()
        self.read_since = False
        self._waits_logged = False
        self._late_logged = False
        # Counts what may have made a unit available (an epoch or a run begun, a unit given
        # back or to be made again): producers told "busy" are tried again when it moves.
        self.progress = 0
        # After a restart, what consumers took in the journal's last moments is known only
        # when they register again: until then nothing is delivered and no unit is handed
        # out again (it might be one they have).
        self.recovering_until = 0.0
        # Served with a job's coordinator (several hosts): only the units it opened here are
        # handed out, and the epoch moves when the job's does (feedline.exact.scope).
        self.job: JobScope | None = None
        # On a job's host: the (job, launch) this state is of, journaled (HostLaunch) so that
        # a host restarted on its journal knows it; None: not known (not a job's host yet, or
        # a journal written before hosts kept it).
        self.job_launch: tuple[int, int] | None = None
        if records:
            self._replay(records)
            if not self.finished:
                self.recovering_until = now + grace
        if journal is not None:
            journal.rewrite(self._snapshot(), state_change=not records)

    # -- journal --------------------------------------------------------------------------
    def _snapshot(self) -> list[Record]:
        recs: list[Record] = [Planned(self.plan)]
        if self.job_launch is not None:
            recs.append(HostLaunch(*self.job_launch))
        recs += [EpochBegun(self.epoch), RunEnds(self.end)]
        if self.finished:
            recs.append(RunFinished())
        for u, total in sorted(self.done.items()):
            recs.append(UnitDone(u, total))
        for u, p in sorted(self.units.items()):
            if p.settled:
                recs.append(Settled(u, p.settled))
            if p.total is not None:
                recs.append(UnitTotal(u, p.total))
        return recs

    def _replay(self, records: list[Record]) -> None:
        for r in records:
            u = getattr(r, "unit", None)
            if u is not None and not 0 <= u < self.plan.units:
                # Checksummed, yet not of this plan (edited, or another's): trusted, a "done"
                # beyond the units would end the epoch without some of its samples.
                raise JournalCorrupt(f"stream {self.stream!r}: its journal names unit {u}, "
                                     f"and the stream has {self.plan.units}")
            match r:
                case Planned():
                    pass  # the plan is the caller's (feedline.exact.streams)
                case HostLaunch(job=job, launch=launch):
                    self.job_launch = (job, launch)
                case EpochBegun(epoch=epoch):
                    self.epoch, self.units, self.done = epoch, {}, {}
                case RunEnds(end=end):
                    self.end = end
                case RunFinished():
                    self.finished = True
                case UnitDone(unit=u, total=total):
                    self.done[u] = total
                    self.units.pop(u, None)
                case Settled(unit=u, batches=b):
                    if u not in self.done:
                        p = self._unit(u)
                        p.settled |= b
                        p.accepted |= b
                case UnitTotal(unit=u, total=total):
                    if u not in self.done:
                        self._unit(u).total = total
                case JobBegun() | JobUnit():
                    raise JournalCorrupt(f"stream {self.stream!r}: its journal is a job "
                                         "coordinator's (feedline coordinator), not a "
                                         "broker's: give each its own --state-dir")
                case _:
                    assert_never(r)
        # A unit whose "done" record was lost (cut short) but whose batches are all settled
        # is done: nothing else would ever mark it.
        for u in [u for u, p in self.units.items() if p.complete()]:
            self._check(u, write=False)
        self.served_at = None  # when it was served is not in the journal
        log.info("stream %s: resumed epoch %d from the journal, %d of %d units done%s",
                 self.stream, self.epoch, len(self.done), self.plan.units,
                 "; every epoch of its run served" if self.finished else "")

    def commit(self, now: float = 0.0) -> None:
        """Journal what was settled (every tick); a failed journal is written whole again
        every few seconds."""
        j = self.journal
        if j is None:
            return
        if j.error is not None:
            self._unsaved.clear()
            self._unsaved_n = 0
            if now >= self._retry_at:
                self._retry_at = now + _RETRY
                j.rewrite(self._snapshot())
            return
        self._flush()

    def _flush(self, last: Record | None = None) -> None:
        """One fsync'd write: what waits, the settled batches, then ``last`` (a unit done
        comes after its batches: cut short, it is left out and they stand)."""
        j = self.journal
        if j is None:
            return
        for u, b in self._unsaved.items():
            j.add(Settled(u, b))
        self._unsaved.clear()
        self._unsaved_n = 0
        if last is not None:
            j.add(last)
        j.commit()

    def _save(self, record: Record) -> None:
        if self.journal is not None:
            self.journal.add(record)

    def _rewrite(self) -> None:
        self._unsaved.clear()
        self._unsaved_n = 0
        if self.journal is not None:
            self.journal.rewrite(self._snapshot())

    # -- units ----------------------------------------------------------------------------
    def _unit(self, u: int) -> UnitProgress:
        p = self.units.get(u)
        if p is None:
            p = self.units[u] = UnitProgress()
        return p

    def complete(self, epoch: int) -> bool:
        """Every batch of ``epoch`` was taken."""
        return epoch < self.epoch or (epoch == self.epoch and self.finished)

    def recovering(self, now: float) -> bool:
        return now < self.recovering_until

    def enlist(self, owner: bytes, session: int, started: float | None = None) -> None:
        """Producer ``owner`` (of ``session``, started at ``started``: a time.monotonic()
        reading, None if it did not say) registered: while a run is served, it is one of
        that run's producers."""
        self.attached[owner] = session
        if started is not None:
            self.started[owner] = started
        else:
            self.started.pop(owner, None)
        if not self.finished:
            self._member(session)
        elif session not in self.members and self._started_before(owner):
            # Of the run just served from the start: a producer of the next job that asks
            # first waits for it to leave, as for the run's other producers.
            self._member(session)
            self._said_late(self.of_served_run(owner))

    def _member(self, session: int) -> None:
        self.members.add(session)
        if len(self.members) > MAX_MEMBERS:
            self.members &= set(self.attached.values())

    def read_by(self, ident: bytes, session: int, resumed: bool = False) -> None:
        """Consumer ``ident`` (of ``session``) registered on the stream (``resumed``: with a
        resume cursor just applied: of the run its job resumed, even one that the resume
        found complete)."""
        self.readers[ident] = session
        if not self.finished or resumed:
            self._reader(session)
        elif session not in self.run_readers:
            self.read_since = True

    def unread(self, ident: bytes) -> None:
        """Consumer ``ident``'s registration ended."""
        self.readers.pop(ident, None)

    def _reader(self, session: int) -> None:
        self.run_readers.add(session)
        if len(self.run_readers) > MAX_MEMBERS:
            self.run_readers &= set(self.readers.values())

    def _open_run(self) -> None:
        """A run is served (again): the consumers registered now are of it."""
        self.read_since = False
        for session in self.readers.values():
            self._reader(session)

    def late(self) -> bool:
        """A newcomer now is a late producer of the run just served: a consumer of that run
        is registered, and none that is not of it registered since it was served."""
        return self.finished and not self.read_since and any(
            s in self.run_readers for s in self.readers.values())

    def _run_attached(self) -> int:
        """Producers of the served run still attached."""
        return sum(1 for s in self.attached.values() if s in self.members)

    def of_served_run(self, owner: bytes) -> str:
        """Why ``owner``, a producer that registered after the run was served and was never
        given a unit, is of that run ('' if it is of the next): it started before the run was
        served, or (when that is not known) :meth:`late`."""
        before = self._started_before(owner)
        if before is not None:
            return "it started before the run was served" if before else ""
        return "that run's consumer is still connected" if self.late() else ""

    def _started_before(self, owner: bytes) -> bool | None:
        """``owner`` started before the run was served (None: one of the two is not known)."""
        started = self.started.get(owner)
        if started is None or self.served_at is None:
            return None
        return started < self.served_at

    def _said_late(self, why: str) -> None:
        if not self._late_logged:
            self._late_logged = True
            log.info("stream %s: a producer registered after its run was served, and %s: it "
                     "is of that run, and told it is finished", self.stream, why)

    def request(self, owner: bytes, now: float = 0.0, first: bool = False) -> Assignment | NoUnit:
        """A unit for ``owner``, or why not: ``busy`` (the epoch's remaining units are being
        produced, or the broker is recovering, or, on a finished stream, the served run's
        producers are still attached: ask again) or ``finished``. ``first``: the producer was
        never given a unit; on a finished stream, if it registered after the run was served,
        it is a late producer of that run (:meth:`of_served_run`: told ``finished``), or else
        it starts the next run once the run's producers are gone."""
        if self.finished and self.job is not None:
            if first and not self._late_logged:
                self._late_logged = True
                log.warning("stream %s: the job's run was served, so a producer that "
                            "registers now is told it is finished (a job served by several "
                            "hosts runs once): to run the job again, give it another stream "
                            "name, or start its coordinator and brokers on empty --state-dir "
                            "directories", self.stream)
            return NoUnit.FINISHED
        if self.finished:
            if not first or self.attached.get(owner) in self.members:
                return NoUnit.FINISHED
            why = self.of_served_run(owner)
            if why:
                session = self.attached.get(owner)
                if session is not None:  # it stays of the run: asked again, the same answer
                    self._member(session)
                self._said_late(why)
                return NoUnit.FINISHED
            waiting = self._run_attached()
            if waiting:
                if not self._waits_logged:
                    self._waits_logged = True
                    log.info("stream %s: a producer of a new run waits for the %d producer(s) "
                             "of the run just served to leave", self.stream, waiting)
                return NoUnit.BUSY
            self._new_run()
        for u, p in self.units.items():
            if p.owner == owner and u not in self.done:
                # It asks again: our answer was lost (a reconnect, a broker restart). The
                # same unit, from where we are: a producer works on one unit at a time.
                return Assignment(self.epoch, u, p.first_missing())
        if self.recovering(now):
            return NoUnit.BUSY
        if self.job is not None:
            return self._request_of_job(self.job, owner, now)
        for u in sorted(self.units):  # units given back first (their owner is gone)
            p = self.units[u]
            if u not in self.done and p.owner is None and u < self._next and not p.produced():
                p.owner = owner
                return Assignment(self.epoch, u, p.first_missing())
        while self._next < self.plan.units:
            u = self._next
            self._next += 1
            if u in self.done:
                continue
            p = self._unit(u)
            if p.produced() or p.owner is not None:
                continue
            p.owner = owner
            return Assignment(self.epoch, u, p.first_missing())
        return NoUnit.BUSY

    def _request_of_job(self, job: JobScope, owner: bytes, now: float) -> Assignment | NoUnit:
        """A unit the job opened here, that no producer here makes (or ``busy``: one is
        asked for)."""
        spare = []
        for u in job.open_units():
            q = self.units.get(u)
            if u not in self.done and (q is None or (q.owner is None and not q.produced())):
                spare.append(u)
        if not spare:
            job.want(now)
            return NoUnit.BUSY
        p = self._unit(spare[0])
        p.owner = owner
        if len(spare) == 1:
            job.want(now)  # one ahead: the next producer to ask does not wait for the job
        return Assignment(self.epoch, spare[0], p.first_missing())

    def _new_run(self) -> None:
        readers = ("a consumer that came since" if self.read_since else
                   "the last run's consumer still connected" if self.readers else
                   "no consumer connected")
        self.progress += 1
        self.epoch += 1
        self.end = self.epoch + self.plan.epochs if self.plan.epochs else 0
        self.finished = False
        self.units, self.done, self._next = {}, {}, 0
        self.members = set()
        for session in self.attached.values():  # every producer here now is of this run
            self._member(session)
        self.run_readers = set()
        self._open_run()
        self._waits_logged = self._late_logged = False
        self._rewrite()
        log.info("stream %s: a new run of %s from epoch %d (a producer started after the "
                 "last run was served and its producers left, with %s)", self.stream,
                 f"{self.plan.epochs} epoch(s)" if self.plan.epochs else "epochs", self.epoch,
                 readers)

    def release(self, owner: bytes) -> None:
        """``owner`` is gone: its units go back to be produced from their first missing batch."""
        self.progress += 1
        self.attached.pop(owner, None)
        self.started.pop(owner, None)
        for p in self.units.values():
            if p.owner == owner:
                p.owner = None

    def accept(self, key: Key) -> bool:
        """A batch arrived: True if it is new (keep it), False if it is a duplicate of one
        here or settled, or of another epoch (drop it)."""
        epoch, u, i = key
        if epoch != self.epoch or self.finished or not 0 <= u < self.plan.units \
                or u in self.done:
            self.duplicates += 1
            return False
        if self.job is not None and not self.job.deliverable(epoch, u, i):
            self.duplicates += 1  # its unit is not open here (any more): another host's
            return False
        p = self._unit(u)
        if p.accepted >> i & 1 or (p.total is not None and i >= p.total):
            self.duplicates += 1
            return False
        p.accepted |= 1 << i
        return True

    def of_plan(self, pipeline: int) -> bool:
        """A batch made by ``pipeline`` (its fingerprint; 0: not said) is of this plan's
        pipeline. One of a replaced pipeline has keys of the same shape, (epoch, unit, index),
        as this one's: served as this one's, it would settle a batch of the new dataset that a
        consumer never got, and hand a trainer the old dataset's samples."""
        return not (pipeline and self.plan.fingerprint and pipeline != self.plan.fingerprint)

    def servable(self, key: Key, pipeline: int = 0) -> bool:
        """This batch may be served: of the epoch being served, of the plan's pipeline
        (:meth:`of_plan`), and not settled."""
        if not self.of_plan(pipeline):
            return False
        epoch, u, i = key
        if epoch != self.epoch or self.finished or u in self.done:
            return False
        if self.job is not None and not self.job.deliverable(epoch, u, i):
            return False
        p = self.units.get(u)
        return p is None or not p.settled >> i & 1

    def lost(self, key: Key) -> None:
        """A batch that was accepted is gone without being settled (never delivered)."""
        epoch, u, i = key
        p = self.units.get(u)
        if epoch == self.epoch and p is not None and not p.settled >> i & 1:
            p.accepted &= ~(1 << i)
            self.progress += 1

    def unit_done(self, owner: bytes, epoch: int, u: int, total: int,
                  empty: list[int] | None = None) -> list[int]:
        """Its producer sent all of unit ``u``: ``total`` batches, but for ``empty`` (batches
        every sample of which was skipped: nothing to take). Returns epochs completed."""
        if epoch != self.epoch or self.finished or u in self.done \
                or not 0 <= u < self.plan.units:
            return []
        if self.job is not None and u not in self.job.member.open:
            return []  # no longer open here: another host's to make
        p = self._unit(u)
        for i in empty or []:
            if 0 <= i < total:
                p.settled |= 1 << i
                p.accepted |= 1 << i
                self._unsaved[u] = self._unsaved.get(u, 0) | 1 << i
        if p.total is not None and p.total != total:
            log.warning("stream %s: unit %d had %d batches, now %d: is every producer running "
                        "the same pipeline?", self.stream, u, p.total, total)
        p.total = total if p.total is None else min(p.total, total)
        if p.owner == owner:
            p.owner = None
        self.progress += 1
        self._save(UnitTotal(u, p.total))
        return self._check(u)

    def settle(self, key: Key) -> list[int]:
        """A consumer took this batch. Returns the epochs this completed (for EPOCH_END)."""
        epoch, u, i = key
        if epoch != self.epoch or self.finished or u in self.done or not 0 <= u < self.plan.units:
            return []
        p = self._unit(u)
        bit = 1 << i
        if p.settled & bit:
            return []
        p.settled |= bit
        p.accepted |= bit
        self._unsaved[u] = self._unsaved.get(u, 0) | bit
        self._unsaved_n += 1
        if self._unsaved_n >= RECORDS_PER_COMMIT:
            self.commit()
        return self._check(u)

    def _check(self, u: int, write: bool = True) -> list[int]:
        p = self.units[u]
        if u in self.done or not p.complete():
            return []
        assert p.total is not None
        self.done[u] = p.total
        del self.units[u]
        if self.job is not None:  # the epoch ends when the job's does (job_view)
            self.job.unit_done(u, p.total)
            if write:
                self._flush(UnitDone(u, p.total))
            return []
        if len(self.done) < self.plan.units:
            if write:
                self._flush(UnitDone(u, p.total))
            return []
        self._unsaved.pop(u, None)
        ended = self.epoch
        self.progress += 1
        if self.end and ended + 1 >= self.end:
            self.finished = True
            self.served_at = time.monotonic()
        else:
            self.epoch += 1
            self.units, self.done, self._next = {}, {}, 0
        if write:
            self._rewrite()
        log.info("stream %s: epoch %d complete%s", self.stream, ended,
                 "; every epoch of its run served" if self.finished else "")
        return [ended]

    # -- what consumers say -----------------------------------------------------------------
    def merge(self, cursor: Cursor) -> tuple[list[int], bool]:
        """A consumer's report of what it took last (it registers again): settle it.
        Returns (epochs completed, lost): ``lost`` when the report shows that this
        coordinator lost the stream's position: it is of a later epoch, or, without a journal,
        it names batches this coordinator never served (the broker restarted)."""
        if cursor.epoch < self.epoch or (cursor.epoch == self.epoch and self.finished):
            return [], False  # that epoch is complete
        if cursor.epoch > self.epoch:
            return [], True
        keys = list(cursor.keys())
        if self.journal is None and not all(self._accepted(k) for k in keys):
            return [], True
        ended: list[int] = []
        for key in keys:
            ended += self.settle(key)
        self.commit()  # at once: the consumer that reported it may not live to report again
        return ended, False

    def _accepted(self, key: Key) -> bool:
        _, u, i = key
        p = self.units.get(u)
        return u in self.done or (p is not None and bool(p.accepted >> i & 1))

    def resume(self, cursor: Cursor) -> tuple[bool, list[int]]:
        """Set the epoch's state to exactly ``cursor`` (a job restarted from its checkpoint):
        what it holds is taken, everything else of its epoch is served (again). Returns
        (the epoch changed, epochs completed)."""
        changed = cursor.epoch != self.epoch
        self.progress += 1
        totals = {} if changed else {**self.done, **{u: p.total for u, p in self.units.items()
                                                     if p.total is not None}}
        owners = {} if changed else {u: p.owner for u, p in self.units.items() if p.owner}
        self.epoch, self.finished = cursor.epoch, False
        for session in self.attached.values():  # the run is open again: they are of it
            self._member(session)
        self._open_run()
        if self.plan.epochs and self.end <= self.epoch:
            self.end = self.epoch + 1
        self.units, self.done, self._next = {}, {}, 0
        self._unsaved.clear()
        for u, b in cursor.bits.items():
            if 0 <= u < self.plan.units and b:
                p = self._unit(u)
                p.settled = p.accepted = b
        for u, total in totals.items():
            self._unit(u).total = total
        for u, owner in owners.items():
            self._unit(u).owner = owner
        ended: list[int] = []
        for u in list(self.units):
            if u in self.units:
                ended += self._check(u, write=False)
        self._rewrite()
        return changed, ended

    # -- a job's coordinator's views (several hosts) -------------------------------------------
    def job_view(self, view: View) -> tuple[list[int], Change]:
        """A view of the job's coordinator arrived: the units open here and the job's epoch
        as it says. Returns the epochs that ended (for EPOCH_END), and what it changed."""
        job = self.job
        assert job is not None
        ch = job.take(view)
        ended: list[int] = []
        moved = (job.member.epoch, job.member.finished) != (self.epoch, self.finished)
        # The launch this state is of, journaled before anything of it is settled here: a
        # host restarted on its journal compares it with the job's (JobMember.view), and a
        # view of another launch voids what the journal holds (takes of that launch: not
        # the job's now, whose checkpoint may lack them).
        launch = (job.member.job, job.member.launch)
        relabeled = job.member.launch != 0 and launch != self.job_launch
        if relabeled:
            self.job_launch = launch
        if ch.new_launch or moved:
            if not ch.new_launch and job.member.epoch >= self.epoch:
                ended = list(range(self.epoch,
                                   job.member.epoch + (1 if job.member.finished else 0)))
            self.epoch, self.finished = job.member.epoch, job.member.finished
            self.units, self.done, self._next = {}, {}, 0
            if self.finished:
                self.served_at = time.monotonic()
            self._rewrite()
            if ended:
                log.info("stream %s: epoch %s complete on every host of the job%s", self.stream,
                         ", ".join(map(str, ended)),
                         "; every epoch of its run served" if self.finished else "")
        elif relabeled:
            self._rewrite()
        for u in ch.closed:
            if u not in self.done:
                self.units.pop(u, None)
        for u, _gen, taken in ch.opened:
            if taken:
                p = self._unit(u)
                p.settled |= taken
                p.accepted |= taken
        if ch.opened or ch.closed or ended or ch.new_launch:
            self.progress += 1
        return ended, ch

    def job_resumed(self, cursor: Cursor) -> None:
        """A consumer's resume was admitted under the job's launch: what its cursor holds of
        the epoch served here is taken (the job's view set the epoch and voided the older
        launch; nothing taken here since is made untaken, as :meth:`resume` would)."""
        if cursor.epoch != self.epoch or self.finished:
            return
        for u, b in cursor.bits.items():
            if 0 <= u < self.plan.units and b and u not in self.done:
                p = self._unit(u)
                new = b & ~p.settled
                if new:
                    p.settled |= new
                    p.accepted |= new
                    self._unsaved[u] = self._unsaved.get(u, 0) | new
        self.progress += 1
        self.commit()

    def job_tick(self, now: float, in_flight: set[Key]) -> None:
        """Give back the units open here that no producer here can make (see
        :mod:`feedline.exact.scope`): none registered for a while, and nothing of the unit
        buffered or in flight here (``in_flight``: the keys of both)."""
        job = self.job
        assert job is not None
        job.producers(len(self.attached), now)
        if not job.joined or not job.give_back_due(now):
            return
        busy = {u for e, u, _ in in_flight if e == self.epoch}
        for u in job.open_units():
            if u in self.done or u in busy:
                continue
            p = self.units.get(u)
            if p is not None and p.accepted & ~p.settled:
                continue  # accepted, not settled: still here somewhere
            job.back(u, p.settled if p is not None else 0)
            self.units.pop(u, None)

    def holding(self, keys: set[Key]) -> None:
        """After a resume: the batches still here (buffered, in flight) count as accepted."""
        for epoch, u, i in keys:
            if epoch == self.epoch and 0 <= u < self.plan.units and u not in self.done:
                self._unit(u).accepted |= 1 << i

"""Exact delivery: the coordinator of one stream's epochs and work units (no sockets).

The dataset (``dataset_size`` samples) is cut into units of ``unit_size``; an epoch is done
when every batch of every unit has been *settled*: taken by a consumer (reported by TAKEN).
The coordinator hands units to producers that ask, one epoch at a time; takes a unit back
from a producer that is gone (its next owner starts at the first batch the broker does not
have); accepts each batch ``(epoch, unit, index)`` once (a re-run unit's batches that are
already here are dropped); records a unit's batch count when its producer says it is done
(a unit whose batches did not all arrive goes back to be produced again from the first one
missing); and moves to the next epoch when every unit is settled.

Its state survives a broker restart through a journal (:class:`Journal`): the plan, the
epoch, each unit done, and the settled batches (written every ``commit_every`` seconds and at
each unit's end, fsync'd). What the last fraction of a second lost is given back by the
consumers: each reports what it took when it registers again (:meth:`merge`). A job restarted
from its checkpoint rolls the epoch back to its cursor (:meth:`resume`).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from feedline.cursor import Cursor

log = logging.getLogger(__name__)
Key = tuple[int, int, int]  # (epoch, unit, index)


@dataclass(frozen=True)
class ExactPlan:
    dataset_size: int
    unit_size: int
    epochs: int = 0  # 0: forever

    @property
    def units(self) -> int:
        return -(-self.dataset_size // self.unit_size)


@dataclass
class UnitProgress:
    owner: bytes | None = None
    accepted: set[int] = field(default_factory=set)  # here (buffered, in flight) or settled
    settled: set[int] = field(default_factory=set)
    total: int | None = None  # batches, once its producer said it is done

    def complete(self) -> bool:
        return self.total is not None and len(self.settled) >= self.total

    def first_missing(self) -> int:
        i = 0
        while i in self.accepted:
            i += 1
        return i


@dataclass(frozen=True)
class Assignment:
    epoch: int
    unit: int
    start: int


class Journal:
    """An fsync'd JSON-lines file of the coordinator's progress; compacted at each epoch."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._pending: list[dict] = []

    def read(self) -> list[dict]:
        try:
            lines = self.path.read_text().splitlines()
        except FileNotFoundError:
            return []
        out = []
        for ln in lines:
            try:
                out.append(json.loads(ln))
            except ValueError:
                break  # a torn last line: what was fsync'd before it stands
        return out

    def add(self, record: dict) -> None:
        self._pending.append(record)

    def commit(self) -> None:
        if not self._pending:
            return
        with open(self.path, "a") as f:
            for r in self._pending:
                f.write(json.dumps(r, separators=(",", ":")) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self._pending.clear()

    def rewrite(self, records: list[dict]) -> None:
        tmp = self.path.with_suffix(".tmp")
        with open(tmp, "w") as f:
            for r in records:
                f.write(json.dumps(r, separators=(",", ":")) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        self._pending.clear()


class Coordinator:
    """One exact stream's epochs and units."""

    def __init__(self, stream: str, plan: ExactPlan, journal: Journal | None = None,
                 grace: float = 0.0, now: float = 0.0) -> None:
        self.stream, self.plan, self.journal = stream, plan, journal
        # After a restart, what consumers took in the journal's last moments is known only
        # when they register again: until then nothing is delivered and no unit is handed
        # out again (it might be one they have).
        self.recovering_until = 0.0
        self.epoch = 0
        self.finished = False
        self.units: dict[int, UnitProgress] = {}
        self.done: set[int] = set()
        self._next = 0  # units below this were assigned at least once this epoch
        self._tokens: set[int] = set()  # resume cursors applied
        self.duplicates = 0
        if journal is not None:
            records = journal.read()
            self._replay(records)
            journal.rewrite(self._snapshot())
            if len(records) > 2:
                self.recovering_until = now + grace

    # -- journal --------------------------------------------------------------------------
    def _snapshot(self) -> list[dict]:
        recs: list[dict] = [{"plan": [self.plan.dataset_size, self.plan.unit_size,
                                      self.plan.epochs]}, {"epoch": self.epoch}]
        if self.finished:
            recs.append({"finished": True})
        for u, p in sorted(self.units.items()):
            if u in self.done:
                recs.append({"done": [u, p.total]})
            elif p.settled:
                recs.append({"settled": [u, sorted(p.settled)]})
            if p.total is not None and u not in self.done:
                recs.append({"total": [u, p.total]})
        return recs

    def _replay(self, records: list[dict]) -> None:
        for r in records:
            if "plan" in r:
                plan = ExactPlan(*r["plan"])
                if plan.dataset_size != self.plan.dataset_size or \
                        plan.unit_size != self.plan.unit_size:
                    log.warning("stream %s: the journal's plan %s differs from the producers' "
                                "%s: starting afresh", self.stream, plan, self.plan)
                    return
            elif "epoch" in r:
                self.epoch, self.units, self.done = int(r["epoch"]), {}, set()
            elif "finished" in r:
                self.finished = True
            elif "done" in r:
                u, total = r["done"]
                p = self._unit(u)
                p.total, p.settled = total, set(range(total))
                p.accepted = set(p.settled)
                self.done.add(u)
            elif "settled" in r:
                u, idx = r["settled"]
                p = self._unit(u)
                p.settled.update(idx)
                p.accepted.update(idx)
            elif "total" in r:
                u, total = r["total"]
                self._unit(u).total = total
        # Units begun but not done go back to be produced; those never begun wait their turn.
        self._next = 0
        log.info("stream %s: resumed epoch %d from the journal, %d of %d units done",
                 self.stream, self.epoch, len(self.done), self.plan.units)

    def commit(self) -> None:
        if self.journal is not None:
            self.journal.commit()

    # -- units --------------------------------------------------------------------------
    def _unit(self, u: int) -> UnitProgress:
        p = self.units.get(u)
        if p is None:
            p = self.units[u] = UnitProgress()
        return p

    def recovering(self, now: float) -> bool:
        return now < self.recovering_until

    def request(self, owner: bytes, now: float = 0.0) -> Assignment | str:
        """A unit for ``owner``, or why not: ``busy`` (the epoch's remaining units are being
        produced, or the broker is recovering; ask again) or ``finished``."""
        if self.finished:
            return "finished"
        for u, p in self.units.items():
            if p.owner == owner and u not in self.done:
                # It asks again: our answer was lost (a reconnect, a broker restart). The
                # same unit, from where we are: a producer works on one unit at a time.
                return Assignment(self.epoch, u, p.first_missing())
        if self.recovering(now):
            return "busy"
        for u in sorted(self.units):  # units given back first (their owner is gone)
            p = self.units[u]
            if u not in self.done and p.owner is None and u < self._next and \
                    (p.total is None or len(p.accepted) < p.total):
                p.owner = owner
                return Assignment(self.epoch, u, p.first_missing())
        while self._next < self.plan.units:
            u = self._next
            self._next += 1
            p = self._unit(u)
            if u in self.done or (p.total is not None and len(p.accepted) >= p.total):
                continue
            p.owner = owner
            return Assignment(self.epoch, u, p.first_missing())
        return "busy"

    def release(self, owner: bytes) -> None:
        """``owner`` is gone: its units go back to be produced from their first missing batch."""
        for p in self.units.values():
            if p.owner == owner:
                p.owner = None

    def accept(self, key: Key) -> bool:
        """A batch arrived: True if it is new (keep it), False if it is a duplicate of one
        here or settled, or of another epoch (drop it)."""
        epoch, u, i = key
        if epoch != self.epoch or self.finished or not 0 <= u < self.plan.units or u in self.done:
            self.duplicates += 1
            return False
        p = self._unit(u)
        if i in p.accepted or (p.total is not None and i >= p.total):
            self.duplicates += 1
            return False
        p.accepted.add(i)
        return True

    def lost(self, key: Key) -> None:
        """A batch that was accepted is gone without being settled (never delivered)."""
        epoch, u, i = key
        p = self.units.get(u)
        if epoch == self.epoch and p is not None and i not in p.settled:
            p.accepted.discard(i)

    def unit_done(self, owner: bytes, epoch: int, u: int, total: int,
                  empty: list[int] | None = None) -> list[int]:
        """Its producer sent all of unit ``u``: ``total`` batches, but for ``empty`` (batches
        every sample of which was skipped: nothing to take). Returns epochs completed."""
        if epoch != self.epoch or u in self.done or not 0 <= u < self.plan.units:
            return []
        p = self._unit(u)
        for i in empty or []:
            if 0 <= i < total:
                p.settled.add(i)
                p.accepted.add(i)
        if p.total is not None and p.total != total:
            log.warning("stream %s: unit %d had %d batches, now %d: is every producer running "
                        "the same pipeline?", self.stream, u, p.total, total)
        p.total = total if p.total is None else min(p.total, total)
        if p.owner == owner:
            p.owner = None
        if self.journal is not None:
            self.journal.add({"total": [u, p.total]})
        return self._check(u)

    def settle(self, key: Key) -> list[int]:
        """A consumer took this batch. Returns the epochs this completed (for EPOCH_END)."""
        epoch, u, i = key
        if epoch != self.epoch:
            return []
        p = self._unit(u)
        if i in p.settled:
            return []
        p.settled.add(i)
        p.accepted.add(i)
        if self.journal is not None:
            self.journal.add({"settled": [u, [i]]})
        return self._check(u)

    def _check(self, u: int) -> list[int]:
        p = self.units[u]
        if u in self.done or not p.complete():
            return []
        self.done.add(u)
        if self.journal is not None:
            self.journal.add({"done": [u, p.total]})
            self.journal.commit()
        if len(self.done) < self.plan.units:
            return []
        ended = self.epoch
        if self.plan.epochs and ended + 1 >= self.plan.epochs:
            self.finished = True
        else:
            self.epoch += 1
            self.units, self.done, self._next = {}, set(), 0
        if self.journal is not None:
            self.journal.rewrite(self._snapshot())
        log.info("stream %s: epoch %d complete%s", self.stream, ended,
                 "; every epoch served" if self.finished else "")
        return [ended]

    # -- what consumers report --------------------------------------------------------------
    def merge(self, cursor: Cursor) -> list[int]:
        """A consumer's report of what it took (after a broker restart): settle it all."""
        ended: list[int] = []
        if cursor.epoch != self.epoch:
            return ended
        for key in cursor.keys():
            ended += self.settle(key)
        return ended

    def resume(self, cursor: Cursor) -> bool:
        """Roll back to a job's checkpoint: exactly ``cursor`` of its epoch is taken, the rest
        is produced again. Applied once per cursor (token). True if the epoch changed."""
        if cursor.token in self._tokens:
            return False
        self._tokens.add(cursor.token)
        changed = cursor.epoch != self.epoch
        self.epoch, self.finished = cursor.epoch, False
        old = self.units
        self.units, self.done, self._next = {}, set(), 0
        for u, idx in cursor.taken.items():
            if 0 <= u < self.plan.units:
                p = self._unit(u)
                p.settled, p.accepted = set(idx), set(idx)
                if not changed and u in old:
                    p.total = old[u].total
        for u, q in old.items():  # totals are facts of the pipeline: keep them
            if not changed and q.total is not None:
                self._unit(u).total = q.total
        for u in list(self.units):
            self._check(u)
        if self.journal is not None:
            self.journal.rewrite(self._snapshot())
        return changed

    def holding(self, keys: set[Key]) -> None:
        """After a resume: the batches still here (buffered, in flight) count as accepted."""
        for epoch, u, i in keys:
            if epoch == self.epoch and 0 <= u < self.plan.units:
                self._unit(u).accepted.add(i)


class ExactStreams:
    """The coordinators of a broker's exact streams, created by their first producer."""

    def __init__(self, state_dir: Path | None = None) -> None:
        self.state_dir = state_dir
        self.streams: dict[str, Coordinator] = {}
        self._pending: dict[str, list[Cursor]] = {}  # cursors that came before any producer

    def get(self, stream: str) -> Coordinator | None:
        return self.streams.get(stream)

    def join(self, stream: str, plan: ExactPlan, now: float = 0.0,
             grace: float = 0.0) -> Coordinator | str:
        """The stream's coordinator for a producer with ``plan``, or why it is refused."""
        c = self.streams.get(stream)
        if c is None:
            journal = None
            if self.state_dir is not None:
                self.state_dir.mkdir(parents=True, exist_ok=True)
                journal = Journal(self.state_dir / f"{stream}.exact.jsonl")
            c = self.streams[stream] = Coordinator(stream, plan, journal, grace, now)
            for cursor in self._pending.pop(stream, []):
                (c.resume if cursor.resume else c.merge)(cursor)
            return c
        if (c.plan.dataset_size, c.plan.unit_size) != (plan.dataset_size, plan.unit_size):
            return (f"stream {stream!r} is exact over {c.plan.dataset_size} samples in units of "
                    f"{c.plan.unit_size}; this producer says {plan.dataset_size} in units of "
                    f"{plan.unit_size}")
        return c

    def report(self, stream: str, cursor: Cursor) -> Coordinator | None:
        """A consumer's cursor: applied now, or when the stream's first producer comes."""
        c = self.streams.get(stream)
        if c is None:
            if len(self._pending) < 64:
                self._pending.setdefault(stream, []).append(cursor)
            return None
        return c

    def commit(self) -> None:
        for c in self.streams.values():
            c.commit()

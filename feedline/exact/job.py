"""One exact stream served by several hosts (brokers, direct-mode trainers): the job's
coordinator, pure logic (no sockets, no clock of its own).

Each host keeps serving its own producers and consumers with its own
:class:`~feedline.exact.coordinator.Coordinator`, as on one host; what the job shares is
which host serves which unit of the epoch, and when the epoch is over. The rules:

- **A unit is open at one host at a time.** A host asks (:class:`Ask`) before it hands a
  unit to a producer; the coordinator opens a unit there (journaled before it answers) and
  counts its generation. Only that host delivers the unit's batches. A unit moves to
  another host only when its host gives it back (:class:`Back`: it has dropped what it
  buffered of the unit, and says exactly which batches its trainers took) or on a resume.
  A host whose producers die finds others for the unit among its own producers first (the
  one-host coordinator's recovery), and gives it back when it has none.
- **The epoch ends job-wide.** A host says a unit is done when every batch of it was taken
  there (:class:`Done`); when every unit of the epoch is done the coordinator tells every
  host (each :class:`View` carries the epoch), and only then opens units of the next one.
- **Every answer is the host's whole view**: the job, its launch, the epoch, and the units
  open at the host. A lost answer is made good by the next one; a host's messages are
  numbered and an old one (reordered, repeated) is ignored; an answer older than the host's
  last Done or Back does not hand those units back to it.
- **Resume starts a launch.** A job restarted from its checkpoint passes its cursor
  (``resume=``); the first rank's host forwards it (:class:`Resume`) and the coordinator sets
  the epoch to exactly it: what the cursor holds is taken, every other batch is served again.
  That begins a new *launch*: a host delivers a launch's units only to consumers it admitted
  under that launch (it admits a consumer once an answer newer than the consumer's HELLO
  came), so a host that learns of the launch late delivers the old launch's units only to the
  old launch's consumers, whose takes do not count: the model restarted from the checkpoint.
  The other ranks' resumes, with the same cursor while the launch has live consumers, are of
  the same launch and change nothing. That works on any number of hosts and ranks: the
  cursor is the job's (the ranks' cursors merged at save time).
- **A silent host keeps its open units** (at most :data:`MAX_OPEN` per host): nobody knows
  which of their batches its trainers took. They come back when it does (its journal and its
  consumers' cursors tell), when it gives them back, or when the job resumes.
- **Bounded**: at most ``max_hosts`` hosts, ``MAX_OPEN`` open units each; the state is the
  units of one epoch.

The coordinator's own restart: its journal holds the plan, the job's id, the launch, the
epoch, every unit opened, done or given back; an answer is sent only after the record it
depends on is fsync'd (the host layer commits before it sends). Without its journal a new
coordinator has another job id: a host that served the old one is told the position is
lost, and the job resumes from its checkpoint, which is all it needs.
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

from feedline.errors import FeedlineError
from feedline.exact.cursor import Cursor
from feedline.exact.journal import (
    JobBegun,
    JobUnit,
    Journal,
    JournalCorrupt,
    JournalStale,
    Planned,
    Record,
)
from feedline.exact.plan import ExactPlan, NoUnit
from feedline.liveness import HEARTBEAT_TIMEOUT

log = logging.getLogger(__name__)

MAX_HOSTS = 4096
MAX_OPEN = 64  # units open at one host at a time, at most (its producers', and one ahead)
OpenUnit = tuple[int, int, int]  # (unit, generation, bitmask of its batches already taken)


class JobRefused(FeedlineError):
    """A host's message the job cannot take: ``reason`` (a refusal reason), ``text`` one line
    saying what to do."""

    def __init__(self, reason: str, text: str) -> None:
        super().__init__(text)
        self.reason, self.text = reason, text


# -- messages: host -> coordinator --------------------------------------------------------
@dataclass(frozen=True)
class Join:
    """A host (re)registers: what it believes of the job (0s: nothing) and its open units."""

    host: str
    session: int
    seq: int
    plan: ExactPlan
    job: int = 0
    launch: int = 0
    epoch: int = 0
    open: tuple[OpenUnit, ...] = ()
    done: tuple[tuple[int, int, int], ...] = ()  # (unit, generation, batches)
    readers: int = 0  # its consumers of ``launch`` connected now


@dataclass(frozen=True)
class Ask:
    """Open a unit here (for a producer that asked for one)."""

    host: str
    session: int
    seq: int
    launch: int


@dataclass(frozen=True)
class Done:
    host: str
    session: int
    seq: int
    launch: int
    epoch: int
    unit: int
    gen: int
    batches: int


@dataclass(frozen=True)
class Back:
    """A unit given back: its batches buffered here dropped; ``taken`` what trainers took."""

    host: str
    session: int
    seq: int
    launch: int
    epoch: int
    unit: int
    gen: int
    taken: int


@dataclass(frozen=True)
class Resume:
    """A consumer registered with ``resume=cursor``; ``alive``: the host's other consumers
    of the current launch whose connection is open now (it probed them); ``launch``: the
    launch the host knew of when it sent this (a count of an older launch than the one the
    host's last resume began says nothing of that launch's consumers there)."""

    host: str
    session: int
    seq: int
    cursor: Cursor
    alive: int = 0
    launch: int = 0


@dataclass(frozen=True)
class Beat:
    """A host is alive; ``readers``: its consumers admitted under ``launch`` still there."""

    host: str
    session: int
    seq: int
    launch: int
    readers: int = 0


@dataclass(frozen=True)
class Leave:
    """A host stops serving the stream (after giving its units back)."""

    host: str
    session: int
    seq: int


Message = Join | Ask | Done | Back | Resume | Beat | Leave


# -- the answer: coordinator -> host -------------------------------------------------------
@dataclass(frozen=True)
class View:
    """The job as the coordinator sees it for one host, after its message ``seq``."""

    host: str
    session: int
    seq: int  # the host's last message taken into account
    job: int
    launch: int
    epoch: int
    finished: bool
    open: tuple[OpenUnit, ...]  # every unit open at this host
    opened: OpenUnit | None = None  # the unit an Ask opened
    wait: NoUnit | None = None  # why an Ask opened none; BUSY to a Resume: send it again
    probe: bool = False  # count the consumers of the launch now, and say so (Beat)
    # The seq of the host's last Resume taken, in its session (0: none): a consumer whose
    # resume it is not, once ``seq`` passed it, sends it again (it was lost, refused, or
    # answered BUSY; the coordinator will not take a message older than ``seq``).
    resumed: int = 0
    # The order views were made in (the coordinator's restarts, then a count): one that
    # comes after a newer one (reordered) is not taken.
    version: tuple[int, int] = (0, 0)


class Unit(Enum):
    FREE = "free"
    OPEN = "open"
    DONE = "done"


@dataclass
class UnitState:
    state: Unit = Unit.FREE
    host: str | None = None
    gen: int = 0
    taken: int = 0  # batches known taken (given back, or a resume's cursor)
    batches: int | None = None  # its batch count, once a host said it was done


@dataclass
class HostState:
    name: str
    session: int
    seq: int = 0
    heard: float = 0.0
    launch: int = 0  # the launch its last message was of
    readers: int = 0  # its consumers of the current launch still connected (Beat)
    readers_at: float = 0.0  # when it said so
    probe: bool = False  # its next view asks it to count them again at once
    resumed: int = 0  # the seq of its last Resume taken (not answered "send it again")
    open: set[int] = field(default_factory=set)


class JobCoordinator:
    """The job-wide state of one exact stream. :meth:`handle` takes a host's message and
    returns the views to send (the sender's first, then any other host's that changed: an
    epoch's end); :class:`JobRefused` for one the job refuses."""

    def __init__(self, stream: str, plan: ExactPlan, journal: Journal | None = None,
                 max_hosts: int = MAX_HOSTS, timeout: float = HEARTBEAT_TIMEOUT,
                 now: float = 0.0) -> None:
        self.stream, self.plan, self.journal, self.max_hosts = stream, plan, journal, max_hosts
        self.timeout = timeout
        self.job = secrets.randbits(62) | 1
        self.boot = 1  # restarts from the journal, counted
        self._made = 0  # views made since
        self.launch = 1
        self.epoch = 0
        self.finished = False
        self.units = [UnitState() for _ in range(plan.units)]
        self.hosts: dict[str, HostState] = {}
        self.resumed: bytes = b""  # the ident of the cursor the current launch began with
        self.restored = False
        self.messages = 0  # taken, for the cost figures
        self._probe_at = 0.0  # a resume asked for fresh consumer counts at this time
        # Whether a unit was opened since the current launch began (True after a restart:
        # not known): while not, nothing of the launch was served anywhere, and a host's
        # resume sent before it heard of the launch its earlier resume began joins that launch.
        self._served_in_launch = False
        self._restored: dict[str, set[int]] = {}  # host -> units open there, from the journal
        self._pool()
        records = journal.read(stream) if journal is not None else []
        # After a restart the hosts' consumer counts are not known until they join again:
        # until then a resume with the launch's own cursor is answered "send it again".
        self._counts_known_at = 0.0
        if records:
            self._replay(records)
            self.restored = True
            self._counts_known_at = now + timeout
            self._served_in_launch = True
        self._rewrite()

    @classmethod
    def open(cls, state_dir: Path, stream: str, plan: ExactPlan, timeout: float,
             now: float) -> JobCoordinator:
        """The coordinator of ``stream`` journaled in ``state_dir`` (``STREAM.job.jsonl``),
        restored from it if it is there; :class:`JobRefused` (``journal_corrupt``) if it
        cannot be used, and ``pipeline_mismatch`` if it is of another pipeline."""
        journal = Journal(state_dir / f"{stream}.job.jsonl")
        try:
            state_dir.mkdir(parents=True, exist_ok=True)
            return cls(stream, plan, journal, timeout=timeout, now=now)
        except (JournalCorrupt, JournalStale) as e:
            raise JobRefused("journal_corrupt", str(e)) from None
        except OSError as e:
            raise JobRefused("journal_corrupt", f"stream {stream!r}: cannot use the state "
                             f"directory {state_dir}: {e.strerror}") from None

    def counts(self) -> dict[str, int]:
        """The epoch's units by state (free, open, done)."""
        out = {u.value: 0 for u in Unit}
        if self.finished:  # its run was served: every unit of its last epoch is done
            out[Unit.DONE.value] = len(self.units)
            return out
        for s in self.units:
            out[s.state.value] += 1
        return out

    # -- journal ------------------------------------------------------------------------
    def _snapshot(self) -> list[Record]:
        out: list[Record] = [Planned(self.plan),
                             JobBegun(self.job, self.launch, self.epoch, self.finished,
                                      self.boot, self.resumed.hex())]
        out += [self._record(u) for u, s in enumerate(self.units)
                if s.state is not Unit.FREE or s.gen or s.taken or s.batches is not None]
        return out

    def _record(self, u: int) -> JobUnit:
        s = self.units[u]
        return JobUnit(u, s.state.value, s.host, s.gen, s.taken, s.batches)

    def _replay(self, records: list[Record]) -> None:
        for r in records:
            match r:
                case Planned(plan=plan):
                    if not plan.same_pipeline(self.plan):
                        raise JobRefused("pipeline_mismatch",
                                         _changed(self.stream, plan, self.plan))
                case JobBegun():
                    self.job, self.launch, self.epoch = r.job, r.launch, r.epoch
                    self.finished, self.boot = r.finished, r.boot + 1
                    self.resumed = bytes.fromhex(r.resumed)
                    self.units = [UnitState() for _ in range(self.plan.units)]
                case JobUnit() if r.unit < len(self.units):
                    self.units[r.unit] = UnitState(Unit(r.state), r.host, r.gen, r.taken,
                                                   r.batches)
                case _:
                    raise JournalCorrupt(f"stream {self.stream!r}: its journal is not a job "
                                         "coordinator's (a broker's?): give each its own "
                                         "--state-dir")
        # Who has which unit open, until each host joins again.
        for u, s in enumerate(self.units):
            if s.state is Unit.OPEN and s.host is not None:
                self._restored.setdefault(s.host, set()).add(u)
        self._pool()

    def _save(self, record: Record) -> None:
        if self.journal is not None:
            self.journal.add(record)

    def _rewrite(self) -> None:
        if self.journal is not None:
            self.journal.rewrite(self._snapshot())

    def commit(self) -> None:
        """Make what was handled durable: the host layer calls it before sending views."""
        if self.journal is not None:
            self.journal.commit()

    # -- messages -----------------------------------------------------------------------
    def handle(self, msg: Message, now: float) -> list[View]:
        self.messages += 1
        if isinstance(msg, Join):
            return self._join(msg, now)
        h = self.hosts.get(msg.host)
        if h is None or h.session != msg.session:
            raise JobRefused("not_registered", f"host {msg.host!r} is not registered with the "
                             f"coordinator of stream {self.stream!r} (it restarted?): join again")
        if msg.seq <= h.seq:
            return []  # an old message: reordered, or sent again
        h.seq, h.heard = msg.seq, now
        if isinstance(msg, Resume):
            return self._resume(h, msg, now)
        if isinstance(msg, Leave):
            del self.hosts[msg.host]
            return []
        h.launch = msg.launch
        if msg.launch != self.launch:
            return [self._view(h)]  # of an older launch: it learns of this one from the view
        if isinstance(msg, Beat):
            h.readers, h.readers_at = msg.readers, now
            return [self._view(h)]
        if isinstance(msg, Ask):
            return [self._ask(h)]
        if isinstance(msg, Done):
            ended = msg.epoch == self.epoch and self._unit_done(h, msg.unit, msg.gen,
                                                                msg.batches)
            return self._views(h, ended)
        self._back(h, msg)
        return [self._view(h)]

    def _join(self, msg: Join, now: float) -> list[View]:
        if not msg.plan.same_pipeline(self.plan):
            raise JobRefused("pipeline_mismatch", _changed(self.stream, msg.plan, self.plan))
        if msg.job and msg.job != self.job:
            raise JobRefused("position_lost",
                             f"host {msg.host!r} served stream {self.stream!r} for another "
                             "coordinator (this one started without its journal, or the job "
                             "has two): give the job one coordinator, on the --state-dir it "
                             "had; to start the job over, stop its brokers and coordinator "
                             "and start them on empty --state-dir directories")
        h = self.hosts.get(msg.host)
        if h is not None and h.session == msg.session and msg.seq <= h.seq:
            return []  # an old Join
        if h is None and len(self.hosts) >= self.max_hosts:
            raise JobRefused("too_many_peers", f"{self.max_hosts} hosts serve stream "
                             f"{self.stream!r} already")
        before = h.open if h is not None else self._restored.pop(msg.host, set())
        h = self.hosts[msg.host] = HostState(msg.host, msg.session, msg.seq, now, msg.launch,
                                             msg.readers, now, open=before)
        ended = False
        if msg.launch == self.launch and msg.epoch == self.epoch:
            for u, gen, batches in msg.done:  # done reports the journal may have lost
                ended = self._unit_done(h, u, gen, batches) or ended
        return self._views(h, ended)

    def _ask(self, h: HostState) -> View:
        if self.finished:
            return self._view(h, wait=NoUnit.FINISHED)
        if len(h.open) >= MAX_OPEN:
            return self._view(h, wait=NoUnit.BUSY)
        u = self._take_free()
        if u is None:
            return self._view(h, wait=NoUnit.BUSY)
        s = self.units[u]
        s.state, s.host, s.gen = Unit.OPEN, h.name, s.gen + 1
        h.open.add(u)
        self._served_in_launch = True
        self._save(self._record(u))
        return self._view(h, opened=(u, s.gen, s.taken))

    def _unit_done(self, h: HostState, u: int, gen: int, batches: int) -> bool:
        """Unit ``u`` done at ``h`` (generation ``gen``); True if that ended the epoch."""
        if not 0 <= u < len(self.units) or self.finished:
            return False
        s = self.units[u]
        if s.state is not Unit.OPEN or s.host != h.name or s.gen != gen:
            return False
        s.state, s.host, s.batches = Unit.DONE, None, batches
        h.open.discard(u)
        self._done += 1
        self._save(self._record(u))
        if self._done < len(self.units):
            return False
        ended = self.epoch
        self._next_epoch()
        self._rewrite()
        log.info("stream %s: epoch %d complete on every host%s", self.stream, ended,
                 "; every epoch of its run served" if self.finished else "")
        return True

    def _next_epoch(self) -> None:
        if self.plan.epochs and self.epoch + 1 >= self.plan.epochs:
            self.finished = True
        else:
            self.epoch += 1
        self.units = [UnitState() for _ in range(self.plan.units)]
        for h in self.hosts.values():
            h.open.clear()
        self._restored.clear()
        self._pool()

    def _back(self, h: HostState, msg: Back) -> None:
        if msg.epoch != self.epoch or not 0 <= msg.unit < len(self.units):
            return
        s = self.units[msg.unit]
        if s.state is Unit.OPEN and s.host == h.name and s.gen == msg.gen:
            s.state, s.host = Unit.FREE, None
            s.taken |= msg.taken
            h.open.discard(msg.unit)
            self._returned.add(msg.unit)
            self._save(self._record(msg.unit))

    # -- free units ---------------------------------------------------------------------
    def _pool(self) -> None:
        """The free units: given back (or partly taken: first), and never opened."""
        self._returned = {u for u, s in enumerate(self.units)
                          if s.state is Unit.FREE and (s.gen or s.taken)}
        self._fresh = [u for u, s in enumerate(self.units)
                       if s.state is Unit.FREE and not (s.gen or s.taken)][::-1]
        self._done = sum(s.state is Unit.DONE for s in self.units)

    def _take_free(self) -> int | None:
        if self._returned:
            u = min(self._returned)
            self._returned.discard(u)
            return u
        return self._fresh.pop() if self._fresh else None

    # -- resume -------------------------------------------------------------------------
    def _resume(self, h: HostState, msg: Resume, now: float) -> list[View]:
        c = msg.cursor
        if c.stream != self.stream or (c.pipeline and self.plan.fingerprint
                                       and c.pipeline != self.plan.fingerprint):
            raise JobRefused("cursor_mismatch",
                             f"a cursor of another stream or pipeline than stream "
                             f"{self.stream!r} serves (fingerprint {c.pipeline:x}, not "
                             f"{self.plan.fingerprint:x}): resume from a checkpoint of this "
                             "pipeline, or start without resume=")
        ident = c.ident()
        if ident == self.resumed and now < self._counts_known_at:
            return [self._view(h, wait=NoUnit.BUSY)]
        if ident == self.resumed:
            # Another rank of the launch that began with this cursor, or the job restarted
            # again from the same checkpoint: the launch's consumers still there tell. Counts
            # older than this resume are asked for again first (the probe), unless their
            # host is silent past the timeout.
            others = [x for x in self.hosts.values() if x is not h and x.launch == self.launch
                      and x.readers and now - x.heard <= self.timeout]
            if others and not self._probe_at:
                self._probe_at = now
            stale = [x for x in others if x.readers_at < self._probe_at]
            if stale:
                for x in stale:
                    x.probe = True
                return [self._view(h, wait=NoUnit.BUSY)] + [self._view(x) for x in stale]
            self._probe_at = 0.0
            # This host's earlier resume began (or joined) the current launch, it sent this
            # one before it heard so, and nothing of the launch was served yet: its ranks
            # resuming at once, of the same launch (its ``alive`` counts the older launch's
            # consumers, none of this one's).
            unheard = (h.launch == self.launch and h.readers > 0 and msg.launch != self.launch
                       and not self._served_in_launch)
            if msg.alive or others or unheard:  # the same launch: nothing changes
                if h.launch == self.launch:
                    h.readers += 1
                    h.readers_at = now
                h.launch, h.resumed = self.launch, msg.seq
                return [self._view(h)]
        self._probe_at = 0.0
        totals = [s.batches for s in self.units] if c.epoch == self.epoch else []
        self.launch += 1
        self._served_in_launch = False
        self.resumed = ident
        self.epoch, self.finished = c.epoch, False
        if self.plan.epochs and c.epoch >= self.plan.epochs:  # its run was served whole
            self.epoch, self.finished, c = self.plan.epochs - 1, True, Cursor(c.stream)
        self.units = [UnitState() for _ in range(self.plan.units)]
        for u, b in c.bits.items():
            if 0 <= u < len(self.units):
                self.units[u].taken = b
        for u, n in enumerate(totals):
            s = self.units[u]
            s.batches = n
            if n is not None and s.taken & ((1 << n) - 1) == (1 << n) - 1:
                s.state = Unit.DONE
        for x in self.hosts.values():
            x.open.clear()
            x.readers = 0
        self._restored.clear()
        h.launch, h.readers, h.readers_at, h.resumed = self.launch, 1, now, msg.seq
        self._pool()
        ended = self._done == len(self.units)
        if ended:
            self._next_epoch()
        self._rewrite()
        log.info("stream %s: launch %d resumed from a checkpoint's cursor (epoch %d, %d "
                 "batches taken)", self.stream, self.launch, c.epoch, c.count())
        return self._views(h, ended)

    # -- views --------------------------------------------------------------------------
    def _view(self, h: HostState, opened: OpenUnit | None = None,
              wait: NoUnit | None = None) -> View:
        probe, h.probe = h.probe, False
        open_ = tuple(sorted((u, self.units[u].gen, self.units[u].taken) for u in h.open))
        self._made += 1
        return View(h.name, h.session, h.seq, self.job, self.launch, self.epoch, self.finished,
                    open_, opened, wait, probe, h.resumed, (self.boot, self._made))

    def _views(self, h: HostState, ended: bool) -> list[View]:
        """``h``'s view, and if the epoch ended, every other host's (they hear at once)."""
        return [self._view(h)] + ([self._view(x) for x in self.hosts.values() if x is not h]
                                  if ended else [])

    def silent(self, now: float) -> list[str]:
        """Hosts not heard from for the timeout (they keep their open units)."""
        return [n for n, h in self.hosts.items() if now - h.heard > self.timeout]


def _changed(stream: str, theirs: ExactPlan, ours: ExactPlan) -> str:
    return (f"a host serves stream {stream!r} with another pipeline ({theirs.describe()}) "
            f"than the job's ({ours.describe()}): give every host the same pipeline, or "
            "another stream name")

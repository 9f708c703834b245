"""The exact streams of a broker (or of a direct-mode trainer): their coordinators, made,
restored from their journals, kept to one pipeline and one delivery mode, and reclaimed.

- **Made by producers, restored by anyone.** An exact producer's registration makes its
  stream's coordinator (:meth:`ExactStreams.join`), restoring it from its journal in the state
  directory if one is there; a consumer that comes first after a restart restores it too.
  Without a state directory a broker refuses exact producers (``no_state_dir``) unless it was
  told to keep exact streams in memory only (``ephemeral``: a direct-mode trainer, or
  ``--exact-ephemeral``).
- **One pipeline, one mode.** A producer whose pipeline (sizes, fingerprint) differs from the
  stream's is refused while producers of the stream's are registered and one of them has been
  heard from since it first asked (it runs); while none has (they were killed: the heartbeat
  timeout drops them, :mod:`feedline.exact.succession`) it is told to wait. With none
  registered, the new pipeline replaces the old and the stream starts again at epoch 0. An
  exact producer is refused on a stream training producers serve, and a training producer on
  a stream that is exact (its state kept until it is reclaimed).
- **Cursors.** A consumer's cursor is a *resume* (its job's checkpoint: the stream's epoch is
  set to exactly it, once for all the consumers registered with that same cursor, so that the
  ranks of one job roll back once and a job that crashes again rolls back again) or a
  *report* (what it took last, when it registers again). One that comes before its stream has
  a coordinator waits (a bounded number of them), judged when the coordinator is made.
- **A job's resume.** On a host of a job served by several hosts (``coordinator``) a resume
  cursor goes to the job's coordinator (:mod:`feedline.exact.scope`), and the consumer waits
  (served nothing) until the job's answer admits it under the launch the resume began or
  joined; a view of a newer launch refuses this host's consumers of the older one
  (``relaunched``: the job was restarted from a checkpoint elsewhere) and drops what it
  buffered for them.
- **Bounded.** At most ``max_streams`` streams have state (coordinators, and any stream a
  registered peer names: ``live``); the state of an exact stream nobody has used for ``idle``
  seconds is reclaimed (its journal stays, unless the stream never settled a batch).
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from feedline.errors import DecodeError, Refusal
from feedline.exact.coordinator import Coordinator, ExactPlan
from feedline.exact.cursor import MAX_UNITS, Cursor
from feedline.exact.job import JobRefused, View
from feedline.exact.journal import Journal, JournalCorrupt, JournalStale, Planned, Record
from feedline.exact.member import JobMember
from feedline.exact.scope import JobScope
from feedline.exact.succession import WAIT, Succession
from feedline.logs import RateLimitedLog

log = logging.getLogger(__name__)
MAX_PENDING = 64  # cursors waiting for their stream's first producer, at most
MAX_RESUMED = 4096  # consumers remembered as having resumed from a cursor, at most


@dataclass(frozen=True)
class Applied:
    """A cursor of ``epoch`` was applied to ``coordinator``: ``resumed`` (its epoch set to a
    resume cursor; ``changed``: to another epoch), ``settled`` (a report: these are taken
    now), and the epochs that this completed."""

    coordinator: Coordinator
    epoch: int
    resumed: bool = False
    changed: bool = False
    settled: Cursor | None = None
    ended: tuple[int, ...] = ()


MAX_STREAMS = 64  # streams a host keeps state for, by default (a broker's --max-streams)


@dataclass(frozen=True)
class ExactConfig:
    state_dir: Path | None = None
    ephemeral: bool = True  # without state_dir: keep exact streams in memory only
    max_streams: int = MAX_STREAMS
    grace: float = 0.0  # after a restart: seconds for the consumers to report first
    idle: float = 20.0  # seconds unused before an exact stream's state is reclaimed
    # Several hosts serve each stream with a job's coordinator at this address (`feedline
    # coordinator`); ``host``: this host's name in the job (unique, stable across restarts).
    coordinator: str | None = None
    host: str = ""


class ExactStreams:
    """The coordinators of a broker's exact streams. A consumer's cursor that waited for its
    stream's coordinator (or, on a job's host, for the job's answer) is answered by
    ``refuse(ident, reason, detail)`` or by ``applied(ident, stream, applied)``; ``probe``
    filters consumers to those whose connection is open; ``void(stream)`` drops what is
    buffered of a stream that its coordinator would not serve now (a job's new launch);
    ``live()`` names the streams registered peers use (for the stream limit); ``succession``
    tells a killed producer of a replaced pipeline from a running one (None: every registered
    one runs)."""

    def __init__(self, cfg: ExactConfig | None = None) -> None:
        self.cfg = cfg or ExactConfig()
        self.streams: dict[str, Coordinator] = {}
        self.refuse: Callable[[bytes, str, str], None] = lambda ident, reason, detail: None
        self.applied: Callable[[bytes, str, Applied], None] = lambda ident, stream, a: None
        self.probe: Callable[[list[bytes]], list[bytes]] = lambda idents: idents
        self.void: Callable[[str], None] = lambda stream: None
        self.live: Callable[[], set[str]] = set
        self.succession: Succession | None = None
        self._producers: dict[str, list[int]] = {}  # stream -> [exact, training] registered
        self._pending: dict[bytes, tuple[str, bytes]] = {}  # consumer -> (stream, cursor)
        self._resumed: dict[bytes, tuple[str, bytes]] = {}  # consumer -> (stream, cursor id)
        self._active: dict[str, float] = {}
        # Consumers registered now: ident -> (stream, session); a coordinator made later is
        # told of them (what decides whether a late producer is of the run just served).
        self._readers: dict[bytes, tuple[str, int]] = {}
        # Consumers whose HELLO's resume cursor was just applied (the registration follows):
        # they are of the run their job resumed, even one the resume found complete.
        self._resuming: dict[bytes, str] = {}
        self._log = RateLimitedLog(log, interval=60.0)

    def get(self, stream: str) -> Coordinator | None:
        return self.streams.get(stream)

    # -- limits -------------------------------------------------------------------------
    def admit(self, stream: str) -> None:
        """Room for state of ``stream`` (a registration naming it); :class:`Refusal` if not."""
        known = set(self.streams) | self.live() | {s for s, _ in self._pending.values()}
        if stream in known or len(known) < self.cfg.max_streams:
            return
        raise Refusal("too_many_streams",
                      f"this broker keeps state for {self.cfg.max_streams} streams already "
                      "(--max-streams): use one of its streams, or raise the limit")

    def attach(self, stream: str, exact: bool) -> None:
        """A producer of ``stream`` registered (``exact``: an exact one)."""
        self._producers.setdefault(stream, [0, 0])[0 if exact else 1] += 1

    def detach(self, stream: str, exact: bool) -> None:
        n = self._producers.get(stream)
        if n is not None:
            n[0 if exact else 1] -= 1
            if n == [0, 0]:
                del self._producers[stream]

    def training_may_join(self, stream: str) -> None:
        """A training producer may serve ``stream`` (not an exact one, and there is room for
        it); :class:`Refusal` if not."""
        if stream in self.streams or self._producers.get(stream, [0, 0])[0]:
            raise Refusal("delivery_mismatch",
                          f"stream {stream!r} is exact (delivery: exact): a training producer "
                          "needs a stream of its own (its state goes once the exact stream "
                          f"has been unused for {self.cfg.idle:.0f}s)")
        self.admit(stream)

    def reader(self, stream: str, ident: bytes, session: int) -> None:
        """Consumer ``ident`` (of ``session``) registered on ``stream``; bounded by the
        consumers a broker registers (each is :meth:`unread` when its registration ends)."""
        self.unread(ident)
        self._readers[ident] = (stream, session)
        of_run = self._resuming.pop(ident, None) == stream
        c = self.streams.get(stream)
        if c is not None:
            c.read_by(ident, session, of_run)
            if c.job is not None:
                c.job.admit(ident)

    def unread(self, ident: bytes) -> None:
        """Consumer ``ident``'s registration ended (a bye, a timeout, registered again)."""
        was = self._readers.pop(ident, None)
        c = self.streams.get(was[0]) if was is not None else None
        if c is not None:
            c.unread(ident)

    def _tell_readers(self, stream: str, c: Coordinator) -> None:
        for ident, (s, session) in self._readers.items():
            if s == stream:
                c.read_by(ident, session)
                if c.job is not None:
                    c.job.admit(ident)

    # -- coordinators -------------------------------------------------------------------
    def join(self, stream: str, plan: ExactPlan, now: float, owner: bytes | None = None,
             session: int = 0, started: float | None = None) -> Coordinator:
        """The coordinator of ``stream`` for a producer with ``plan``; :class:`Refusal` (its
        reason, and a line saying what to do) if it is refused. ``owner`` (its ident),
        ``session`` and ``started`` (when it started, on the clock of ``now``; None: not
        said): the producer is enlisted (:meth:`Coordinator.enlist`): nothing refuses it
        after this, and its departure is :meth:`Coordinator.release`."""
        if self.cfg.state_dir is None and not self.cfg.ephemeral:
            raise Refusal("no_state_dir",
                          f"stream {stream!r} is exact, and this broker has no --state-dir to "
                          "keep its progress in (a restart would serve its epochs again from "
                          "epoch 0): start the broker with --state-dir DIR, or with "
                          "--exact-ephemeral to keep exact streams in memory only")
        if plan.dataset_size < 1 or plan.unit_size < 1:
            raise Refusal("delivery_mismatch",
                          "exact delivery needs the dataset's size and a unit size")
        if plan.units > MAX_UNITS:
            raise Refusal("too_many_units",
                          f"{plan.units} work units is more than {MAX_UNITS}: use a unit_size "
                          f"of at least {-(-plan.dataset_size // MAX_UNITS)}")
        n = self._producers.get(stream, [0, 0])
        if n[1]:
            raise Refusal("delivery_mismatch",
                          f"stream {stream!r} is served in training mode by {n[1]} producer(s): "
                          "an exact producer needs a stream of its own")
        c = self.streams.get(stream)
        if c is None:
            got = self._restore(stream, now, plan)
            assert got is not None  # with a plan, it makes one or refuses
            c = got
        elif not c.plan.same_pipeline(plan):
            if n[0]:
                left = None if self.succession is None else \
                    self.succession.wait(stream, list(c.attached), now)
                if left is not None:
                    raise Refusal(WAIT, f"stream {stream!r} is served by {n[0]} producer(s) of "
                                  f"another pipeline ({c.plan.describe()}; this one: "
                                  f"{plan.describe()}), silent since this producer first asked: "
                                  f"it waits for them to end, at most {left:.1f}s more (the "
                                  "broker drops silent producers at its heartbeat timeout), then "
                                  "this pipeline replaces theirs from epoch 0")
                raise Refusal("delivery_mismatch",
                              f"stream {stream!r} is served by {n[0]} producer(s) of another "
                              f"pipeline ({c.plan.describe()}; this one: {plan.describe()}): "
                              "every producer of a stream runs the same pipeline file")
            c = self._replace(stream, c, plan, now)
        elif not c.plan.fingerprint and plan.fingerprint:  # restored from an older journal
            c.plan = replace(c.plan, fingerprint=plan.fingerprint)
        self._active[stream] = now
        if self.succession is not None:
            self.succession.settled(stream)
        if owner is not None:
            c.enlist(owner, session, started)
        return c

    def load(self, stream: str, now: float) -> Coordinator | None:
        """The coordinator of ``stream``: in memory, or restored from its journal (a consumer
        came first after a restart); None if it has neither."""
        c = self.streams.get(stream)
        if c is not None or self.cfg.state_dir is None:
            return c
        return self._restore(stream, now, None)

    def _journal(self, stream: str) -> Journal | None:
        if self.cfg.state_dir is None:
            return None
        return Journal(self.cfg.state_dir / f"{stream}.exact.jsonl")

    def _restore(self, stream: str, now: float, plan: ExactPlan | None) -> Coordinator | None:
        """Make the coordinator (from its journal if there is one: with ``plan`` None, only
        then)."""
        journal = self._journal(stream)
        records: list[Record] = []
        if journal is not None:
            try:
                self.cfg.state_dir.mkdir(parents=True, exist_ok=True)  # type: ignore[union-attr]
                records = journal.read(stream)
            except (JournalCorrupt, JournalStale) as e:
                self._log.log(logging.ERROR, "%s", e)
                raise Refusal("journal_stale" if isinstance(e, JournalStale)
                              else "journal_corrupt", str(e)) from None
            except OSError as e:
                raise Refusal("journal_corrupt", f"stream {stream!r}: cannot use the state "
                              f"directory {self.cfg.state_dir}: {e.strerror}") from None
        old = records[0].plan if records and isinstance(records[0], Planned) else None
        if plan is None:
            if old is None:
                return None
            plan = old
        elif old is not None and not old.same_pipeline(plan):
            log.warning("stream %s: its journal %s is of another pipeline (%s): this one (%s) "
                        "starts at epoch 0", stream, journal.path if journal else "",
                        old.describe(), plan.describe())
            records = []
        self.admit(stream)
        try:
            c = self._make(stream, plan, journal, records, now)
        except JournalCorrupt as e:  # well-formed records that do not fit the plan
            text = (f"{e}: its journal {journal.path if journal else ''} does not fit its "
                    "plan: delete the file to start the stream at epoch 0")
            self._log.log(logging.ERROR, "%s", text)
            raise Refusal("journal_corrupt", text) from None
        self._tell_readers(stream, c)
        self.streams[stream] = c
        self._active[stream] = now
        self._judge_pending(stream, c, now)
        return c

    def _make(self, stream: str, plan: ExactPlan, journal: Journal | None,
              records: list[Record], now: float) -> Coordinator:
        c = Coordinator(stream, plan, journal, records, self.cfg.grace if records else 0.0,
                        now)
        if self.cfg.coordinator is not None:  # one host of a job: the job's units only
            member = JobMember(self.cfg.host, stream, plan, secrets.randbits(62) | 1)
            if c.job_launch is not None:  # restarted on its journal (JobMember.restore)
                member.restore(*c.job_launch, c.epoch, c.finished)
            c.job = JobScope(member, self.cfg.coordinator, now)
        return c

    def _replace(self, stream: str, old: Coordinator, plan: ExactPlan,
                 now: float) -> Coordinator:
        log.warning("stream %s: a producer of another pipeline (%s) replaces the one whose "
                    "producers left (%s): the stream starts at epoch 0", stream,
                    plan.describe(), old.plan.describe())
        c = self._make(stream, plan, old.journal, [], now)
        self._tell_readers(stream, c)
        self.streams[stream] = c
        return c

    # -- consumers' cursors -------------------------------------------------------------
    def cursor(self, ident: bytes, stream: str, data: bytes, now: float,
               others_alive: Callable[[list[bytes]], list[bytes]] = lambda xs: xs,
               ) -> Applied | None:
        """A consumer's cursor (its HELLO's): applied now, or kept until its stream has a
        coordinator or (a resume on a job's host) until the job answers (None; then
        ``applied`` or ``refuse``); :class:`Refusal` if it is refused. ``others_alive``
        filters other consumers to those still connected (the broker probes them)."""
        try:
            name, _, _, resume = Cursor.peek(data)
        except DecodeError as e:
            raise Refusal("bad_cursor", f"resume= is not a feedline cursor: {e}") from None
        if name != stream:
            raise Refusal("bad_cursor", f"a cursor of stream {name!r}, not {stream!r}")
        if self._producers.get(stream, [0, 0])[1]:  # a training stream
            if resume:
                raise Refusal("not_exact", f"stream {stream!r} is served in training mode: "
                              "resume= applies to exact streams")
            return None
        c = self.load(stream, now)
        if c is None:
            if ident not in self._pending and len(self._pending) >= MAX_PENDING:
                raise Refusal("too_many_pending",
                              f"{MAX_PENDING} cursors wait for streams no producer serves yet "
                              f"here: start the producers of stream {stream!r} first")
            self._pending[ident] = (stream, data)
            return None
        self._active[stream] = now
        return self._apply(ident, c, data, others_alive)

    def _apply(self, ident: bytes, c: Coordinator, data: bytes,
               others_alive: Callable[[list[bytes]], list[bytes]]) -> Applied | None:
        try:
            cursor = Cursor.decode(data, max_units=c.plan.units)
        except DecodeError as e:
            raise Refusal("bad_cursor", f"a cursor that does not fit stream {c.stream!r} "
                          f"({c.plan.units} units): {e}") from None
        if cursor.pipeline and c.plan.fingerprint and cursor.pipeline != c.plan.fingerprint:
            what = "resume from a cursor" if cursor.resume else "a cursor"
            raise Refusal("cursor_mismatch",
                          f"{what} of another pipeline than stream {c.stream!r} serves now "
                          f"(fingerprint {cursor.pipeline:x}, not {c.plan.fingerprint:x}: its "
                          "seed, unit or batch size, or dataset changed): resume from a "
                          "checkpoint of this pipeline, or start without resume=")
        if c.job is not None:
            if cursor.resume:  # the job's: it waits for the job's answer (job_view)
                c.job.resume(ident, cursor, len(others_alive(c.job.of_launch(but=ident))))
                return None
            if c.job.stale(ident):
                raise Refusal("relaunched", _relaunched(c))
        if not cursor.resume:
            ended, lost = c.merge(cursor)
            if lost:
                raise Refusal("position_lost",
                              f"the broker lost stream {c.stream!r}'s position (it restarted "
                              f"without its journal); this consumer was in epoch "
                              f"{cursor.epoch}: restart the job from its checkpoint "
                              "(resume=), and give the broker --state-dir")
            return Applied(c, cursor.epoch, settled=cursor, ended=tuple(ended))
        self._resuming.pop(ident, None)
        self._resuming[ident] = c.stream
        while len(self._resuming) > MAX_PENDING:
            self._resuming.pop(next(iter(self._resuming)))
        key = (c.stream, cursor.ident())
        same = self._resumed.get(ident) == key or others_alive(
            [x for x, v in self._resumed.items() if v == key and x != ident])
        self._resumed.pop(ident, None)
        self._resumed[ident] = key
        while len(self._resumed) > MAX_RESUMED:
            self._resumed.pop(next(iter(self._resumed)))
        if same:  # another rank of the same job applied it already
            return Applied(c, cursor.epoch)
        changed, ended = c.resume(cursor)
        log.info("stream %s: resumed from a checkpoint's cursor (epoch %d, %d batches taken)",
                 c.stream, cursor.epoch, cursor.count())
        return Applied(c, cursor.epoch, resumed=True, changed=changed, ended=tuple(ended))

    def _judge_pending(self, stream: str, c: Coordinator, now: float) -> None:
        for ident, (s, data) in list(self._pending.items()):
            if s != stream:
                continue
            del self._pending[ident]
            try:
                got = self._apply(ident, c, data, self.probe)
            except Refusal as e:
                self.refuse(ident, e.reason, e.detail)
            else:
                if got is not None:
                    self.applied(ident, stream, got)

    # -- a job's host -----------------------------------------------------------------------
    def job_view(self, c: Coordinator, view: View, now: float) -> list[int]:
        """A view of the job's coordinator for stream ``c``: applied to it, and what it says
        of this host's consumers (admitted, sent again, refused: an older launch's). Returns
        the epochs that ended (for EPOCH_END)."""
        job = c.job
        assert job is not None
        ended, ch = c.job_view(view)
        got = job.answers(view, ch, now)
        for ident in got.stale:  # (it stays of its launch: registered again, refused again)
            self.refuse(ident, "relaunched", _relaunched(c))
        if ch.new_launch:
            log.log(logging.WARNING if got.stale else logging.INFO,
                    "stream %s: the job is at launch %d (restarted from a checkpoint): what "
                    "was buffered here of the launch before is dropped%s", c.stream,
                    job.member.launch, f", and its {len(got.stale)} consumer(s) here refused"
                    if got.stale else "")
            self.void(c.stream)
        for ident, cursor in got.again:
            self._resume_again(c, ident, cursor)
        for ident, cursor, first in got.admitted:
            c.job_resumed(cursor)
            epoch = min(cursor.epoch, c.epoch)
            if first:
                log.info("stream %s: resumed from a checkpoint's cursor under the job's launch "
                         "%d (epoch %d, %d batches taken)", c.stream, job.member.launch,
                         cursor.epoch, cursor.count())
            self.applied(ident, c.stream, Applied(c, epoch, resumed=True))
        if ch.probe:
            job.beat(job.readers(c.readers), now)
        return ended

    def job_tick(self, c: Coordinator, now: float) -> None:
        """Once a tick: resumes answered busy sent again when due."""
        job = c.job
        assert job is not None
        for ident, cursor in job.due(now):
            self._resume_again(c, ident, cursor)

    def job_refused(self, c: Coordinator, refused: JobRefused, now: float) -> None:
        """The job refused a message of this host: the consumers it was about are refused
        with its line; the host's own state follows (:meth:`JobScope.refuse`)."""
        job = c.job
        assert job is not None
        for ident in job.refused_consumers(refused):
            self.refuse(ident, refused.reason, refused.text)
        job.refuse(refused, now)

    def _resume_again(self, c: Coordinator, ident: bytes, cursor: Cursor) -> None:
        job = c.job
        assert job is not None
        if not self.probe([ident]):
            return  # its connection is closed: it went (forget)
        if job.waits(ident):
            job.resume(ident, cursor, len(self.probe(job.of_launch(but=ident))))

    def forget(self, ident: bytes, gone: bool = False) -> None:
        """A consumer's registration ended: its waiting cursor goes; ``gone`` (its connection
        is closed), its part in a resume too (a paused rank of a job is still of the job)."""
        self._pending.pop(ident, None)
        self._resuming.pop(ident, None)
        if gone:
            self._resumed.pop(ident, None)
        for c in self.streams.values():
            if c.job is not None:
                c.job.forget(ident, gone)

    def waits(self, ident: bytes, stream: str) -> bool:
        """Consumer ``ident``'s resume waits for the job's answer: serve it nothing yet."""
        c = self.streams.get(stream)
        return c is not None and c.job is not None and c.job.waits(ident)

    # -- time -----------------------------------------------------------------------------
    def commit(self, now: float) -> None:
        for c in self.streams.values():
            c.commit(now)
            j = c.journal
            if j is not None and j.error is not None:
                self._log.log(logging.ERROR, "stream %s: %s; exact delivery goes on, but a "
                              "broker restart now would refuse the stream until this is "
                              "fixed: make room in the state directory %s", c.stream, j.error,
                              self.cfg.state_dir)

    def reclaim(self, now: float, busy: set[str]) -> None:
        """Forget the state of exact streams nobody has used for ``idle`` seconds: no
        producer, no consumer, nothing held (``busy``: streams with any of those)."""
        for stream, c in list(self.streams.items()):
            if stream in busy or self._producers.get(stream):
                self._active[stream] = now
                continue
            if now - self._active.get(stream, now) < self.cfg.idle:
                continue
            c.commit(now)
            empty = c.epoch == 0 and not c.done and not c.finished and \
                not any(p.settled for p in c.units.values())
            if empty and c.journal is not None:
                c.journal.remove()  # nothing to keep: a stream that never served a batch
            del self.streams[stream]
            self._active.pop(stream, None)
            log.info("stream %s: unused for %.0fs: its state is reclaimed%s", stream,
                     self.cfg.idle, "" if empty or c.journal is None else
                     " (its journal stays: it goes on from there when its producers return)")


def _relaunched(c: Coordinator) -> str:
    return (f"stream {c.stream!r}: the job was restarted from a checkpoint elsewhere (its "
            "coordinator began a new launch), so this training process is of the job before "
            "that restart and is served no more: stop it (the restarted job's processes go on)")

"""A host's exact stream as one part of a job served by several hosts: what limits its own
:class:`~feedline.exact.coordinator.Coordinator` to the units the job's coordinator opened
here, and the messages that keep the two in step. Pure logic: the host's link
(:mod:`feedline.serving.job_link`) sends what :meth:`JobScope.drain` gives and hands every
view it receives to :meth:`Coordinator.job_view <feedline.exact.coordinator.Coordinator.job_view>`.

The host's rules, each bounded:

- **Joined first.** Nothing is handed to a producer before the coordinator answered the
  host's :class:`~feedline.exact.job.Join` (sent again every :data:`RETRY` seconds; after
  :data:`UNREACHABLE` seconds without an answer the host logs, once, that the coordinator
  cannot be reached and what to do). A coordinator that does not know the host (it restarted)
  is joined again, with the units open here and the units done here this epoch.
- **Asked before handed.** A producer that asks for a unit gets one the job opened here; if
  there is none the host asks the job (one :class:`~feedline.exact.job.Ask` at a time,
  again every :data:`RETRY` seconds while a producer waits), and hands a unit out once a view
  opened it. Each unit handed out is followed by an Ask when no spare unit is left, so that
  a producer rarely waits for a round trip.
- **Delivered only while open here.** A batch is kept and served only if its unit is open
  here, of the job's epoch and launch, and not taken before (:meth:`JobScope.deliverable`).
- **Done and given back.** A unit every batch of which was taken here is done
  (:class:`~feedline.exact.job.Done`); a unit no producer of this host can make (none has been
  registered for :data:`BACK_AFTER` seconds) is given back once nothing of it is buffered or
  in flight here (:class:`~feedline.exact.job.Back`, with what was taken), never before: a
  batch on its way to a trainer here must not be made again elsewhere.
- **The epoch is the job's.** The host's coordinator does not end an epoch when its own units
  are settled; it moves when a view says the job's epoch moved.
- **A resume is the job's.** A consumer's ``resume=`` cursor goes to the job as a
  :class:`~feedline.exact.job.Resume` (:meth:`JobScope.resume`, with the host's consumers of
  the current launch still connected); the consumer is served nothing until a view answers
  that Resume (:meth:`JobScope.answers`): admitted under the view's launch, or sent again (a
  Resume answered busy waits :data:`AGAIN_AFTER` seconds first). A consumer without
  ``resume=`` is of the launch the host knows when it registers.
- **A new launch voids the older one here.** On a view of a new launch the host's consumers
  admitted under an older launch are refused (the job was restarted from a checkpoint
  elsewhere), and what it buffered that is not deliverable now is dropped.
- **Bounded**: the consumers it keeps (waiting, admitted) are the host's registered ones,
  and those it saw gone are forgotten; at most :data:`MAX_CONSUMERS` of each.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from feedline.exact.cursor import Cursor
from feedline.exact.job import JobRefused, Message, View
from feedline.exact.member import Answer, Change, JobMember
from feedline.exact.plan import NoUnit

log = logging.getLogger(__name__)

RETRY = 1.0  # seconds between a Join or an Ask and the same again, while unanswered
UNREACHABLE = 10.0  # seconds without an answer before the host says it cannot reach the job
BEAT = 1.0  # seconds between beats
BACK_AFTER = 5.0  # seconds without a producer here before units open here go back
MAX_OUTBOX = 1024  # messages waiting to be sent; beyond, the host joins again (it says all)
AGAIN_AFTER = 0.05  # seconds before a Resume answered busy is sent again
MAX_CONSUMERS = 4096  # consumers remembered (waiting, or admitted under a launch), at most


@dataclass
class Waiting:
    """A consumer's resume, sent as message ``seq``, until a view answers it."""

    cursor: Cursor
    seq: int
    again_at: float = 0.0  # answered busy: sent again at this time (0: not due)


@dataclass
class Answers:
    """What a view said of the host's consumers: ``admitted`` (ident, cursor, and whether it
    is the first admitted here under the view's launch), ``again`` (resumes to send again
    now: probe the host's consumers, then :meth:`JobScope.resume`), ``stale`` (consumers
    admitted under an older launch: refuse them)."""

    admitted: list[tuple[bytes, Cursor, bool]] = field(default_factory=list)
    again: list[tuple[bytes, Cursor]] = field(default_factory=list)
    stale: list[bytes] = field(default_factory=list)


class JobScope:
    """Stream ``member.stream`` of host ``member.host``, served with the job's coordinator at
    ``address`` (for what it logs)."""

    def __init__(self, member: JobMember, address: str, now: float) -> None:
        self.member, self.address = member, address
        self.outbox: deque[Message] = deque()
        self.joined = False
        self._join_seq = 0
        self._join_at = self._first_join = now
        self._ask_seq = 0  # the Ask outstanding (0: none)
        self._ask_at = 0.0
        self.wanted = False  # a producer here waits for a unit
        self._beat_at = now
        self._no_producer_since: float | None = now
        self.refused: JobRefused | None = None  # the job refused this host: why
        self._said_unreachable = False
        self.views = 0  # views taken (metrics)
        self.waiting: dict[bytes, Waiting] = {}  # consumer -> its resume, until answered
        self.launch_of: dict[bytes, int] = {}  # consumer -> the launch it is of (0: unknown)
        self.resumed_launch = 0  # the launch a resume was last admitted under here
        self._join()

    # -- what the host's coordinator asks ---------------------------------------------------
    def open_units(self) -> list[int]:
        """The units open here, lowest first."""
        return sorted(self.member.open)

    def deliverable(self, epoch: int, unit: int, index: int) -> bool:
        return self.joined and self.member.deliverable(epoch, unit, index)

    def want(self, now: float) -> None:
        """A producer here waits for a unit: ask the job (unless an Ask is outstanding)."""
        self.wanted = True
        if self.joined and self.refused is None and not self._ask_seq:
            self._ask(now)

    def unit_done(self, unit: int, batches: int) -> None:
        msg = self.member.done(unit, batches)
        if msg is not None:
            self._send(msg)

    def back(self, unit: int, taken: int) -> None:
        msg = self.member.back(unit, taken)
        if msg is not None:
            log.info("stream %s: unit %d given back to the job (no producer here for %.0fs)",
                     self.member.stream, unit, BACK_AFTER)
            self._send(msg)

    def producers(self, n: int, now: float) -> None:
        """``n`` producers of the stream are registered here now."""
        if n:
            self._no_producer_since = None
        elif self._no_producer_since is None:
            self._no_producer_since = now

    def give_back_due(self, now: float) -> bool:
        """No producer has been registered here for :data:`BACK_AFTER` seconds."""
        return (self._no_producer_since is not None
                and now - self._no_producer_since >= BACK_AFTER)

    # -- consumers ---------------------------------------------------------------------------
    def resume(self, ident: bytes, cursor: Cursor, alive: int) -> None:
        """Consumer ``ident`` registered with ``resume=cursor``; ``alive``: the host's other
        consumers of the current launch whose connection is open (probed). It waits for a
        view that answers its Resume (:meth:`answers`)."""
        self.launch_of.pop(ident, None)
        self.waiting.pop(ident, None)
        msg = self.member.resume(cursor, alive)
        self.waiting[ident] = Waiting(cursor, msg.seq)
        while len(self.waiting) > MAX_CONSUMERS:
            self.waiting.pop(next(iter(self.waiting)))
        self._send(msg)

    def admit(self, ident: bytes) -> None:
        """Consumer ``ident`` registered without a resume waiting: it is of the launch the
        host knows now (if it was not admitted under one already)."""
        if ident not in self.waiting and ident not in self.launch_of:
            self.launch_of[ident] = self.member.launch
            while len(self.launch_of) > MAX_CONSUMERS:
                self.launch_of.pop(next(iter(self.launch_of)))

    def stale(self, ident: bytes) -> bool:
        """Consumer ``ident`` was admitted under a launch before the current one."""
        launch = self.launch_of.get(ident, 0)
        return launch != 0 and self.member.launch != 0 and launch != self.member.launch

    def of_launch(self, but: bytes = b"") -> list[bytes]:
        """The consumers admitted under the current launch (but ``but``)."""
        return [x for x, n in self.launch_of.items() if n == self.member.launch and x != but]

    def waits(self, ident: bytes) -> bool:
        return ident in self.waiting

    def forget(self, ident: bytes, gone: bool) -> None:
        """Consumer ``ident``'s registration ended: its resume waits no more; ``gone`` (its
        connection is closed), its launch goes too."""
        self.waiting.pop(ident, None)
        if gone:
            self.launch_of.pop(ident, None)

    def readers(self, registered: Iterable[bytes]) -> int:
        """Of the consumers ``registered`` now (a container of idents), those of the current
        launch or waiting for a view (what a Beat counts)."""
        return sum(1 for x in registered
                   if x in self.waiting or self.launch_of.get(x, -1) in (0, self.member.launch))

    def answers(self, view: View, ch: Change, now: float) -> Answers:
        """What ``view``, just taken (``ch``: what it changed), says of the host's
        consumers."""
        out = Answers()
        launch = self.member.launch
        for x, n in list(self.launch_of.items()):
            if n == 0 and launch:
                self.launch_of[x] = launch  # of the launch the host first heard of
        if ch.new_launch:
            out.stale = [x for x in self.launch_of if self.stale(x)]
        for ident, w in list(self.waiting.items()):
            a = self.member.answer(view, w.seq, True)
            if a is Answer.ADMITTED:
                del self.waiting[ident]
                self.launch_of[ident] = launch
                first = self.resumed_launch != launch
                self.resumed_launch = launch
                out.admitted.append((ident, w.cursor, first))
            elif a is Answer.AGAIN:
                if view.seq == w.seq and view.wait is NoUnit.BUSY:
                    w.again_at = now + AGAIN_AFTER  # answered busy: not at once
                elif not w.again_at:
                    out.again.append((ident, w.cursor))
        return out

    def due(self, now: float) -> list[tuple[bytes, Cursor]]:
        """Resumes answered busy whose time to be sent again came."""
        return [(x, w.cursor) for x, w in self.waiting.items()
                if w.again_at and now >= w.again_at]

    def refused_consumers(self, refused: JobRefused) -> list[bytes]:
        """The waiting consumers a refusal of the job is about (they go): a cursor the job
        refused (those of another stream or pipeline; all of them if none is), or the job's
        position lost (every one)."""
        if refused.reason == "cursor_mismatch":
            fp = self.member.plan.fingerprint
            out = [x for x, w in self.waiting.items() if w.cursor.stream != self.member.stream
                   or (w.cursor.pipeline and fp and w.cursor.pipeline != fp)]
            out = out or list(self.waiting)
        elif refused.reason == "position_lost":
            out = list(self.waiting)
        else:
            return []
        for x in out:
            del self.waiting[x]
        return out

    # -- what the link does ---------------------------------------------------------------
    def drain(self) -> list[Message]:
        out = list(self.outbox)
        self.outbox.clear()
        return out

    def take(self, view: View) -> Change:
        """A view arrived: what it changed (the host's coordinator applies it)."""
        self.views += 1
        if not self.joined and view.seq >= self._join_seq and view.session == \
                self.member.session:
            self.joined = True
            self.refused = None
            if self._said_unreachable:
                log.info("stream %s: the job's coordinator at %s answers", self.member.stream,
                         self.address)
            self._said_unreachable = False
        if self._ask_seq and view.seq >= self._ask_seq:
            self._ask_seq = 0
        ch = self.member.view(view)
        if ch.opened:
            self.wanted = False
        return ch

    def refuse(self, refused: JobRefused, now: float) -> None:
        """The job refused one of this host's messages (a consumer's cursor: only that
        consumer is refused, :meth:`refused_consumers`)."""
        if refused.reason == "cursor_mismatch":
            return
        if refused.reason == "not_registered":  # the coordinator restarted: join again
            self.joined = False
            self._join()
            self._join_at = now
            return
        if self.refused is None or self.refused.reason != refused.reason:
            log.error("stream %s: the job's coordinator at %s refuses this host: %s",
                      self.member.stream, self.address, refused.text)
        self.refused = refused
        self.joined = False

    def tick(self, now: float, readers: int) -> None:
        """Once a tick: a Join or an Ask again if unanswered, a beat when one is due."""
        if not self.joined:
            if now - self._join_at >= RETRY and self.refused is None:
                self._join(readers)
                self._join_at = now
            if not self._said_unreachable and now - self._first_join >= UNREACHABLE \
                    and self.refused is None:
                self._said_unreachable = True
                log.error("stream %s: the job's coordinator at %s has not answered for %.0fs: "
                          "start `feedline coordinator` there, or give this host its address "
                          "(--coordinator); producers here wait", self.member.stream,
                          self.address, now - self._first_join)
            return
        if self.wanted and self.refused is None and now - self._ask_at >= RETRY:
            self._ask(now)  # unanswered (lost), or answered busy: a producer still waits
        if now - self._beat_at >= BEAT:
            self._beat_at = now
            self._send(self.member.beat(readers))

    def beat(self, readers: int, now: float) -> None:
        """A beat now (a view asked for the count of the launch's consumers)."""
        if self.joined:
            self._beat_at = now
            self._send(self.member.beat(readers))

    # -- sending ------------------------------------------------------------------------
    def _join(self, readers: int = 0) -> None:
        msg = self.member.join(readers)
        self._join_seq = msg.seq
        self.outbox.clear()  # a Join says it all: what was waiting is in it
        self.outbox.append(msg)

    def _ask(self, now: float) -> None:
        msg = self.member.ask()
        self._ask_seq, self._ask_at = msg.seq, now
        self._send(msg)

    def _send(self, msg: Message) -> None:
        if len(self.outbox) >= MAX_OUTBOX:
            self._join()
            return
        self.outbox.append(msg)

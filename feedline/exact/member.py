"""A host's side of a job served by several hosts (one exact stream): what it asks the job's
coordinator (:mod:`feedline.exact.job`), and what it makes of the answers. Pure logic: the
host's loop sends the messages it makes and hands it the views it receives.

What the host does with it:

- before it hands a unit to a producer it asks (:meth:`ask`), and hands the unit over once a
  view opened it (:attr:`Change.opened`);
- it delivers a batch only if :meth:`deliverable` says so: its unit is open here, of this
  epoch and launch, and the batch was not taken (a unit given back here after a host took part
  of it comes with what was taken);
- a unit every batch of which was taken here is :meth:`done`; one it cannot finish (no
  producer left for it) it gives back (:meth:`back`) after dropping what it buffered of it;
- a consumer's HELLO goes to the coordinator as a beat, or as a resume with its ``resume=``
  cursor (:meth:`resume`); the consumer is admitted (served) only once a view answers that
  message (:meth:`answer`), under the launch that view names; a resume the coordinator went
  past without taking (lost, refused when the coordinator restarted, answered BUSY) is sent
  again;
- a view of a new launch voids every unit of the older one (:attr:`Change.new_launch`):
  the host drops their buffered batches and refuses the older launch's consumers;
- an epoch's end (:attr:`Change.ended`) is told to its consumers.

State the host keeps in its journal (its own coordinator's, :mod:`feedline.exact.journal`):
the job id and the launch its state is of (``HostLaunch``), the epoch, and what was taken
here. A host restarted on it is :meth:`JobMember.restore`-d from it, so that a first view of
another launch voids what it holds (takes of the older launch, which the job's checkpoint may
lack); the units open here are the coordinator's to say (its view after the Join).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from feedline.exact.cursor import Cursor
from feedline.exact.job import Ask, Back, Beat, Done, Join, Leave, OpenUnit, Resume, View
from feedline.exact.plan import ExactPlan, NoUnit

MAX_RELEASED = 4096  # units done or given back, remembered until a view caught up with them


@dataclass
class Change:
    """What a view changed for the host."""

    new_launch: bool = False  # every unit of the older launch is void
    ended: list[int] = field(default_factory=list)  # epochs that ended
    opened: list[OpenUnit] = field(default_factory=list)  # open here now, not before
    closed: list[int] = field(default_factory=list)  # no longer open here
    wait: NoUnit | None = None
    probe: bool = False  # count the launch's consumers now and beat


class Answer(Enum):
    """What a view says of a consumer's registration (its beat or resume)."""

    PENDING = "pending"  # not answered yet: wait for another view
    AGAIN = "again"  # a resume not taken (lost, refused, BUSY): send it again
    ADMITTED = "admitted"  # serve the consumer, under the member's launch


class JobMember:
    """Host ``host`` (restarted: a new ``session``) of stream ``stream``."""

    def __init__(self, host: str, stream: str, plan: ExactPlan, session: int) -> None:
        self.host, self.stream, self.plan, self.session = host, stream, plan, session
        self.seq = 0
        self.job = 0
        self.launch = 0
        self.epoch = 0
        self.finished = False
        self.open: dict[int, tuple[int, int]] = {}  # unit -> (generation, taken bits)
        self.done_units: dict[int, tuple[int, int]] = {}  # this epoch: unit -> (gen, batches)
        self._released: dict[int, int] = {}  # unit -> seq of the Done/Back that let it go
        self.heard = 0  # the seq of the last view taken
        self.version = (0, 0)  # of the last view taken

    def restore(self, job: int, launch: int, epoch: int, finished: bool) -> None:
        """A host restarted on its journal: it believes what it journaled (the job, the launch
        its state is of, the epoch). A first view of another launch then voids that state
        (:attr:`Change.new_launch`), as on a host that ran through the change; a member that
        knew no launch would take any first view as its own."""
        self.job, self.launch, self.epoch, self.finished = job, launch, epoch, finished

    def _next(self) -> int:
        self.seq += 1
        return self.seq

    # -- messages -------------------------------------------------------------------------
    def join(self, readers: int = 0) -> Join:
        return Join(self.host, self.session, self._next(), self.plan, self.job, self.launch,
                    self.epoch, tuple((u, g, t) for u, (g, t) in sorted(self.open.items())),
                    tuple((u, g, n) for u, (g, n) in sorted(self.done_units.items())), readers)

    def ask(self) -> Ask:
        return Ask(self.host, self.session, self._next(), self.launch)

    def done(self, unit: int, batches: int) -> Done | None:
        got = self.open.pop(unit, None)
        if got is None:
            return None
        seq = self._next()
        self._release(unit, seq)
        self.done_units[unit] = (got[0], batches)
        return Done(self.host, self.session, seq, self.launch, self.epoch, unit, got[0], batches)

    def back(self, unit: int, taken: int) -> Back | None:
        got = self.open.pop(unit, None)
        if got is None:
            return None
        seq = self._next()
        self._release(unit, seq)
        return Back(self.host, self.session, seq, self.launch, self.epoch, unit, got[0],
                    taken | got[1])

    def beat(self, readers: int) -> Beat:
        return Beat(self.host, self.session, self._next(), self.launch, readers)

    def resume(self, cursor: Cursor, alive: int) -> Resume:
        return Resume(self.host, self.session, self._next(), cursor, alive, self.launch)

    def leave(self) -> Leave:
        return Leave(self.host, self.session, self._next())

    def _release(self, unit: int, seq: int) -> None:
        self._released[unit] = seq
        while len(self._released) > MAX_RELEASED:
            self._released.pop(next(iter(self._released)))

    # -- views ----------------------------------------------------------------------------
    def view(self, v: View) -> Change:
        """Take a view (in any order, any number of times: an old one changes nothing it
        should not)."""
        out = Change(wait=v.wait, probe=v.probe)
        if v.host != self.host or v.session != self.session or v.version <= self.version:
            return out  # another session's, or made before one taken
        self.heard, self.version, self.job = v.seq, v.version, v.job
        if v.launch != self.launch:
            out.new_launch = self.launch != 0 or bool(self.open)
            out.closed = sorted(self.open)
            self.open.clear()
            self.done_units.clear()
            self._released.clear()
            self.launch, self.epoch, self.finished = v.launch, v.epoch, v.finished
        elif (v.epoch, v.finished) != (self.epoch, self.finished):
            out.ended = list(range(self.epoch, v.epoch + (1 if v.finished else 0)))
            out.closed = sorted(self.open)
            self.open.clear()
            self.done_units.clear()
            self._released.clear()
            self.epoch, self.finished = v.epoch, v.finished
        for u, gen, taken in v.open:
            seq = self._released.get(u)
            if seq is not None and v.seq < seq:
                continue  # we let it go after this view was made
            if u not in self.open or self.open[u][0] != gen:
                self.open[u] = (gen, taken)
                out.opened.append((u, gen, taken))
        listed = {u for u, _, _ in v.open}
        for u in [u for u in self.open if u not in listed]:
            del self.open[u]  # the coordinator says it is not ours (a view after our Back)
            out.closed.append(u)
        for u in [u for u, seq in self._released.items() if v.seq >= seq]:
            del self._released[u]
        return out

    def answer(self, v: View, seq: int, resume: bool) -> Answer:
        """What ``v`` (taken by :meth:`view` just now) says of this host's registration of a
        consumer, sent as message ``seq`` (a :meth:`resume` if ``resume``, else a beat).

        Only the view last taken decides (an older one, reordered, says nothing: the member's
        launch is a newer view's). A beat is answered by any view that took it into account;
        a resume only by one that took it: the coordinator keeps a host's messages in order
        and never takes one older than the last it took, so a view past ``seq`` that did not
        take the resume means it never will."""
        if v.host != self.host or v.session != self.session or v.version != self.version \
                or v.seq < seq:
            return Answer.PENDING
        if resume and v.resumed != seq:
            return Answer.AGAIN
        return Answer.ADMITTED

    def deliverable(self, epoch: int, unit: int, index: int) -> bool:
        """A batch of unit ``unit`` may be delivered here: the unit is open here, of this
        epoch, and the batch was not taken before it came here."""
        got = self.open.get(unit)
        return (got is not None and epoch == self.epoch and not self.finished
                and not got[1] >> index & 1)

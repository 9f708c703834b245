"""The credit planner: who may send how much, so that memory stays within the budget.

Pure bookkeeping (no sockets, no clock of its own): the broker tells it what happened
(HELLO, batch, WANT, RETURNED, departure) and asks it for a plan, given what the broker holds
already (buffered and in flight to consumers). The plan is a list of producers whose grant
changed (their new absolute totals are in :class:`ProducerCredit`) and a list of producers
to ask for their unused credit back.

The rules, each a bound:

- Credit is batches and bytes, within one :class:`~feedline.serving.budget.Budget`. A
  producer holds ``granted - received`` batches and ``granted_bytes - received_bytes`` bytes
  of credit (received counts refused batches too: a refused batch used its credit, the room
  it did not fill is planned anew, which is how its credit comes back).
  ``held + Σ outstanding <= max_batches`` and ``held_bytes + Σ reserved <= max_bytes``
  always.
- A new registration gets nothing until it asks (WANT, which an honest producer sends once
  it has a batch ready): a peer that registers and never asks holds no credit, however
  often it registers. Producers that have not sent a batch yet hold at most the budget's
  ``new_producers`` share together (a quarter), so a flood of registrations that ask and
  never send cannot take what the producers that do send need; they start a few at a time.
- Streams share the budget (``Budget.per_stream``): only streams that are produced (a
  producer of it has sent a batch, or something of it is held) or read (a consumer waits for
  it) count, so registrations that never send, on stream names of their own that nobody
  reads, shrink nobody's share; and a stream that is read keeps at least the budget's
  ``stream_floor`` whatever the others do.
- A credit is worth ``unit`` bytes: the largest of the size the producer declared in its
  HELLO, the largest batch it sent, and what it asked for (WANT). A batch larger than
  ``max_bytes`` can never be granted: its WANT is refused (``batch_too_large``).
- At most ``window`` batches outstanding per producer; fewest-outstanding first, ties
  rotated, producers that asked first of all. A deep window is topped up by parts
  (:func:`~feedline.serving.budget.top_up`: once an eighth of it is free, or 6 batches
  where that is at most a quarter of it; then filled in the same plan), so that a producer
  of small batches gets a GRANT per several batches; a window under 16 gets each credit back
  as its room frees.
- ``by_bytes`` (a broker and a direct-mode trainer): small batches are counted by their
  bytes (:func:`~feedline.serving.budget.depth`): a producer's window for its own unit, the
  budget's batches for the largest unit of the producers registered
  (:meth:`Budget.for_unit`; kept while no producer's size is known). One producer of large
  batches brings the count back to ``max_batches`` for all; what is held beyond it then
  waits to be taken: no credit is granted until it is. The shares that evict an unread
  stream's batches (:meth:`CreditPlanner.shares`) are counted for the deepest count the
  budget has had: a count that shrank under what a broker holds would evict batches it
  granted.
- A producer whose batch was refused gets more credit only when it asks (WANT), as a new
  registration does.
- Credit unused for ``lease`` seconds while another producer waits for room is asked back
  (REVOKE); the producer answers with what it sent (RETURNED) and gets credit again only
  when it asks (WANT). One that does not answer is the broker's to cut off.
- A producer is in one :class:`CreditState`; what happens to it (a :class:`CreditEvent`)
  moves it as :data:`TRANSITIONS` says, and an event the table does not have for its state
  is a bug of the planner or of its caller (:func:`step` raises :class:`CreditStateError`).
  The state says what a plan may give it; how much stays in numbers (granted, received,
  ``short_bytes``).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

from feedline.errors import FeedlineError
from feedline.protocol.messages import DEFAULT_STREAM
from feedline.serving.budget import TOP_UP, Budget, Share, depth, top_up


class CreditState(Enum):
    """Where a producer's credit stands: what a plan may give it."""

    # Identity, not the name's hash (Enum's own, a Python call): a state is looked up in
    # TRANSITIONS at every batch.
    __hash__ = object.__hash__

    IDLE = "idle"  # new, gave its credit back, or its batch was refused: more only if it asks
    RUNNING = "running"  # sent a batch, or asked and was granted: its window is topped up
    WANTING = "wanting"  # asked (WANT) and short: granted what it asked first, topped up too
    # Gave its credit back (RETURNED) with a WANT from before the REVOKE still standing: that
    # WANT, counted anew against what it holds after the RETURNED, is granted; nothing more
    # until it sends (a producer asks again after a RETURNED; the grant may cross it).
    IDLE_WANTING = "idle_wanting"
    REVOKING = "revoking"  # asked to give its unused credit back: nothing until it answers
    REVOKING_WANTING = "revoking_wanting"  # ... with a WANT standing (granted after RETURNED)


class CreditEvent(Enum):
    """What happened to a producer's credit (a HELLO makes a new one, IDLE; a departure drops
    it, whatever its state)."""

    __hash__ = object.__hash__  # as CreditState's

    WANT = "want"  # it asked (WANT), short of batch or byte credit
    WANT_COVERED = "want_covered"  # it asked, and a GRANT that crossed the WANT covers it
    BATCH = "batch"  # a batch (or a bundle of them) arrived
    REFUSED = "refused"  # the batch that just arrived was refused
    GRANT = "grant"  # a plan granted what it asked for
    REVOKE = "revoke"  # a plan asked for its unused credit back
    RETURNED = "returned"  # it answered the REVOKE


class CreditStateError(FeedlineError, RuntimeError):
    """An event that the producer's state has no transition for: a bug, not a peer's fault
    (the planner ignores what a peer may send out of turn before it steps)."""


_S, _E = CreditState, CreditEvent
_NOT_REVOKING = (_S.IDLE, _S.RUNNING, _S.WANTING, _S.IDLE_WANTING)
TRANSITIONS: dict[tuple[CreditState, CreditEvent], CreditState] = {
    # A WANT is honoured in any state but while a REVOKE is pending (its RETURNED is on the
    # way; it asks again after): what it asked stands until a plan grants it or it sends.
    **{(s, _E.WANT): _S.WANTING for s in _NOT_REVOKING},
    **{(s, _E.WANT_COVERED): _S.RUNNING for s in _NOT_REVOKING},
    # A batch answers any WANT (it had the credit after all) and makes it a running producer:
    # topped up unasked. A revoked one still owes its RETURNED.
    **{(s, _E.BATCH): _S.RUNNING for s in _NOT_REVOKING},
    (_S.REVOKING, _E.BATCH): _S.REVOKING,
    (_S.REVOKING_WANTING, _E.BATCH): _S.REVOKING,
    # A refusal follows the batch it refuses: more credit only when it asks.
    (_S.RUNNING, _E.REFUSED): _S.IDLE,
    (_S.REVOKING, _E.REFUSED): _S.REVOKING,
    (_S.WANTING, _E.GRANT): _S.RUNNING,
    (_S.IDLE_WANTING, _E.GRANT): _S.IDLE,
    # Any producer holding credit may be asked for it; a WANT it made stands.
    (_S.IDLE, _E.REVOKE): _S.REVOKING,
    (_S.RUNNING, _E.REVOKE): _S.REVOKING,
    (_S.WANTING, _E.REVOKE): _S.REVOKING_WANTING,
    (_S.IDLE_WANTING, _E.REVOKE): _S.REVOKING_WANTING,
    (_S.REVOKING, _E.RETURNED): _S.IDLE,
    (_S.REVOKING_WANTING, _E.RETURNED): _S.IDLE_WANTING,
}
del _S, _E, _NOT_REVOKING

# Module names for the states and events the planner reads at every batch and plan (an
# Enum's attribute is a slow lookup), and the sets of states that a rule reads.
IDLE, RUNNING, WANTING, IDLE_WANTING, REVOKING, REVOKING_WANTING = CreditState
WANT, WANT_COVERED, BATCH, REFUSED, GRANT, REVOKE, RETURNED = CreditEvent
ASKING = frozenset({WANTING, IDLE_WANTING})  # what it asked is granted first in a plan
TOPPED = frozenset({RUNNING, WANTING})  # its window is topped up unasked
WANTS = frozenset({WANTING, IDLE_WANTING, REVOKING_WANTING})  # a WANT stands
REVOKED = frozenset({REVOKING, REVOKING_WANTING})  # a REVOKE waits for its RETURNED


def step(p: ProducerCredit, event: CreditEvent) -> None:
    """Move ``p`` as :data:`TRANSITIONS` says for ``event``; raises
    :class:`CreditStateError` if the table has no such transition."""
    try:
        p.state = TRANSITIONS[p.state, event]
    except KeyError:
        raise CreditStateError(
            f"credit planner: no transition for {event.name} in state {p.state.name} "
            f"(a bug: the planner or its caller stepped out of turn)") from None


@dataclass
class ProducerCredit:
    """What the credit planner keeps of each producer."""

    declared: int = 0  # largest batch it expects (HELLO), bytes
    largest: int = 0  # largest batch received, bytes
    granted: int = 0  # absolute totals since its HELLO
    granted_bytes: int = 0
    received: int = 0
    received_bytes: int = 0
    short_bytes: int = 0  # WANT: bytes its next batch needs beyond its byte credit
    short_batch: bool = False  # WANT: ... and it has no batch credit either
    want_size: int = 0  # WANT: the size of the batch it asked for (kept across a REVOKE)
    revoking_since: float | None = None  # when the REVOKE pending (None: none) was sent
    state: CreditState = CreditState.IDLE
    held_since: float = 0.0  # when it last started holding credit, or last used it
    held_seconds: float = 0.0  # time it held unused batch credit, up to held_since
    stream: str = DEFAULT_STREAM

    @property
    def outstanding(self) -> int:
        return max(0, self.granted - self.received)

    def credit_seconds(self, now: float) -> float:
        """Seconds it held unused batch credit since its HELLO, up to ``now``: the time it
        was asked for a batch and had not sent it (what tells a producer that runs free from
        one the trainers hold back; sizing reads it). Credit given back on a REVOKE (unused for
        a lease: an idle producer) is not counted."""
        return self.held_seconds + (max(0.0, now - self.held_since) if self.outstanding else 0.0)

    @property
    def reserved(self) -> int:
        return max(0, self.granted_bytes - self.received_bytes)

    @property
    def unit(self) -> int:
        return max(self.declared, self.largest)

    def covers(self, batches: int, nbytes: int) -> bool:
        """Its grant covers ``batches`` more batches of ``nbytes`` in all: counting them is
        no breach."""
        return (self.received + batches <= self.granted
                and self.received_bytes + nbytes <= self.granted_bytes)

    @property
    def idle(self) -> bool:
        """It gets no credit it does not ask for (not topped up: ``state``)."""
        return self.state not in TOPPED

    @property
    def wanting(self) -> bool:
        """A WANT of it stands (``short_bytes``, ``short_batch`` say what it needs)."""
        return self.state in WANTS


@dataclass(frozen=True)
class Plan:
    grants: list[bytes]  # producers whose totals grew: send them GRANT
    revokes: list[bytes]  # producers to ask for unused credit: send them REVOKE


class CreditPlanner:
    """Credit of every registered producer, by key (the broker uses ROUTER identities)."""

    # A top-up given at once to the last producer that can take more, rather than one credit
    # per pass (the same grants: tests/broker/test_serving_fast_paths.py compares with False).
    BULK = True

    def __init__(self, budget: Budget, window: int, lease: float,
                 by_bytes: bool = False) -> None:
        self.base, self.max_bytes = budget, budget.max_bytes
        self.window, self.lease, self.by_bytes = window, lease, by_bytes
        self.producers: dict[bytes, ProducerCredit] = {}
        self._rr = 0
        self._unit = -1
        # What tells a host that a plan may grant more (it plans when either holds, when
        # something else happened, and on its clock): ``due``, an arrival left a producer
        # room for a top-up; ``blocked``, the last plan left one without what it could use.
        self.due = self.blocked = True
        # The deepest count the budget has had, and its shares: what may be kept (evicting).
        self.deepest: Budget = budget
        self._evict_per_stream: dict[tuple[int, bool], Share] = {}
        self._scale(0)

    def _scale(self, unit: int) -> None:
        """Count the budget's batches for the largest unit of the producers (``unit``; 0:
        none known, the count stays): the budget in force and its shares (frozen values,
        kept until the unit changes). Called with 0 once, then only if ``by_bytes``."""
        if unit != self._unit and (self._unit < 0 or unit > 0):
            first, self._unit = self._unit < 0, unit
            self.budget = self.base.for_unit(unit)
            self._new = self.budget.new_producers
            self._per_stream: dict[tuple[int, bool], Share] = {}
            if first or self.budget.max_batches > self.deepest.max_batches:
                self.deepest = self.budget
                self._evict_per_stream = {}

    def _rescale(self) -> None:
        """``by_bytes``: the budget counted for the largest unit of the producers now."""
        self._scale(max((p.unit for p in self.producers.values()), default=0))

    # -- what happened ------------------------------------------------------------------
    def join(self, key: bytes, declared: int, stream: str = DEFAULT_STREAM) -> ProducerCredit:
        p = self.producers[key] = ProducerCredit(declared=min(declared, self.max_bytes),
                                                 stream=stream)
        return p

    def leave(self, key: bytes) -> ProducerCredit | None:
        return self.producers.pop(key, None)

    def batch(self, key: bytes, nbytes: int, now: float, count: int = 1,
              largest: int = 0) -> str | None:
        """A batch of ``nbytes`` arrived (or ``count``, ``nbytes`` in all, the largest
        ``largest``: a bundle's within its credit). Returns a breach (``no_credit``,
        ``over_credit``) if the producer sent beyond its grant; the caller cuts it off."""
        p = self.producers[key]
        p.held_seconds = p.credit_seconds(now)
        p.received += count
        p.received_bytes += nbytes
        p.largest = max(p.largest, min(largest or nbytes, self.max_bytes))
        p.short_bytes, p.short_batch, p.held_since = 0, False, now
        # step(p, BATCH) without its call, at every batch (+3.5% of the planner's bytecodes
        # at 1 producer): every state has a BATCH (tests/broker/test_credit_states.py).
        p.state = TRANSITIONS[p.state, BATCH]
        if not self.due and not self.blocked and p.state is RUNNING:
            # Its window may be topped up now; not while the last plan was short of room (an
            # arrival frees none: batches taken do, ``wake``).
            self.due = self._room_for_top_up(p)
        if p.received > p.granted:
            return "no_credit"
        if p.received_bytes > p.granted_bytes:
            return "over_credit"
        return None

    def refused(self, key: bytes) -> None:
        """The batch just counted (:meth:`batch`) was refused: its room is planned anew, and
        this producer gets more credit only when it asks (WANT), as after a REVOKE. An honest
        encoder never sends a batch the host refuses; one that does must not hold a window of
        credit it spends on refusals (feedline/producer/channel.py asks after a REFUSED)."""
        step(self.producers[key], REFUSED)

    def want(self, key: bytes, sent: int, sent_bytes: int, size: int) -> str | None:
        """The producer's next batch is ``size`` bytes and its credit does not cover it.
        Returns ``batch_too_large`` if no plan could ever cover it."""
        p = self.producers[key]
        if size > self.max_bytes:
            return "batch_too_large"
        if p.state in REVOKED:
            return None  # its RETURNED is on the way; it asks again after
        p.declared, p.want_size = max(p.declared, size), size
        p.short_batch = p.granted - sent <= 0
        p.short_bytes = max(0, size - max(0, p.granted_bytes - sent_bytes))
        # Both 0: a grant crossed the WANT on the way, nothing more to do.
        step(p, WANT if p.short_batch or p.short_bytes else WANT_COVERED)
        return None

    def returned(self, key: bytes, sent: int, sent_bytes: int) -> bool:
        """The answer to a REVOKE: it sent ``sent`` batches, ``sent_bytes`` bytes, and will
        use no more of its grant. False if no REVOKE was pending (ignored)."""
        p = self.producers[key]
        if p.state not in REVOKED:
            return False
        p.granted = max(min(sent, p.granted), p.received)
        p.granted_bytes = max(min(sent_bytes, p.granted_bytes), p.received_bytes)
        p.revoking_since = None
        if p.state is REVOKING_WANTING:
            # The WANT stands, but it was reckoned against the credit just given back: what
            # it needs is counted anew from what it holds now (no batch credit is left: the
            # grant is what it sent), so that the grant after the RETURNED lets it send.
            p.short_batch = p.granted - sent <= 0
            p.short_bytes = max(0, p.want_size - max(0, p.granted_bytes - sent_bytes))
        step(p, RETURNED)
        return True

    # -- the plan -----------------------------------------------------------------------
    def outstanding(self) -> tuple[int, int]:
        return (sum(p.outstanding for p in self.producers.values()),
                sum(p.reserved for p in self.producers.values()))

    def shares(self, by_stream: dict[str, tuple[int, int]],
               unread: set[str]) -> dict[str, Share]:
        """Each registered producer's stream's share of the budget (``Budget.per_stream``).
        The streams that count are those produced (a producer of it has sent a batch, or
        something of it is held: ``by_stream``) or read (not in ``unread``); one that is
        neither is counted as one more
        for its own share (its producers' first credits come from the new producers' share
        anyway). ``unread``: the streams no consumer reads now."""
        produced = {p.stream for p in self.producers.values() if p.received > 0}
        if self.by_bytes:
            self._rescale()
        return self._shares({p.stream for p in self.producers.values()}, produced, by_stream,
                            unread, evicting=True)

    def _shares(self, streams: set[str] | dict[str, Any], produced: set[str],
                by_stream: dict[str, tuple[int, int]], unread: set[str],
                evicting: bool = False) -> dict[str, Share]:
        """:meth:`shares` given the producers' streams and those of them that have sent;
        ``evicting``: counted for the deepest budget so far (what may be kept), else for the
        budget now (what may be granted)."""
        # A stream counts once produced, or once read: a consumer waiting for one that has not
        # sent yet must not find the budget held by an unread one (no first credit, ever).
        counted = produced | {s for s, (b, y) in by_stream.items() if b > 0 or y > 0}
        counted |= {s for s in streams if s not in unread}
        out = {}
        n = len(counted)
        budget, cache = ((self.deepest, self._evict_per_stream) if evicting
                         else (self.budget, self._per_stream))
        for s in counted.union(streams):
            key = (n + (s not in counted), s not in unread)
            share = cache.get(key)
            if share is None:
                share = cache[key] = budget.per_stream(*key)
            out[s] = share
        return out

    def _tally(self) -> tuple[int, int, dict[str, list[int]], set[str], int, int]:
        """One pass over the producers for a plan: the outstanding batches and reserved bytes
        of all (as :meth:`outstanding`), of each stream, and of those that have not sent yet;
        and the streams that some producer has sent on; the budget counted for their largest
        unit. (A plan runs once per batch or so: the separate sums it replaces cost a broker
        ~10 us a batch.)"""
        out_b = out_y = fresh_b = fresh_y = 0
        mine: dict[str, list[int]] = {}
        produced: set[str] = set()
        if self.by_bytes:
            self._rescale()
        for p in self.producers.values():
            ob, oy = p.granted - p.received, p.granted_bytes - p.received_bytes
            ob, oy = (ob if ob > 0 else 0), (oy if oy > 0 else 0)
            out_b += ob
            out_y += oy
            t = mine.get(p.stream)
            if t is None:
                mine[p.stream] = [ob, oy]
            else:
                t[0] += ob
                t[1] += oy
            if p.received > 0:
                produced.add(p.stream)
            else:
                fresh_b += ob
                fresh_y += oy
        return out_b, out_y, mine, produced, fresh_b, fresh_y

    def _stream_room(self, by_stream: dict[str, tuple[int, int]], unread: set[str],
                     mine: dict[str, list[int]], produced: set[str]) -> dict[str, list[int]]:
        """Free [batches, bytes] of each stream's share (held and granted count)."""
        room = {}
        for s, share in self._shares(mine, produced, by_stream, unread).items():
            b, y = by_stream.get(s, (0, 0))
            ob, oy = mine.get(s, (0, 0))
            room[s] = [share.batches - b - ob, share.nbytes - y - oy]
        return room

    def plan(self, now: float, held_batches: int, held_bytes: int,
             by_stream: dict[str, tuple[int, int]] | None = None,
             unread: set[str] | None = None) -> Plan:
        """Grant what the room allows; ask idle holders back if someone waits for room.
        ``by_stream``: what is held of each stream (one stream if not given); ``unread``:
        the streams no consumer reads now."""
        self.due = False
        out_b, out_y, mine, produced, fresh_b, fresh_y = self._tally()
        free_b = self.budget.max_batches - held_batches - out_b
        free_y = self.budget.max_bytes - held_bytes - out_y
        if by_stream is None:
            by_stream = {p.stream: (held_batches, held_bytes) for p in self.producers.values()}
        room = self._stream_room(by_stream, unread or set(), mine, produced)
        fresh = self._fresh_room(fresh_b, fresh_y)
        grants: dict[bytes, None] = {}
        starving = False
        keys = list(self.producers)
        if keys:
            self._rr = (self._rr + 1) % len(keys)
            keys = keys[self._rr:] + keys[: self._rr]
        # Those that asked, first: each has one batch ready and waits for it.
        for key in keys:
            p = self.producers[key]
            if p.state not in ASKING:
                continue
            need_b = 1 if p.short_batch else 0
            sr = room[p.stream]
            if need_b <= min(free_b, sr[0]) and p.short_bytes <= min(free_y, sr[1]) \
                    and self._fits_fresh(p, fresh, need_b, p.short_bytes):
                p.granted += need_b
                p.granted_bytes += p.short_bytes
                free_b, free_y = free_b - need_b, free_y - p.short_bytes
                sr[0], sr[1] = sr[0] - need_b, sr[1] - p.short_bytes
                if p.outstanding == need_b:
                    p.held_since = now
                p.short_bytes, p.short_batch = 0, False
                step(p, GRANT)
                grants[key] = None
            else:
                starving = True
        # Then one credit at a time, fewest outstanding first (in bulk once a single
        # producer is left that can take more: _more_of).
        order = sorted(keys, key=lambda k: self.producers[k].outstanding)
        topping: set[bytes] = set()
        progress = True
        while progress and free_b > 0:
            progress = False
            passed: list[bytes] = []  # granted a credit in this pass
            for key in order:
                p = self.producers[key]
                unit = p.unit
                if p.state not in TOPPED or unit == 0:
                    continue
                window = self._window_of(unit)
                if p.outstanding >= window:
                    continue
                if window >= 2 * TOP_UP and key not in topping:  # else top_up is 1
                    # A deep window is topped up once a part of it is free, not a credit
                    # at a time (one GRANT per batch would be); then filled in this plan.
                    if window - p.outstanding < top_up(window):
                        continue
                    topping.add(key)
                if p.received == 0 and p.outstanding >= 1:
                    # Slow start: one credit until its first batch arrives, so that the first
                    # of many new producers to ask cannot take the quarter they share.
                    continue
                if free_b <= 0:
                    break
                sr = room[p.stream]
                if sr[0] <= 0:
                    continue
                # Bytes left over by batches smaller than the unit count towards the new
                # credit: what it holds stays within (batch credit) x unit.
                more = max(0, (p.outstanding + 1) * unit - p.reserved)
                if more > min(free_y, sr[1]):
                    starving = starving or p.outstanding == 0
                    continue
                if not self._fits_fresh(p, fresh, 1, more):
                    continue
                if p.outstanding == 0:
                    p.held_since = now
                p.granted += 1
                p.granted_bytes += more
                free_b, free_y = free_b - 1, free_y - more
                sr[0], sr[1] = sr[0] - 1, sr[1] - more
                grants[key] = None
                passed.append(key)
                progress = True
            if self.BULK and len(passed) == 1 and self.producers[passed[0]].received > 0:
                # Only one producer (past its slow start) took a credit in this pass; the
                # others' reasons only grow, so every later pass would give it one more: at once.
                p = self.producers[passed[0]]
                sr = room[p.stream]
                n = self._more_of(p, min(free_b, sr[0]), min(free_y, sr[1]))
                more = max(0, (p.outstanding + n) * p.unit - p.reserved) if n else 0
                p.granted += n
                p.granted_bytes += more
                free_b, free_y = free_b - n, free_y - more
                sr[0], sr[1] = sr[0] - n, sr[1] - more
                progress = False  # it can take no more, and the others no more than before
        if free_b <= 0 and any(self._could_use(p) for p in self.producers.values()):
            starving = True
        # Room for more would be granted at once: some producer waits, or has room in its
        # window for a top-up, that this plan could not cover.
        self.blocked = starving or any(
            p.state in TOPPED and p.unit > 0
            and (p.received > 0 or p.outstanding == 0)
            and self._room_for_top_up(p)
            for p in self.producers.values())
        revokes = self._revocations(now) if starving else []
        return Plan(list(grants), revokes)

    def _more_of(self, p: ProducerCredit, batches: int, nbytes: int) -> int:
        """How many more credits ``p`` may take, given ``batches`` and ``nbytes`` of room:
        up to its window, and while its bytes, ``(outstanding + n) x unit`` beyond what it
        has reserved, fit."""
        by_bytes = (nbytes + p.reserved) // p.unit - p.outstanding
        return max(0, min(self._window_of(p.unit) - p.outstanding, batches, by_bytes))

    @property
    def wake(self) -> int:
        """After a plan that left a producer short (``blocked``), batches taken before another
        plan is worth making: a top-up of a window of the largest batches, the least a GRANT
        gives (an eighth of the budget's count let 16 KB batches run dry: -10%)."""
        return top_up(self._window_of(self._unit))

    def _window_of(self, unit: int) -> int:
        """A producer's window for batches of ``unit`` bytes (by bytes, or in batches)."""
        return depth(self.window, unit) if self.by_bytes else self.window

    def _room_for_top_up(self, p: ProducerCredit) -> bool:
        """``p``'s window has a top-up's room free (what a GRANT to it would give, at least)."""
        return (window := self._window_of(p.unit)) - p.outstanding >= top_up(window)

    def _fresh_room(self, b: int, y: int) -> list[int]:
        """[batches, bytes, holds nothing] left of the budget's share that producers which
        have not sent a batch yet may hold together, given what they hold (``b``, ``y``)."""
        share = self._new
        return [share.batches - b, share.nbytes - y, int(b == y == 0)]

    @staticmethod
    def _fits_fresh(p: ProducerCredit, fresh: list[int], batches: int, nbytes: int) -> bool:
        """Take ``batches``/``nbytes`` from ``fresh`` (the room left to producers that have not
        sent yet: [batches, bytes, holds nothing]) if ``p`` has not sent yet; one batch of any
        size fits while no fresh producer holds anything."""
        if p.received > 0:
            return True
        if batches > fresh[0] or (nbytes > fresh[1] and not fresh[2]):
            return False
        fresh[0], fresh[1], fresh[2] = fresh[0] - batches, fresh[1] - nbytes, 0
        return True

    def _could_use(self, p: ProducerCredit) -> bool:
        return (p.outstanding == 0 and p.state in TOPPED
                and (p.unit > 0 or p.state is WANTING))

    def _revocations(self, now: float) -> list[bytes]:
        out = []
        for key, p in self.producers.items():
            # Batch credit, or bytes left over with none (small batches under a large
            # declared size), unused for the lease.
            if (p.outstanding > 0 or p.reserved > 0) and p.state not in REVOKED \
                    and now - p.held_since > self.lease:
                p.revoking_since = now
                step(p, REVOKE)
                out.append(key)
        return out

    def unanswered(self, now: float, timeout: float) -> list[bytes]:
        """Producers that did not answer a REVOKE within ``timeout``: they break the rules."""
        return [k for k, p in self.producers.items()
                if p.revoking_since is not None and now - p.revoking_since > timeout]


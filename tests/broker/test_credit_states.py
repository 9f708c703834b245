"""A producer's credit as named states (feedline/serving/credit.py): the transition table
itself, the planner's calls that step through it, and a Hypothesis state machine that
drives the planner with honest and out-of-turn producers and checks, after every step,
that each producer's state agrees with the numbers beside it."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from feedline.errors import FeedlineError
from feedline.serving.budget import Budget
from feedline.serving.credit import (
    ASKING,
    REVOKED,
    TOPPED,
    TRANSITIONS,
    WANTS,
    CreditEvent,
    CreditPlanner,
    CreditState,
    CreditStateError,
    ProducerCredit,
    step,
)

S, E = CreditState, CreditEvent
KB = 1024


def planner(batches: int = 8, nbytes: int = 64 * KB, lease: float = 1.0) -> CreditPlanner:
    return CreditPlanner(Budget(batches, nbytes), window=4, lease=lease)


# -- the table --------------------------------------------------------------------------


def test_every_state_has_a_batch_transition() -> None:
    """CreditPlanner.batch looks BATCH up in the table without step() (its hot path): a
    state without one would be a KeyError in the middle of serving."""
    assert {s for (s, e) in TRANSITIONS if e is E.BATCH} == set(S)


def test_a_revoked_producer_leaves_its_state_only_by_returning() -> None:
    """While a REVOKE is pending, nothing but its RETURNED ends it: a batch still owes the
    answer, a refusal leaves it revoked, and no WANT or GRANT is taken."""
    for s in REVOKED:
        outs = {e: t for (f, e), t in TRANSITIONS.items() if f is s}
        assert set(outs) <= {E.BATCH, E.REFUSED, E.RETURNED}
        assert outs[E.RETURNED] not in REVOKED
        assert all(t in REVOKED for e, t in outs.items() if e is not E.RETURNED)


def test_a_want_is_honoured_in_every_state_but_revoked_ones() -> None:
    for s in S:
        assert ((s, E.WANT) in TRANSITIONS) == (s not in REVOKED)
        if s not in REVOKED:
            assert TRANSITIONS[s, E.WANT] in ASKING


def test_the_named_sets_are_what_the_states_say() -> None:
    assert TOPPED == {S.RUNNING, S.WANTING}
    assert ASKING == {S.WANTING, S.IDLE_WANTING}
    assert WANTS == ASKING | {S.REVOKING_WANTING}
    # A grant ends an ask; a standing WANT survives a REVOKE and its RETURNED.
    assert all(TRANSITIONS[s, E.GRANT] not in ASKING for s in ASKING)
    assert TRANSITIONS[S.WANTING, E.REVOKE] is S.REVOKING_WANTING
    assert TRANSITIONS[S.REVOKING_WANTING, E.RETURNED] is S.IDLE_WANTING


MISSING: list[tuple[CreditState, CreditEvent]] = sorted(
    ((s, e) for s in S for e in E if (s, e) not in TRANSITIONS),
    key=lambda se: (se[0].value, se[1].value))


@pytest.mark.parametrize("state,event", MISSING)
def test_an_event_the_table_lacks_is_one_line_naming_both(state, event) -> None:
    p = ProducerCredit(state=state)
    with pytest.raises(CreditStateError) as e:
        step(p, event)
    assert isinstance(e.value, FeedlineError)
    msg = str(e.value)
    assert "\n" not in msg and state.name in msg and event.name in msg
    assert p.state is state  # unchanged


# -- the planner's calls ----------------------------------------------------------------


def test_a_new_producer_asks_is_granted_and_runs() -> None:
    cp = planner()
    p = cp.join(b"a", 4 * KB)
    assert p.state is S.IDLE and p.idle
    assert cp.want(b"a", 0, 0, 4 * KB) is None
    assert p.state is S.WANTING and p.wanting and p.short_batch and p.short_bytes == 4 * KB
    plan = cp.plan(0.0, 0, 0)
    assert b"a" in plan.grants and p.state is S.RUNNING
    assert p.granted >= 1 and p.granted_bytes >= 4 * KB and not p.wanting


def test_a_want_a_grant_already_covers_leaves_it_running() -> None:
    cp = planner()
    p = cp.join(b"a", 4 * KB)
    cp.want(b"a", 0, 0, 4 * KB)
    cp.plan(0.0, 0, 0)
    assert cp.want(b"a", 0, 0, 4 * KB) is None  # it had not seen the GRANT yet
    assert p.state is S.RUNNING and p.short_bytes == 0 and not p.short_batch


def test_a_refused_batch_leaves_it_idle_until_it_asks() -> None:
    cp = planner()
    p = cp.join(b"a", 4 * KB)
    cp.want(b"a", 0, 0, 4 * KB)
    cp.plan(0.0, 0, 0)
    assert cp.batch(b"a", 4 * KB, 0.1) is None and p.state is S.RUNNING
    cp.refused(b"a")
    assert p.state is S.IDLE
    before = p.granted
    cp.plan(0.2, 0, 0)
    assert p.granted == before  # not topped up unasked


def _revoked(cp: CreditPlanner, key: bytes, want_first: bool) -> ProducerCredit:
    """A producer holding unused credit past its lease while another waits for room."""
    p = cp.join(key, 4 * KB)
    cp.want(key, 0, 0, 4 * KB)
    cp.plan(0.0, 0, 0)
    if want_first:  # a WANT for a bigger batch than its credit, on the way as REVOKE is
        cp.want(key, 0, 0, 40 * KB)
    cp.join(b"other", 60 * KB)
    cp.want(b"other", 0, 0, 60 * KB)
    for t in (0.5, 2.0, 5.0):
        plan = cp.plan(t, 0, 0)
        if key in plan.revokes:
            break
    else:
        raise AssertionError(f"{key!r} was never asked for its credit back")
    return p


def test_a_revoke_waits_for_its_returned_and_ignores_wants_meanwhile() -> None:
    cp = planner(batches=2, nbytes=64 * KB)
    p = _revoked(cp, b"a", want_first=False)
    assert p.state is S.REVOKING and p.revoking_since is not None
    assert cp.want(b"a", 0, 0, 4 * KB) is None and p.state is S.REVOKING  # out of turn
    assert cp.returned(b"a", 0, 0) is True
    assert p.state is S.IDLE and p.revoking_since is None and p.outstanding == 0
    assert cp.returned(b"a", 0, 0) is False  # no REVOKE pending: ignored, no error


def test_a_want_from_before_the_revoke_is_granted_after_the_returned() -> None:
    cp = planner(batches=2, nbytes=64 * KB)
    p = _revoked(cp, b"a", want_first=True)
    assert p.state is S.REVOKING_WANTING and p.wanting
    cp.returned(b"a", 0, 0)
    assert p.state is S.IDLE_WANTING
    cp.leave(b"other")
    cp.plan(10.0, 0, 0)
    # What it asked is granted, counted against what it holds after the RETURNED (the review
    # of issue 57: it was reckoned against the credit given back, 36 KiB and no batch, and
    # the grant did not let it send), and nothing more is given unasked.
    assert p.state is S.IDLE and not p.wanting
    assert p.covers(1, 40 * KB) and p.granted == 1


# -- the model --------------------------------------------------------------------------

KEYS = (b"p0", b"p1", b"p2")
SIZES = st.sampled_from([KB, 8 * KB, 30 * KB])


class CreditStates(RuleBasedStateMachine):
    """Producers that follow the protocol (send within their credit, answer a REVOKE with
    what they sent, ask when short) and that send a WANT or a RETURNED out of turn; after
    every step each producer's state agrees with its numbers."""

    def __init__(self) -> None:
        super().__init__()
        self.cp = planner(batches=6, nbytes=64 * KB, lease=1.0)
        self.now = 0.0
        self.sent: dict[bytes, tuple[int, int]] = {}  # what each producer sent, as it counts

    def _live(self) -> list[bytes]:
        return sorted(self.cp.producers)

    @rule(key=st.sampled_from(KEYS), declared=SIZES)
    def join(self, key: bytes, declared: int) -> None:
        if key not in self.cp.producers:
            self.cp.join(key, declared)
            self.sent[key] = (0, 0)

    @precondition(lambda self: self.cp.producers)
    @rule(data=st.data(), size=SIZES)
    def send_or_ask(self, data: st.DataObject, size: int) -> None:
        key = data.draw(st.sampled_from(self._live()))
        p = self.cp.producers[key]
        n, y = self.sent[key]
        if p.state in REVOKED:
            return  # an honest producer answers first (rule ``answer``)
        if n < p.granted and y + size <= p.granted_bytes:
            assert self.cp.batch(key, size, self.now) is None  # within its grant: no breach
            self.sent[key] = (n + 1, y + size)
        else:
            assert self.cp.want(key, n, y, size) is None

    @precondition(lambda self: self.cp.producers)
    @rule(data=st.data())
    def refuse_last(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(self._live()))
        p = self.cp.producers[key]
        if p.state in (S.RUNNING, S.REVOKING) and self.sent[key][0] > 0:
            self.cp.refused(key)

    @precondition(lambda self: self.cp.producers)
    @rule(data=st.data())
    def answer(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(self._live()))
        was = self.cp.producers[key].state
        assert self.cp.returned(key, *self.sent[key]) is (was in REVOKED)

    @precondition(lambda self: self.cp.producers)
    @rule(data=st.data(), size=SIZES)
    def want_out_of_turn(self, data: st.DataObject, size: int) -> None:
        """A WANT that crossed a REVOKE or a GRANT on the way: never an error."""
        key = data.draw(st.sampled_from(self._live()))
        self.cp.want(key, *self.sent[key], size)

    @precondition(lambda self: self.cp.producers)
    @rule(data=st.data())
    def leave(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(self._live()))
        self.cp.leave(key)
        del self.sent[key]

    @rule(dt=st.sampled_from([0.0, 0.4, 1.5]))
    def plan(self, dt: float) -> None:
        self.now += dt
        plan = self.cp.plan(self.now, 0, 0)
        for key in plan.revokes:
            assert self.cp.producers[key].state in REVOKED
        assert len(set(plan.grants)) == len(plan.grants)

    @invariant()
    def states_agree_with_numbers(self) -> None:
        for key, p in self.cp.producers.items():
            assert isinstance(p.state, CreditState)
            assert (p.revoking_since is not None) == (p.state in REVOKED), (key, p)
            if p.state in ASKING:  # something it asked is still owed
                assert p.short_batch or p.short_bytes > 0, (key, p)
            if p.state not in WANTS:
                assert not p.short_batch and p.short_bytes == 0, (key, p)
            assert p.received <= p.granted and p.received_bytes <= p.granted_bytes
            assert (p.received, p.received_bytes) == self.sent[key]


TestCreditStates = CreditStates.TestCase
TestCreditStates.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                     suppress_health_check=[HealthCheck.too_slow])

"""The producers-wanted estimator (feedline/serving/sizing.py): pure, so tested as arithmetic.

The stabilizer never reverses under noise inside its band and converges after a step; the
whole estimator, fed with the counters a broker would sample from a simulated stream
(producers that each deliver ``capacity`` batches/s when credit allows, consumers that take
``demand`` when data is there), follows a demand that goes fast, slow, fast; learns the
capacity only from unthrottled producers; and splits the number among supervisors fairly.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from feedline.serving.sizing import (
    ConsumerSample,
    ProducerSample,
    SizingConfig,
    Stabilizer,
    StreamSizer,
    fleet_shares,
)

H, B = 0.10, 0.15  # the default headroom and band
K = (1 + H + B) / (1 + H)
EPS = (K - 1) / (K + 1)  # the largest relative noise the band absorbs: (1+e)/(1-e) <= K


def proposals(x: float) -> tuple[int, int]:
    return math.ceil(x * (1 + H) - 1e-9), math.ceil(x * (1 + H + B) - 1e-9)


# ---------------------------------------------------------------------------- Stabilizer
def test_stabilizer_moves_only_after_its_hold() -> None:
    s = Stabilizer(up_hold=2.0, down_hold=5.0, value=3)
    assert [s.update(t, 5, 6) for t in (0.0, 1.0)] == [3, 3]
    assert s.update(2.0, 4, 5) == 4  # 2 s of higher proposals: to the lowest of them
    assert s.update(3.0, 1, 2) == 4
    assert s.update(6.0, 1, 3) == 4  # 3 s since the change: not yet
    assert s.update(7.0, 1, 2) == 3  # 5 s of lower: to the highest of them
    s.update(8.0, 1, 1)
    assert s.update(9.0, 3, 3) == 3  # an interrupted run starts over


@settings(max_examples=300, deadline=None)
@given(x=st.floats(0.3, 40.0), start=st.integers(0, 60),
       noise=st.lists(st.floats(-EPS, EPS), min_size=20, max_size=200),
       up_hold=st.sampled_from([0.0, 1.0, 2.0, 4.0]), down_hold=st.sampled_from([0.0, 3.0, 10.0]))
def test_noise_inside_the_band_never_reverses_the_number(
        x: float, start: int, noise: list[float], up_hold: float, down_hold: float) -> None:
    """Whatever the start, a need that wanders within the band moves the number one way at
    most: never up then down, never down then up (no flapping)."""
    s = Stabilizer(up_hold, down_hold, value=start)
    values = [s.update(float(t), *proposals(x * (1 + e))) for t, e in enumerate(noise)]
    steps = [b - a for a, b in zip([start, *values], values, strict=False) if b != a]
    assert all(d > 0 for d in steps) or all(d < 0 for d in steps), (start, values)


@settings(max_examples=300, deadline=None)
@given(x1=st.floats(0.3, 40.0), x2=st.floats(0.3, 40.0),
       up_hold=st.sampled_from([0.0, 1.0, 2.0, 4.0]), down_hold=st.sampled_from([0.0, 3.0, 10.0]))
def test_a_step_change_converges_within_the_hold(x1: float, x2: float, up_hold: float,
                                                 down_hold: float) -> None:
    """After a step from x1 to x2 the number lands where x2 puts it (at least its headroom,
    at most its band) within one hold plus a sample, and stays."""
    s = Stabilizer(up_hold, down_hold, value=proposals(x1)[0])
    t = 0
    for _ in range(30):
        s.update(float(t), *proposals(x1))
        t += 1
    up, down = proposals(x2)
    hold = up_hold if up > s.value else down_hold
    for _ in range(int(hold) + 2):
        s.update(float(t), up, down)
        t += 1
    assert up <= s.value <= down
    settled = s.value
    for _ in range(30):
        s.update(float(t), up, down)
        t += 1
    assert s.value == settled


# --------------------------------------------------------------- a simulated stream
class Stream:
    """A stream as the broker samples it, once a second: ``n`` producers of ``capacity``
    batches/s each, one consumer that would take ``demand`` batches/s (window 8)."""

    def __init__(self, capacity: float, n: int) -> None:
        self.capacity, self.n = capacity, n
        self.taken = 0.0
        self.waited = 0.0
        self.received: dict[int, float] = {}
        self.credit: dict[int, float] = {}
        self.next_id = 0
        self.resize(n)

    def resize(self, n: int) -> None:
        while len(self.received) < n:
            self.received[self.next_id] = self.credit[self.next_id] = 0.0
            self.next_id += 1
        while len(self.received) > n:  # the newest leave first
            k = max(self.received)
            del self.received[k], self.credit[k]
        self.n = n

    def second(self, demand: float) -> tuple[list[ConsumerSample], list[ProducerSample]]:
        supply = self.capacity * self.n
        take = min(demand, supply)
        self.taken += take
        self.waited += 1 - take / demand if demand else 0.0
        # Unthrottled producers hold credit all the time; throttled ones only while they
        # make a batch the consumers already asked for.
        share = 1.0 if supply <= demand else 0.1 * demand / supply
        for k in self.received:
            self.received[k] += take / self.n if self.n else 0
            self.credit[k] += share
        held = 0 if supply < demand * 0.97 else (8 if supply > demand * 1.05 else 4)
        return ([ConsumerSample("c", int(self.taken), self.waited, held, 8)],
                [ProducerSample(k, int(v), self.credit[k]) for k, v in self.received.items()])


def run(sizer: StreamSizer, stream: Stream, schedule: list[float], lag: int = 2,
        t0: float = 0.0) -> list[int]:
    """Feed ``schedule`` (demand per second); the fleet follows the number ``lag`` s late."""
    wanted = []
    for i, demand in enumerate(schedule):
        est = sizer.observe(t0 + i, *stream.second(demand))
        wanted.append(est.wanted)
        if len(wanted) > lag:
            stream.resize(max(1, wanted[-1 - lag]))
    return wanted


def test_the_number_follows_fast_slow_fast() -> None:
    cfg = SizingConfig.for_window(6.0)
    sizer, stream = StreamSizer(cfg), Stream(capacity=10.0, n=1)
    fast, slow = 40.0, 12.0
    phases = [fast] * 40 + [slow] * 40 + [fast] * 40
    wanted = run(sizer, stream, phases)
    need_fast, need_slow = proposals(fast / 10.0)[0], proposals(slow / 10.0)[0]
    assert (need_fast, need_slow) == (5, 2)
    # Up within a window and a hold plus the fleet's lag, down within a window and its hold.
    up = wanted.index(need_fast)
    assert up <= cfg.window + cfg.up_hold + 8, wanted
    assert wanted[39] == need_fast
    down = next(i for i in range(40, 80) if wanted[i] <= proposals(slow / 10)[1])
    assert down - 40 <= cfg.window + cfg.down_hold + 4, wanted
    assert need_slow <= wanted[79] <= proposals(slow / 10)[1]
    again = next(i for i in range(80, 120) if wanted[i] == need_fast)
    assert again - 80 <= cfg.window + cfg.up_hold + 4, wanted
    assert wanted[-1] == need_fast
    assert sizer.capacity is not None and abs(sizer.capacity - 10.0) < 1.0


def test_capacity_is_learnt_only_from_unthrottled_producers() -> None:
    """Too many producers from the start (model-bound: each is throttled to demand / n): no
    capacity can be measured, so the number probes down one at a time until the producers
    run free, then settles at what the demand needs."""
    cfg = SizingConfig.for_window(4.0)
    sizer, stream = StreamSizer(cfg), Stream(capacity=10.0, n=8)
    wanted = run(sizer, stream, [15.0] * 150)
    assert wanted[3] == 8  # nothing said before half a window
    assert sizer.capacity is not None and abs(sizer.capacity - 10.0) < 1.0
    assert wanted[-1] == proposals(1.5)[0] == 2
    assert all(b <= a for a, b in zip(wanted[:60], wanted[1:60], strict=False)), wanted  # only down


def test_a_number_above_the_connected_producers_comes_down_while_model_bound() -> None:
    """The capacity figure was learnt while the one producer ran flat out (10 batches/s for a
    trainer of 10: headroom asks for 2), then the producer got faster (a warm cache) and the
    trainer is fed: throttled, it delivers 10/s, which says nothing of what it could do, so
    the figure stays and keeps asking for 2. The fleet never starts the second producer (it
    is at its limit). Model-bound with one producer means one suffices: the number comes
    down after the hold (it stayed at 2 for ever before)."""
    cfg = SizingConfig.for_window(4.0)
    sizer, stream = StreamSizer(cfg), Stream(capacity=10.0, n=1)
    early = [sizer.observe(float(t), *stream.second(10.0)) for t in range(20)]
    assert early[-1].wanted == 2 and early[-1].verdict != "model-bound"
    stream.capacity = 40.0
    late = [sizer.observe(float(t), *stream.second(10.0)) for t in range(20, 50)]
    assert late[-1].verdict == "model-bound" and sizer.capacity == pytest.approx(10.0, 0.05)
    assert late[-1].wanted == 1, [e.wanted for e in late]


@settings(max_examples=40, deadline=None)
@given(noise=st.lists(st.floats(-0.04, 0.04), min_size=120, max_size=120),
       demand=st.floats(8.0, 60.0))
def test_noisy_demand_does_not_flap_once_settled(noise: list[float], demand: float) -> None:
    cfg = SizingConfig.for_window(6.0)
    sizer, stream = StreamSizer(cfg), Stream(capacity=10.0, n=1)
    run(sizer, stream, [demand] * 60)
    settled = sizer.wanted
    later = run(sizer, stream, [demand * (1 + e) for e in noise], t0=60.0)
    changes = sum(1 for a, b in zip([settled, *later], later, strict=False) if a != b)
    assert changes <= 1, (settled, later)


def test_no_consumer_means_nobody_is_wanted_after_the_hold() -> None:
    cfg = SizingConfig(window=4.0, up_hold=1.0, down_hold=3.0)
    sizer = StreamSizer(cfg)
    producers = [ProducerSample("p", 0, 0.0)]
    assert sizer.observe(0.0, [], producers).wanted == 1  # starts at what is connected
    est = [sizer.observe(float(t), [], producers) for t in range(1, 6)]
    assert est[0].verdict == "idle"
    assert est[-1].wanted == 0


def test_a_consumer_with_no_producer_asks_for_one() -> None:
    sizer = StreamSizer(SizingConfig(window=2.0, up_hold=1.0, down_hold=3.0))
    got = [sizer.observe(float(t), [ConsumerSample("c", 0, float(t), 0, 4)], [])
           for t in range(6)]
    assert got[-1].wanted == 1 and got[-1].verdict == "input-bound"


# ---------------------------------------------------------------------------- shares
def test_fleet_shares_are_fair_stable_and_respect_limits() -> None:
    assert fleet_shares(7, {"b": 0, "a": 0, "c": 0}) == {"a": 3, "b": 2, "c": 2}
    assert fleet_shares(7, {"a": 2, "b": 0}) == {"a": 2, "b": 5}
    assert fleet_shares(10, {"a": 2, "b": 3}) == {"a": 2, "b": 3}  # all at their limits
    assert fleet_shares(5, {"a": 0, "b": 0}, unmanaged=3) == {"a": 1, "b": 1}
    assert fleet_shares(2, {"a": 0, "b": 0}, unmanaged=3) == {"a": 0, "b": 0}


@given(wanted=st.integers(0, 500), limits=st.dictionaries(
    st.text("abcdef", min_size=1, max_size=3), st.integers(0, 50), min_size=1, max_size=8),
    unmanaged=st.integers(0, 20))
def test_fleet_shares_add_up(wanted: int, limits: dict[str, int], unmanaged: int) -> None:
    shares = fleet_shares(wanted, limits, unmanaged)
    room = sum(v for v in limits.values()) if all(limits.values()) else None
    left = max(0, wanted - unmanaged)
    assert sum(shares.values()) == (left if room is None else min(left, room))
    for f, n in shares.items():
        assert n <= limits[f] or not limits[f]
    # No supervisor with room has two fewer than another: equal shares, floor and ceil.
    free = [shares[f] for f in shares if not limits[f] or shares[f] < limits[f]]
    assert not free or max(shares.values()) - min(free) <= 1 or \
        all(limits[f] and shares[f] == limits[f] for f in shares if shares[f] > min(free) + 1)


def _backlogged(taken_rate: float, each: float, buffered: int, seconds: int = 12) -> list:
    """A full trainer (held 8 of 8, never waiting) taking ``taken_rate`` while 2 producers
    deliver ``each`` per second, ``buffered`` more batches in the broker; capacity 10."""
    sizer = StreamSizer(SizingConfig.for_window(4.0))
    sizer.capacity = 10.0  # learnt earlier
    taken = received = 0.0
    out = []
    for t in range(seconds):
        taken += taken_rate
        received += each
        out.append(sizer.observe(float(t), [ConsumerSample("c", int(taken), 0.0, 8, 8)],
                                 [ProducerSample(k, int(received), float(t)) for k in (0, 1)],
                                 buffered))
    return out


def test_a_draining_backlog_asks_for_more_producers_while_the_queue_is_still_full() -> None:
    """Demand rose from 12 to 40 batches/s after a slow phase that left a backlog (the broker
    buffer and the trainer's window, deep for small batches: 640 batches of 10 KB in the
    fleet test). The trainer takes 40/s from it without waiting and its window stays full
    (model-bound), while the 2 producers deliver their 10/s each: once the backlog lasts less
    than DRAIN_HORIZON windows the number rises to 5, before it runs dry. Before, model-bound
    capped it at the 2 connected until the trainer waited (26 s in tests/commands/test_fleet.py)."""
    out = _backlogged(40.0, 10.0, buffered=100)  # (100 + 8) / 20 per s: 5.4 s < 16 s
    assert out[-1].verdict == "model-bound", out[-1]
    assert out[-1].wanted == proposals(4.0)[0] == 5, [e.wanted for e in out]
    # A backlog that lasts longer (1000 / 20 per s: 50 s) asks for nothing yet.
    assert all(e.wanted <= 2 for e in _backlogged(40.0, 10.0, buffered=1000))
    # Producers that deliver nothing (the end of the data, an exact stream's last units):
    # more of them would deliver nothing more. (Ones that deliver a little while holding
    # credit teach the sizer a lower capacity within a few windows, and are then taken at
    # their word: the capacity rule's, not this one's.)
    assert all(e.wanted <= 2 for e in _backlogged(40.0, 0.0, buffered=100))
    # Fed at the rate it takes (no backlog draining): never more than the connected.
    assert all(e.wanted <= 2 for e in _backlogged(20.0, 10.0, buffered=100))


def test_a_burst_of_batches_made_while_waiting_for_credit_is_not_capacity() -> None:
    """After a slow phase (2 producers throttled to 6.25 batches/s each) demand rises to 40/s
    and the trainer drains its backlog. Producers paced at 10/s first send the batches each
    made while waiting for credit, at the rate the trainer frees room (17.5/s for 3 s),
    then run free at their 10/s. That burst once raised the capacity figure (a throttled
    producer's rate above it did) and with it the supply: the number stayed below 5
    (tests/commands/test_fleet.py, last fast phase: read 17.6, scaled up 14 s in). Throttled
    producers no longer move the figure; free ones teach it."""
    sizer = StreamSizer(SizingConfig.for_window(4.0))
    sizer.capacity = 10.0  # learnt earlier
    taken = received = credit = 0.0
    out = []
    rates = [6.25] * 6 + [17.5] * 3 + [10.0] * 8
    for t, rate in enumerate(rates):
        taken += 12.5 if t < 6 else 40.0
        received += rate
        credit += 1.0 if t >= 9 else 0.0  # free (holding credit) once the burst is sent
        out.append(sizer.observe(float(t), [ConsumerSample("c", int(taken), 0.0, 8, 8)],
                                 [ProducerSample(k, int(received), credit) for k in (0, 1)],
                                 buffered=100 if t >= 6 else 400))
    assert max(e.capacity or 0 for e in out) <= 10.0 + 1e-9, [e.capacity for e in out]
    assert out[-1].wanted == proposals(4.0)[0] == 5, [e.wanted for e in out]


def test_credit_of_producers_that_left_is_not_capacity() -> None:
    """The fleet scales 5 producers down to 2 in a slow phase (12.5 batches/s taken): the
    credit of those that leave goes to those that stay, which send what they had made
    meanwhile (12.2/s read from a producer paced at 10 in tests/commands/test_fleet.py). Throttled,
    that says nothing of their pace: the figure stays."""
    sizer = StreamSizer(SizingConfig.for_window(4.0))
    sizer.capacity = 10.0
    taken = 0.0
    received = {k: 0.0 for k in range(5)}
    out = []
    for t in range(20):
        taken += 12.5
        stay = 2 if t >= 4 else 5
        for k in range(stay):
            received[k] += 12.5 / stay + (5.0 if 4 <= t < 10 else 0.0)
        out.append(sizer.observe(float(t), [ConsumerSample("c", int(taken), 0.0, 8, 8)],
                                 [ProducerSample(k, int(received[k]), 0.0)
                                  for k in range(stay)], buffered=400))
    assert all(e.capacity == 10.0 for e in out), [e.capacity for e in out]

"""How many producers a stream needs: demand, supply, and the number, held so it does not flap.

Pure (no clock, no sockets): the broker samples its counters about once a second and calls
:meth:`StreamSizer.observe`; everything else is arithmetic on what it was given.

- **Demand** is what the stream's consumers would take per second if they never waited for
  data: each consumer's take rate over the window divided by the share of that time it was
  not waiting (consumers report the seconds their loop waited in every TAKEN). A trainer that
  takes 20 batches/s while waiting half the time would take 40.
- **Capacity** is what one producer delivers when credit is not what holds it back: the
  delivery rate of producers that held unused credit at least :attr:`SizingConfig.unthrottled`
  of the window (the credit planner keeps that time exactly). Producers of a stream run the
  same pipeline, so the stream learns one figure (a moving average) and keeps it while the
  producers are throttled (model-bound, so their rate says nothing of what they could do,
  not even at least that much: a producer that waited for credit sends the batches it made
  meanwhile as soon as credit comes, a burst above its pace).
- **Supply** is capacity x producers connected; **need** is ``demand x (1 + headroom) /
  capacity``, producers as a real number.
- **Verdict** (the reason): the consumers' mean occupancy (``held / window``, what the broker
  delivered and they did not take yet) and wait share, judged as everywhere else
  (:mod:`feedline.verdict`, with its hysteresis); ``idle`` when no consumer reads the stream.

The number exported, :attr:`Estimate.wanted`, moves only when the evidence holds
(:class:`Stabilizer`): up when every proposal of the last ``up_hold`` seconds was higher (to
the lowest of them), down when every proposal of the last ``down_hold`` seconds was lower,
with ``band`` more headroom (to the highest of them). Proposals up also look at the demand
of the last half window (a rise shows there first); proposals down at the whole window. A
need that wanders inside the band never reverses the number (tests/broker/test_sizing.py proves it
with Hypothesis). The first number is the producers connected at the first sample, so the
broker takes none until :attr:`SizingConfig.settle` has passed since it started (its
producers, after a restart, are all back by then).

Guards where the figures and the verdict disagree: model-bound never asks for more
producers than are connected (a number above them comes down after ``down_hold``), unless
the consumers take more than producers at their capacity deliver and the backlog lasts less
than ``DRAIN_HORIZON`` windows (full queues that will run dry), and input-bound never for
fewer. Before any capacity was learned the verdict alone moves the number, once the
connected producers have matched it for a window (a scale-up still starting is not
judged): one fewer per ``down_hold`` while model-bound (a probe: fewer producers run free,
and then measure), one more while input-bound with producers holding credit (so not waiting
for it: more of them would deliver more).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from feedline.errors import ConfigError
from feedline.liveness import HEARTBEAT_TIMEOUT
from feedline.verdict import VerdictTracker

IDLE = "idle"  # no consumer reads the stream
VERDICTS = ("input-bound", "balanced", "model-bound", IDLE)


DRAIN_HORIZON = 4.0  # sizing windows: a backlog that runs dry sooner asks for producers now


@dataclass(frozen=True)
class SizingConfig:
    """How the number is derived (the broker's ``--sizing-window`` sets the times)."""

    window: float = 10.0  # seconds of samples the rates are taken over
    headroom: float = 0.10  # supply wanted above demand
    band: float = 0.15  # further headroom a scale-down must leave (the hysteresis band)
    up_hold: float = 2.0  # a higher number must be proposed this long before it is taken
    down_hold: float = 10.0  # a lower one, this long
    unthrottled: float = 0.9  # share of time holding credit for a rate to count as capacity
    min_busy: float = 0.05  # a consumer's busy share is at least this (demand <= 20x take)
    learn: float = 0.3  # weight of a new capacity measurement in the moving average
    # Seconds after the broker starts before it says any number: the peers of a broker that
    # restarted come back one by one within their reconnect window, and a number held from a
    # partial count (1 of 4 producers back) had the fleet stop the other 3 (issue 53, 15).
    settle: float = 2 * HEARTBEAT_TIMEOUT

    def __post_init__(self) -> None:
        if self.window <= 0 or self.up_hold < 0 or self.down_hold < 0 or self.settle < 0:
            raise ConfigError("window must be > 0, the holds and settle >= 0")
        if self.headroom < 0 or self.band < 0:
            raise ConfigError("headroom and band must be >= 0")

    @classmethod
    def for_window(cls, window: float, settle: float = 2 * HEARTBEAT_TIMEOUT
                   ) -> SizingConfig:
        """The defaults scaled to a window: up after a fifth of it, down after all of it;
        no number for ``settle`` seconds after the start (the broker passes twice its
        heartbeat timeout: a peer that was connected before a restart has noticed the
        silence and reconnected by then)."""
        return cls(window=window, up_hold=window / 5, down_hold=window, settle=settle)


@dataclass(frozen=True)
class ConsumerSample:
    """One consumer now: cumulative counters of its registration, and what it holds."""

    key: object  # unique per registration (a new one starts new counters)
    taken: int
    waited: float  # seconds its loop waited for data (0 if it does not say)
    held: int  # delivered and not taken yet
    window: int


@dataclass(frozen=True)
class ProducerSample:
    """One producer now: cumulative counters of its registration."""

    key: object
    received: int  # batches the broker received from it
    credit_seconds: float  # time it held unused credit


@dataclass(frozen=True)
class Estimate:
    """What :meth:`StreamSizer.observe` concluded; rates in batches/s, None while unknown."""

    wanted: int
    verdict: str  # one of VERDICTS, or "" before a window's worth of samples
    demand: float | None = None
    taken: float = 0.0
    wait_share: float | None = None
    occupancy: float | None = None
    capacity: float | None = None
    supply: float | None = None
    delivered: float = 0.0
    producers: int = 0
    need: float | None = None


@dataclass
class _Sample:
    t: float
    consumers: dict[object, ConsumerSample]
    producers: dict[object, ProducerSample]


class Stabilizer:
    """An integer that follows proposals only when they hold: up after ``up_hold`` seconds of
    higher ``up`` proposals (to their lowest), down after ``down_hold`` seconds of lower
    ``down`` proposals (to their highest). ``down >= up`` is the hysteresis band."""

    def __init__(self, up_hold: float, down_hold: float, value: int = 0) -> None:
        self.up_hold, self.down_hold, self.value = up_hold, down_hold, value
        self._history: deque[tuple[float, int, int]] = deque()
        self._since: float | None = None  # when the history started (a change resets it)

    def update(self, now: float, up: int, down: int) -> int:
        """Record one proposal pair at ``now``; return the value held."""
        if self._since is None:
            self._since = now
        self._history.append((now, up, down))
        keep = max(self.up_hold, self.down_hold)
        while self._history and self._history[0][0] < now - keep:
            self._history.popleft()
        ups = [u for t, u, _ in self._history if t >= now - self.up_hold]
        if now - self._since >= self.up_hold and min(ups) > self.value:
            return self._set(now, min(ups))
        downs = [d for t, _, d in self._history if t >= now - self.down_hold]
        if now - self._since >= self.down_hold and max(downs) < self.value:
            return self._set(now, max(downs))
        return self.value

    def _set(self, now: float, value: int) -> int:
        self.value = value
        self._history.clear()
        self._since = now
        return value


class StreamSizer:
    """The estimate of one stream, from samples taken about once a second."""

    def __init__(self, cfg: SizingConfig | None = None) -> None:
        self.cfg = cfg or SizingConfig()
        self.capacity: float | None = None
        self._samples: deque[_Sample] = deque()
        self._verdict = VerdictTracker()
        self._held: Stabilizer | None = None
        self._changed = 0.0  # when the number last changed
        self._reached: float | None = 0.0  # when the connected producers reached it since

    @property
    def wanted(self) -> int:
        return self._held.value if self._held is not None else 0

    def observe(self, now: float, consumers: Iterable[ConsumerSample],
                producers: Iterable[ProducerSample], buffered: int = 0) -> Estimate:
        """The estimate at ``now`` from the stream's consumers and producers, and the
        batches the broker holds for it (``buffered``: with what the consumers hold, the
        backlog a demand above the supply drains)."""
        cur = _Sample(now, {c.key: c for c in consumers}, {p.key: p for p in producers})
        self._samples.append(cur)
        # Keep the newest sample at or before the window's start: the base of its rates.
        while len(self._samples) > 2 and self._samples[1].t <= now - self.cfg.window:
            self._samples.popleft()
        n = len(cur.producers)
        if self._held is None:
            self._held = Stabilizer(self.cfg.up_hold, self.cfg.down_hold, value=n)
        if not cur.consumers:
            self._verdict = VerdictTracker()
            before = self._held.value
            wanted = self._held.update(now, 0, 0)
            if wanted != before:
                self._changed, self._reached = now, None
            return Estimate(wanted, IDLE, producers=n, capacity=self.capacity)
        span = now - self._samples[0].t
        if span < self.cfg.window / 2:  # too little seen yet to say anything
            return Estimate(self._held.value, "", producers=n, capacity=self.capacity)
        demand, taken, wait, occupancy = self._consumers(cur)
        delivered, credit_share = self._producers(cur)
        verdict = self._verdict.update(occupancy, wait)
        held = self._held.value
        need = None
        if self.capacity:
            # Rising demand is seen over the last half window too: too few producers cost
            # the trainers time, too many only CPU, so the number rises faster than it falls.
            recent = self._consumers(cur, since=now - self.cfg.window / 2)[0]
            need = max(demand, recent) * (1 + self.cfg.headroom) / self.capacity
            up = math.ceil(need - 1e-9)
            down = math.ceil(demand * (1 + self.cfg.headroom + self.cfg.band)
                             / self.capacity - 1e-9)
        else:
            up = down = held
        # The fleet did what was asked a window ago: the verdict is about these producers.
        if n < held:
            self._reached = None
        elif self._reached is None:
            self._reached = now
        settled = self._reached is not None and now - self._reached >= self.cfg.window
        if verdict == "model-bound" and not self._draining(
                taken, delivered, buffered + sum(c.held for c in cur.consumers.values()), n):
            # The connected producers keep the trainers fed: never more than them (nor, while
            # the fleet has not settled, more than the number held).
            up = min(up, n) if settled else min(up, n, held)
            down = min(down, max(n, 1))
            if not self.capacity and settled:
                up = down = n - 1  # nothing learned yet: probe one fewer
        elif verdict == "input-bound":
            down = max(down, held)
            if settled and not self.capacity and credit_share >= 0.5:
                up = max(up, n + 1)  # free-running producers that measure nothing: add one
        up = max(up, 1)  # someone reads: at least one producer
        down = max(down, up)
        wanted = self._held.update(now, up, down)
        if wanted != held:
            self._changed, self._reached = now, None
        supply = self.capacity * n if self.capacity else None
        return Estimate(wanted, verdict, demand, taken, wait, occupancy, self.capacity,
                        supply, delivered, n, need)

    def _draining(self, taken: float, delivered: float, backlog: int, n: int) -> bool:
        """Trainers that take more than the producers deliver are fed from a backlog (what
        the buffer and their windows hold, deep for small batches): full queues that will run
        dry. True once it lasts less than DRAIN_HORIZON windows, if the ``n`` producers
        deliver what their capacity says (more of them would deliver more: not at the end of
        the data, nor while they wait for an exact stream's units)."""
        drain, capacity = taken - delivered, self.capacity or 0.0
        return (capacity > 0 and drain > delivered * self.cfg.headroom
                and backlog < drain * DRAIN_HORIZON * self.cfg.window
                and delivered >= n * capacity * (1 - self.cfg.band))

    def _base(self, kind: str, key: object, since: float = -math.inf) -> _Sample | None:
        """The oldest sample of the window (not before ``since``) that has ``key`` (a
        consumer or a producer); for a consumer, one after its first TAKEN.

        A consumer's ``waited`` counts from the start of its process, not of its
        registration: a trainer that reconnects (its broker restarted) says with its first
        TAKEN the seconds it waited all its life. Taken as waited since a sample before that
        (0), it read as a trainer waiting the whole window, demand 20x its take (749
        batches/s from a trainer of 50: "wanted 91").
        """
        for s in self._samples:
            if s.t >= since and key in getattr(s, kind):
                if kind == "consumers":
                    c = s.consumers[key]
                    if c.taken == 0 and c.waited == 0.0:
                        continue  # no TAKEN yet: its counters are not a base
                return s
        return None

    def _consumers(self, cur: _Sample, since: float = -math.inf
                   ) -> tuple[float, float, float, float]:
        """(demand, take rate, mean wait share, mean occupancy over the window), the rates
        from ``since`` on if given."""
        demand = taken = 0.0
        waits: list[float] = []
        for key, c in cur.consumers.items():
            base = self._base("consumers", key, since)
            if base is None or base is cur:
                continue
            b = base.consumers[key]
            dt = cur.t - base.t
            rate = max(0, c.taken - b.taken) / dt
            wait = min(1.0, max(0.0, c.waited - b.waited) / dt)
            taken += rate
            demand += rate / max(self.cfg.min_busy, 1.0 - wait)
            waits.append(wait)
        occ = [sum(min(1.0, c.held / max(1, c.window)) for c in s.consumers.values())
               / len(s.consumers) for s in self._samples if s.consumers]
        return (demand, taken, sum(waits) / len(waits) if waits else 0.0,
                sum(occ) / len(occ) if occ else 0.0)

    def _producers(self, cur: _Sample) -> tuple[float, float]:
        """(delivery rate, mean share of time holding credit); learns the capacity from the
        producers that ran free. Not from throttled ones, even above the figure: when demand
        rises after a slow phase, or producers leave and their credit goes to the others,
        those send what they made while they waited for credit (producers paced at 10
        batches/s read 12.2 and 17.6 in tests/commands/test_fleet.py: a figure raised to that kept
        the fleet one producer short for 10 s). A figure too low asks for a producer too
        many, until they run free and are measured; one too high left trainers waiting."""
        delivered = 0.0
        free: list[float] = []
        shares: list[float] = []
        for key, p in cur.producers.items():
            base = self._base("producers", key)
            if base is None or base is cur:
                continue
            b = base.producers[key]
            dt = cur.t - base.t
            rate = max(0, p.received - b.received) / dt
            delivered += rate
            if dt < self.cfg.window / 2:
                continue  # new: starting up, not yet representative
            share = min(1.0, max(0.0, p.credit_seconds - b.credit_seconds) / dt)
            shares.append(share)
            if share >= self.cfg.unthrottled:
                free.append(rate)
        if free:
            measured = sum(free) / len(free)
            self.capacity = measured if self.capacity is None else (
                self.cfg.learn * measured + (1 - self.cfg.learn) * self.capacity)
        return delivered, (sum(shares) / len(shares) if shares else 0.0)


def fleet_shares(wanted: int, fleets: Mapping[str, int], unmanaged: int = 0) -> dict[str, int]:
    """Split ``wanted`` producers among supervisors (``feedline fleet``), after the
    ``unmanaged`` producers (started by no supervisor) are counted.

    ``fleets`` maps each supervisor's id to the most producers it runs (0: no limit). Equal
    shares in the order of the ids (the first ones take the remainder), a supervisor at its
    limit leaving the rest to the others (water-filling). Deterministic: every supervisor,
    and the broker, compute the same split from the same figures.
    """
    left = max(0, min(wanted, 1 << 16) - unmanaged)
    order = sorted(fleets)
    out = {f: 0 for f in order}
    while left > 0:
        room = [f for f in order if not fleets[f] or out[f] < fleets[f]]
        if not room:
            break
        for f in room:
            if left == 0:
                break
            out[f] += 1
            left -= 1
    return out

"""The producers-wanted estimator after a broker restart (issue 53, finding 15): pure, so fed
the counters a restarted broker samples. tests/commands/test_fleet.py's broker-restart test runs the
whole of it with real processes and ``kill -9``.
"""

from __future__ import annotations

from feedline.serving.sizing import ConsumerSample, ProducerSample, SizingConfig, StreamSizer

TAKE, WAIT = 50.0, 0.1  # a trainer taking 50 batches/s, waiting 10% of its time
LIFETIME_WAIT = 300.0  # seconds it waited before the broker restarted


def test_a_reconnected_trainers_lifetime_wait_is_not_read_as_this_windows() -> None:
    """A trainer says, with every TAKEN, the seconds its loop waited since it started; to a
    broker that just restarted its first TAKEN carries its whole life's (300 s), against 0
    at the sample before (registered, nothing taken yet). Read as waited within the window,
    that was a trainer waiting all the time: demand 20x its take (1000 batches/s here for
    the first window; 749 from a trainer of 50 and "wanted 91" in the fleet test). Its base
    is now its first TAKEN: demand is its take / (1 - wait) from the first estimate."""
    sizer = StreamSizer(SizingConfig.for_window(4.0))
    producers = [f"p{i}" for i in range(4)]  # each sends 12.5 batches/s, never held back
    demands = []
    for k in range(12):
        t = float(k)
        if k == 0:  # registered, no TAKEN yet
            c = ConsumerSample("trainer", 0, 0.0, 0, 4)
        else:
            c = ConsumerSample("trainer", int(TAKE * t), LIFETIME_WAIT + WAIT * t, 4, 4)
        ps = [ProducerSample(p, int(12.5 * t), t) for p in producers]
        est = sizer.observe(t, [c], ps)
        if est.demand is not None:
            demands.append(est.demand)
    assert demands, "no demand estimated"
    want = TAKE / (1 - WAIT)
    assert all(abs(d - want) < 0.05 * want for d in demands), demands

"""The lifetimes of exact runs and of shard-claim tables (issue 53, findings 3 and 10), with
real broker and producer processes on 127.0.0.1.

- An exact run's producers are the producers registered while it is served: every one of them
  ends when its epochs are served, and a new run starts only with a producer that came after
  the run ended, once the run's producers left (docs/pipelines.md, "Runs").
- A stream's shard-claim table ends with its last producer (after
  :data:`feedline.serving.claims.LINGER` seconds, what a restarting producer needs to find it
  again); a changed shard list starts a fresh table once the old one's producers are gone,
  and a finished table's next producer starts the next run.
"""

from __future__ import annotations

from feedline.procs import wait_for
from feedline.serving.coordinator import Assignment
from tests.test_exact_delivery import assert_exactly_once, pipeline, producer, samples
from tests.test_exact_resume import remote


def connected(broker, n: int) -> bool:
    """The broker logged its ``n``-th producer joining."""
    return f"({n} connected)" in broker.log_text()


def test_two_exact_producers_of_a_one_epoch_run_both_end_when_it_is_served(
        broker_proc, daemons, endpoints, tmp_path):
    """Finding 3: two producers, ``epochs: 1``, a dataset of one unit (so one producer is
    given it and the other never is), a trainer reading ``epoch()``. Before: the epoch arrived
    once, but the producer that never had a unit asked as a newcomer after the run was served,
    began "a new run of 1 epoch(s)" and buffered an epoch nobody asked for, for as long as it
    ran. Now both registered while the run was served, both are of that run: both exit 0."""
    broker = broker_proc("--state-dir", str(tmp_path / "state"))
    cfg = pipeline(tmp_path, epochs=1, n=16)
    procs = [producer(daemons, cfg, endpoints.ingress, f"p{i}") for i in range(2)]
    wait_for(lambda: connected(broker, 2), 20, what="both producers to register")
    with remote(endpoints.egress) as src:
        batches = list(src.epoch())
    assert_exactly_once([s for b in batches for s in samples(b)], cfg, batches[0].epoch)
    wait_for(lambda: not any(p.alive() for p in procs), 20,
             what="both producers to exit once the run is served")
    assert [p.proc.returncode for p in procs] == [0, 0]
    assert "a new run" not in broker.log_text(), broker.log_text()[-3000:]


def test_a_new_jobs_producer_waits_for_the_last_runs_producers_then_starts_the_next(
        broker_proc, daemons, endpoints, tmp_path):
    """The rule's other side: a producer that registers after the run was served and its
    producers left starts the next run, and a trainer gets that run's epoch, whole (one that
    comes while they are still attached waits for them: tests/test_coordinator_model.py)."""
    broker = broker_proc("--state-dir", str(tmp_path / "state"))
    cfg = pipeline(tmp_path, epochs=1, n=16)
    old = [producer(daemons, cfg, endpoints.ingress, f"old{i}") for i in range(2)]
    wait_for(lambda: connected(broker, 2), 20, what="both producers to register")
    with remote(endpoints.egress) as src:
        first = list(src.epoch())
    wait_for(lambda: not any(p.alive() for p in old), 20, what="the run's producers to exit")
    assert "a new run" not in broker.log_text()
    new = producer(daemons, cfg, endpoints.ingress, "next-job")
    with remote(endpoints.egress) as src:
        second = list(src.epoch())
    epoch = second[0].epoch
    assert epoch > first[0].epoch
    assert_exactly_once([s for b in second for s in samples(b)], cfg, epoch)
    wait_for(lambda: not new.alive(), 20, what="the next job's producer to exit")
    assert "a new run" in broker.log_text()


# -- the rules as the broker's tables see them (no sockets: these classes have none) ---------

def test_a_producer_of_the_run_is_told_it_is_finished_and_a_later_one_waits_for_it():
    """Finding 3 at the coordinator: ``a`` and ``b`` register while the run (1 epoch of 1
    unit) is served, ``a`` is given the unit; ``b``, never given one, is told ``finished``
    (before: it began a new run). ``c``, registered once the run was served, waits while ``b``
    is attached, and starts the next run when it is gone."""
    from feedline.serving.coordinator import Coordinator, ExactPlan

    c = Coordinator("val", ExactPlan(4, 4, epochs=1, fingerprint=1))
    c.enlist(b"a", 1)
    c.enlist(b"b", 2)
    assert c.request(b"a", first=True) == Assignment(0, 0, 0)
    assert c.request(b"b", first=True) == "busy"
    c.unit_done(b"a", 0, 0, 1)
    assert c.settle((0, 0, 0)) == [0] and c.finished
    c.enlist(b"c", 3)
    assert c.request(b"a") == "finished"
    c.release(b"a")
    assert c.request(b"c", first=True) == "busy"  # b, of the served run, is still here
    assert c.request(b"b", first=True) == "finished"
    c.release(b"b")
    assert c.request(b"c", first=True) == Assignment(1, 0, 0)  # the next run
    c.enlist(b"b", 2)  # b registers again (a reconnect): of this run now, not a newcomer
    assert c.request(b"b", first=True) == "busy"

"""The lifetimes of exact runs and of shard-claim tables (issue 53, findings 3 and 10), with
real broker and producer processes on 127.0.0.1.

- An exact run's producers are the producers registered while it is served: every one of them
  ends when its epochs are served, and a new run starts only with a producer that came after
  the run ended, once the run's producers left (docs/pipelines.md, "Runs").
- A stream's shard-claim table ends with its last producer (after
  :data:`feedline.serving.handout.LINGER` seconds, what a restarting producer needs to find it
  again); a changed shard list starts a fresh table once the old one's producers are gone,
  and a finished table's next producer starts the next run.
"""

from __future__ import annotations

import re
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import yaml

from feedline.errors import Refusal
from feedline.exact.coordinator import Assignment
from feedline.procs import wait_for
from tests.support.exact_run import (
    FAST,
    LIVENESS,
    assert_exactly_once,
    pipeline,
    producer,
    remote,
    samples,
)
from tests.support.shard_server import file_server
from tests.support.shard_support import make_wds


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
    comes while they are still attached waits for them: tests/exact/test_coordinator_model.py)."""
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


def gated_producer(daemons, gate: Path, cfg: Path, broker: str, name: str):
    """A producer process started now that registers only once ``gate`` exists (its process,
    and so the age its HELLO says, starts now): one of a job's producers slow to come up."""
    return daemons("tests.support.gated", gate, "feedline.producer", "--config", cfg, "--broker",
                   broker, "--id", name, *LIVENESS, name=name)


def test_a_late_producer_of_a_served_run_is_told_finished_while_its_trainer_reads(
        broker_proc, daemons, endpoints, tmp_path):
    """Issue 53 follow-up: two producers of an ``epochs: 1`` run started together, a trainer
    waiting on ``epoch()``; the first serves the whole epoch and leaves before the second
    registers (the race made certain: the second is held back until the first is gone).
    Before: the late one began "a new run of 1 epoch(s)", made an epoch nobody asked for,
    left it in the broker and waited for ever (the next job's trainer got it). Now it started
    before the run was served, so it is of that run: told it is finished, it exits 0 and
    nothing is buffered."""
    broker = broker_proc("--state-dir", str(tmp_path / "state"))
    cfg = pipeline(tmp_path, epochs=1, n=16)
    gate = tmp_path / "gate"
    with remote(endpoints.egress) as src:
        first = producer(daemons, cfg, endpoints.ingress, "first")
        late = gated_producer(daemons, gate, cfg, endpoints.ingress, "late")
        batches = list(src.epoch())
        assert_exactly_once([s for b in batches for s in samples(b)], cfg, batches[0].epoch)
        wait_for(lambda: not first.alive(), 20, what="the first producer to exit")
        gate.touch()
        wait_for(lambda: not late.alive(), 20,
                 what="the late producer to exit (before: it began a new run and waited)")
        assert late.proc.returncode == 0
        assert "a new run" not in broker.log_text(), broker.log_text()[-3000:]
        assert "told it is finished" in broker.log_text()


def test_a_late_producer_of_a_served_run_ends_with_it_after_its_trainer_left(
        broker_proc, daemons, endpoints, tmp_path):
    """Finding 3, the README's order (issue 53's first-hour scene, 1 run in 3 under load):
    two producers of an ``epochs: 1`` run started together; the first serves the whole
    epoch, the trainer takes it and leaves, the first exits, and only then does the second
    register (held back until then: the race made certain). Before: nothing told it from the
    next job's first producer: it began "a new run of 1 epoch(s)" and waited for ever for a
    trainer. Now its HELLO says it started before the run was served: it is of that run, told
    it is finished, and exits 0."""
    broker = broker_proc("--state-dir", str(tmp_path / "state"))
    cfg = pipeline(tmp_path, epochs=1, n=16)
    gate = tmp_path / "gate"
    first = producer(daemons, cfg, endpoints.ingress, "first")
    late = gated_producer(daemons, gate, cfg, endpoints.ingress, "late")
    with remote(endpoints.egress) as src:
        batches = list(src.epoch())
    assert_exactly_once([s for b in batches for s in samples(b)], cfg, batches[0].epoch)
    wait_for(lambda: not first.alive(), 20, what="the first producer to exit")
    wait_for(lambda: re.search(r"consumer \S+ (dropped|left)", broker.log_text()), 20,
             what="the broker to see the trainer leave")
    gate.touch()
    wait_for(lambda: not late.alive(), 30,
             what="the late producer to exit (before: it began a new run and waited)")
    assert late.proc.returncode == 0, late.log_text()[-2000:]
    said = broker.log_text()
    assert "a new run" not in said, said[-3000:]
    assert "it started before the run was served: it is of that run" in said, said[-3000:]


def test_a_producer_started_after_the_run_was_served_starts_the_next_while_its_trainer_stays(
        broker_proc, daemons, endpoints, tmp_path):
    """The rule's other side: the run served, its trainer still connected (it evaluates, its
    ``RemoteDataZMQ`` open), the next job's producer started. Before: taken for a late
    producer of the last job ("finished", exit 0) because a consumer of that run was still
    there: the next job got nothing. Now it started after the run was served: it starts the
    next run, and the next job's trainer gets that run's epoch, whole, once the old one
    leaves (what the old one was sent of it is served again)."""
    broker = broker_proc("--state-dir", str(tmp_path / "state"))
    cfg = pipeline(tmp_path, epochs=1, n=16)
    old = remote(endpoints.egress)
    try:
        first = producer(daemons, cfg, endpoints.ingress, "first")
        served = list(old.epoch())
        wait_for(lambda: not first.alive(), 20, what="the first producer to exit")
        nxt = producer(daemons, cfg, endpoints.ingress, "next-job")
        wait_for(lambda: "a new run" in broker.log_text() or not nxt.alive(), 20,
                 what="the next run")
        assert "a new run" in broker.log_text(), nxt.log_text()[-2000:]
        assert "the last run's consumer still connected" in broker.log_text()
        old.close()
        with remote(endpoints.egress) as src:
            second = list(src.epoch())
    finally:
        old.close()
    epoch = second[0].epoch
    assert epoch > served[0].epoch
    assert_exactly_once([s for b in second for s in samples(b)], cfg, epoch)
    wait_for(lambda: not nxt.alive(), 20, what="the next job's producer to exit")
    assert nxt.proc.returncode == 0


def test_a_producer_after_a_new_consumer_came_starts_the_next_run(
        broker_proc, daemons, endpoints, tmp_path):
    """The rule's other side: the served run's trainer is still connected, but another
    consumer (the next job's trainer) registered since: a producer now starts the next run
    (and once the old trainer leaves, what it was sent of it is served again), and the new
    trainer gets its epoch, whole."""
    broker = broker_proc("--state-dir", str(tmp_path / "state"))
    cfg = pipeline(tmp_path, epochs=1, n=16)
    old = remote(endpoints.egress)
    try:
        first = producer(daemons, cfg, endpoints.ingress, "first")
        served = list(old.epoch())
        wait_for(lambda: not first.alive(), 20, what="the first producer to exit")
        with remote(endpoints.egress) as src:
            src._start()  # registers now (the broker learns of a consumer by its HELLO)
            wait_for(lambda: broker.log_text().count("joined stream val") >= 2, 20,
                     what="the new trainer to register")
            nxt = producer(daemons, cfg, endpoints.ingress, "next-job")
            wait_for(lambda: "a new run" in broker.log_text(), 20, what="the next run")
            old.close()  # the last job's trainer leaves (with two, they share the epoch)
            second = list(src.epoch())
    finally:
        old.close()
    epoch = second[0].epoch
    assert epoch > served[0].epoch
    assert_exactly_once([s for b in second for s in samples(b)], cfg, epoch)
    wait_for(lambda: not nxt.alive(), 20, what="the next job's producer to exit")
    assert "a consumer that came since" in broker.log_text()


def shard_pipeline(tmp_path: Path, url: str, shards: int, epochs: int | None = 1,
                   first: int = 0) -> Path:
    last = first + shards - 1
    cfg = {"stream": "train", "seed": 1, "epochs": epochs,
           "source": {"webdataset": {"urls": f"{url}/train-{{{first:06d}..{last:06d}}}.tar",
                                     "fields": ["bin", "cls"]}},
           "steps": [{"map": {"function": "tests.support.shard_support:id_and_digest",
                              "component": None}},
                     {"batch": {"batch_size": 5, "remainder": True}}]}
    path = tmp_path / f"train-{first}-{shards}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def shard_producer(daemons, cfg: Path, broker: str, name: str):
    return daemons("feedline.producer", "--config", cfg, "--broker", broker, "--id", name,
                   *LIVENESS, name=name)


def take_ids(egress: str, n: int, until: set[int] | None = None, most: int = 20000) -> Counter:
    """``n`` samples of stream ``train``, counted by id (with ``until``: until those ids are
    seen too, at most ``most`` samples: what an earlier producer left buffered comes first)."""
    from feedline.consumer import ConsumerOptions, RemoteDataZMQ

    seen: Counter = Counter()
    with RemoteDataZMQ(egress, stream="train", timeout=30, return_meta=True,
                       options=ConsumerOptions(link=FAST)) as src:
        it = iter(src)
        while sum(seen.values()) < n or (until and not until <= set(seen)
                                         and sum(seen.values()) < most):
            ids, _ = next(it).datapoint
            seen.update(int(i) for i in np.asarray(ids))
    return seen


def test_a_one_epoch_shard_pipeline_run_a_second_time_is_served_again(
        broker_proc, daemons, endpoints, tmp_path):
    """Finding 10, second half: an ``epochs: 1`` shard pipeline (claims) served, its producer
    gone; the same pipeline run again (the next job). Before: 0 batches, the producer exited
    0 at once ("finished": the claim table of the first run was still there). Now a table
    whose run was served and whose producers left is gone: the second job gets every sample."""
    make_wds(tmp_path / "shards", shards=4, per_shard=5, nbytes=200)
    broker = broker_proc()
    with file_server(str(tmp_path / "shards")) as url:
        cfg = shard_pipeline(tmp_path, url, 4)
        for job in range(2):
            p = shard_producer(daemons, cfg, endpoints.ingress, f"job{job}")
            assert take_ids(endpoints.egress, 20) == Counter({i: 1 for i in range(20)}), job
            wait_for(lambda p=p: not p.alive(), 20, what=f"job {job}'s producer to finish")
            assert p.proc.returncode == 0, p.log_text()[-2000:]
    assert "delivery_mismatch" not in broker.log_text()


def test_a_grown_shard_list_starts_a_fresh_claim_table_once_the_old_producers_left(
        broker_proc, daemons, endpoints, tmp_path):
    """Finding 10, first half: a stream read from 4 shards, its producers stopped, the shard
    list grown to 6 and the producers started again. Before: every new producer was refused
    ``delivery_mismatch`` ("reads 4 shards") for as long as the broker ran. Now the old table
    goes with its producers and the new ones read all 6 shards. While an old producer is still
    attached, a producer of the other list is refused with one line naming both and what to
    do."""
    make_wds(tmp_path / "shards", shards=6, per_shard=5, nbytes=200)
    broker = broker_proc("--max-batches", "8")  # what the old producer leaves buffered: little
    with file_server(str(tmp_path / "shards")) as url:
        four, six = shard_pipeline(tmp_path, url, 4, epochs=None), shard_pipeline(tmp_path, url, 6)
        old = shard_producer(daemons, four, endpoints.ingress, "old")
        take_ids(endpoints.egress, 10)
        early = shard_producer(daemons, six, endpoints.ingress, "early")
        wait_for(lambda: not early.alive(), 20, what="the other list's producer to be refused")
        line = [s for s in early.log_text().splitlines() if "reads 4 shards" in s]
        assert early.proc.returncode != 0 and line, early.log_text()[-2000:]
        assert "reads 6 shards" in line[-1] and "stop the stream's other" in line[-1], line[-1]
        old.stop()
        p = shard_producer(daemons, six, endpoints.ingress, "new")
        wait_for(lambda: "producer new joined" in broker.log_text(), 20,
                 what="the new list's producer to register")
        seen = take_ids(endpoints.egress, 30, until=set(range(20, 30)))
        assert set(range(20, 30)) <= set(seen), seen  # shards 4 and 5 are read
        wait_for(lambda: not p.alive(), 20, what="the new producer to finish")
        assert p.proc.returncode == 0, p.log_text()[-2000:]
    assert "a fresh claim table" in broker.log_text(), broker.log_text()[-3000:]


def test_a_changed_shard_list_started_after_a_kill_9_waits_for_the_old_claims_then_is_served(
        broker_proc, daemons, endpoints, tmp_path):
    """Issue 53, hole 3: the old list's producer (4 shards) is killed with ``kill -9`` and a
    producer of a grown list (6 shards) is started at once; the broker still counts the
    killed one until its heartbeat timeout (6 s here, so that the new one surely registers
    first). Before: the new producer was refused ``delivery_mismatch`` and exited, for good.
    Now it is told to wait, says so in one line naming both lists and for how long at most,
    and is served once the killed producer is dropped: shards 4 and 5 are read, and it ends
    0 at the end of its epoch."""
    make_wds(tmp_path / "shards", shards=6, per_shard=5, nbytes=200)
    broker = broker_proc("--max-batches", "8", "--heartbeat-timeout", "6")
    with file_server(str(tmp_path / "shards")) as url:
        four, six = shard_pipeline(tmp_path, url, 4, epochs=None), shard_pipeline(tmp_path, url, 6)
        old = shard_producer(daemons, four, endpoints.ingress, "old")
        take_ids(endpoints.egress, 10)
        old.kill9()
        new = shard_producer(daemons, six, endpoints.ingress, "new")
        wait_for(lambda: "has us wait" in new.log_text() or not new.alive(), 30,
                 what="the new list's producer to be told to wait")
        assert "has us wait" in new.log_text(), new.log_text()[-2000:]  # before: refused
        seen = take_ids(endpoints.egress, 30, until=set(range(20, 30)))
        assert set(range(20, 30)) <= set(seen), seen  # shards 4 and 5 are read
        wait_for(lambda: not new.alive(), 30, what="the new producer to finish its epoch")
        assert new.proc.returncode == 0, new.log_text()[-2000:]
        waits = [s for s in new.log_text().splitlines() if "has us wait" in s]
        assert len(waits) == 1 and "reads 4 shards (list " in waits[0] \
            and "this producer (6 shards (list " in waits[0] and "at most " in waits[0], waits
        assert "WARNING" not in new.log_text(), new.log_text()[-2000:]  # a wait, not an error
    said = broker.log_text()
    assert "producer old dropped (timeout" in said and "a fresh claim table" in said, \
        said[-3000:]


def test_another_list_of_as_many_shards_is_refused_in_one_line_while_the_old_is_read(
        broker_proc, daemons, endpoints, tmp_path):
    """Finding 10, a changed list of the same length (shards 2-5 for 0-3): told apart by
    the list's fingerprint. Before: taken into the old table (its shards 0-3 handed out as if
    they were the new list's, silently). Now refused in one line naming both lists while the
    old list's producer reads."""
    make_wds(tmp_path / "shards", shards=6, per_shard=5, nbytes=200)
    broker_proc()
    with file_server(str(tmp_path / "shards")) as url:
        old = shard_producer(daemons, shard_pipeline(tmp_path, url, 4, epochs=None),
                             endpoints.ingress, "old")
        take_ids(endpoints.egress, 5)
        other = shard_producer(daemons, shard_pipeline(tmp_path, url, 4, first=2),
                               endpoints.ingress, "other")
        wait_for(lambda: not other.alive(), 20, what="the other list's producer to be refused")
        assert old.alive() and other.proc.returncode != 0
        line = other.log_text().strip().splitlines()[-1]
        assert "reads 4 shards (list " in line and "this producer reads 4 shards (list " \
            in line and "stop the stream's other producers first" in line, line


# -- the rules as the broker's tables see them (no sockets: these classes have none) ---------

def test_a_producer_of_the_run_is_told_it_is_finished_and_a_later_one_waits_for_it():
    """Finding 3 at the coordinator: ``a`` and ``b`` register while the run (1 epoch of 1
    unit) is served, ``a`` is given the unit; ``b``, never given one, is told ``finished``
    (before: it began a new run). ``c``, registered once the run was served, waits while ``b``
    is attached, and starts the next run when it is gone."""
    from feedline.exact.coordinator import Coordinator, ExactPlan

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


def test_a_claim_table_lingers_for_a_restarting_producer_then_starts_afresh():
    """Finding 10 at the claim table: a table whose producers left goes on for a producer
    that comes within LINGER seconds (a restart), and starts at epoch 0 for one after."""
    from feedline.serving.handout import LINGER, ClaimStreams

    s = ClaimStreams()
    t = s.join("train", 4, 0, b"a", now=0.0)
    assert not isinstance(t, str)
    for _ in range(6):
        a = t.request(b"a")
        assert not isinstance(a, str)
        t.ack(b"a", a.epoch, a.unit)
    s.leave("train", b"a", now=1.0)
    assert s.join("train", 4, 0, b"b", now=LINGER) is t and t.epoch == 1  # where it was
    s.leave("train", b"b", now=LINGER)
    fresh = s.join("train", 4, 0, b"c", now=2 * LINGER + 1)
    assert fresh is not t and not isinstance(fresh, str) and fresh.epoch == fresh.next == 0


def test_a_served_claim_table_goes_with_its_producers_and_a_changed_list_starts_afresh():
    """Finding 10: an ``epochs: 1`` table handed out: a producer that registers while the
    run's producer still reads is told ``busy``, then starts the next run once it left;
    another shard list is refused in one line naming both while a producer of the old list is
    attached, and starts a fresh table once none is."""
    from feedline.serving.handout import ClaimStreams

    s = ClaimStreams()
    t = s.join("train", 2, 1, b"a", fingerprint=0xA, now=0.0)
    assert not isinstance(t, str)
    for _ in range(2):
        a = t.request(b"a")
        assert not isinstance(a, str)
        t.ack(b"a", a.epoch, a.unit)
    assert t.request(b"a") == "finished"
    assert s.join("train", 2, 1, b"b", fingerprint=0xA, now=1.0) is t
    assert t.request(b"b") == "busy"  # a still reads its last shard
    with pytest.raises(Refusal) as e:
        s.join("train", 3, 1, b"x", fingerprint=0xB, now=1.0)
    refused = e.value.detail
    assert e.value.reason == "delivery_mismatch" and "\n" not in refused
    assert "reads 2 shards (list a)" in refused and "reads 3 shards (list b)" in refused
    assert "stop the stream's other producers first" in refused
    s.leave("train", b"a", now=2.0)
    assert t.request(b"b") == Assignment(0, 0, 0)  # the next run
    s.leave("train", b"b", now=3.0)
    other = s.join("train", 2, 1, b"y", fingerprint=0xB, now=3.0)  # same count, other files
    assert other is not t and not isinstance(other, str) and other.fingerprint == 0xB


def test_when_a_producer_started_decides_its_run_whatever_the_consumers():
    """Finding 3 at the coordinator, with start times (a HELLO's ``age_ms``): ``b`` started
    with ``a`` but registered once ``a`` had served the run and no consumer was left: of that
    run (told ``finished``), and ``n``, the next job's (started after the run was served),
    waits for it, then starts the next run. Before: ``b`` began a new run nobody asked for."""
    from feedline.exact.coordinator import Coordinator, ExactPlan

    c = Coordinator("val", ExactPlan(4, 4, epochs=1, fingerprint=1))
    before = time.monotonic()
    c.enlist(b"a", 1, before)
    c.read_by(b"trainer", 9)
    assert c.request(b"a", first=True) == Assignment(0, 0, 0)
    c.unit_done(b"a", 0, 0, 1)
    assert c.settle((0, 0, 0)) == [0] and c.finished
    after = time.monotonic()
    c.unread(b"trainer")
    c.release(b"a")
    c.enlist(b"b", 2, before)
    c.enlist(b"n", 3, after)
    assert c.request(b"n", first=True) == "busy"  # b, of the served run, is still here
    assert c.request(b"b", first=True) == "finished"
    c.release(b"b")
    assert c.request(b"n", first=True) == Assignment(1, 0, 0)  # the next run
    c.read_by(b"trainer2", 10)  # that run's trainer
    c.unit_done(b"n", 1, 0, 1)
    assert c.settle((1, 0, 0)) == [1] and c.finished
    # The next job's producer, started after that run was served while its trainer is still
    # connected: of the next run all the same (before: taken for a late one of the run).
    c.release(b"n")
    c.enlist(b"m", 4, time.monotonic())
    assert c.request(b"m", first=True) == Assignment(2, 0, 0)


def test_a_producer_that_does_not_say_when_it_started_is_judged_by_the_consumers():
    """An older producer (no ``age_ms``), or a stream restored finished from its journal:
    late while the run's consumer is still registered and no other came since."""
    from feedline.exact.coordinator import Coordinator, ExactPlan

    c = Coordinator("val", ExactPlan(4, 4, epochs=1, fingerprint=1))
    c.enlist(b"a", 1, time.monotonic())
    c.read_by(b"trainer", 9)
    assert c.request(b"a", first=True) == Assignment(0, 0, 0)
    c.unit_done(b"a", 0, 0, 1)
    assert c.settle((0, 0, 0)) == [0] and c.finished
    c.release(b"a")
    c.enlist(b"old", 2)  # says nothing of its start
    assert c.request(b"old", first=True) == "finished"  # the trainer of the run is here
    c.release(b"old")
    c.unread(b"trainer")
    c.enlist(b"old2", 3)
    assert c.request(b"old2", first=True) == Assignment(1, 0, 0)


def test_a_claim_tables_late_producer_is_of_its_run_if_it_started_before_it_was_handed_out():
    """The same rule for an ``epochs: 1`` shard pipeline: ``b``, started with ``a`` and
    registered after ``a`` was handed every shard, is told ``finished`` (before: it waited for
    ``a`` and then read every shard again, a second run of a one-epoch job); ``c``, started
    after, waits for ``a`` and ``b``, then reads the next run."""
    from feedline.serving.handout import ClaimStreams

    s = ClaimStreams()
    before = time.monotonic()
    t = s.join("train", 2, 1, b"a", now=0.0, started=before)
    for _ in range(2):
        a = t.request(b"a")
        assert isinstance(a, Assignment)
        t.ack(b"a", a.epoch, a.unit)
    assert t.finished
    after = time.monotonic()
    assert s.join("train", 2, 1, b"b", now=1.0, started=before) is t
    assert s.join("train", 2, 1, b"c", now=1.0, started=after) is t
    assert t.request(b"b") == "finished"
    assert t.request(b"c") == "busy"
    s.leave("train", b"a", now=2.0)
    assert t.request(b"c") == "busy"  # b, of the served run, is still attached
    s.leave("train", b"b", now=2.0)
    assert t.request(b"c") == Assignment(0, 0, 0)


class Heard:
    """What :class:`~feedline.exact.succession.Succession` asks the producer table: when
    each registered producer was last heard from."""

    def __init__(self) -> None:
        self.at: dict[bytes, float] = {}

    def __call__(self, ident: bytes) -> float | None:
        return self.at.get(ident)


def test_a_changed_shard_list_waits_for_killed_producers_and_is_refused_by_running_ones():
    """Finding 10 after a ``kill -9`` (issue 53, hole 3): the old list's producer is killed
    and stays registered until the heartbeat timeout (1.5 s here) drops it. Before: a
    producer of the new list registering meanwhile was refused ``delivery_mismatch``, for
    good. Now it is told to wait (one line naming both lists and for how long at most) while
    the old producer is silent, and starts a fresh table once it is dropped; while an old
    producer is heard from after the new one first asked (it reads), the new one is
    refused, in one line, as before."""
    from feedline.exact.succession import WAIT, Succession
    from feedline.serving.handout import ClaimStreams

    heard = Heard()
    s = ClaimStreams(succession=Succession(heard, timeout=1.5))
    s.join("train", 4, 0, b"old", fingerprint=0xA, now=0.0)
    heard.at[b"old"] = 0.2  # its last heartbeat; then kill -9
    with pytest.raises(Refusal) as e:
        s.join("train", 6, 0, b"new", fingerprint=0xB, now=1.0)
    line = e.value.detail
    assert e.value.reason == WAIT and "\n" not in line
    assert "reads 4 shards (list a)" in line and "(6 shards (list b))" in line, line
    assert "at most 0.7s more" in line, line
    with pytest.raises(Refusal) as e:  # it says HELLO again: still silent, still waiting
        s.join("train", 6, 0, b"new", fingerprint=0xB, now=1.6)
    assert e.value.reason == WAIT and "at most 0.1s more" in e.value.detail
    del heard.at[b"old"]
    s.leave("train", b"old", now=1.8)  # dropped at the timeout
    t = s.join("train", 6, 0, b"new", fingerprint=0xB, now=2.0)
    assert t.units == 6 and t.fingerprint == 0xB and t.members == {b"new"}

    # An old producer that reads: heard from after the new one first asked.
    s.join("val", 4, 0, b"reader", fingerprint=0xA, now=0.0)
    heard.at[b"reader"] = 0.9
    with pytest.raises(Refusal) as e:
        s.join("val", 6, 0, b"other", fingerprint=0xB, now=1.0)
    assert e.value.reason == WAIT  # it might be dead: the first HELLO waits
    heard.at[b"reader"] = 1.2  # its heartbeat
    with pytest.raises(Refusal) as e:
        s.join("val", 6, 0, b"other", fingerprint=0xB, now=2.0)
    assert e.value.reason == "delivery_mismatch", e.value
    assert "stop the stream's other producers first" in e.value.detail


def test_a_replaced_exact_pipeline_waits_for_its_killed_producers_too():
    """The same for an exact stream whose pipeline changed after its producer was killed:
    told to wait while the old producer is silent, admitted (from epoch 0) once it is
    dropped; refused while an old producer is heard from."""
    from feedline.exact.coordinator import ExactPlan
    from feedline.exact.streams import ExactStreams
    from feedline.exact.succession import WAIT, Succession

    heard = Heard()
    s = ExactStreams()
    s.succession = Succession(heard, timeout=1.5)
    s.attach("val", True)
    s.join("val", ExactPlan(8, 4, 1, fingerprint=1), 0.0, b"old", 1)
    heard.at[b"old"] = 0.2
    with pytest.raises(Refusal) as e:
        s.join("val", ExactPlan(16, 4, 1, fingerprint=2), 1.0, b"new", 2)
    assert e.value.reason == WAIT and "at most 0.7s more" in e.value.detail, e.value
    s.detach("val", True)
    s.streams["val"].release(b"old")
    del heard.at[b"old"]
    c = s.join("val", ExactPlan(16, 4, 1, fingerprint=2), 2.0, b"new", 2)
    assert c.plan.dataset_size == 16 and c.epoch == 0


def test_a_job_resumed_from_a_checkpoint_of_its_whole_run_is_that_runs_consumer():
    """Found by tests/exact/test_coordinator_model.py: a job resumes from a checkpoint that holds
    its whole run (it crashed after its last batch), so the resume finds the run complete.
    Before: its consumer, registering right after the resume, counted as one that came since
    the run was served, and a late producer that does not say when it started (an older
    one) began a run nobody asked for. Now a consumer whose resume was just applied is of the
    run its job resumed: that producer is told the run is finished."""
    from feedline.exact.coordinator import ExactPlan
    from feedline.exact.cursor import Cursor
    from feedline.exact.streams import ExactStreams

    s = ExactStreams()
    c = s.join("val", ExactPlan(8, 4, 1, fingerprint=5), 0.0, b"p", 1)
    for u in range(2):
        assert c.request(b"p", first=u == 0) == Assignment(0, u, 0)
        c.accept((0, u, 0))
        c.unit_done(b"p", 0, u, 1)
        c.settle((0, u, 0))
    assert c.finished
    c.release(b"p")
    whole = Cursor.of("val", 0, {0: {0}, 1: {0}}, pipeline=5)
    whole.resume = True
    s.cursor(b"job", "val", whole.encode(), 1.0)  # its HELLO's cursor, then its registration
    s.reader("val", b"job", 7)
    assert c.finished
    s.join("val", ExactPlan(8, 4, 1, fingerprint=5), 2.0, b"older", 2)  # no start said
    assert c.request(b"older", first=True) == "finished"

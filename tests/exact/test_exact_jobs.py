"""What users do next on an exact stream (issue 22, findings 7-9): a second job after the
first was served (and after a broker restart), a consumer paused past the heartbeat timeout
(a GC pause, a slow checkpoint save, a debugger), and one paused near the end of an epoch.
Real broker and producer processes; the paused consumers are processes
(:mod:`tests.support.exact_ledger_consumer`) stopped with SIGSTOP, whose ledgers are audited against
a clean run (:func:`tests.support.exact_ledger.audit`)."""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import yaml

from feedline.procs import Child, wait_for
from tests.support import ROOT
from tests.support.exact_ledger import audit, clean_run, exact_config, read_exact_ledger
from tests.support.exact_run import (
    LIVENESS,
    assert_exactly_once,
    pipeline,
    producer,
    remote,
    samples,
)


def test_a_second_job_gets_a_whole_epoch_also_after_a_broker_restart(broker_proc, daemons,
                                                                      endpoints, tmp_path):
    """Finding 7: a validation job takes its epoch (``epochs: 1``: its producers are told the
    run is served and exit), then a second job starts its producers again, and a third after
    a broker restart. Before: the producers were told "finished" again and exited, the second
    job got 0 of 64 batches and waited for ever, also after a broker restart. Now a producer
    that was never given a unit starts the next run: each job gets a whole epoch, a later one
    than the job before, exactly once."""
    state = str(tmp_path / "state")
    broker = broker_proc("--state-dir", state)
    cfg = pipeline(tmp_path, epochs=1)
    last = -1
    for job in range(3):
        procs = [producer(daemons, cfg, endpoints.ingress, f"j{job}p{i}") for i in range(2)]
        with remote(endpoints.egress) as src:
            batches = list(src.epoch())
        epoch = batches[0].epoch
        assert epoch > last and {b.epoch for b in batches} == {epoch}
        assert_exactly_once([s for b in batches for s in samples(b)], cfg, epoch)
        last = epoch
        for p in procs:  # the job is over: its launcher stops what did not exit by itself
            p.stop()
        if job == 1:
            broker.kill9()
            broker = broker_proc("--state-dir", state)


def test_a_producer_a_fleet_adds_after_the_run_is_served_ends_instead_of_starting_another(
        broker_proc, daemons, endpoints, tmp_path):
    """A fleet that scales up as the last units go out: a producer it adds (``feedline
    fleet`` gives it ``--join-run`` once the broker lists its producers) may connect after the
    run was served. It is told so and exits 0, and no next run begins. Before: it began one,
    whose batches nobody took, and the fleet never exited. A producer of a new job (no flag)
    still starts the next run."""
    broker = broker_proc("--state-dir", str(tmp_path / "state"))
    cfg = pipeline(tmp_path, epochs=1)
    # One producer serves the run (of two started together, the second could connect after
    # the run was served and, with no flag, start the next one: what --join-run prevents).
    p = producer(daemons, cfg, endpoints.ingress, "p0")
    with remote(endpoints.egress) as src:
        first = {b.epoch for b in src.epoch()}
    wait_for(lambda: not p.alive(), 20, what="the run's producer to exit")
    late = daemons("feedline.producer", "--config", cfg, "--broker", endpoints.ingress,
                   "--id", "late", "--fleet", "A", "--join-run", *LIVENESS, name="late")
    wait_for(lambda: not late.alive(), 20, what="the late producer to exit")
    assert late.proc.returncode == 0, late.log_text()[-2000:]
    assert "sent 0 batches" in late.log_text(), late.log_text()[-2000:]
    assert "a new run" not in broker.log_text(), broker.log_text()[-3000:]
    producer(daemons, cfg, endpoints.ingress, "next-job")
    with remote(endpoints.egress) as src:
        second = {b.epoch for b in src.epoch()}
    assert len(first) == len(second) == 1 and min(second) > max(first)
    assert "a new run" in broker.log_text()


N, UNIT, BATCH = 960, 64, 4  # 240 batches, 16 a unit
STEP = 0.05  # seconds per batch in each consumer (a model step)


def consumer(tmp: Path, name: str, egress: str, step: float = STEP) -> Child:
    return Child([sys.executable, "-m", "tests.support.exact_ledger_consumer", "--broker", egress,
                  "--ledger", str(tmp / f"{name}.ledger"), "--window", "2",
                  "--step", str(step), *LIVENESS], tmp / f"{name}.log",
                 env={"PYTHONPATH": str(ROOT)})


def start(broker_proc, daemons, endpoints, tmp_path: Path, rate: float = 400.0) -> dict:
    broker_proc("--state-dir", str(tmp_path / "state"))
    cfg = exact_config(N, UNIT, BATCH, 1, nbytes=512, rate=rate)
    path = tmp_path / "exact.yaml"
    path.write_text(yaml.safe_dump(cfg))
    for i in range(2):
        producer(daemons, path, endpoints.ingress, f"p{i}")
    return cfg


@contextmanager
def consumers(tmp: Path, egress: str, a_step: float = STEP) -> Iterator[Child]:
    """Consumers ``a`` (yielded: the one the test stops) and ``b``; on leaving, waits until
    both say their epoch ended, then stops them."""
    a, b = consumer(tmp, "a", egress, step=a_step), consumer(tmp, "b", egress)
    try:
        yield a
        wait_for(lambda: ended(tmp, "a") and ended(tmp, "b"), 90,
                 what="both consumers' epoch to end")
    finally:
        for c in (a, b):
            c.signal(signal.SIGCONT)
            c.stop()


def pause(c: Child) -> None:
    """SIGSTOP for 2.5 s: past the heartbeat timeout (1.5 s)."""
    c.signal(signal.SIGSTOP)
    time.sleep(2.5)
    c.signal(signal.SIGCONT)


def taken(tmp: Path, *names: str) -> int:
    return sum(len(read_exact_ledger(tmp / f"{n}.ledger").entries) for n in names)


def ended(tmp: Path, name: str) -> bool:
    return bool(read_exact_ledger(tmp / f"{name}.ledger").ends)


def check_epoch(tmp: Path, cfg: dict) -> None:
    ledgers = {n: read_exact_ledger(tmp / f"{n}.ledger").entries for n in ("a", "b")}
    a = audit(ledgers, {0: clean_run(cfg)[0]})
    v = a.epochs[0]
    assert v.clean() and not a.corrupt, (f"lost {len(v.lost)} {v.lost[:12]}, duplicated "
                                         f"{len(v.duplicated)} {v.duplicated[:12]}")


def test_a_consumer_paused_past_the_timeout_gets_nothing_twice(broker_proc, daemons,
                                                                endpoints, tmp_path):
    """Finding 8: one of two consumers is stopped three times for 2.5 s (the heartbeat
    timeout is 1.5 s): the broker drops it each time, and it comes back. It waits for batches
    (no model step), so what was sent to it while it was stopped is there when it wakes, and
    it takes that before it hears it was dropped. Before: those batches were served again to
    the other consumer (12 samples duplicated over 3 pauses in the audit)."""
    cfg = start(broker_proc, daemons, endpoints, tmp_path, rate=40.0)
    with consumers(tmp_path, endpoints.egress, a_step=0.0) as a:
        for k in range(3):
            wait_for(lambda: taken(tmp_path, "a") >= 8 * (k + 1), 60,  # noqa: B023
                     what=f"consumer a under way ({k})")
            pause(a)
    check_epoch(tmp_path, cfg)


def test_a_consumer_paused_near_the_end_of_an_epoch_strands_nothing(broker_proc, daemons,
                                                                    endpoints, tmp_path):
    """Finding 9: one of two consumers is stopped past the timeout while it holds some of the
    epoch's last batches, then woken. Before: those batches were never served again (12-16 of
    96 samples never arrived) and neither consumer's epoch ended."""
    cfg = start(broker_proc, daemons, endpoints, tmp_path)
    with consumers(tmp_path, endpoints.egress) as a:
        wait_for(lambda: taken(tmp_path, "a", "b") >= N // BATCH - 6, 90,
                 what="the epoch near its end")
        pause(a)
    check_epoch(tmp_path, cfg)

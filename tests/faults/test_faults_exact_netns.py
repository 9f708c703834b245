"""Exact delivery across real hosts: every sample of every epoch exactly once, byte for byte,
in spite of a producer killed mid-unit, a broker killed and restarted, one of two consumers
killed, a producer stopped beyond the heartbeat timeout, a 10 s partition and 5% loss; and
through what users do next (issue 22): a second job after the run was served, a job resumed
twice from one checkpoint, two ranks resuming from their merged cursors, a consumer stopped
past the timeout near an epoch's end, a broker restarted at an epoch's start, and the state
directory's disk full.

Topology (tests/support/netns.py): hosts ``broker``, ``trainer``, ``p1``, ``p2``, ``p3``, real TCP.
The
broker runs with ``--state-dir`` (its journal). Three producers run one ``delivery: exact``
pipeline file (tests/support/exact_ledger.py): 3072 sample ids in units of 64 (16 batches of 4),
3 epochs, each producer paced at 50 batches/s, so a unit takes 0.32 s and a fault lands in the
middle of one (the producer faults wait until p1 has just delivered an early batch of a unit).
Ledger consumers (tests/support/exact_ledger_consumer.py) iterate ``remote.epoch()`` and log, per
batch, its (epoch, unit, index), its producer and each sample's id and content digest.

Each scenario runs the whole job (the producers exit when every epoch is served), then
asserts per epoch: the union of the ledgers is the dataset exactly (0 lost, 0 duplicated,
0 foreign ids), every sample's digest equals a clean run's (computed in-process with
``feedline.producer.exact.build_exact``), no crc mismatch, and each consumer's ``epoch()``
iterations
each held one epoch and ended. Heartbeats are the defaults (1 s interval, 5 s timeout).
Recovery times and the other measurements go to ``$FEEDLINE_RELIABILITY_OUT`` when set
(``benchmarks/reliability.py --exact``); no time is asserted.
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from feedline.exact.cursor import Cursor
from feedline.procs import wait_for
from tests.support import netns
from tests.support.exact_cluster import JOB_TIMEOUT, ExactCluster, run_scenario
from tests.support.exact_ledger import ExactAudit, exact_config

# One at a time, on one pytest-xdist worker: fault scenarios measure rates and recovery.
pytestmark = [pytest.mark.netns, pytest.mark.slow, pytest.mark.xdist_group("netns")]

_WHY = netns.unavailable()
if _WHY:
    pytestmark.append(pytest.mark.skip(reason=f"network namespaces unavailable: {_WHY}"))

PRODUCERS = ("p1", "p2", "p3")
N, UNIT, BATCH, EPOCHS = 3072, 64, 4, 3
RATE = 200.0  # samples/s each producer makes: 50 batches/s
WINDOW = 4
Maker = Callable[..., ExactCluster]
CFG = exact_config(N, UNIT, BATCH, EPOCHS, nbytes=4096, rate=RATE)


@pytest.fixture
def net() -> Iterator[netns.Network]:
    netns.sweep()
    n = netns.Network(["broker", "trainer", *PRODUCERS])
    yield n
    n.close()


@pytest.fixture
def cluster(net: netns.Network, tmp_path: Path) -> Iterator[Maker]:
    """Factory: the cluster, started and flowing (every producer delivering); closed at the
    end."""
    made: list[ExactCluster] = []

    def make(consumers: tuple[str, ...] = ("c1",), step: float = 0.0,
             extra: dict[str, tuple[str, ...]] | None = None) -> ExactCluster:
        c = ExactCluster(net, tmp_path, CFG, step=step, producer_window=WINDOW,
                         max_batches=32, window=WINDOW)
        made.append(c)
        c.start_broker()
        for name in consumers:
            c.start_consumer(name, "trainer", *(extra or {}).get(name, ()))
        for p in PRODUCERS:
            c.start_producer(p)
        for p in PRODUCERS:
            c.wait_count(10, producer=p, timeout=60)
        return c

    yield make
    for c in made:
        c.close()


def check(c: ExactCluster, a: ExactAudit, epochs: int = EPOCHS) -> None:
    """Per epoch: the dataset exactly, the clean run's bytes; each epoch() one epoch, and
    every epoch a consumer that lived to the end took of ended for it."""
    assert set(a.epochs) == set(range(epochs)), f"epochs in the ledgers: {sorted(a.epochs)}"
    for epoch, v in a.epochs.items():
        assert v.clean(), (f"epoch {epoch}: lost {v.lost[:20]} ({len(v.lost)}), duplicated "
                           f"{v.duplicated[:20]} ({len(v.duplicated)}), foreign {v.foreign[:20]}, "
                           f"bytes differ from a clean run {v.mismatched[:20]}\n{c.diagnosis()}")
    assert a.corrupt == 0, f"{a.corrupt} batches failed their crc"
    assert a.taken == N * epochs
    ended: set[int] = set()
    for name in c.consumers:
        led = c.ledger(name)
        for _, got in led.ends:
            assert len(got) <= 1, f"{name}: one epoch() iteration yielded epochs {got}"
            ended.update(got)
        if name in c.killed or name in c.crashed:
            continue
        took = {e.epoch for e in led.entries}
        assert took <= ended, f"{name}: epoch() never ended for epochs {sorted(took - ended)}"
    assert ended == set(range(epochs))


def test_exact_producer_kill9_mid_unit_and_restart(cluster: Maker) -> None:
    c = cluster()
    res, a = run_scenario(c, "producer kill -9 mid-unit, restart after 3 s",
                          lambda: c.producer("p1").kill9(), lambda: c.start_producer("p1"), 3.0,
                          before=lambda: c.wait_mid_unit("p1"), affected="p1",
                          guarantee="its unit is produced again from the first batch missing")
    # The unit p1 was making when it died was finished by another producer (or by its next
    # incarnation): the kill landed mid-unit.
    assert res["units_taken_over"] >= 1, res
    check(c, a)


def test_exact_broker_kill9_and_restart(cluster: Maker) -> None:
    c = cluster()
    res, a = run_scenario(c, "broker kill -9, restart after 1 s (--state-dir)",
                          c.kill9_broker, c.start_broker, 1.0,
                          guarantee="the journal and the consumers' reports restore progress")
    assert all(len(incs) == 1 for incs in c.producers.values()), "no producer was restarted"
    assert (c.tmp / "state" / "val.exact.jsonl").exists()
    check(c, a)


def test_exact_consumer_kill9_one_of_two(cluster: Maker) -> None:
    """The audit rule for the killed consumer (tests.support.exact_ledger.audit): its last batch
    before
    the kill is unconfirmed until its TAKEN reaches the broker. If it did not arrive, the broker
    serves that batch again to the other consumer and it is not counted for the dead one; if it
    did, nobody else gets it and it counts. Any other batch in both ledgers is a duplicate.
    The consumers take a 2 ms model step per batch, so that each TAKEN leaves before the next
    batch is taken: only the last one can be in doubt."""
    c = cluster(consumers=("c1", "c2"), step=0.002)
    res, a = run_scenario(c, "consumer kill -9 (one of two)", lambda: c.kill9_consumer("c1"),
                          lambda: None, 0.0,
                          guarantee="what it had not confirmed is served to the other")
    assert len(a.served_again) + len(a.confirmed_last) == 1, a
    assert c.ledger("c2").entries[-1].t > c.ledger("c1").entries[-1].t, "c2 went on"
    check(c, a)


def test_exact_producer_sigstop_beyond_heartbeat_timeout(cluster: Maker) -> None:
    c = cluster()
    p1 = c.producer("p1")
    res, a = run_scenario(c, "producer SIGSTOP 8 s mid-unit, SIGCONT",
                          lambda: p1.signal(signal.SIGSTOP), lambda: p1.signal(signal.SIGCONT),
                          8.0, before=lambda: c.wait_mid_unit("p1"), affected="p1",
                          guarantee="dropped at the timeout, its unit moves; woken, what it "
                                    "sends again is dropped as duplicate")
    assert res["units_taken_over"] >= 1, res
    assert len(c.producers["p1"]) == 1 and p1.proc.returncode == 0, "the same process finished"
    check(c, a)


def test_exact_partition_of_a_producer_host_10s(cluster: Maker) -> None:
    c = cluster()
    host = c.net["p1"]
    res, a = run_scenario(c, "partition of p1 for 10 s mid-unit", host.partition, host.heal,
                          10.0, before=lambda: c.wait_mid_unit("p1"), affected="p1",
                          guarantee="its unit moves at the timeout; p1 rejoins")
    assert res["units_taken_over"] >= 1, res
    check(c, a)


def test_exact_five_percent_loss_on_a_producer_link(cluster: Maker) -> None:
    c = cluster()
    p1, broker = c.net["p1"], c.net["broker"]
    res, a = run_scenario(c, "5% packet loss on p1's link for 10 s",
                          lambda: p1.lose(0.05, broker), lambda: p1.clear_loss(broker), 10.0,
                          guarantee="TCP absorbs it")
    check(c, a)


# -- what users do next (issue 22) ------------------------------------------------------------

def job_done(c: ExactCluster, what: str) -> None:
    try:
        wait_for(c.done, JOB_TIMEOUT, interval=0.25, what=what)
    except TimeoutError as e:
        raise TimeoutError(f"{e}\n{c.diagnosis()}") from None


def test_exact_second_job_after_the_run_is_served(cluster: Maker) -> None:
    """A second job: the first took its 3 epochs and its producers exited (the run is served);
    the second starts its consumer and the producers again, and gets the next 3 epochs."""
    c = cluster()
    job_done(c, "the first job's run")
    c.consumers["c1"].stop(timeout=10)
    c.start_consumer("c2")
    for p in PRODUCERS:
        c.start_producer(p)
    job_done(c, "the second job's run")
    c.close()
    check(c, c.exact_audit(2 * EPOCHS), 2 * EPOCHS)
    assert {e.epoch for e in c.ledger("c2").entries} == set(range(EPOCHS, 2 * EPOCHS))


def test_exact_two_resumes_from_one_checkpoint(cluster: Maker, tmp_path: Path) -> None:
    """A job checkpoints in epoch 1 and crashes 100 batches later; restarted from the
    checkpoint it crashes again after 50; restarted from the same checkpoint again it
    finishes. What the job took up to the checkpoint and after its last restart is every
    epoch exactly once."""
    saved = str(tmp_path / "job.ckpt")
    c = cluster(consumers=("r1",), extra={
        "r1": ("--save", saved, "--save-after", "1000", "--crash-after", "1100")})
    for name, extra in (("r2", ("--crash-after", "50")), ("r3", ())):
        prev = c.consumers[max(c.consumers)]
        wait_for(lambda: not prev.alive(), 120, what="the job to crash")  # noqa: B023
        c.crashed.add(max(c.consumers))
        c.start_consumer(name, "trainer", "--resume", saved, *extra)
    job_done(c, "the job, resumed twice")
    c.close()
    check(c, c.exact_audit())


def test_exact_every_rank_resumes_from_the_merged_cursor(cluster: Maker, tmp_path: Path
                                                         ) -> None:
    """Two ranks checkpoint together (each its own cursor), then both crash; restarted,
    each merges the two cursors itself and resumes from its merge, the second a second after
    the first. Every epoch exactly once."""
    saved = [str(tmp_path / f"rank{i}.ckpt") for i in range(2)]
    c = cluster(consumers=("a1", "b1"), step=0.002,
                extra={"a1": ("--save", saved[0]), "b1": ("--save", saved[1])})
    c.wait_count(900, timeout=120)
    for name in ("a1", "b1"):
        c.consumers[name].signal(signal.SIGUSR1)  # the checkpoint
    wait_for(lambda: all(c.ledger(n).ckpt is not None for n in ("a1", "b1")), 30,
             what="both checkpoints")
    time.sleep(0.5)  # they take a few more: lost with the crash
    for name in ("a1", "b1"):
        c.consumers[name].kill9()
        c.crashed.add(name)
    epochs = {Cursor.decode(Path(f).read_bytes()).epoch for f in saved}
    assert len(epochs) == 1, f"the two checkpoints straddle an epoch's end: {epochs}"
    merged = ",".join(saved)
    c.start_consumer("a2", "trainer", "--resume", merged)
    time.sleep(1.0)
    c.start_consumer("b2", "trainer", "--resume", merged)
    job_done(c, "the job, resumed by both ranks")
    c.close()
    check(c, c.exact_audit())


def test_exact_consumer_paused_past_the_timeout_near_an_epoch_end(cluster: Maker) -> None:
    """One of two consumers is stopped for 8 s (the timeout is 5) while epoch 0 is about to
    end, holding some of its last batches; woken, it registers again."""
    c = cluster(consumers=("c1", "c2"), step=0.002)
    c1 = c.consumers["c1"]
    res, a = run_scenario(c, "consumer SIGSTOP 8 s near an epoch's end",
                          lambda: c1.signal(signal.SIGSTOP), lambda: c1.signal(signal.SIGCONT),
                          8.0, before=lambda: c.wait_count(N // BATCH - 12, timeout=60),
                          guarantee="its batches are served again once it registers again, "
                                    "without what it took")
    check(c, a)


def test_exact_broker_restart_at_an_epoch_start(cluster: Maker) -> None:
    """The broker is killed just after epoch 0 ended (its journal holds the new epoch's first
    records) and restarted 1 s later."""
    c = cluster()

    def epoch_ended() -> None:
        wait_for(lambda: any(0 in got for _, got in c.ledger("c1").ends), 60,
                 interval=0.01, what="epoch 0's end")

    res, a = run_scenario(c, "broker kill -9 at an epoch's start, restart after 1 s",
                          c.kill9_broker, c.start_broker, 1.0, before=epoch_ended,
                          guarantee="the recovery wait applies: the reports come first")
    check(c, a)


def test_exact_disk_full_mid_epoch(cluster: Maker, tmp_path: Path) -> None:
    """The broker's state directory is on a 1 MiB tmpfs; it fills in epoch 1 and is freed
    10 s later. Exact delivery goes on (without durability meanwhile), the broker says so
    naming the directory, and writes its journal whole again once there is room."""
    state = tmp_path / "state"
    state.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(state)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs")
    try:
        c = cluster()
        filler = state / "filler"

        def fill() -> None:
            try:
                with open(filler, "wb") as f:
                    while True:
                        f.write(b"\0" * 4096)
                        f.flush()
            except OSError:
                pass

        res, a = run_scenario(c, "the state directory's disk full for 10 s", fill,
                              filler.unlink, 10.0,
                              before=lambda: c.wait_count(N // BATCH + 100, timeout=60),
                              guarantee="served without durability meanwhile, and said so")
        check(c, a)
        log = "\n".join(p.read_text() for p in sorted(tmp_path.glob("*broker.log")))
        assert "No space left on device" in log and str(state) in log
    finally:
        subprocess.run(["umount", "-l", str(state)], capture_output=True)

"""Exact delivery across real hosts: every sample of every epoch exactly once, byte for byte,
in spite of a producer killed mid-unit, a broker killed and restarted, one of two consumers
killed, a producer stopped beyond the heartbeat timeout, a 10 s partition and 5% loss.

Topology (tests/netns.py): hosts ``broker``, ``trainer``, ``p1``, ``p2``, ``p3``, real TCP. The
broker runs with ``--state-dir`` (its journal). Three producers run one ``delivery: exact``
pipeline file (tests/exact_ledger.py): 3072 sample ids in units of 64 (16 batches of 4),
3 epochs, each producer paced at 50 batches/s, so a unit takes 0.32 s and a fault lands in the
middle of one (the producer faults wait until p1 has just delivered an early batch of a unit).
Ledger consumers (tests/exact_ledger_consumer.py) iterate ``remote.epoch()`` and log, per
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
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests import netns
from tests.exact_cluster import ExactCluster, run_scenario
from tests.exact_ledger import ExactAudit, exact_config

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

    def make(consumers: tuple[str, ...] = ("c1",), step: float = 0.0) -> ExactCluster:
        c = ExactCluster(net, tmp_path, CFG, step=step, producer_window=WINDOW,
                         max_batches=32, window=WINDOW)
        made.append(c)
        c.start_broker()
        for name in consumers:
            c.start_consumer(name)
        for p in PRODUCERS:
            c.start_producer(p)
        for p in PRODUCERS:
            c.wait_count(10, producer=p, timeout=60)
        return c

    yield make
    for c in made:
        c.close()


def check(c: ExactCluster, a: ExactAudit) -> None:
    """Per epoch: the dataset exactly, the clean run's bytes; each epoch() one epoch."""
    assert set(a.epochs) == set(range(EPOCHS)), f"epochs in the ledgers: {sorted(a.epochs)}"
    for epoch, v in a.epochs.items():
        assert v.clean(), (f"epoch {epoch}: lost {v.lost[:20]} ({len(v.lost)}), duplicated "
                           f"{v.duplicated[:20]} ({len(v.duplicated)}), foreign {v.foreign[:20]}, "
                           f"bytes differ from a clean run {v.mismatched[:20]}\n{c.diagnosis()}")
    assert a.corrupt == 0, f"{a.corrupt} batches failed their crc"
    assert a.taken == N * EPOCHS
    ended: set[int] = set()
    for name in c.consumers:
        if name in c.killed:
            continue
        led = c.ledger(name)
        for _, epochs in led.ends:
            assert len(epochs) <= 1, f"{name}: one epoch() iteration yielded epochs {epochs}"
            ended.update(epochs)
        took = {e.epoch for e in led.entries}
        assert took <= ended, f"{name}: epoch() never ended for epochs {sorted(took - ended)}"
    assert ended == set(range(EPOCHS))


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
    """The audit rule for the killed consumer (tests.exact_ledger.audit): its last batch before
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

"""Job-wide exact delivery across real hosts (issue 54): three training hosts, each its own
broker joined to one `feedline coordinator`, each with two ranks (training processes); every
sample of every epoch is taken exactly once by the whole job, in spite of a producer killed
-9 (and started again), a training host's broker killed -9 and restarted from its
``--state-dir``, the coordinator killed -9 and restarted from its journal, and a training
host partitioned for longer than the heartbeat timeout, then healed.

Topology (tests/support/netns.py, real TCP between namespaces): ``job`` runs the coordinator;
``t1``, ``t2``, ``t3`` each run a broker (``--coordinator``, ``--host-name tN``, ``--state-dir``)
and two ledger consumers (tests/support/exact_ledger_consumer.py) on its loopback egress;
``p1``..``p4`` each run one ``feedline producer`` of the same ``delivery: exact`` pipeline
(tests/support/exact_ledger.py), p1 and p4 sending to t1, p2 to t2, p3 to t3 (an exact producer
speaks to one broker). The dataset is 384 sample ids in units of 16 (4 batches of 4), 2 epochs,
each producer paced at 40 samples/s, so an epoch takes a few seconds and a fault lands in its
middle (each fault waits until the job has taken some batches of epoch 0). Heartbeats: 0.2 s
interval, 1.5 s timeout, everywhere (the coordinator's too).

Each scenario runs the whole job: it ends when every rank's ``epoch()`` ended twice (the run is
served); then, per epoch, the union of the six ledgers must be the dataset exactly (0 lost, 0
duplicated, 0 foreign ids), every sample's digest the clean run's, no crc mismatch, and each
``epoch()`` iteration of each rank one epoch.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from feedline.procs import Child, stop_all, wait_for
from tests.support import netns
from tests.support.exact_ledger import (
    ExactAudit,
    ExactLedger,
    audit,
    clean_run,
    exact_config,
    read_exact_ledger,
)

pytestmark = [pytest.mark.netns, pytest.mark.slow, pytest.mark.xdist_group("netns")]

_WHY = netns.unavailable()
if _WHY:
    pytestmark.append(pytest.mark.skip(reason=f"network namespaces unavailable: {_WHY}"))

TRAINERS = ("t1", "t2", "t3")
FEEDS = {"p1": "t1", "p2": "t2", "p3": "t3", "p4": "t1"}  # producer -> the host it sends to
RANKS = 2  # training processes per host
N, UNIT, BATCH, EPOCHS = 384, 16, 4, 2
RATE = 40.0  # samples/s each producer makes
HB = ("--heartbeat-interval", "0.2", "--heartbeat-timeout", "1.5")
TIMEOUT = 1.5  # the heartbeat timeout (s)
CFG = exact_config(N, UNIT, BATCH, EPOCHS, nbytes=256, rate=RATE)
JOB_PORT, INGRESS, EGRESS, METRICS_PORT = 7900, 7878, 7879, 9502
START_TIMEOUT = 30.0
JOB_TIMEOUT = 45.0  # seconds for the whole job after the fault healed
_CLEAN: list[dict[int, dict[int, str]]] = []


class JobCluster:
    """The coordinator, the brokers, their ranks and the producers, on ``net``'s hosts."""

    def __init__(self, net: netns.Network, tmp: Path) -> None:
        self.net, self.tmp = net, tmp
        self.cfg = tmp / "exact.yaml"
        self.cfg.write_text(yaml.safe_dump(CFG))
        self.job = f"tcp://{net['job'].addr}:{JOB_PORT}"
        self.coordinator: Child | None = None
        self.brokers: dict[str, Child] = {}
        self.producers: dict[str, list[Child]] = {p: [] for p in FEEDS}
        self.ranks: dict[str, Child] = {}
        self._n = 0

    def _log(self, name: str) -> Path:
        self._n += 1
        return self.tmp / f"{self._n:02d}-{name}.log"

    @staticmethod
    def _up(child: Child, line: str, what: str) -> Child:
        wait_for(lambda: line in child.log_text() or not child.alive(), START_TIMEOUT,
                 interval=0.05, what=what)
        assert child.alive(), f"{what}: exited\n{child.log_text()[-3000:]}"
        return child

    # -- daemons ----------------------------------------------------------------------------
    def start_coordinator(self) -> Child:
        """On its ``--state-dir``: a restart goes on from its journal."""
        c = self.net["job"].python(
            "feedline", "coordinator", "--bind", f"tcp://0.0.0.0:{JOB_PORT}", "--insecure",
            "--state-dir", self.tmp / "job-state", "--metrics-addr", "127.0.0.1",
            "--metrics-port", str(METRICS_PORT), "--heartbeat-timeout", str(TIMEOUT),
            log_path=self._log("coordinator"))
        self.coordinator = self._up(c, "coordinator up", "coordinator up")
        return c

    def start_broker(self, host: str) -> Child:
        """Host ``host``'s broker, on its state directory, name and ports (a restart is the
        same host)."""
        b = self.net[host].python(
            "feedline.broker", "--ingress", f"tcp://0.0.0.0:{INGRESS}", "--insecure",
            "--egress", f"tcp://127.0.0.1:{EGRESS}", "--metrics-port", "0", *HB,
            "--state-dir", self.tmp / f"state-{host}", "--coordinator", self.job,
            "--host-name", host, log_path=self._log(f"broker-{host}"))
        self.brokers[host] = self._up(b, "broker up", f"{host}'s broker up")
        return b

    def start_rank(self, host: str, rank: int) -> Child:
        name = f"{host}-r{rank}"
        self.ranks[name] = self.net[host].python(
            "tests.support.exact_ledger_consumer", "--broker", f"tcp://127.0.0.1:{EGRESS}",
            "--ledger", self.tmp / f"{name}.ledger", *HB, log_path=self._log(name))
        return self.ranks[name]

    def start_producer(self, name: str) -> Child:
        to = self.net[FEEDS[name]]
        p = self.net[name].python(
            "feedline.producer", "--config", self.cfg, "--broker", f"tcp://{to.addr}:{INGRESS}",
            "--id", name, *HB, log_path=self._log(name))
        self.producers[name].append(p)
        return p

    def start(self) -> None:
        self.start_coordinator()
        for h in TRAINERS:
            self.start_broker(h)
        for h in TRAINERS:
            for r in range(RANKS):
                self.start_rank(h, r)
        for p in FEEDS:
            self.start_producer(p)

    # -- progress ---------------------------------------------------------------------------
    def ledger(self, rank: str) -> ExactLedger:
        return read_exact_ledger(self.tmp / f"{rank}.ledger")

    def taken(self) -> int:
        return sum(len(self.ledger(r).entries) for r in self.ranks)

    def epochs_ended(self) -> int:
        """Epochs every rank's ``epoch()`` ended (the job's epochs ended, job-wide)."""
        return min(len(self.ledger(r).ends) for r in self.ranks)

    def done(self) -> bool:
        return self.epochs_ended() >= EPOCHS

    def diagnosis(self, lines: int = 15) -> str:
        out = [f"batches taken per rank: { {r: len(self.ledger(r).entries) for r in self.ranks} }"
               f"; epochs ended per rank: { {r: len(self.ledger(r).ends) for r in self.ranks} }"]
        for log in sorted(self.tmp.glob("*.log")):
            tail = log.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {log.name}\n" + "\n".join(tail))
        return "\n".join(out)

    def silent_hosts(self) -> float:
        """The coordinator's ``feedline_job_hosts_silent`` (read inside ``job``)."""
        text = self.net["job"].http_get(f"http://127.0.0.1:{METRICS_PORT}/metrics")
        return netns.metric_sum(text, "feedline_job_hosts_silent")

    def close(self) -> None:
        stop_all([*self.ranks.values(), *(p for ps in self.producers.values() for p in ps)],
                 timeout=10)
        servers = [*self.brokers.values(), *([self.coordinator] if self.coordinator else [])]
        stop_all(servers, timeout=10)  # their shutdowns overlap

    def audit(self) -> ExactAudit:
        if not _CLEAN:  # a second or so of work: once per test session
            _CLEAN.append(clean_run(CFG))
        return audit({r: self.ledger(r).entries for r in self.ranks}, _CLEAN[0])


@dataclass(frozen=True)
class Fault:
    name: str  # what the assertion messages say
    inject: Callable[[JobCluster], object]
    heal: Callable[[JobCluster], object]
    hold: float  # seconds between the two, at least
    # While the fault holds (within ``hold``, or longer): what shows it took effect.
    during: Callable[[JobCluster], object] = lambda c: None
    # After the job: what shows the product recovered the way it says.
    check: Callable[[JobCluster], object] = lambda c: None


def _kill_producer(c: JobCluster) -> None:
    c.producers["p1"][-1].kill9()


def _kill_broker(c: JobCluster) -> None:
    c.brokers["t2"].kill9()


def _kill_coordinator(c: JobCluster) -> None:
    assert c.coordinator is not None
    c.coordinator.kill9()


def _t3_silent(c: JobCluster) -> None:
    """The coordinator counts t3 silent once the heartbeat timeout has passed (it keeps its
    open units: the epoch waits for it)."""
    wait_for(lambda: c.silent_hosts() == 1, 3 * TIMEOUT, interval=0.2,
             what="the coordinator to count t3 silent")


def _t2_resumed(c: JobCluster) -> None:
    second = c.brokers["t2"].log_text()
    assert "from the journal" in second, second[-3000:]


def _coordinator_restored(c: JobCluster) -> None:
    assert c.coordinator is not None
    assert "restored from its journal" in c.coordinator.log_text(), c.coordinator.log_text()


def _producer_restarted(c: JobCluster) -> None:
    first, _ = c.producers["p1"]
    joined = c.brokers["t1"].log_text().count("producer p1 joined")
    assert first.proc.returncode == -9 and joined == 2, \
        f"p1 killed (exit {first.proc.returncode}) and joined t1 again ({joined} joins)"


FAULTS = [
    Fault("kill -9 of p1 (one of t1's two producers), started again 1 s later",
          _kill_producer, lambda c: c.start_producer("p1"), 1.0,
          check=_producer_restarted),
    Fault("kill -9 of t2's broker, restarted 1 s later from its --state-dir",
          _kill_broker, lambda c: c.start_broker("t2"), 1.0, check=_t2_resumed),
    Fault("kill -9 of the coordinator, restarted 1 s later from its journal",
          _kill_coordinator, lambda c: c.start_coordinator(), 1.0,
          check=_coordinator_restored),
    Fault(f"partition of training host t3 for {2 * TIMEOUT:g} s (heartbeat timeout "
          f"{TIMEOUT:g} s), healed", lambda c: c.net["t3"].partition(),
          lambda c: c.net["t3"].heal(), 2 * TIMEOUT, during=_t3_silent),
]


@pytest.fixture
def net() -> Iterator[netns.Network]:
    netns.sweep()
    n = netns.Network(["job", *TRAINERS, *FEEDS])
    try:
        yield n
    finally:
        n.close()


@pytest.fixture
def cluster(net: netns.Network, tmp_path: Path) -> Iterator[JobCluster]:
    c = JobCluster(net, tmp_path)
    try:
        yield c
    finally:
        for h in TRAINERS:  # a failed partition scenario leaves no cable pulled
            net[h].heal()
        c.close()


@pytest.mark.parametrize("fault", FAULTS, ids=["producer", "broker", "coordinator",
                                               "partition"])
def test_job_exactly_once_across_three_hosts(cluster: JobCluster, fault: Fault) -> None:
    c = cluster
    c.start()
    why = f"[{fault.name}]"
    try:
        # Mid-epoch 0: every host's ranks have taken batches (each host serves units).
        wait_for(lambda: all(len(c.ledger(f"{h}-r0").entries) + len(c.ledger(f"{h}-r1")
                                                                    .entries) >= 3
                             for h in TRAINERS), START_TIMEOUT, interval=0.1,
                 what="every host serving")
        assert c.epochs_ended() == 0, f"{why} epoch 0 ended before the fault: pace it more"
        fault.inject(c)
        t_fault = time.time()
        fault.during(c)
        time.sleep(max(0.0, t_fault + fault.hold - time.time()))
        fault.heal(c)
        wait_for(c.done, JOB_TIMEOUT, interval=0.25, what=f"{why} every epoch served")
    except (TimeoutError, AssertionError) as e:
        raise AssertionError(f"{why} {e}\n{c.diagnosis()}") from None
    c.close()
    a = c.audit()
    assert set(a.epochs) == set(range(EPOCHS)), f"{why} epochs taken: {sorted(a.epochs)}"
    for epoch, v in sorted(a.epochs.items()):
        assert v.clean(), (f"{why} epoch {epoch}: lost {v.lost[:20]} ({len(v.lost)}), "
                           f"duplicated {v.duplicated[:20]} ({len(v.duplicated)}), foreign "
                           f"{v.foreign[:20]}, bytes differ from a clean run "
                           f"{v.mismatched[:20]}\n{c.diagnosis()}")
    assert a.corrupt == 0, f"{why} {a.corrupt} batches failed their crc"
    assert a.taken == N * EPOCHS, f"{why} {a.taken} samples taken"
    for rank in c.ranks:
        ends = c.ledger(rank).ends
        assert all(len(got) <= 1 for _, got in ends), \
            f"{why} {rank}: an epoch() iteration yielded several epochs: {ends}"
    # The fault landed mid-epoch 0 (before any rank saw it end), and the job's units were
    # served by every host.
    first_end = min(t for r in c.ranks for t, _ in c.ledger(r).ends)
    assert t_fault < first_end, f"{why} the fault came after epoch 0 ended: pace it more"
    for h in TRAINERS:
        assert c.ledger(f"{h}-r0").entries or c.ledger(f"{h}-r1").entries, \
            f"{why} host {h} served nothing"
    try:
        fault.check(c)
    except (TimeoutError, AssertionError) as e:
        raise AssertionError(f"{why} {e}") from None


if __name__ == "__main__":
    pytest.main([__file__, "-q", "-n", "0"])

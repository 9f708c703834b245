"""Exact delivery on network-namespace hosts: the harness of :mod:`tests.support.fault_cluster` with
exact producers, exact ledger consumers, and a scenario that runs the whole job.

:class:`ExactCluster` starts the broker with ``--state-dir`` (as a deployment of exact delivery
would: its progress survives a restart), every producer with the same ``delivery: exact``
pipeline file (:func:`tests.support.exact_ledger.exact_config`), and
:mod:`tests.support.exact_ledger_consumer` on ``trainer``. A job ends by itself: once every epoch is
served the producers exit, so :func:`run_scenario` runs the fault in the middle of the job and
then waits for the job's end, not for a quiet moment.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from feedline.procs import Child, wait_for
from tests.support.exact_ledger import (
    ExactAudit,
    ExactEntry,
    ExactLedger,
    audit,
    clean_run,
    read_exact_ledger,
)
from tests.support.fault_cluster import (
    Cluster,
    Entry,
    _Incarnation,
    rate_series,
    record,
    recovery_seconds,
)
from tests.support.netns import Network, metric_sum

BASELINE = 2.0  # seconds of steady flow before the fault: the offered load
OBSERVE = 20.0  # seconds after the heal within which full throughput must come back
JOB_TIMEOUT = 90.0  # seconds for the rest of the job after recovery
_CLEAN: dict[str, dict[int, dict[int, str]]] = {}  # clean runs by pipeline


class ExactCluster(Cluster):
    """Broker (with a journal), exact producers, exact ledger consumers."""

    def __init__(self, net: Network, tmp: Path, cfg: dict[str, Any], *, step: float = 0.0,
                 **kw: Any) -> None:
        super().__init__(net, tmp, broker_args=("--state-dir", str(tmp / "state")), **kw)
        self.cfg, self.step = cfg, step
        self.cfg_path = tmp / "exact.yaml"
        self.cfg_path.write_text(yaml.safe_dump(cfg))
        self.per_unit = -(-int(cfg["exact"]["unit_size"]) // self.batch_size)
        self.killed: set[str] = set()
        self.crashed: set[str] = set()  # a job's process that crashed after its checkpoint

    @property
    def batch_size(self) -> int:
        return int(self.cfg["steps"][-1]["batch"]["batch_size"])

    def nominal(self) -> float:
        """Batches/s the producers offer (their pacing), all together."""
        rate = float(self.cfg["steps"][0]["map"]["args"]["rate"])
        return rate / self.batch_size * len(self.producers)

    # -- daemons ------------------------------------------------------------------------
    def start_producer(self, name: str, *, broker: str | None = None,
                       rate: float | None = None, nbytes: int | None = None) -> Child:
        """Producer ``name`` on host ``name``: the one pipeline file every producer runs."""
        child = self.net[name].python(
            "feedline.producer", "--config", self.cfg_path, "--broker", broker or self.ingress,
            "--id", name, "--log-interval", "2", *self._hb_args(), log_path=self._log(name))
        self.producers[name].append(_Incarnation(child, Path(), time.time()))
        return child

    def start_consumer(self, name: str = "c1", host: str = "trainer", *extra: str) -> Child:
        """A ledger consumer; ``extra``: its checkpoint flags (``--save``, ``--resume``...)."""
        child = self.net[host].python(
            "tests.support.exact_ledger_consumer", "--broker", self.egress, "--ledger",
            self.tmp / f"{name}.ledger", "--window", str(self.window), "--step", str(self.step),
            *self._hb_args(), *extra, log_path=self._log(name))
        self.consumers[name] = child
        return child

    def kill9_consumer(self, name: str) -> None:
        self.consumers[name].kill9()
        self.killed.add(name)

    def done(self) -> bool:
        """Every epoch served: each producer's last incarnation has exited."""
        return all(not incs[-1].child.alive() for incs in self.producers.values())

    # -- ledgers ------------------------------------------------------------------------
    def ledger(self, consumer: str, tail: int | None = None) -> ExactLedger:
        return read_exact_ledger(self.tmp / f"{consumer}.ledger", tail)

    def exact_entries(self, consumer: str | None = None) -> list[ExactEntry]:
        names = [consumer] if consumer else list(self.consumers)
        return sorted((e for n in names for e in self.ledger(n).entries), key=lambda e: e.t)

    def entries(self, consumer: str | None = None) -> list[Entry]:
        return list(self.exact_entries(consumer))

    def wait_mid_unit(self, producer: str, timeout: float = 30.0) -> ExactEntry:
        """Until a batch of ``producer`` early in its unit has just arrived (the producer is
        then making that unit's next batches): a fault now lands mid-unit. Returns it."""
        def fresh() -> ExactEntry | None:
            now = time.time()
            for name in self.consumers:
                for e in reversed(self.ledger(name, tail=16384).entries):
                    if e.producer == producer:
                        if now - e.t < 0.2 and 1 <= e.index <= self.per_unit - 5:
                            return e
                        break
            return None
        return wait_for(fresh, timeout, interval=0.02, what=f"{producer} mid-unit")

    def clean(self, epochs: int | None = None) -> dict[int, dict[int, str]]:
        cfg = self.cfg if epochs is None else {**self.cfg, "epochs": epochs}
        key = yaml.safe_dump(cfg)
        if key not in _CLEAN:  # seconds of work: once per pipeline and test session
            _CLEAN[key] = clean_run(cfg)
        return _CLEAN[key]

    def exact_audit(self, epochs: int | None = None) -> ExactAudit:
        """The audit (``epochs``: of that many epochs, when jobs ran more than the file's)."""
        ledgers = {n: self.exact_entries(n) for n in self.consumers}
        crashed = {n: self.ledger(n).ckpt or 0 for n in self.crashed}
        return audit(ledgers, self.clean(epochs), frozenset(self.killed), crashed)


def taken_over(entries: list[ExactEntry], producer: str, until: float
               ) -> dict[tuple[int, int], float]:
    """Units ``producer`` began (first batch arrived before ``until``: the heal) that another
    producer, or another session of it, also delivered batches of: (epoch, unit) -> when the
    first batch of the other one arrived."""
    by_unit: dict[tuple[int, int], list[ExactEntry]] = defaultdict(list)
    for e in entries:
        by_unit[(e.epoch, e.unit)].append(e)
    out = {}
    for key, es in by_unit.items():
        first = min(es, key=lambda e: e.t)
        if first.producer != producer or first.t > until:
            continue
        others = [e.t for e in es if (e.producer, e.session) != (first.producer, first.session)]
        if others:
            out[key] = min(others)
    return out


def longest_wait(entries: list[Entry], t0: float, t1: float) -> float:
    """The longest time between two batches taken (by any consumer) in [t0, t1]."""
    times = [t0] + sorted(e.t for e in entries if t0 <= e.t <= t1) + [t1]
    return max(b - a for a, b in zip(times, times[1:], strict=False))


def run_scenario(c: ExactCluster, name: str, fault: Callable[[], object],
                 heal: Callable[[], object], hold: float, *, guarantee: str = "",
                 before: Callable[[], object] | None = None,
                 affected: str | None = None) -> tuple[dict, ExactAudit]:
    """Steady flow, ``before()`` (e.g. wait until p1 is mid-unit), ``fault()``, ``hold``
    seconds, ``heal()``, full throughput again, the rest of the job, audit. Recovery is the
    total throughput's (units move between producers: a producer's own rate says little);
    ``affected`` names the producer whose units the fault interrupts (for ``takeover_s``).
    Returns the measurements (also recorded for docs/reliability.md) and the audit."""
    t_start = time.time()
    time.sleep(BASELINE)
    # The offered load: the producers' pacing, or what this machine gave just before the
    # fault if that was less (a busy machine must not read as a slow recovery).
    offered = min(c.nominal(), c.count(since=time.time() - BASELINE) / BASELINE)
    if before is not None:
        before()
    t_fault = time.time()
    fault()
    time.sleep(hold)
    during = c.count(since=t_fault) / hold if hold else None
    t_heal = time.time()
    heal()

    def recovered() -> float | None:
        return recovery_seconds(c.entries(), t_heal, offered)

    try:
        wait_for(lambda: recovered() is not None or c.done(), OBSERVE, interval=0.25,
                 what=f"{name}: full throughput after the heal")
        wait_for(c.done, JOB_TIMEOUT, interval=0.25, what=f"{name}: every epoch served")
    except TimeoutError as e:
        raise TimeoutError(f"{e}\n{c.diagnosis()}") from None
    rec = recovered()  # None: the job ended first (a measurement, not a verdict)
    # Batches the (last) broker dropped because it had them: units produced again.
    dropped = metric_sum(c.broker_metrics(), "feedline_broker_duplicate_batches_total") \
        if c.broker is not None and c.broker.alive() else None
    c.close()
    entries = c.exact_entries()
    t_end = max(e.t for e in entries)
    moved = taken_over(entries, affected, t_heal) if affected else {}
    a = c.exact_audit()
    result = {
        "scenario": name, "mode": "exact", "guarantee": guarantee, "hold_s": hold,
        "fault_at": round(t_fault - t_start, 2), "healed_at": round(t_heal - t_start, 2),
        "recovery_s": round(rec, 2) if rec is not None else None, "affected": None,
        "offered_per_s": round(offered, 1),
        "rate_during_fault": round(during, 1) if during is not None else None,
        "takeover_s": round(min(moved.values()) - t_fault, 2) if moved else None,
        "units_taken_over": len(moved),
        "longest_wait_s": round(longest_wait(c.entries(), t_fault, t_end), 2),
        "job_s": round(t_end - t_start, 2), "taken_samples": a.taken,
        "ledger": a.summary(), "served_again": len(a.served_again),
        "broker_dropped_duplicates": dropped,
        "total": rate_series(c.entries(), t_start, t_end),
        "per_producer": {p: rate_series([e for e in entries if e.producer == p], t_start,
                                        t_end) for p in c.producers},
    }
    record(result)
    return result, a

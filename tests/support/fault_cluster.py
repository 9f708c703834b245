"""A feedline system spread over network-namespace hosts, with a ledger of every batch.

:class:`Cluster` runs the real daemons (``python -m feedline.broker``,
                                        ``python -m feedline.producer``) and
ledger-keeping training processes (:mod:`tests.support.ledger_consumer`) on the hosts of a
:class:`tests.support.netns.Network`. Producers emit :mod:`tests.support.ledger_data` batches at a
paced rate
and log the index of every datapoint they produce, one log per process incarnation; consumers
log every batch they take. :meth:`Cluster.audit` joins the two into a :class:`Audit`:

- corrupt: batches whose payload did not match its checksum;
- duplicates: a (producer session, index) taken twice;
- unexpected: an index no producer produced;
- missing: produced but never taken, split into *gaps* (before the last index taken from that
  session) and the *tail* (after it: in flight when the session ended);
- counted: what the consumers were told was lost (the broker's sequence-gap counts).

:func:`recovery_seconds` reads the throughput from the consumers' arrival times: the time from
a fault's heal until a one-second window again carries 90% of the offered load.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from feedline.procs import Child, stop_all, wait_for
from tests.support.netns import Network


@dataclass(frozen=True)
class Entry:
    t: float
    producer: str
    session: int
    seq: int
    index: int
    ok: bool


def read_ledger(path: Path) -> tuple[list[Entry], dict]:
    """Batches taken (in order) and the consumer's last per-producer stats."""
    entries: list[Entry] = []
    stats: dict = {}
    if not path.exists():
        return entries, stats
    for line in path.read_text().splitlines():
        if line.startswith("#stats "):
            stats = json.loads(line[7:])
        elif line.count(" ") == 5:  # a line cut by kill -9 is not a batch taken
            t, p, s, q, i, ok = line.split()
            entries.append(Entry(float(t), p, int(s), int(q), int(i), ok == "1"))
    return entries, stats


@dataclass
class Audit:
    taken: int = 0
    corrupt: int = 0
    duplicates: int = 0
    unexpected: int = 0
    gaps: dict[str, int] = field(default_factory=dict)  # per producer id
    tails: dict[str, list[int]] = field(default_factory=dict)  # per producer: per incarnation
    counted: dict[str, int] = field(default_factory=dict)  # lost, as the consumers were told
    sessions: dict[str, int] = field(default_factory=dict)

    def clean(self) -> bool:
        return not (self.corrupt or self.duplicates or self.unexpected)


@dataclass
class _Incarnation:
    child: Child
    log: Path
    started: float


class Cluster:
    """Broker on host ``broker``, producers on their hosts, consumers on ``trainer``."""

    def __init__(self, net: Network, tmp: Path, *, rate: float = 40.0, nbytes: int = 32768,
                 producer_window: int = 4, max_batches: int = 32, window: int = 4,
                 heartbeat: tuple[float, float] = (1.0, 5.0),
                 broker_args: tuple[str, ...] = ()) -> None:
        self.net, self.tmp = net, tmp
        self.broker_args = broker_args  # more flags for every broker start (--state-dir DIR)
        self.rate, self.nbytes = rate, nbytes
        self.producer_window, self.max_batches, self.window = producer_window, max_batches, window
        self.heartbeat = heartbeat
        self.broker_host = net["broker"]
        self.ingress = f"tcp://{self.broker_host.addr}:7878"
        self.egress = f"tcp://{self.broker_host.addr}:7879"
        self.broker: Child | None = None
        self.producers: dict[str, list[_Incarnation]] = defaultdict(list)
        self.consumers: dict[str, Child] = {}
        self._n = 0

    def _log(self, name: str) -> Path:
        self._n += 1
        return self.tmp / f"{self._n:02d}-{name}.log"

    def _hb_args(self) -> list[str]:
        return ["--heartbeat-interval", str(self.heartbeat[0]),
                "--heartbeat-timeout", str(self.heartbeat[1])]

    # -- daemons ------------------------------------------------------------------------
    def start_broker(self) -> Child:
        log = self._log("broker")
        self.broker = self.broker_host.python(
            "feedline.broker", "--ingress", "tcp://0.0.0.0:7878", "--egress", "tcp://0.0.0.0:7879",
            "--insecure", "--metrics-port", "9500", "--producer-window",
            str(self.producer_window), "--max-batches", str(self.max_batches),
            *self._hb_args(), *self.broker_args, log_path=log)
        b = self.broker
        wait_for(lambda: "broker up" in log.read_text() or not b.alive(), 30, what="broker up")
        assert b.alive(), log.read_text()
        return b

    def start_producer(self, name: str, *, broker: str | None = None,
                       rate: float | None = None, nbytes: int | None = None) -> Child:
        """Producer ``name`` on host ``name`` (a new incarnation if it ran before)."""
        seed = sorted(self.net.hosts).index(name)
        ledger = self.tmp / f"{name}-{len(self.producers[name])}.produced"
        cfg = self.tmp / f"{name}-{len(self.producers[name])}.yaml"
        cfg.write_text(yaml.safe_dump({"factory": "tests.support.ledger_data:make", "args": {
            "nbytes": nbytes or self.nbytes, "seed": seed, "log": str(ledger),
            "rate": rate or self.rate}}))
        child = self.net[name].python(
            "feedline.producer", "--config", cfg, "--broker", broker or self.ingress, "--id", name,
            "--log-interval", "2", *self._hb_args(), log_path=self._log(name))
        self.producers[name].append(_Incarnation(child, ledger, time.time()))
        return child

    def producer(self, name: str) -> Child:
        return self.producers[name][-1].child

    def kill9_broker(self) -> None:
        assert self.broker is not None
        self.broker.kill9()

    def start_consumer(self, name: str = "c1", host: str = "trainer") -> Child:
        child = self.net[host].python(
            "tests.support.ledger_consumer", "--broker", self.egress, "--ledger",
            self.tmp / f"{name}.ledger", "--window", str(self.window), *self._hb_args(),
            log_path=self._log(name))
        self.consumers[name] = child
        return child

    def entries(self, consumer: str | None = None) -> list[Entry]:
        names = [consumer] if consumer else list(self.consumers)
        out = [e for n in names for e in read_ledger(self.tmp / f"{n}.ledger")[0]]
        return sorted(out, key=lambda e: e.t)

    def count(self, producer: str | None = None, since: float = 0.0) -> int:
        return sum(1 for e in self.entries()
                   if (producer is None or e.producer == producer) and e.t >= since)

    def wait_count(self, n: int, producer: str | None = None, since: float = 0.0,
                   timeout: float = 60.0) -> None:
        try:
            wait_for(lambda: self.count(producer, since) >= n, timeout,
                     interval=0.2, what=f"{n} batches from {producer or 'all producers'}")
        except TimeoutError as e:
            raise TimeoutError(f"{e}\n{self.diagnosis()}") from None

    def diagnosis(self, lines: int = 12) -> str:
        """What each process said last, and what the consumers took: for a failure report."""
        out = [f"taken per producer: "
               f"{ {p: self.count(p) for p in self.producers} }"]
        for log in sorted(self.tmp.glob("*.log")):
            tail = log.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {log.name}\n" + "\n".join(tail))
        return "\n".join(out)

    def broker_metrics(self) -> str:
        return self.broker_host.http_get(f"http://{self.broker_host.addr}:9500/metrics")

    # -- ending -------------------------------------------------------------------------
    def finish(self, quiet: float = 1.5, timeout: float = 30.0) -> None:
        """Stop producers cleanly, let consumers take what is left, stop everything."""
        for incs in self.producers.values():
            incs[-1].child.stop(timeout=15)
        last = {"count": -1, "at": time.monotonic()}  # the ledger's size, and when it last grew

        def settled() -> bool:
            n = self.count()
            if n != last["count"]:
                last.update(count=n, at=time.monotonic())
            return time.monotonic() - last["at"] >= quiet

        wait_for(settled, timeout, interval=0.1, what="consumers to drain")
        self.close()

    def close(self) -> None:
        children = [*self.consumers.values(),
                    *(inc.child for incs in self.producers.values() for inc in incs)]
        for c in children:
            c.signal(signal.SIGCONT)
        stop_all(children, timeout=15)  # their shutdowns overlap
        if self.broker is not None:
            self.broker.stop(timeout=10)

    # -- the ledger -----------------------------------------------------------------------
    def audit(self) -> Audit:
        """Join what producers produced with what consumers took (call after :meth:`finish`)."""
        entries = self.entries()
        a = Audit(taken=len(entries))
        a.corrupt = sum(not e.ok for e in entries)
        for name in self.consumers:
            for pid, st in read_ledger(self.tmp / f"{name}.ledger")[1].items():
                a.counted[pid] = a.counted.get(pid, 0) + int(st["lost"])
        by_session: dict[tuple[str, int], list[Entry]] = defaultdict(list)
        for e in entries:
            by_session[(e.producer, e.session)].append(e)
        for name, incs in self.producers.items():
            # Incarnations and sessions meet in time order: a restarted process is a new
            # session, and each incarnation's first batch arrives after the previous one's.
            sessions = sorted((s for (p, s) in by_session if p == name),
                              key=lambda s: by_session[(name, s)][0].t)
            a.sessions[name] = len(sessions)
            a.gaps[name], a.tails[name] = 0, []
            for k, inc in enumerate(incs):
                produced = {int(x) for x in inc.log.read_text().split()} if inc.log.exists() \
                    else set()
                got = [e.index for e in by_session[(name, sessions[k])]] \
                    if k < len(sessions) else []
                a.duplicates += len(got) - len(set(got))
                a.unexpected += len(set(got) - produced)
                last = max(got, default=-1)
                missing = produced - set(got)
                a.gaps[name] += sum(1 for i in missing if i < last)
                a.tails[name].append(sum(1 for i in missing if i > last))
        a.unexpected += sum(len(v) for (p, _), v in by_session.items()
                            if p not in self.producers)
        return a


def rate_series(entries: list[Entry], t0: float, t1: float, step: float = 0.25,
                span: float = 1.0) -> list[tuple[float, float]]:
    """(time since t0, batches/s over the ``span`` seconds ending then), every ``step``."""
    times = sorted(e.t for e in entries)
    out, lo, hi = [], 0, 0
    t = t0 + span
    while t <= t1:
        while hi < len(times) and times[hi] <= t:
            hi += 1
        while lo < len(times) and times[lo] <= t - span:
            lo += 1
        out.append((round(t - t0, 3), (hi - lo) / span))
        t += step
    return out


def recovery_seconds(entries: list[Entry], healed: float, offered: float,
                     fraction: float = 0.9, span: float = 1.0) -> float | None:
    """Seconds from ``healed`` to the first arrival that starts ``span`` seconds carrying
    ``fraction`` of the ``offered`` rate (full throughput again); None if that never happens
    in ``entries``. Its resolution is the spacing of arrivals, not ``span``."""
    times = sorted(e.t for e in entries if e.t >= healed)
    need = fraction * offered * span
    hi = 0
    for lo, t in enumerate(times):
        while hi < len(times) and times[hi] < t + span:
            hi += 1
        if hi - lo >= need:
            return t - healed
        if hi == len(times):
            return None  # this window and all later ones are not over yet
    return None


def record(result: dict) -> None:
    """Append a scenario's measurements to $FEEDLINE_RELIABILITY_OUT, if set (JSON lines)."""
    out = os.environ.get("FEEDLINE_RELIABILITY_OUT")
    if out:
        with open(out, "a") as f:
            f.write(json.dumps(result) + "\n")


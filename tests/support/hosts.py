"""The two hosts of the serving core, started the same way, for the hostile-peer tests.

A broker (``python -m feedline.broker``) and a direct-mode trainer (``python -m
tests.support.direct_trainer``: ``RemoteDataZMQ(bind=True)`` in its own process) both serve
producers
with the same core (feedline/serving/server.py); every hostile-peer test runs against both
through the ``host`` fixture (tests/conftest.py). A :class:`Host` has the address producers
connect to, the serving metrics (``feedline_broker_*``: a direct-mode trainer serves them
too), its process, and :meth:`Host.trainer`: what the training side takes. For a broker that
is a ``RemoteDataZMQ`` in this process on its egress; for a direct-mode trainer, the trainer
process itself, read from the ledger it keeps. Both take the broker's flags.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from feedline.procs import Daemon, free_port, wait_for
from feedline.producer import send_dataflow
from feedline.protocol.wire import Batch
from feedline.transport.link import LinkConfig
from tests.support.direct_trainer import summary
from tests.support.flow_support import FAST, CountingConsumer, Metrics

KINDS = ("broker", "direct")


class Trainer:
    """What a training process took, per producer (``counts``), and each batch's summary
    (:meth:`batches`: dicts as tests.support.direct_trainer writes them)."""

    def __init__(self) -> None:
        self._got: list[dict[str, Any]] = []

    def batches(self) -> list[dict[str, Any]]:
        return list(self._got)

    @property
    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for b in self.batches():
            out[b["p"]] = out.get(b["p"], 0) + 1
        return out

    @property
    def total(self) -> int:
        return len(self.batches())

    def of(self, producer: str) -> list[dict[str, Any]]:
        return [b for b in self.batches() if b["p"] == producer]

    def close(self) -> None:
        pass


class EgressTrainer(Trainer):
    """A ``RemoteDataZMQ`` on a broker's egress, iterated by a thread of this process."""

    def __init__(self, addr: str, window: int = 4, link: LinkConfig = FAST) -> None:
        super().__init__()
        self._consumer = CountingConsumer(addr, window, link, keep=self._keep)

    def _keep(self, b: Batch) -> None:
        self._got.append({"p": b.producer, "s": b.seq, "a": summary(b.datapoint)})

    def close(self) -> None:
        self._consumer.close()


class LedgerTrainer(Trainer):
    """The batches a direct-mode trainer process took from now on (its ledger, read as it
    grows)."""

    def __init__(self, ledger: Path) -> None:
        super().__init__()
        self._path = ledger
        self._offset = ledger.stat().st_size if ledger.exists() else 0

    def batches(self) -> list[dict[str, Any]]:
        if self._path.exists():
            with open(self._path, "rb") as f:
                f.seek(self._offset)
                text = f.read()
            done = text.rfind(b"\n") + 1  # a line being written is read next time
            self._offset += done
            self._got.extend(json.loads(ln) for ln in text[:done].splitlines() if ln)
        return list(self._got)


class Host:
    """A broker or a direct-mode trainer process serving producers at :attr:`ingress`."""

    def __init__(self, kind: str, daemon: Daemon, ingress: str, metrics: Metrics,
                 egress: str | None = None, tensorpack: str | None = None,
                 ledger: Path | None = None) -> None:
        self.kind, self.daemon, self.ingress, self.metrics = kind, daemon, ingress, metrics
        self.egress, self.tensorpack, self.ledger = egress, tensorpack, ledger
        self._trainers: list[Trainer] = []

    @property
    def pid(self) -> int:
        return self.daemon.pid

    @property
    def port(self) -> int:
        return int(self.ingress.rsplit(":", 1)[1])

    def alive(self) -> bool:
        return self.daemon.alive()

    def log_text(self) -> str:
        return self.daemon.log_text()

    def trainer(self, window: int = 4, link: LinkConfig = FAST) -> Trainer:
        """What the training side takes from now on (closed with the host)."""
        if self.kind == "broker":
            assert self.egress is not None
            t: Trainer = EgressTrainer(self.egress, window, link)
        else:
            assert self.ledger is not None
            t = LedgerTrainer(self.ledger)
        self._trainers.append(t)
        return t

    def close(self) -> None:
        for t in self._trainers:
            t.close()


def start_host(kind: str, daemons: Callable[..., Daemon], tmp_path: Path, endpoints: Any,
               *extra: str, reading: bool = True, liveness: tuple[str, ...] = (
                   "--heartbeat-interval", "0.2", "--heartbeat-timeout", "1.5")) -> Host:
    """Start a host of ``kind`` on ``endpoints`` with the broker flags ``extra`` (and fast
    heartbeats unless ``liveness`` says otherwise); ready (ingress and metrics answer) when
    returned. ``reading=False``: a direct-mode trainer that takes nothing after its first
    batch (as a broker without a consumer)."""
    tp = extra[extra.index("--tensorpack-ingress") + 1] if "--tensorpack-ingress" in extra \
        else None
    for _ in range(3):
        # free_port's port was free a moment ago; a parallel test may take it before the
        # host binds it (the host then exits: "--metrics-port N: ... already in use").
        port = free_port()
        args = ["--ingress", endpoints.ingress, "--metrics-port", str(port), *liveness, *extra]
        if kind == "broker":
            d = daemons("feedline.broker", *args, "--egress", endpoints.egress, name="broker")
            host = Host(kind, d, endpoints.ingress, Metrics(port), egress=endpoints.egress,
                        tensorpack=tp)
        else:
            ledger = tmp_path / f"trainer-{port}.ledger"
            d = daemons("tests.support.direct_trainer", *args, "--ledger", str(ledger),
                        *(() if reading else ("--hold",)), name="trainer")
            host = Host(kind, d, endpoints.ingress, Metrics(port), tensorpack=tp,
                        ledger=ledger)
        wait_for(lambda h=host, d=d: h.metrics.up() or not d.alive(), 30,
                 what=f"{kind} metrics")
        if d.alive() or f"--metrics-port {port}: port {port}" not in d.log_text():
            break
    wait_for(lambda: _tcp_ready(host.port) or not d.alive(), 30, what=f"{kind} ingress")
    assert d.alive(), d.log_text()
    return host


def _tcp_ready(port: int) -> bool:
    import socket

    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def honest_round(host: Host, n: int = 8, tag: int = 5, timeout: float = 30) -> None:
    """An honest producer sends n batches; the training side must get exactly those, every
    array intact."""
    trainer = host.trainer()
    data = [[np.full((3, 5), tag, np.float32), np.array([i], np.int64)] for i in range(n)]
    name = f"honest{tag}-{time.monotonic_ns()}"
    t = threading.Thread(target=send_dataflow, args=(data, host.ingress), daemon=True,
                         kwargs={"epochs": 1, "producer_id": name, "link": FAST})
    t.start()
    try:
        wait_for(lambda: len(trainer.of(name)) >= n, timeout, what=f"{n} honest batches")
    finally:
        t.join(15)
        trainer.close()
    assert not t.is_alive()
    got = trainer.of(name)
    assert sorted(b["a"][1][2] for b in got) == list(range(n)), got
    assert all(b["a"][0][0] == [3, 5] and b["a"][0][2] == b["a"][0][3] == tag for b in got), got

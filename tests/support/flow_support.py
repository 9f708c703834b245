"""Helpers of the flow-control tests (issue 16): a metric reader, an RSS sampler, producer
processes with a ``fake`` source, hand-played peers and brokers, a consumer thread that counts.

Everything here is a real part: ``python -m feedline.broker`` and ``python -m feedline.producer``
processes,
ZeroMQ sockets on 127.0.0.1 or ipc://, psutil reading the broker's resident memory.

The protocol spoken by hand (the peers that misbehave, the fake brokers) is spelled in this
module only, in the section "hand-spoken protocol" below: when the wire protocol changes, that
section changes and the tests that use it do not.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import yaml
import zmq

from feedline.consumer import ConsumerOptions, RemoteDataZMQ
from feedline.errors import ReceiveTimeout, Stopped
from feedline.procs import Daemon, free_port, wait_for
from feedline.producer import Sender
from feedline.protocol import wire
from feedline.scrape import Scrape, scrape
from feedline.transport.link import LinkConfig
from tests.support.hand_protocol import K, broker_heartbeat, unpack

FAST = LinkConfig(heartbeat_interval=0.2, heartbeat_timeout=1.5)
MiB = 1 << 20
OVERHEAD = 48 * MiB  # what the issue allows above the formula: interpreter, libzmq, buffers
# tensorpack's send_dataflow_zmq in msgpack form, run in a child process only: importing
# tensorpack here would monkeypatch msgpack in the test process.
TP_ENV = {"TENSORPACK_SERIALIZE": "msgpack", "TF_CPP_MIN_LOG_LEVEL": "3"}


# ------------------------------------------------------------------- hand-spoken protocol

HELLO = -1  # either hello kind (FakeBroker.wait_for_kind)
WANT = K.WANT


































# ------------------------------------------------------------------- processes and metrics


class Metrics:
    """Reads a daemon's /metrics page."""

    def __init__(self, port: int) -> None:
        self.port = port

    def value(self, name: str, **labels: str) -> float:
        """The sum of the samples named ``name`` whose labels include ``labels`` (0 if none)."""
        got = scrape(self.port, timeout=5)
        assert got.error is None, got.error
        return got.total(name, **labels)

    def by_label(self, name: str, label: str) -> dict[str, float]:
        got = scrape(self.port, timeout=5)
        assert got.error is None, got.error
        return got.by_label(name, label)

    def snapshot(self) -> Scrape:
        """Every sample of one scrape (values read together are consistent)."""
        got = scrape(self.port, timeout=5)
        assert got.error is None, got.error
        return got

    def up(self) -> bool:
        return scrape(self.port, timeout=2).error is None


def start_broker(broker_proc: Any, *extra: str) -> tuple[Daemon, Metrics]:
    """A broker process (the ``broker_proc`` fixture: heartbeat 0.2 s, timeout 1.5 s) with its
    metrics on a free port; returns when both the ingress and the metrics answer."""
    port = free_port()
    d = broker_proc("--metrics-port", str(port), *extra)
    m = Metrics(port)
    wait_for(lambda: m.up() or not d.alive(), 20, what="broker metrics")
    assert d.alive(), d.log_text()
    return d, m


class RssSampler:
    """Samples a process's resident memory every ``interval`` s from a thread.

    ``base`` is the RSS when sampling starts (the idle broker); ``peak_growth`` the largest
    growth over it seen so far. ``exceeded`` is set as soon as the growth passes ``limit``, so
    a scenario that breaks the bound can stop at once instead of filling the machine.
    """

    def __init__(self, pid: int, limit: int | None = None, interval: float = 0.02) -> None:
        self.proc = psutil.Process(pid)
        self.limit, self.interval = limit, interval
        self.base = self.proc.memory_info().rss
        self.peak = self.base
        self.exceeded = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                rss = self.proc.memory_info().rss
            except psutil.Error:  # the process ended
                return
            self.peak = max(self.peak, rss)
            if self.limit is not None and self.peak - self.base > self.limit:
                self.exceeded.set()
            self._stop.wait(self.interval)

    @property
    def peak_growth(self) -> int:
        return self.peak - self.base

    def mib(self) -> float:
        return round(self.peak_growth / MiB, 1)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def __enter__(self) -> RssSampler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def fake_yaml(tmp_path: Path, name: str, shapes: list[list[int]], dtypes: list[str],
              size: int = 1000, epochs: int | None = None) -> Path:
    """A pipeline file with a constant ``fake`` source (no generation cost per batch)."""
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({
        "source": {"fake": {"shapes": shapes, "dtypes": dtypes, "random": False,
                            "size": size}},
        "epochs": epochs}))
    return path


def start_producer(daemons: Any, broker: str, config: Path, name: str, *extra: str) -> Daemon:
    """``python -m feedline.producer --config CONFIG --broker BROKER --id NAME`` with fast
    heartbeats."""
    return daemons("feedline.producer", "--config", config, "--broker", broker, "--id", name,
                   "--heartbeat-interval", "0.2", "--heartbeat-timeout", "1.5",
                   "--log-interval", "1", *extra, name=name)




class CountingConsumer:
    """A RemoteDataZMQ iterated by a thread, counting the batches it takes, per producer
    (and handing each to ``keep``, if given)."""

    def __init__(self, addr: str, window: int = 4, link: LinkConfig = FAST,
                 keep: Callable[[wire.Batch], None] | None = None) -> None:
        self.addr, self.window, self.link, self.keep = addr, window, link, keep
        self.counts: dict[str, int] = {}
        self.stats: dict[str, Any] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="counting-consumer", daemon=True)
        self._thread.start()

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def _run(self) -> None:
        with RemoteDataZMQ(self.addr, timeout=0.3, return_meta=True,
                           options=ConsumerOptions(window=self.window, link=self.link)) as src:
            it = iter(src)
            while not self._stop.is_set():
                try:
                    b = next(it)
                except ReceiveTimeout:
                    it = iter(src)
                    continue
                self.counts[b.producer] = self.counts.get(b.producer, 0) + 1
                if self.keep is not None:
                    self.keep(b)
            self.stats = src.stats()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(15)
        assert not self._thread.is_alive(), "consumer thread did not stop"


def run_script(code: str, log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """``python -c CODE`` (an attacker, a tensorpack producer), its output going to ``log``."""
    with open(log, "ab") as out:
        return subprocess.Popen([sys.executable, "-c", code], stdout=out,
                                stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})


def log_lines(text: str, level: str, *words: str) -> list[str]:
    """Lines of a daemon log at ``level`` that contain every one of ``words``."""
    return [ln for ln in text.splitlines() if f" {level} " in ln and all(w in ln for w in words)]


@contextlib.contextmanager
def sender_and_fake_broker(producer_id: str, datapoints: list[Any],
                           handed: list[int] | None = None
                           ) -> Iterator[tuple[FakeBroker, list[BaseException]]]:
    """A broker played by the test, and a real Sender in a thread sending ``datapoints`` to
    it (then flushing); on exit the Sender is stopped (its close gives up on what no credit
    covers) and the broker closed. What the Sender raises, other than being stopped, lands in
    the list for the test to assert (after the ``with``: the thread has ended by then).
    ``handed``: the index of each datapoint whose ``send`` returned is appended to it."""
    fake = FakeBroker()
    stop = threading.Event()
    failure: list[BaseException] = []

    def produce() -> None:
        try:
            with Sender(fake.addr, producer_id=producer_id, link=FAST) as s:
                try:
                    for i, dp in enumerate(datapoints):
                        s.send(dp, stop=stop)
                        if handed is not None:
                            handed.append(i)
                    s.flush(10)
                except Stopped:
                    s.stopped = True
        except BaseException as e:  # surfaces in the test thread
            failure.append(e)

    t = threading.Thread(target=produce, daemon=True)
    t.start()
    try:
        yield fake, failure
    finally:
        stop.set()
        t.join(10)
        fake.close()


class FakeBroker:
    """A ROUTER played by the test: it sees what a real Sender or RemoteDataZMQ sends and
    answers what the test says, as broker instance ``b`` of its choice."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.linger = 0
        self.addr = f"tcp://127.0.0.1:{free_port()}"
        self.sock.bind(self.addr)
        self.peer: bytes | None = None

    def recv(self, timeout: float) -> list[dict[str, Any]]:
        """Headers of the messages that arrive within ``timeout`` s (the peer is remembered)."""
        out = []
        end = time.monotonic() + timeout
        while self.sock.poll(max(0, int((end - time.monotonic()) * 1000))):
            ident, first, *_ = self.sock.recv_multipart()
            self.peer = ident
            out.append(unpack(first))
        return out

    def wait_for_kind(self, kind: int, timeout: float) -> dict[str, Any]:
        """The first message of ``kind`` (``HELLO``: either hello) that arrives."""
        kinds = (K.PRODUCER_HELLO, K.CONSUMER_HELLO) if kind == HELLO else (kind,)
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for h in self.recv(0.05):
                if h.get("k") in kinds:
                    return h
        raise TimeoutError(f"no message of kind {kind} within {timeout}s")

    def serve(self, instance: int, seconds: float) -> Iterator[tuple[dict[str, Any], int]]:
        """Each message that arrives, as (header, its bytes in all), heartbeating as broker
        ``instance`` while none does, for ``seconds`` (or until the caller stops)."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if not self.sock.poll(200):
                self.send(broker_heartbeat(instance))
                continue
            self.peer, first, *rest = self.sock.recv_multipart()
            yield unpack(first), len(first) + sum(len(f) for f in rest)

    def send(self, *frames: Any) -> None:
        assert self.peer is not None, "nobody has connected yet"
        self.sock.send_multipart([self.peer, *frames])

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


def queue_when_settled(it: Iterator[Any], registry: Any) -> list[float]:
    """Take one batch from ``it`` and no more: the consumer's local queue (batches), sampled
    every 0.1 s until ten samples in a row agree (what its window let in)."""
    next(it)
    samples: list[float] = []

    def settled() -> bool:
        samples.append(registry.get_sample_value("feedline_consumer_local_queue_batches") or 0)
        return len(samples) > 10 and len(set(samples[-10:])) == 1

    wait_for(settled, 20, interval=0.1, what="the queue to settle")
    return samples

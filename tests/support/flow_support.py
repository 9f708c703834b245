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
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import psutil
import yaml
import zmq

from feedline import messages as m
from feedline import wire
from feedline.consumer import RemoteDataZMQ
from feedline.errors import ReceiveTimeout, Stopped
from feedline.link import LinkConfig
from feedline.procs import Daemon, free_port, wait_for
from feedline.producer import Sender
from feedline.scrape import Scrape, scrape

FAST = LinkConfig(heartbeat_interval=0.2, heartbeat_timeout=1.5)
MiB = 1 << 20
OVERHEAD = 48 * MiB  # what the issue allows above the formula: interpreter, libzmq, buffers
# tensorpack's send_dataflow_zmq in msgpack form, run in a child process only: importing
# tensorpack here would monkeypatch msgpack in the test process.
TP_ENV = {"TENSORPACK_SERIALIZE": "msgpack", "TF_CPP_MIN_LOG_LEVEL": "3"}


# ------------------------------------------------------------------- hand-spoken protocol

VERSION = wire.PROTOCOL_VERSION
K = wire.Kind
HELLO = -1  # either hello kind (FakeBroker.wait_for_kind)
BATCH, CREDIT, HEARTBEAT, DELIVER, BYE = K.BATCH, K.GRANT, K.HEARTBEAT, K.DELIVER, K.BYE
WANT = K.WANT
RAW_BATCH_BYTES = MiB  # what hand-played producers declare (and ask for)


def pack(kind: int, **fields: Any) -> bytes:
    """One header frame: ``{"v": VERSION, "k": kind, **fields}`` (anything, valid or not)."""
    return msgpack.packb({"v": VERSION, "k": int(kind), **fields}, use_bin_type=True)


def unpack(frame: Any) -> dict[str, Any]:
    return dict(msgpack.unpackb(bytes(frame), raw=False, strict_map_key=False))


def producer_hello(pid: str, session: int, n: int = 0) -> bytes:
    """A producer's registration (``n``: the sequence number of its next batch)."""
    return m.encode(m.ProducerHello(producer=pid, session=session, next_seq=n,
                                    max_batch_bytes=RAW_BATCH_BYTES, registration=1))


def consumer_hello(cid: str, window: int, registration: int = 1) -> bytes:
    return m.encode(m.ConsumerHello(consumer=cid, session=1, window=window,
                                    max_bytes=1 << 40, registration=registration))


def batch_header(pid: str, session: int, seq: int, datapoint: Any,
                 arrays: list[tuple[str, list[int]]]) -> bytes:
    """A batch header as a producer sends it. ``datapoint`` is the structure (``ARRAY(i)`` for
    the i-th array frame), ``arrays`` the (dtype, shape) of each frame."""
    return pack(BATCH, p=pid, q=session, s=seq, e=0, c=0, d=datapoint,
                a=[[dt, list(shape)] for dt, shape in arrays])


def ARRAY(i: int) -> msgpack.ExtType:  # noqa: N802 (reads as a constructor in structures)
    return msgpack.ExtType(1, i.to_bytes(4, "big"))


def credit_of(h: dict[str, Any]) -> int | None:
    """The absolute credit a broker's GRANT grants, or None for another kind."""
    t = h.get("t")
    return t if h.get("k") == CREDIT and isinstance(t, int) else None


def welcome(instance: int, registration: int) -> bytes:
    return m.encode(m.Welcome(broker=instance, registration=registration))


def broker_credit(instance: int, total: int, registration: int) -> bytes:
    """A GRANT of ``total`` batches of up to 1 MiB each."""
    return m.encode(m.Grant(broker=instance, batches=total, nbytes=total * MiB,
                            registration=registration))


def broker_grant(instance: int, batches: int, nbytes: int, registration: int) -> bytes:
    """A GRANT of absolute totals: ``batches`` batches, ``nbytes`` bytes."""
    return m.encode(m.Grant(broker=instance, batches=batches, nbytes=nbytes,
                            registration=registration))


def want_of(header: dict[str, Any]) -> tuple[int, int]:
    """A WANT's (bytes sent so far, size of the next batch): it asks for bytes up to their
    sum."""
    return int(header["y"]), int(header["z"])


def broker_heartbeat(instance: int) -> bytes:
    return m.encode(m.Heartbeat(broker=instance))


def deliver_envelope(instance: int, gap: Any, registration: int = 1) -> bytes:
    return pack(DELIVER, b=instance, g=gap, r=registration)


def zmtp_dealer(addr: str) -> socket.socket:
    """A raw stream (tcp:// or ipc://) that completes a ZMTP 3.0 NULL handshake as a DEALER:
    what it sends next is written byte by byte, as libzmq would never send it."""
    if addr.startswith("tcp://"):
        host, port = addr[len("tcp://"):].rsplit(":", 1)
        s = socket.create_connection((host, int(port)), timeout=10)
    else:
        s = socket.socket(socket.AF_UNIX)
        s.settimeout(10)
        s.connect(addr[len("ipc://"):])
    s.sendall(b"\xff" + b"\0" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\0")
              + b"\x00" + b"\0" * 31)
    _recv_exact(s, 64)  # the broker's greeting
    ready = b"\x05READY" + b"\x0bSocket-Type" + (6).to_bytes(4, "big") + b"DEALER"
    s.sendall(bytes([0x04, len(ready)]) + ready)
    flags, size = _recv_exact(s, 2)
    assert flags == 0x04, "expected the broker's READY command"
    _recv_exact(s, size)
    return s


def _recv_exact(s: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        assert chunk, "connection closed during the handshake"
        buf += chunk
    return buf


def empty_frames(n: int) -> bytes:
    """ZMTP bytes of one message of ``n`` empty frames (2 bytes each on the wire)."""
    return b"\x01\x00" * (n - 1) + b"\x00\x00"


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


class RawPeer:
    """A DEALER that speaks the protocol by hand. Use it from one thread."""

    def __init__(self, ctx: zmq.Context, addr: str, rcvhwm: int = 1000) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.linger = 0
        self.sock.rcvhwm = rcvhwm
        self.sock.connect(addr)
        self.granted = 0  # the largest credit granted (absolute)
        self.registrations = 0
        self.sent = self.sent_bytes = 0  # batches sent (honest peers answer REVOKE with it)

    def hello_producer(self, pid: str, session: int, n: int = 0, ask: bool = True) -> None:
        """Register as a producer of RAW_BATCH_BYTES batches and (``ask``) ask for credit at
        once: a new registration holds none until it asks."""
        self.sock.send(producer_hello(pid, session, n))
        if ask:
            self.want(RAW_BATCH_BYTES)

    def hello_consumer(self, cid: str, window: int) -> None:
        """Register as a consumer; each call is a new registration (as a restarted iterator's
        would be), not a repeat of the last one."""
        self.registrations += 1
        self.sock.send(consumer_hello(cid, window, self.registrations))

    def heartbeat(self) -> None:
        self.sock.send(m.encode(m.Heartbeat()), zmq.NOBLOCK)

    def send(self, frames: list[Any]) -> None:
        self.sent += 1
        self.sent_bytes += sum(len(f) if isinstance(f, bytes) else f.nbytes for f in frames)
        self.sock.send_multipart(frames)

    def read(self, timeout_ms: int = 0) -> list[dict[str, Any]]:
        """Headers of what arrived (waiting up to ``timeout_ms`` for the first); tracks credit."""
        out = []
        while self.sock.poll(timeout_ms):
            timeout_ms = 0
            h = unpack(self.sock.recv_multipart()[0])
            t = credit_of(h)
            if t is not None:
                self.granted = max(self.granted, t)
            if h.get("k") == K.REVOKE:  # give unused credit back, as the protocol asks
                self.granted = self.sent
                self.sock.send(m.encode(m.Returned(sent=self.sent, sent_bytes=self.sent_bytes,
                                                   registration=h.get("r", 1))))
            out.append(h)
        return out

    def want(self, size: int) -> None:
        """Ask for credit for a batch of ``size`` bytes (what an honest producer does when it
        has a batch and no credit)."""
        self.sock.send(m.encode(m.Want(sent=self.sent, sent_bytes=self.sent_bytes, size=size,
                                       registration=1)))

    def wait_credit(self, above: int, seconds: float) -> bool:
        """Read (heartbeating) until the credit granted exceeds ``above``; False on timeout."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.read(100)
            if self.granted > above:
                return True
            self.heartbeat()
        return False

    def close(self) -> None:
        self.sock.close(linger=0)


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
        with RemoteDataZMQ(self.addr, window=self.window, timeout=0.3, return_meta=True,
                           link=self.link) as src:
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

"""Hostile peers against a real broker process: garbage, half messages, floods, known attacks.

Each test runs ``python -m feedline.broker`` (plain TCP on 127.0.0.1), attacks it through real
sockets
(ZeroMQ DEALER/PUSH, and a raw TCP socket speaking ZMTP 3.0 by hand where libzmq would not
let us misbehave), then proves that the broker is alive, counted each refused message under
its reason in ``feedline_broker_rejected_messages_total``, and still serves an honest producer
to an honest consumer, every batch intact.
"""

from __future__ import annotations

import itertools
import os
import pickle
import socket
import threading

import msgpack
import numpy as np
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from feedline import messages as m
from feedline import wire
from feedline.consumer import RemoteDataZMQ
from feedline.link import LinkConfig
from feedline.procs import free_port, wait_for
from feedline.producer import send_dataflow
from feedline.scrape import scrape

FAST = LinkConfig(heartbeat_interval=0.2, heartbeat_timeout=1.5)
ARRAY = msgpack.ExtType(1, b"\0\0\0\0")


# ------------------------------------------------------------------------------ helpers


class Scraper:
    def __init__(self, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}/metrics"

    def samples(self) -> dict[tuple, float]:
        got = scrape(self.url, timeout=5)
        if got.error:
            raise OSError(got.error)
        return got.samples

    def rejected(self) -> dict[str, int]:
        return {dict(labels)["reason"]: int(v) for (name, labels), v in self.samples().items()
                if name == "feedline_broker_rejected_messages_total"}

    def received(self) -> int:
        return int(sum(v for (name, _), v in self.samples().items()
                       if name == "feedline_broker_received_batches_total"))


@pytest.fixture
def broker(broker_proc):
    """Factory: a broker process with metrics on a free port; returns (daemon, scraper)."""

    def start(*extra: str):
        port = free_port()
        d = broker_proc("--metrics-port", str(port), *extra)
        scraper = Scraper(port)
        wait_for(lambda: _up(scraper), 20, what="broker metrics")
        return d, scraper

    return start


def _up(s: Scraper) -> bool:
    try:
        s.samples()
        return True
    except OSError:
        return False


def honest_round(endpoints, n: int = 8, tag: int = 5) -> list:
    """An honest producer sends n batches; an honest consumer must get exactly those."""
    data = [[np.full((3, 5), tag, np.float32), np.array([i], np.int64)] for i in range(n)]
    t = threading.Thread(target=send_dataflow, args=(data, endpoints.ingress), daemon=True,
                         kwargs={"epochs": 1, "producer_id": f"honest{tag}", "link": FAST})
    t.start()
    with RemoteDataZMQ(endpoints.egress, timeout=30, link=FAST) as src:
        got = list(itertools.islice(src, n))
    t.join(15)
    assert not t.is_alive()
    assert sorted(int(dp[1][0]) for dp in got) == list(range(n))
    assert all(dp[0].shape == (3, 5) and (dp[0] == tag).all() for dp in got)
    return got


class RawProducer:
    """A DEALER that speaks the protocol by hand, to send what no honest producer would."""

    def __init__(self, ctx: zmq.Context, addr: str) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.linger = 0
        self.sock.connect(addr)
        self.granted = self.sent = 0

    def _read(self, timeout_ms: int) -> int:
        """Read what arrived; returns the batches granted so far."""
        while self.sock.poll(timeout_ms):
            timeout_ms = 0
            msg = m.decode(self.sock.recv())
            if isinstance(msg, m.Grant):
                self.granted = max(self.granted, msg.batches)
        return self.granted

    def hello(self) -> int:
        """Register and wait for the first credit; returns the batches granted."""
        self.sock.send(m.encode(m.ProducerHello(producer="raw", session=99,
                                                max_batch_bytes=1 << 20, registration=1)))
        # A new registration holds no credit until it asks.
        self.sock.send(m.encode(m.Want(sent=0, sent_bytes=0, size=1 << 20, registration=1)))
        wait_for(lambda: self._read(100) > 0, 20, what="credit")
        return self.granted

    def send(self, frames: list) -> None:
        """Send within credit, as the broker requires even of a peer sending garbage (one
        without credit is cut off: test_flow_* covers that)."""
        wait_for(lambda: self._read(10) > self.sent, 20, what="credit")
        self.sent += 1
        self.sock.send_multipart(frames)

    def close(self) -> None:
        self.sock.close(linger=0)


def header(**over) -> dict:
    h = {"v": 2, "k": 2, "p": "raw", "q": 99, "s": 0, "e": 0, "c": 0, "d": [ARRAY],
         "a": [["<f4", [4]]]}
    h.update(over)
    return h


def zmtp_connect(port: int) -> socket.socket:
    """A raw TCP connection that completes a ZMTP 3.0 NULL handshake as a DEALER."""
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
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


def _frame(body: bytes, more: bool) -> bytes:
    assert len(body) < 256
    return bytes([0x01 if more else 0x00, len(body)]) + body


def _nest(x: object, depth: int) -> object:
    for _ in range(depth):
        x = [x]
    return x


class MakesFile:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


# ------------------------------------------------------------------------------ tests


def test_garbage_flood_is_counted_and_honest_peers_are_served(broker, endpoints):
    d, metrics = broker()
    ctx = zmq.Context()
    flood = ctx.socket(zmq.DEALER)
    flood.linger = 0
    flood.connect(endpoints.ingress)
    kinds = [
        os.urandom(64),  # bytes
        b"",  # an empty frame
        wire.packb([1, 2, 3]),  # msgpack, not a map
        wire.packb({"v": 99, "k": 2}),  # unknown version
        wire.packb({"v": 2, "k": 77}),  # unknown kind
        wire.packb(header()),  # a batch from a peer that never said hello
        b"\x91" * 5000 + b"\xc0",  # deep nesting
        b"\xdd\xff\xff\xff\xff",  # a list claiming 4 G entries
    ]
    n = 4000
    stop = threading.Event()

    def run_flood() -> None:
        for i in range(n):
            if stop.is_set():
                return
            flood.send(kinds[i % len(kinds)])

    t = threading.Thread(target=run_flood, daemon=True)
    t.start()
    try:
        honest_round(endpoints, n=20)  # while the flood goes on
    finally:
        t.join(60)
        stop.set()
    wait_for(lambda: sum(metrics.rejected().values()) >= n, 60, what="flood counted")
    rejected = metrics.rejected()
    assert sum(rejected.values()) == n, rejected
    assert {"bad_msgpack", "bad_header", "bad_version", "bad_kind", "unknown_peer"} <= set(
        rejected), rejected
    assert "internal_error" not in rejected
    assert d.alive()
    flood.close(linger=0)
    ctx.term()
    honest_round(endpoints, n=5, tag=6)  # and after it
    log = d.log_text()
    # Logged at a rate limit: 4000 rejects make a handful of lines, not thousands.
    assert 1 <= log.count("rejected a message") < 50, log[-2000:]


def test_half_multipart_and_truncated_frames_are_dropped(broker, endpoints):
    d, metrics = broker()
    h = wire.packb(header())
    s = zmtp_connect(endpoints.port)  # a header frame with MORE, then the connection ends
    s.sendall(_frame(h, more=True))
    s.close()
    s = zmtp_connect(endpoints.port)  # a frame that announces 200 bytes and sends 20
    s.sendall(bytes([0x00, 200]) + b"x" * 20)
    s.close()
    s = zmtp_connect(endpoints.port)  # a complete header, then half of the array frame
    s.sendall(_frame(h, more=True) + bytes([0x00, 16]) + b"\0" * 8)
    s.close()
    s = socket.create_connection(("127.0.0.1", endpoints.port), timeout=10)
    # Not ZMTP 3: libzmq may read it as unversioned ZMTP 1.0 framing and deliver garbage
    # messages, which the decoder must then refuse like any other.
    s.sendall(b"GET / HTTP/1.1\r\nHost: feedline\r\n\r\n" * 100)
    s.close()
    ctx = zmq.Context()
    raw = RawProducer(ctx, endpoints.ingress)
    try:
        assert raw.hello() >= 1
        raw.send([wire.packb(header(a=[["<f4", [4]], ["<f4", [4]]], d=[ARRAY, ARRAY])),
                  b"\0" * 16])  # a batch that lost a frame
        raw.send([wire.packb(header())])  # a batch with its header only
        wait_for(lambda: metrics.rejected().get("frame_count", 0) == 2, 20,
                 what="truncated batches rejected")
    finally:
        raw.close()
        ctx.term()
    honest_round(endpoints)
    assert d.alive()
    assert metrics.received() == 8  # only the honest batches got in
    rejected = metrics.rejected()
    assert rejected["frame_count"] == 2 and "internal_error" not in rejected, rejected


def test_oversized_message_disconnects_the_sender_only(broker, endpoints):
    d, metrics = broker("--max-message-bytes", "64KiB")
    ctx = zmq.Context()
    big = ctx.socket(zmq.DEALER)
    big.linger = 0
    mon = big.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
    try:
        big.connect(endpoints.ingress)
        assert recv_monitor_message(mon)["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED
        big.send_multipart([wire.packb(header(a=[["|u1", [1 << 20]]])), b"\0" * (1 << 20)])
        # libzmq's MAXMSGSIZE on the broker's socket: the connection is cut, nothing read
        assert recv_monitor_message(mon)["event"] == zmq.EVENT_DISCONNECTED
    finally:
        big.disable_monitor()
        mon.close(linger=0)
        big.close(linger=0)
        ctx.term()
    honest_round(endpoints)
    assert d.alive() and metrics.received() == 8


def test_main_ingress_known_attacks_are_rejected_by_reason(broker, endpoints, tmp_path):
    d, metrics = broker()
    attacks = {
        "bad_dtype": [wire.packb(header(a=[["|O", [2]]])), b"A" * 16],  # raw pointers
        "shape_mismatch": [wire.packb(header(a=[["<f4", [1000]]])), b"\0" * 16],  # lies
        "bad_shape": [wire.packb(header(a=[["<f4", [0, 1 << 30, 1 << 30]]])), b""],  # huge
        "too_many_dims": [wire.packb(header(a=[["<f4", [1] * 40]])), b"\0" * 4],
        "too_deep": [wire.packb(header(d=_nest(ARRAY, 20))), b"\0" * 16],
        "header_too_large": [wire.packb(header(x="y" * 70_000)), b"\0" * 16],
        "too_many_arrays": [wire.packb(header()), *[b""] * 2000],
        "bad_structure": [wire.packb(header(d=[msgpack.ExtType(1, b"\0\0\0\x09")])), b"\0" * 16],
    }
    ctx = zmq.Context()
    raw = RawProducer(ctx, endpoints.ingress)
    try:
        raw.hello()
        for frames in attacks.values():
            raw.send(frames)
        wait_for(lambda: sum(metrics.rejected().values()) >= len(attacks), 20,
                 what="attacks rejected")
    finally:
        raw.close()
        ctx.term()
    got = metrics.rejected()
    assert got == {reason: 1 for reason in attacks}, got
    honest_round(endpoints)
    assert d.alive() and metrics.received() == 8


def test_tensorpack_ingress_known_attacks(broker, endpoints, tmp_path):
    tp_addr = f"tcp://127.0.0.1:{free_port()}"
    d, metrics = broker("--tensorpack-ingress", tp_addr, "--max-message-bytes", "1MiB")
    marker = tmp_path / "pwned"

    def arr(type_: object, shape: object, data: bytes, kind: bytes = b"") -> dict:
        return {b"nd": True, b"type": type_, b"kind": kind, b"shape": shape, b"data": data}

    pickled = pickle.dumps(np.array([MakesFile(str(marker))], dtype=object))
    attacks = {
        "pickle": wire.packb([arr("|O", [1], pickled, b"O")]),
        "object_dtype": wire.packb([arr("|O", [2], b"A" * 16)]),
        "structured": wire.packb([arr("|V8", [2], b"A" * 16, b"V")]),
        "lying_shape": wire.packb([arr("<f4", [100], b"\0" * 16)]),
        "huge_empty": wire.packb([arr("<f4", [0, 2**62, 2**62], b"")]),  # crashed numpy
        "deep": b"\x91" * 5000 + b"\xc0",
        "claims": b"\xdc\xff\xff" * 20_000,
        "garbage": os.urandom(256),
    }
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.linger = 2000
    try:
        push.connect(tp_addr)
        for payload in attacks.values():
            push.send(payload)
        push.send(os.urandom(2 << 20))  # over MAXMSGSIZE: cut by libzmq, never read
    finally:
        push.close()
    push = ctx.socket(zmq.PUSH)  # a fresh, honest tensorpack producer
    push.linger = 2000
    try:
        push.connect(tp_addr)
        push.send(wire.packb([arr("<i4", [3], np.arange(3, dtype="<i4").tobytes())]))
        with RemoteDataZMQ(endpoints.egress, timeout=30, link=FAST) as src:
            dp = next(iter(src))
    finally:
        push.close()
        ctx.term()
    np.testing.assert_array_equal(dp[0], [0, 1, 2])
    wait_for(lambda: sum(metrics.rejected().values()) >= len(attacks), 20,
             what="attacks rejected")
    rejected = metrics.rejected()
    assert sum(rejected.values()) == len(attacks), rejected
    assert "internal_error" not in rejected and rejected.get("bad_dtype") == 3, rejected
    assert not marker.exists()
    assert d.alive() and metrics.received() == 1
    honest_round(endpoints)


def test_tensorpack_ingress_refuses_exposed_address_even_with_keys(tmp_path, endpoints):
    """tensorpack cannot speak CURVE, so its port stays local unless --insecure."""
    import subprocess
    import sys

    from feedline import security
    from tests.conftest import ROOT

    if not zmq.has("curve"):
        pytest.skip("libzmq without CURVE")
    _, sec = security.generate_keypair(tmp_path / "b", "broker")
    allowed = tmp_path / "allowed"
    security.generate_keypair(allowed, "producer")
    r = subprocess.run(
        [sys.executable, "-m", "feedline.commands", "broker", "--ingress", endpoints.ingress,
         "--egress", endpoints.egress, "--metrics-port", "0", "--curve-secret", str(sec),
         "--curve-allowed", str(allowed), "--tensorpack-ingress", "tcp://0.0.0.0:1"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode != 0 and "refusing to listen on tcp://0.0.0.0:1" in r.stderr


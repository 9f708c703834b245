"""Hostile peers against a real host process: garbage, half messages, floods, known attacks.

Each test runs against both hosts of the serving core (the ``host`` fixture: a ``python -m
feedline.broker`` process, and a direct-mode trainer process, ``RemoteDataZMQ(bind=True)``;
plain TCP on 127.0.0.1), attacks it through real sockets (ZeroMQ DEALER/PUSH, and a raw TCP
socket speaking ZMTP 3.0 by hand where libzmq would not let us misbehave), then proves that
the host is alive, counted each refused message under its reason in
``feedline_broker_rejected_messages_total``, and still serves an honest producer to its
training side, every batch intact.
"""

from __future__ import annotations

import os
import pickle
import socket
import threading

import msgpack
import numpy as np
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from feedline.procs import free_port, wait_for
from feedline.protocol import messages as m
from feedline.protocol import wire
from tests.support.hand_protocol import zmtp_dealer
from tests.support.hosts import KINDS, Host, honest_round

ARRAY = msgpack.ExtType(1, b"\0\0\0\0")


# ------------------------------------------------------------------------------ helpers


def rejected(host: Host) -> dict[str, int]:
    return {k: int(v) for k, v in host.metrics.by_label(
        "feedline_broker_rejected_messages_total", "reason").items()}


def received(host: Host) -> int:
    return int(host.metrics.value("feedline_broker_received_batches_total"))


class RawProducer:
    """A DEALER that speaks the protocol by hand, to send what no honest producer would."""

    def __init__(self, ctx: zmq.Context, addr: str) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.linger = 0
        self.sock.connect(addr)
        self.granted = self.sent = self.sent_bytes = 0

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
        without credit is cut off: test_flow_* covers that). Out of credit, it asks (WANT)
        as an honest producer does: after a refused batch the broker grants only when asked."""
        if self._read(0) <= self.sent:
            self.sock.send(m.encode(m.Want(sent=self.sent, sent_bytes=self.sent_bytes,
                                           size=1 << 20, registration=1)))
        wait_for(lambda: self._read(10) > self.sent, 20, what="credit")
        self.sent += 1
        self.sent_bytes += sum(len(f) for f in frames)
        self.sock.send_multipart(frames)

    def close(self) -> None:
        self.sock.close(linger=0)


def header(**over) -> dict:
    h = {"v": 2, "k": 2, "p": "raw", "q": 99, "s": 0, "e": 0, "c": 0, "d": [ARRAY],
         "a": [["<f4", [4]]]}
    h.update(over)
    return h


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


def test_garbage_flood_is_counted_and_honest_peers_are_served(host):
    d = host()
    ctx = zmq.Context()
    flood = ctx.socket(zmq.DEALER)
    flood.linger = 0
    flood.connect(d.ingress)
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
        honest_round(d, n=20)  # while the flood goes on
    finally:
        t.join(60)
        stop.set()
    wait_for(lambda: sum(rejected(d).values()) >= n, 60, what="flood counted")
    got = rejected(d)
    assert sum(got.values()) == n, got
    assert {"bad_msgpack", "bad_header", "bad_version", "bad_kind", "unknown_peer"} <= set(
        got), got
    assert "internal_error" not in got
    assert d.alive()
    flood.close(linger=0)
    ctx.term()
    honest_round(d, n=5, tag=6)  # and after it
    log = d.log_text()
    # Logged at a rate limit: 4000 rejects make a handful of lines, not thousands.
    assert 1 <= log.count("rejected a message") < 50, log[-2000:]


def test_half_multipart_and_truncated_frames_are_dropped(host):
    d = host()
    h = wire.packb(header())
    # a header frame with MORE, then the connection ends
    s = zmtp_dealer(f"tcp://127.0.0.1:{d.port}")
    s.sendall(_frame(h, more=True))
    s.close()
    s = zmtp_dealer(f"tcp://127.0.0.1:{d.port}")  # a frame that announces 200 bytes and sends 20
    s.sendall(bytes([0x00, 200]) + b"x" * 20)
    s.close()
    s = zmtp_dealer(f"tcp://127.0.0.1:{d.port}")  # a complete header, then half of the array frame
    s.sendall(_frame(h, more=True) + bytes([0x00, 16]) + b"\0" * 8)
    s.close()
    s = socket.create_connection(("127.0.0.1", d.port), timeout=10)
    # Not ZMTP 3: libzmq may read it as unversioned ZMTP 1.0 framing and deliver garbage
    # messages, which the decoder must then refuse like any other.
    s.sendall(b"GET / HTTP/1.1\r\nHost: feedline\r\n\r\n" * 100)
    s.close()
    ctx = zmq.Context()
    raw = RawProducer(ctx, d.ingress)
    try:
        assert raw.hello() >= 1
        raw.send([wire.packb(header(a=[["<f4", [4]], ["<f4", [4]]], d=[ARRAY, ARRAY])),
                  b"\0" * 16])  # a batch that lost a frame
        raw.send([wire.packb(header())])  # a batch with its header only
        wait_for(lambda: rejected(d).get("frame_count", 0) == 2, 20,
                 what="truncated batches rejected")
    finally:
        raw.close()
        ctx.term()
    honest_round(d)
    assert d.alive()
    assert received(d) == 8  # only the honest batches got in
    got = rejected(d)
    assert got["frame_count"] == 2 and "internal_error" not in got, got


def test_oversized_message_disconnects_the_sender_only(host):
    d = host("--max-message-bytes", "64KiB")
    ctx = zmq.Context()
    big = ctx.socket(zmq.DEALER)
    big.linger = 0
    mon = big.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
    try:
        big.connect(d.ingress)
        assert recv_monitor_message(mon)["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED
        big.send_multipart([wire.packb(header(a=[["|u1", [1 << 20]]])), b"\0" * (1 << 20)])
        # libzmq's MAXMSGSIZE on the broker's socket: the connection is cut, nothing read
        assert recv_monitor_message(mon)["event"] == zmq.EVENT_DISCONNECTED
    finally:
        big.disable_monitor()
        mon.close(linger=0)
        big.close(linger=0)
        ctx.term()
    honest_round(d)
    assert d.alive() and received(d) == 8


def test_main_ingress_known_attacks_are_rejected_by_reason(host):
    d = host()
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
    raw = RawProducer(ctx, d.ingress)
    try:
        raw.hello()
        for frames in attacks.values():
            raw.send(frames)
        wait_for(lambda: sum(rejected(d).values()) >= len(attacks), 20,
                 what="attacks rejected")
    finally:
        raw.close()
        ctx.term()
    got = rejected(d)
    assert got == {reason: 1 for reason in attacks}, got
    honest_round(d)
    assert d.alive() and received(d) == 8


def test_tensorpack_ingress_known_attacks(host, tmp_path):
    tp_addr = f"tcp://127.0.0.1:{free_port()}"
    d = host("--tensorpack-ingress", tp_addr, "--max-message-bytes", "1MiB")
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
    trainer = d.trainer()
    push = ctx.socket(zmq.PUSH)  # a fresh, honest tensorpack producer
    push.linger = 2000
    try:
        push.connect(tp_addr)
        push.send(wire.packb([arr("<i4", [3], np.arange(3, dtype="<i4").tobytes())]))
        wait_for(lambda: trainer.counts.get("tensorpack", 0) >= 1, 30,
                 what="the honest datapoint")
    finally:
        push.close()
        ctx.term()
        trainer.close()
    assert trainer.of("tensorpack")[0]["a"] == [[[3], "<i4", 0, 2]], trainer.batches()
    wait_for(lambda: sum(rejected(d).values()) >= len(attacks), 20,
             what="attacks rejected")
    got = rejected(d)
    assert sum(got.values()) == len(attacks), got
    assert "internal_error" not in got and got.get("bad_dtype") == 3, got
    assert not marker.exists()
    assert d.alive() and received(d) == 1
    honest_round(d)


@pytest.mark.parametrize("kind", KINDS)
def test_tensorpack_ingress_refuses_exposed_address_even_with_keys(kind, tmp_path, endpoints):
    """tensorpack cannot speak CURVE, so its port stays local unless --insecure (broker) /
    insecure=True (direct mode): the same rule, the same code, the same error
    (feedline.serving.server.check_exposure).

    Before (direct mode, issue 22 finding 21): ``DirectConfig(tensorpack="tcp://0.0.0.0:...")``
    with server keys was accepted: tensorpack's plain port open to the network."""
    import subprocess
    import sys

    from feedline import security
    from tests.support import ROOT

    if not zmq.has("curve"):
        pytest.skip("libzmq without CURVE")
    _, sec = security.generate_keypair(tmp_path / "b", "broker")
    allowed = tmp_path / "allowed"
    security.generate_keypair(allowed, "producer")
    exposed = f"tcp://0.0.0.0:{free_port()}"
    if kind == "broker":
        r = subprocess.run(
            [sys.executable, "-m", "feedline.commands", "broker", "--ingress",
             endpoints.ingress, "--egress", endpoints.egress, "--metrics-port", "0",
             "--curve-secret", str(sec), "--curve-allowed", str(allowed),
             "--tensorpack-ingress", exposed],
            cwd=ROOT, capture_output=True, text=True, timeout=60,
            env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert r.returncode != 0, r.stderr
        error = r.stderr.strip().splitlines()[-1]
    else:
        from feedline.consumer import ConsumerOptions, RemoteDataZMQ
        from feedline.consumer.direct import DirectConfig

        keys = security.ServerKeys.load(sec, allowed)
        with pytest.raises(ValueError) as err:
            RemoteDataZMQ(endpoints.ingress, bind=True, curve=keys,
                          options=ConsumerOptions(direct=DirectConfig(tensorpack=exposed)))
        error = str(err.value)
    assert f"refusing to listen on {exposed} without CURVE keys" in error, error
    assert "tensorpack" in error and "\n" not in error, error

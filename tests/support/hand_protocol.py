"""The protocol played by hand: frames built field by field (valid or not), a DEALER that
speaks it message by message (:class:`RawPeer`), and a raw ZMTP stream that writes bytes as
libzmq never would (:func:`zmtp_dealer`). The hostile-peer tests, the flow tests and
benchmarks/hostile.py build their messages here."""

from __future__ import annotations

import socket
import time
from typing import Any

import msgpack
import zmq

from feedline.protocol import messages as m
from feedline.protocol import wire

MiB = 1 << 20
VERSION = wire.PROTOCOL_VERSION
K = wire.Kind
BATCH, CREDIT, HEARTBEAT, DELIVER, BYE = K.BATCH, K.GRANT, K.HEARTBEAT, K.DELIVER, K.BYE
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

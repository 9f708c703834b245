"""Receiving one ZeroMQ message frame by frame, its frame count and its size checked as it goes.

``recv_multipart`` builds a Python object for every frame before anyone can look at the
count: one message of 4 M empty frames (8 MiB on the wire) cost a broker 1 GiB and half a
minute. :func:`recv_message` keeps at most ``max_frames`` frames and ``max_bytes`` bytes of a
message: the frames are weighed as they are read, and once a message passes either bound what
was kept of it is let go, the rest is read without being kept, and the message is refused
(:class:`Oversized`: ``too_many_arrays`` or ``message_too_large``). So a message of 40 frames
of 15 MiB against a 16 MiB budget is held by this process one frame at a time, not whole.

What no application can bound: libzmq delivers a multipart message only once all of it has
arrived, so it holds the whole message first (64 bytes per frame in its pipe, plus the
frames' data). ``ZMQ_MAXMSGSIZE`` bounds a frame, not a message (libzmq 4.3.5 checks each
frame's size as it decodes it, nothing else); what one connection can make libzmq hold is one
message of any number of frames, per message its receive high-water mark lets in. That is
what the hosts bound with a receive high-water mark of one message per producer connection,
and by cutting off the sender of an oversized message (:mod:`feedline.serving.endpoint`); the
rest is why every exposed port needs CURVE keys.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import zmq

from feedline.protocol.codec import DecodeError

_CHECK_EVERY = 4096  # frames between clock checks while draining an oversized message
_KEEPALIVE_SECONDS = 0.1  # ... and the keepalive calls, at most this far apart


class Oversized(DecodeError):
    """A message had more frames or more bytes than allowed; it was read to its end and
    dropped, nothing of it kept.

    ``first`` is its first frame's bytes (a ROUTER's peer identity; empty if longer than 256
    bytes), ``fd`` the connection it came on (``zmq.SRCFD``, -1 if unknown), ``frames`` and
    ``nbytes`` what it had in all, ``seconds`` how long reading it took.
    """

    def __init__(self, reason: str, first: bytes, fd: int, frames: int, nbytes: int,
                 seconds: float) -> None:
        what = (f"{frames} frames" if reason == TOO_MANY_FRAMES
                else f"{nbytes} bytes in {frames} frames")
        super().__init__(reason, f"a message of {what}")
        self.what = what
        self.first, self.fd, self.frames, self.nbytes = first, fd, frames, nbytes
        self.seconds = seconds


TOO_MANY_FRAMES = "too_many_arrays"
TOO_LARGE = "message_too_large"


# Plain ints: pyzmq's constants are enums, and ``sock.get(zmq.EVENTS) & zmq.POLLIN`` built
# an enum member for the option and another for the result (2.7 of its 4.1 us, every batch).
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)


def waiting(sock: zmq.Socket) -> bool:
    """A message is waiting on ``sock``: ask this before reading again in a drain loop, as a
    read of nothing raises ``zmq.Again``, which costs more than asking (per batch, it shows)."""
    return (int(sock.get(_EVENTS)) & _POLLIN) != 0


_MORE_NOBLOCK, _NOBLOCK = int(zmq.SNDMORE) | int(zmq.NOBLOCK), int(zmq.NOBLOCK)


def send_frames(sock: zmq.Socket, frames: list, copy: bool = False) -> None:
    """``sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=copy)``, less pyzmq's enum
    arithmetic (``SNDMORE | flags`` built a flag member for every frame: 6 us of a 3-frame
    message). Sends the same frames with the same flags, in the same order, and raises what
    it raises (``zmq.Again`` for a full pipe, another ``ZMQError`` for the rest)."""
    send = sock.send
    for f in frames[:-1]:
        send(f, _MORE_NOBLOCK, copy=copy)
    send(frames[-1], _NOBLOCK, copy=copy)


def recv_message(sock: zmq.Socket, max_frames: int, flags: int = zmq.NOBLOCK,
                 keepalive: Callable[[], None] | None = None,
                 max_bytes: int | None = None,
                 oversized: Callable[[str, int], None] | None = None) -> list[zmq.Frame]:
    """One whole message as zero-copy frames, at most ``max_frames`` of them and (if given)
    ``max_bytes`` bytes in all.

    Raises ``zmq.Again`` if none is waiting (with ``zmq.NOBLOCK``), :class:`Oversized` for a
    message with more frames or bytes (read to its end: the socket is ready for the next
    one). ``oversized(reason, fd)`` is called as soon as a message is found too large or too
    long, before the rest of it is read (``fd``: its connection, ``zmq.SRCFD``, -1 if
    unknown): a caller that cuts the sender off there stops what it sends next while this one
    is drained. ``keepalive`` is called now and then while such a message is drained, so that
    the caller can keep its peers' links alive meanwhile.
    """
    first = sock.recv(flags, copy=False)
    frames = [first]
    more = first.more
    if max_bytes is None:
        while more and len(frames) < max_frames:
            f = sock.recv(copy=False)
            frames.append(f)
            more = f.more
        if not more:
            return frames
        reason, size = TOO_MANY_FRAMES, 0
    else:
        size = len(first)
        while more and len(frames) < max_frames and size <= max_bytes:
            f = sock.recv(copy=False)
            frames.append(f)
            size += len(f)
            more = f.more
        if not more and size <= max_bytes:
            return frames
        reason = TOO_LARGE if size > max_bytes else TOO_MANY_FRAMES
    t0 = last = time.monotonic()
    n = len(frames)
    ident = first.bytes if len(first) <= 256 else b""
    try:
        fd = int(first.get(zmq.SRCFD))
    except zmq.ZMQError:  # not every transport has one
        fd = -1
    frames.clear()  # keep nothing of it
    del first
    if oversized is not None:
        oversized(reason, fd)
    while more:
        f = sock.recv(copy=False)
        more = f.more
        size += len(f)
        n += 1
        if keepalive is not None and n % _CHECK_EVERY == 0:
            now = time.monotonic()
            if now - last >= _KEEPALIVE_SECONDS:
                keepalive()
                last = now
    raise Oversized(reason, ident, fd, n, size, time.monotonic() - t0)

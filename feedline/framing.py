"""Receiving one ZeroMQ message frame by frame, with its frame count checked as it goes.

``recv_multipart`` builds a Python object for every frame before anyone can look at the
count: one message of 4 M empty frames (8 MiB on the wire) cost a broker 1 GiB and half a
minute. :func:`recv_message` keeps at most ``max_frames`` frames; the rest of an oversized
message is read and dropped without being kept, and the message is refused as
``too_many_frames``.

What no application can bound: libzmq delivers a multipart message only once all of it has
arrived, so it holds the whole message first (64 bytes per frame in its pipe, plus the
frames' data). ``ZMQ_MAXMSGSIZE`` bounds a frame, not the number of frames; the frame count
is bounded only by what a peer can send, which is why every exposed port needs CURVE keys.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import zmq

from feedline.codec import DecodeError

_CHECK_EVERY = 4096  # frames between clock checks while draining an oversized message
_KEEPALIVE_SECONDS = 0.1  # ... and the keepalive calls, at most this far apart


class TooManyFrames(DecodeError):
    """A message had more frames than allowed; it was read to its end and dropped.

    ``first`` is its first frame (a ROUTER's peer identity), ``frames`` how many it had.
    """

    def __init__(self, first: Any, frames: int, seconds: float) -> None:
        super().__init__("too_many_arrays", f"a message of {frames} frames")
        self.first, self.frames, self.seconds = first, frames, seconds


def waiting(sock: zmq.Socket) -> bool:
    """A message is waiting on ``sock``: ask this before reading again in a drain loop, as a
    read of nothing raises ``zmq.Again``, which costs more than asking (per batch, it shows)."""
    return bool(int(sock.get(zmq.EVENTS)) & zmq.POLLIN)


def recv_message(sock: zmq.Socket, max_frames: int, flags: int = zmq.NOBLOCK,
                 keepalive: Callable[[], None] | None = None) -> list[zmq.Frame]:
    """One whole message as zero-copy frames, at most ``max_frames`` of them.

    Raises ``zmq.Again`` if none is waiting (with ``zmq.NOBLOCK``), :class:`TooManyFrames`
    for a message with more frames (read to its end: the socket is ready for the next one).
    ``keepalive`` is called now and then while such a message is drained, so that the caller
    can keep its peers' links alive meanwhile.
    """
    first = sock.recv(flags, copy=False)
    frames = [first]
    more = first.more
    while more and len(frames) < max_frames:
        f = sock.recv(copy=False)
        frames.append(f)
        more = f.more
    if not more:
        return frames
    t0 = last = time.monotonic()
    n = len(frames)
    ident = first.bytes if len(first) <= 256 else b""
    frames.clear()  # keep nothing of it
    while more:
        more = sock.recv(copy=False).more
        n += 1
        if keepalive is not None and n % _CHECK_EVERY == 0:
            now = time.monotonic()
            if now - last >= _KEEPALIVE_SECONDS:
                keepalive()
                last = now
    raise TooManyFrames(ident, n, time.monotonic() - t0)

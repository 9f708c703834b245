"""Leaving a broker without losing what was sent to it: BYE, then the broker's answer.

A TCP connection closed with received data still unread is reset, not closed, and the reset
throws away what the kernel had not yet sent: a leaving producer's last batches and its BYE,
whenever a GRANT arrived just before the close (the broker then counted the producer gone by
timeout and the batches lost: 1 run in ~10 of tests/consumer/test_data_path.py's three fast
producers). So a producer says BYE and reads until the broker's answer, BYE too: the last
message the broker sends on the connection, after everything it had to say before our BYE.
Once it is read, nothing is left unread, and all we sent has arrived. A broker that does not
answer (gone, or of a version that does not) holds the producer up :data:`BYE_SECONDS` at
most.

Two ways to leave: :func:`await_byes` when the producer closes (it blocks: nothing else is
left to do), and :class:`Leaving` for a broker left while the producer goes on serving the
others (a target that its DNS name no longer lists): the loop checks for the answer on every
turn and closes each link once answered, or at its deadline.
"""

from __future__ import annotations

import logging
import time

import zmq

from feedline.protocol import messages as m
from feedline.protocol.codec import DecodeError
from feedline.protocol.framing import recv_message, waiting
from feedline.transport.link import Link

BYE_SECONDS = 1.0  # how long a producer waits for a broker to answer its BYE, at most

log = logging.getLogger(__name__)


def read_bye(link: Link) -> bool:
    """Read what waits on ``link`` without blocking, dropping it unhandled (we are leaving);
    True once the broker's BYE was among it, or the link has no socket."""
    sock = link.socket
    if sock is None:
        return True
    limits = link.cfg.limits
    while waiting(sock):
        try:
            frames = recv_message(sock, limits.max_frames)
            msg = m.decode(frames[0], limits)
        except zmq.Again:
            return False
        except DecodeError:
            continue
        if isinstance(msg, m.Bye):
            return True
    return False


def await_byes(links: list[Link], seconds: float) -> int:
    """Wait, at most ``seconds``, for each of ``links`` (BYE sent) to read its broker's answer;
    returns how many did not."""
    pending = {link.socket: link for link in links if link.socket is not None}
    poller = zmq.Poller()
    for sock in pending:
        poller.register(sock, zmq.POLLIN)
    deadline = time.monotonic() + seconds
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        for sock, _ in poller.poll(max(1, int(left * 1000))):
            if read_bye(pending[sock]):
                poller.unregister(sock)
                del pending[sock]
    return len(pending)


class Leaving:
    """Links to brokers this producer leaves while it goes on serving the others."""

    def __init__(self, what: str) -> None:
        self.what = what  # the producer, for the log
        self._links: list[tuple[Link, float]] = []  # (link, deadline)

    def __len__(self) -> int:
        return len(self._links)

    def add(self, link: Link, seconds: float, now: float) -> None:
        """Say BYE on ``link``; it is closed once answered, or ``seconds`` from ``now``."""
        link.send_msg(m.Bye())
        self._links.append((link, now + seconds))

    def tick(self, now: float) -> None:
        """Close the links whose broker answered, and those past their deadline."""
        keep = []
        for link, deadline in self._links:
            if read_bye(link):
                log.info("%s: left %s (it answered BYE: all we sent there arrived)", self.what,
                         link.addr)
                link.close()
            elif now >= deadline:
                log.info("%s: left %s without its answer to BYE", self.what, link.addr)
                link.close()
            else:
                keep.append((link, deadline))
        self._links = keep

    def close(self, seconds: float, staying: list[Link]) -> int:
        """The producer closes: wait (``seconds`` at most) for the answers still due and for
        those of ``staying`` (its other links, BYE sent; the loop closes them), then close
        the links left. Returns how many brokers did not answer."""
        left = await_byes([link for link, _ in self._links] + staying, seconds)
        for link, _ in self._links:
            link.close()
        self._links = []
        return left

"""A host's link to the job's coordinator (``--coordinator``): one DEALER socket, the views it
receives handed to the exact streams' coordinators, the messages they make sent.

The messages and what each side does with them are :mod:`feedline.exact.job` and
:mod:`feedline.exact.scope`; this module only moves frames. Sending never blocks the host's
loop: a message that finds the socket's queue full is dropped and the stream joins the job
again (a Join says everything the dropped messages said). A frame that is not a job frame is
counted (``feedline_job_frames_refused_total``) and dropped.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import zmq

from feedline.errors import DecodeError
from feedline.exact import (
    JOB_FRAME_MAX,
    ExactStreams,
    JobRefused,
    View,
    decode_job_frame,
    encode_job_frame,
)
from feedline.logs import RateLimitedLog

log = logging.getLogger(__name__)
DRAIN = 256  # frames taken per loop turn, at most
HWM = 4096  # frames queued towards the coordinator, at most


class JobLink:
    """Connects to ``address``; ``epoch_end(stream, epoch)`` tells a stream's consumers that
    the job ended an epoch; ``held(stream)`` gives the exact keys of the stream buffered or in
    flight on this host."""

    def __init__(self, ctx: zmq.Context, address: str, streams: ExactStreams,
                 epoch_end: Callable[[str, int], None],
                 held: Callable[[str], set[tuple[int, int, int]]],
                 refused: Callable[[str], None] = lambda reason: None) -> None:
        self.address, self.streams = address, streams
        self.epoch_end, self.held, self.count_refused = epoch_end, held, refused
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, HWM)
        self.sock.setsockopt(zmq.RCVHWM, HWM)
        self.sock.setsockopt(zmq.MAXMSGSIZE, JOB_FRAME_MAX)
        self.sock.connect(address)
        self.sent = self.received = self.bad = 0
        self._log = RateLimitedLog(log, interval=30.0)

    def on_ready(self, now: float) -> None:
        """Take what arrived (up to :data:`DRAIN` frames), then send what that made."""
        for _ in range(DRAIN):
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                break
            self.received += 1
            try:
                if len(frames) != 1:
                    raise DecodeError("bad_job_frame", f"{len(frames)} frames")
                stream, msg = decode_job_frame(frames[0])
            except DecodeError as e:
                self.bad += 1
                self.count_refused(e.reason)
                self._log.log(logging.WARNING, "the job's coordinator at %s sent a frame that "
                              "is not one: %s", self.address, e)
                continue
            c = self.streams.get(stream)
            if c is None or c.job is None:
                continue  # a stream this host no longer serves
            if isinstance(msg, JobRefused):
                self.streams.job_refused(c, msg, now)
            elif isinstance(msg, View):
                if msg.host != c.job.member.host:
                    continue
                for epoch in self.streams.job_view(c, msg, now):
                    self.epoch_end(stream, epoch)
        self.flush()

    def tick(self, now: float) -> None:
        """Once a tick: every job stream's rules (joins, asks, beats, units given back)."""
        for stream, c in list(self.streams.streams.items()):
            if c.job is not None:
                c.job_tick(now, self.held(stream))
                self.streams.job_tick(c, now)
                c.job.tick(now, c.job.readers(c.readers))
        self.flush()

    def flush(self) -> None:
        for stream, c in self.streams.streams.items():
            job = c.job
            if job is None or not job.outbox:
                continue
            for msg in job.drain():
                try:
                    self.sock.send(encode_job_frame(stream, msg), zmq.NOBLOCK)
                    self.sent += 1
                except zmq.Again:  # the coordinator does not take them: say it all again
                    job.joined = False
                    break

    def close(self) -> None:
        """No Leave: a stopped host keeps the units open at it (its trainers may have taken
        some of their batches); they come back when it does, or when the job resumes."""
        self.sock.close(0)

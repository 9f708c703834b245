"""``feedline coordinator``'s core: the job's coordinator of every exact stream that several
training hosts serve, on one ROUTER socket.

Each stream's state is a :class:`~feedline.exact.job.JobCoordinator` (pure logic), made by
the first host that joins it and restored from its journal in the state directory
(``STREAM.job.jsonl``) after a restart. A message is handled, the journal committed (fsync'd),
and only then the views sent: a view never promises what a restart would forget. A frame that
is not a job frame, or a message of the wrong direction, is counted by reason
(``feedline_job_frames_refused_total``) and dropped; a message the job refuses is answered
with the refusal's line, which the host logs.

Bounded: at most ``max_streams`` streams and, per stream, the job's ``max_hosts`` hosts (the
routes to them with it); at most :data:`DRAIN` frames a loop turn.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import zmq
from prometheus_client import CollectorRegistry, Counter, Gauge

from feedline.errors import DecodeError
from feedline.exact import (
    JOB_FRAME_MAX,
    JobCoordinator,
    JobJoin,
    JobRefused,
    View,
    decode_job_frame,
    encode_job_frame,
    encode_job_refusal,
)
from feedline.liveness import HEARTBEAT_TIMEOUT
from feedline.logs import RateLimitedLog

log = logging.getLogger(__name__)
DRAIN = 1024
MAX_STREAMS = 64
HWM = 16384


class JobMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.messages = Counter("feedline_job_messages", "Job messages taken from hosts",
                                ["stream"], registry=registry)
        self.refused = Counter("feedline_job_frames_refused",
                               "Frames dropped: not job frames, or of the wrong direction",
                               ["reason"], registry=registry)
        self.refusals = Counter("feedline_job_refusals", "Host messages the job refused",
                                ["stream", "reason"], registry=registry)
        self.hosts = Gauge("feedline_job_hosts", "Hosts serving the stream's job (joined)",
                           ["stream"], registry=registry)
        self.silent = Gauge("feedline_job_hosts_silent",
                            "Hosts not heard from for the heartbeat timeout (they keep their "
                            "open units)", ["stream"], registry=registry)
        self.epoch = Gauge("feedline_job_epoch", "The job's epoch", ["stream"],
                           registry=registry)
        self.units = Gauge("feedline_job_units", "Units of the epoch by state",
                           ["stream", "state"], registry=registry)
        self.launch = Gauge("feedline_job_launch", "Launches (resumes from a checkpoint)",
                            ["stream"], registry=registry)


class JobServer:
    """Bind ``address``; run with :meth:`run` (blocks until ``stop`` is set)."""

    def __init__(self, ctx: zmq.Context, address: str, state_dir: Path,
                 registry: CollectorRegistry | None = None,
                 timeout: float = HEARTBEAT_TIMEOUT, max_streams: int = MAX_STREAMS) -> None:
        self.state_dir, self.timeout, self.max_streams = state_dir, timeout, max_streams
        self.metrics = JobMetrics(registry if registry is not None else CollectorRegistry())
        self.jobs: dict[str, JobCoordinator] = {}
        self.routes: dict[tuple[str, str], bytes] = {}  # (stream, host) -> ROUTER identity
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, JOB_FRAME_MAX)
        self.sock.setsockopt(zmq.RCVHWM, HWM)
        self.sock.setsockopt(zmq.SNDHWM, HWM)
        try:
            self.sock.bind(address)
        except zmq.ZMQError:
            self.sock.close(0)
            raise
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._log = RateLimitedLog(log, interval=30.0)

    # -- one frame --------------------------------------------------------------------------
    def handle(self, frames: list[bytes], now: float) -> None:
        if len(frames) != 2:
            self._bad("bad_job_frame", f"{len(frames) - 1} frames")
            return
        ident, frame = frames
        try:
            stream, msg = decode_job_frame(frame)
        except DecodeError as e:
            self._bad(e.reason, str(e))
            return
        if isinstance(msg, (View, JobRefused)):
            self._bad("bad_job_direction", f"a {type(msg).__name__} sent to the coordinator")
            return
        try:
            job = self.jobs.get(stream) or self._open(stream, msg, now)
            self.routes[(stream, msg.host)] = ident
            views = job.handle(msg, now)
            job.commit()  # durable before any view says it
        except JobRefused as r:
            self.metrics.refusals.labels(stream, r.reason).inc()
            self._log.log(logging.WARNING, "stream %s: host %r refused: %s", stream,
                          getattr(msg, "host", "?"), r.text)
            self._send(ident, encode_job_refusal(stream, r))
            return
        self.metrics.messages.labels(stream).inc()
        for v in views:
            to = self.routes.get((stream, v.host))
            if to is not None:
                self._send(to, encode_job_frame(stream, v))

    def _open(self, stream: str, msg: object, now: float) -> JobCoordinator:
        if not isinstance(msg, JobJoin):
            raise JobRefused("not_registered", f"the coordinator does not serve stream "
                             f"{stream!r} (it restarted?): join again")
        if len(self.jobs) >= self.max_streams:
            raise JobRefused("too_many_streams", f"the coordinator serves {self.max_streams} "
                             "streams already: start another for this job")
        job = JobCoordinator.open(self.state_dir, stream, msg.plan, self.timeout, now)
        log.info("stream %s: job %x %s (%s)", stream, job.job,
                 "restored from its journal" if job.restored else "begun", msg.plan.describe())
        self.jobs[stream] = job
        return job

    def _send(self, ident: bytes, frame: bytes) -> None:
        try:
            self.sock.send_multipart([ident, frame], zmq.NOBLOCK)
        except zmq.ZMQError:  # full, or gone: the host asks again (its messages are numbered)
            pass

    def _bad(self, reason: str, detail: str) -> None:
        self.metrics.refused.labels(reason).inc()
        self._log.log(logging.WARNING, "dropped a frame that is not a job message (%s): %s",
                      reason, detail)

    # -- the loop ---------------------------------------------------------------------------
    def gauges(self, now: float) -> None:
        m = self.metrics
        for stream, job in self.jobs.items():
            m.hosts.labels(stream).set(len(job.hosts))
            m.silent.labels(stream).set(len(job.silent(now)))
            m.epoch.labels(stream).set(job.epoch)
            m.launch.labels(stream).set(job.launch)
            for state, n in job.counts().items():
                m.units.labels(stream, state).set(n)
        # Routes stay only while the job knows their host.
        known = {(s, h) for s, j in self.jobs.items() for h in j.hosts}
        for key in [k for k in self.routes if k not in known]:
            del self.routes[key]

    def run(self, stop: threading.Event, tick: float = 1.0) -> None:
        log.info("coordinator up on %s, state in %s", self.endpoint, self.state_dir)
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        next_tick = time.monotonic()
        try:
            while not stop.is_set():
                if poller.poll(int(tick * 1000 / 4)):
                    now = time.monotonic()
                    for _ in range(DRAIN):
                        try:
                            frames = self.sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self.handle(frames, now)
                now = time.monotonic()
                if now >= next_tick:
                    self.gauges(now)
                    next_tick = now + tick
        finally:
            self.close()

    def close(self) -> None:
        for job in self.jobs.values():
            job.commit()
        self.sock.close(0)

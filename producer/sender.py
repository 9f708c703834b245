"""Sending datapoints to a broker under its credit (the producer half of the data path).

A :class:`Sender` holds one :class:`~feedline.link.BrokerLink`. It sends a batch only when the
broker has granted credit for it, so a slow trainer makes producers wait (that wait is
``feedline_producer_credit_wait_seconds``) instead of filling anybody's memory. Arrays are
sent zero-copy: the caller must not modify an array after handing it to :meth:`Sender.send`.
"""

from __future__ import annotations

import logging
import os
import random
import socket
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import zmq
from prometheus_client import CollectorRegistry

from feedline import wire
from feedline.errors import Stopped
from feedline.link import BrokerLink, LinkConfig
from feedline.logs import RateLimitedLog
from producer.metrics import ProducerMetrics

log = logging.getLogger(__name__)


def default_producer_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


@dataclass
class SendStats:
    """What a :func:`send_dataflow` call did."""

    batches: int = 0
    bytes: int = 0
    epochs: int = 0
    seconds: float = 0.0
    credit_wait_seconds: float = 0.0

    @property
    def batches_per_second(self) -> float:
        return self.batches / self.seconds if self.seconds > 0 else 0.0

    @property
    def bytes_per_second(self) -> float:
        return self.bytes / self.seconds if self.seconds > 0 else 0.0


class Sender:
    """A producer's connection to the broker. Create and use it in one thread."""

    def __init__(
        self,
        addr: str,
        *,
        producer_id: str | None = None,
        link: LinkConfig | None = None,
        ctx: zmq.Context | None = None,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.producer_id = producer_id or default_producer_id()
        if not 0 < len(self.producer_id) <= wire.DEFAULT_LIMITS.max_id_len:
            raise ValueError("producer_id must be 1..256 characters")
        self.session = random.getrandbits(62)
        self.seq = 0
        self.metrics = ProducerMetrics(registry if registry is not None else CollectorRegistry())
        self.credit_wait_seconds = 0.0
        self._reject_log = RateLimitedLog(log)
        self._granted = 0  # absolute credit of this registration ("t" of the last CREDIT)
        self._sent = 0  # batches sent in this registration
        self._own_ctx = ctx is None
        self.ctx = ctx or zmq.Context()
        self.link = BrokerLink(
            self.ctx,
            addr,
            hello=lambda: {"r": "producer", "p": self.producer_id, "q": self.session,
                           "n": self.seq},
            config=link or LinkConfig(),
            on_register=self._on_register,
        )

    def _on_register(self) -> None:
        self._granted = self._sent = 0
        self.metrics.registrations.inc()

    @property
    def credit(self) -> int:
        return self._granted - self._sent

    # -------------------------------------------------------------------------- pump
    def pump(self, timeout_ms: int = 0) -> None:
        """Handle what the broker sent (credit, heartbeats, resets); do liveness work."""
        sock = self.link.socket
        if sock is None:
            time.sleep(timeout_ms / 1000)
        elif sock.poll(timeout_ms, zmq.POLLIN):
            for _ in range(1000):
                try:
                    frame = sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                try:
                    header = wire.decode_header(frame)
                except wire.DecodeError as e:
                    self.metrics.rejected.labels(e.reason).inc()
                    self._reject_log.warning("rejected a message from the broker: %s", e)
                    continue
                if self.link.handle(header):
                    continue
                if header["k"] == wire.Kind.CREDIT:
                    t = header.get("t")
                    if isinstance(t, int) and not isinstance(t, bool):
                        self._granted = max(self._granted, t)
        self.link.tick()

    def _wait_for_credit(self, stop: threading.Event | None) -> None:
        if self.credit > 0:
            return
        t0 = time.monotonic()
        while self.credit <= 0:
            if stop is not None and stop.is_set():
                raise Stopped("stopped while waiting for credit")
            self.pump(self.link.poll_timeout_ms())
        waited = time.monotonic() - t0
        self.credit_wait_seconds += waited
        self.metrics.credit_wait.observe(waited)

    # -------------------------------------------------------------------------- send
    def send(self, datapoint: Any, epoch: int = 0, stop: threading.Event | None = None) -> int:
        """Send one datapoint when credit allows; returns its array bytes.

        Blocks while the broker grants no credit or is unreachable (reconnecting with
        backoff). Raises :class:`Stopped` if ``stop`` is set meanwhile.
        """
        while True:
            self._wait_for_credit(stop)
            frames = wire.encode_batch(
                datapoint, producer=self.producer_id, session=self.session, seq=self.seq,
                epoch=epoch,
            )
            if self.link.send_frames(frames, copy=False):
                break
            # Not connected (IMMEDIATE) or pipe full: keep the batch, let the link recover.
            self.pump(self.link.poll_timeout_ms())
        nbytes = sum(a.nbytes for a in frames[1:])
        self.seq += 1
        self._sent += 1
        self.metrics.sent_batches.inc()
        self.metrics.sent_bytes.inc(nbytes)
        self.pump(0)
        return nbytes

    def end(self, epochs: int) -> None:
        """Tell consumers this producer's dataflow ended (EOS)."""
        self._control_retry(wire.Kind.EOS, p=self.producer_id, s=self.seq, e=epochs)

    def error(self, exc: BaseException) -> None:
        """Send a pipeline failure with its traceback to the consumers."""
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        self._control_retry(
            wire.Kind.ERROR, p=self.producer_id, m=f"{type(exc).__name__}: {exc}"[:4096],
            tb=tb[-16384:],
        )

    def _control_retry(self, kind: wire.Kind, seconds: float = 2.0, **fields: Any) -> None:
        deadline = time.monotonic() + seconds
        while not self.link.send_control(kind, **fields):
            if time.monotonic() > deadline:
                log.warning("could not tell the broker %s (not connected)", kind.name)
                return
            self.pump(50)

    def close(self) -> None:
        """Say BYE (frees our credit at the broker at once) and close the socket, giving what
        is still queued (last batches, EOS, BYE) up to ``flush_ms`` to leave."""
        if self.link.socket is not None:
            self.link.send_control(wire.Kind.BYE)
        self.link.close(flush=True)
        if self._own_ctx:
            self.ctx.term()

    def __enter__(self) -> Sender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def send_dataflow(
    df: Iterable[Any],
    addr: str,
    *,
    epochs: int | None = None,
    producer_id: str | None = None,
    link: LinkConfig | None = None,
    stop: threading.Event | None = None,
    registry: CollectorRegistry | None = None,
    log_interval: float = 10.0,
    skipped: Callable[[], int] | None = None,
) -> SendStats:
    """Send every datapoint of ``df`` to the broker at ``addr``, ``epochs`` times.

    ``epochs=None`` sends forever (the training default, as tensorpack's
    ``send_dataflow_zmq``). Calls ``df.reset_state()`` first if it has one. Logs a rate line
    every ``log_interval`` seconds (with ``skipped()``, the datapoints the pipeline skipped so
    far, when given). A pipeline exception is sent to the consumers (with its
    traceback) and re-raised. Returns when done, or when ``stop`` is set.
    """
    reset = getattr(df, "reset_state", None)
    if reset is not None:
        reset()
    stats = SendStats()
    with Sender(addr, producer_id=producer_id, link=link, registry=registry) as sender:
        t0 = last_log = time.monotonic()
        last_batches, last_bytes = 0, 0
        try:
            epoch = 0
            while epochs is None or epoch < epochs:
                before = stats.batches
                ready = time.monotonic()  # when we started waiting for the pipeline
                for dp in df:
                    sender.metrics.pipeline_seconds.inc(time.monotonic() - ready)
                    stats.bytes += sender.send(dp, epoch=epoch, stop=stop)
                    stats.batches += 1
                    now = ready = time.monotonic()
                    if now - last_log >= log_interval:
                        dt = now - last_log
                        log.info(
                            "%s: %d batches, %.1f batches/s, %.1f MB/s%s",
                            sender.producer_id, stats.batches,
                            (stats.batches - last_batches) / dt,
                            (stats.bytes - last_bytes) / dt / 1e6,
                            "" if skipped is None else f", {skipped()} skipped",
                        )
                        last_log, last_batches, last_bytes = now, stats.batches, stats.bytes
                    if stop is not None and stop.is_set():
                        raise Stopped
                if stats.batches == before:
                    raise ValueError("the dataflow yielded nothing in a whole epoch")
                epoch += 1
                stats.epochs = epoch
            sender.end(epoch)
        except Stopped:
            pass
        except Exception as e:
            sender.error(e)
            raise
        finally:
            stats.seconds = time.monotonic() - t0
            stats.credit_wait_seconds = sender.credit_wait_seconds
    return stats

"""RemoteDataZMQ: the training process's iterator over batches served by a broker.

An I/O thread (:class:`feedline.transport.client.ClientLoop`) owns the connection to the broker: it
registers with a *window* (how many batches this process may hold undelivered to the model)
and a byte budget, keeps the link alive while the model is busy (a long evaluation does not get
us dropped), decodes what arrives and hands it to the iterating thread through a bounded
queue. Each batch the iterator takes returns one credit to the broker, so at most ``window``
batches (and ``max_bytes`` bytes) are ever buffered here.

Arrays are ``np.frombuffer`` views on the received frames: no copy is made between the socket
and the caller. They are read-only, and may be unaligned for their dtype (NumPy copes;
``a.copy()`` aligns and makes a writeable copy).

Threads: iterate from one thread at a time; :meth:`RemoteDataZMQ.close` is safe from any
thread (it ends a running iteration: the iterator stops as if exhausted). A RemoteDataZMQ
dropped without ``close()`` releases its thread, sockets and registration when it is
garbage-collected.
"""

from __future__ import annotations

import os
import queue
import random
import socket
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import zmq
from prometheus_client import CollectorRegistry

from feedline import endpoints
from feedline.consumer.direct import DirectConfig, DirectIO
from feedline.consumer.io import ConsumerIO, Delivery, EpochMark, Marker, ProducerStats, Shared
from feedline.errors import ConfigError, FeedlineError, ReceiveTimeout
from feedline.exact import Cursor
from feedline.protocol.messages import DEFAULT_STREAM, check_stream
from feedline.security import ClientKeys, ServerKeys
from feedline.serving.budget import DEPTH
from feedline.serving.metrics import BrokerMetrics
from feedline.serving.server import DIRECT, check_exposure
from feedline.transport.client import ClientLoop, Waker
from feedline.transport.link import LinkConfig

__all__ = ["ConsumerConfig", "ProducerStats", "RemoteDataZMQ"]

_CLOSED = object()
WINDOW = 4  # batches a consumer may hold ahead of its model, by default
MAX_BYTES = 1 << 30  # bytes it may hold, by default


@dataclass(frozen=True)
class ConsumerConfig:
    """What a consumer registers with."""

    window: int = WINDOW
    max_bytes: int = MAX_BYTES
    stream: str = DEFAULT_STREAM


class RemoteDataZMQ:
    """An iterable of batches from the broker at ``addr`` (``ipc://`` or ``tcp://``).

    Yields each batch in the structure its producer sent (list, tuple or dict), or a
    :class:`feedline.protocol.wire.Batch` with its metadata when ``return_meta=True``. Several
    processes on one broker share the stream; each batch goes to exactly one of them.

    ``window``: batches this process may hold ahead of the model; ``max_bytes``: bytes it
    may hold (the broker delivers while both allow, and at least one batch at a time).
    Batches under 8 MiB are counted by their bytes: up to 128 x ``window`` of them
    (:func:`feedline.serving.budget.depth`; docs/tensorflow.md, "Small batches"), except an
    exact stream's (one each: its ranks split each epoch).
    ``timeout``: seconds to wait for a batch before raising :class:`ReceiveTimeout`
    (``None``: wait forever). ``on_error``: ``"raise"`` a producer's failure here as
    :class:`ProducerError`, or ``"log"`` it and go on. ``curve``: this process's keys when
    the broker has CURVE keys (it then requires them on ``ipc://`` too), e.g.
    ``feedline.security.ClientKeys.load("trainer.key_secret", "broker.key")``.
    ``stream``: the named stream to receive (producers declare theirs).

    ``bind=True`` (direct mode, as tensorpack's RemoteDataZMQ binds): this process serves its
    producers itself at ``addr``, no broker, one network hop (:mod:`feedline.consumer.direct`);
    ``curve`` is then this trainer's :class:`~feedline.security.ServerKeys`, required on a
    non-loopback address unless ``insecure=True``; ``direct`` tunes the producers' window,
    the credit lease and a tensorpack ingress.

    Iteration ends with :class:`ReceiveTimeout`, :class:`ProducerError`, a
    :class:`FeedlineError` if the I/O thread failed, or ``StopIteration`` once
    :meth:`close` was called (from any thread).
    """

    def __init__(
        self,
        addr: str,
        *,
        window: int = WINDOW,
        max_bytes: int | None = None,
        timeout: float | None = None,
        consumer_id: str | None = None,
        return_meta: bool = False,
        on_error: str = "raise",
        link: LinkConfig | None = None,
        registry: CollectorRegistry | None = None,
        curve: ClientKeys | ServerKeys | None = None,
        stream: str = DEFAULT_STREAM,
        bind: bool = False,
        direct: DirectConfig | None = None,
        insecure: bool = False,
        resume: Cursor | dict | bytes | None = None,
    ) -> None:
        link = link or LinkConfig()
        if not 0 < window <= link.limits.max_window:
            raise ConfigError(f"window must be in 1..{link.limits.max_window}")
        if on_error not in ("raise", "log"):
            raise ConfigError("on_error must be 'raise' or 'log'")
        if max_bytes is not None and max_bytes < 1:
            raise ConfigError("max_bytes must be >= 1")
        self.addr, self.window, self.timeout = addr, window, timeout
        self.config = ConsumerConfig(window, max_bytes or ConsumerConfig.max_bytes, stream)
        self.consumer_id = consumer_id or f"{socket.gethostname()}-{os.getpid()}"
        self.return_meta, self.on_error = return_meta, on_error
        self.link_config, self.curve, self.bind = link, curve, bind
        self.direct, self.insecure = direct or DirectConfig(), insecure
        check_stream(stream, link.limits)
        if bind:
            if curve is not None and not isinstance(curve, ServerKeys):
                raise TypeError("bind=True serves producers: curve= takes this trainer's "
                                "ServerKeys (its key pair and the allowed producer keys)")
            # The broker's rules, by the same code: keys for an exposed address, tensorpack's
            # loopback-only, one bind per address (checked again when the I/O thread binds).
            check_exposure([addr], self.direct.tensorpack, curve is not None, insecure, DIRECT)
            endpoints.check_bind(addr, DIRECT.ingress)
            if self.direct.tensorpack is not None:
                endpoints.check_bind(self.direct.tensorpack, DIRECT.tensorpack)
        else:
            if curve is not None and not isinstance(curve, ClientKeys):
                raise TypeError("curve= takes this process's ClientKeys (or ServerKeys with "
                                "bind)")
            # Here, one line (AddressError, a ValueError), as the CLI says it: libzmq's
            # answer to "127.0.0.1:7879" was a ZMQError from the I/O thread, deep in a
            # traceback. The name is not resolved: libzmq resolves it on each attempt.
            endpoints.check_connect(addr, "RemoteDataZMQ: address", resolve=False)
        self._shared = Shared(self.consumer_id, random.getrandbits(62), self.config.window,
                              self.config.max_bytes, stream, on_error,
                              registry if registry is not None else CollectorRegistry(),
                              slots=DEPTH * window)
        self.metrics = self._shared.setup.metrics
        self.metrics.set_stream(stream)
        if resume is not None:
            self._shared.exact.resume_from(_as_cursor(resume))
        # Direct mode serves producers as a broker does, with the broker's metrics.
        self.serving_metrics = BrokerMetrics(self._shared.setup.registry) if bind else None
        self._io: ClientLoop | None = None
        self._lock = threading.Lock()
        # Dropped without close(): stop the I/O thread (signal only; it ends by itself).
        self._finalizer = weakref.finalize(self, _stop_loop, self._shared)

    # --------------------------------------------------------------------- public API
    def reset_state(self) -> None:
        """DataFlow contract; the connection is made lazily by the first ``__iter__``."""

    def stats(self) -> dict[str, ProducerStats]:
        """Per producer id: batches received, bytes, batches lost, finished."""
        return self._shared.stats_copy()

    def __iter__(self) -> Iterator[Any]:
        yield from self._deliveries(self._start(), epoch=None)

    def epoch(self) -> Iterator[Any]:
        """Exact delivery: the batches of one epoch, then stop. The epoch is the one of the
        first batch this yields (after ``resume=``, the cursor's, until a batch came); it ends
        when the broker says every batch of it was taken (with several consumers on the
        stream, the union of what they take is the epoch, exactly once). For a validation
        loop: ``for images, labels in remote.epoch(): ...``.
        """
        shared = self._start()
        with shared.lock:
            resumed = shared.exact.resume
        yield from self._deliveries(shared, epoch=-1 if resumed is None else resumed.epoch)

    def state(self) -> Cursor:
        """Exact delivery: what this process has taken of the current epoch (a cursor to
        checkpoint with the model and pass back as ``resume=``; ``.to_dict()`` for plain
        frameworks, :func:`feedline.consumer.checkpoint.trackable` for ``tf.train.Checkpoint``)."""
        s = self._shared
        with s.lock:
            return s.exact.cursor.copy()

    def _deliveries(self, shared: Shared, epoch: int | None) -> Iterator[Any]:
        """Yield batches; ``epoch`` None: forever; -1: the epoch of the first batch, until
        its end."""
        while True:
            item = self._get(shared)
            if item is _CLOSED:
                return
            if isinstance(item, Marker):
                raise item.exc
            if isinstance(item, EpochMark):
                if epoch is not None and epoch >= 0 and item.epoch >= epoch:
                    return
                continue
            assert isinstance(item, Delivery)
            b = item.batch
            if not shared.took(item):
                continue  # see Shared.took
            if epoch == -1 and b.unit >= 0:
                epoch = b.epoch
            yield b if self.return_meta else b.datapoint

    def close(self) -> None:
        """Stop the I/O thread (it tells the broker we leave and closes its sockets, bounded
        time). Safe from any thread; a running iteration then ends."""
        with self._lock:
            io, self._io = self._io, None
        shared, was = self._shared, self._shared.closed
        shared.closed = True
        if not was:
            shared.queue.put_and_wake(_CLOSED)  # ends a waiting iteration now
        if io is not None:
            io.stop(timeout=self.link_config.heartbeat_interval * 2
                    + self.link_config.flush_ms / 1000 + 5)

    def __enter__(self) -> RemoteDataZMQ:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------------- internals
    def _start(self) -> Shared:
        with self._lock:
            if self._io is not None and self._io.alive():
                return self._shared
            shared = self._shared.fresh()  # a new run after close(): new queue and thread
            self._shared = shared
            self._finalizer.detach()
            self._finalizer = weakref.finalize(self, _stop_loop, shared)
            waker = Waker()
            shared.waker = waker
            addr, cfg, curve = self.addr, self.link_config, self.curve
            if self.bind:
                keys = curve if isinstance(curve, ServerKeys) else None
                direct, metrics, insecure = self.direct, self.serving_metrics, self.insecure
                assert metrics is not None

                def make(ctx: zmq.Context) -> Any:
                    return DirectIO(ctx, addr, cfg, keys, shared, direct, metrics, insecure)
            else:
                client = curve if isinstance(curve, ClientKeys) else None

                def make(ctx: zmq.Context) -> Any:
                    return ConsumerIO(ctx, addr, cfg, client, shared)
            io = ClientLoop("feedline-consumer-io", make, waker, after_turn=shared.queue.flush)
            shared.loop = io
            self._io = io
        io.start()
        return shared

    def _get(self, shared: Shared) -> Any:
        if shared.closed:
            return _CLOSED
        try:  # a batch is waiting: no clock, no sleep
            item = shared.queue.get_nowait()
            self.metrics.wait.observe(0.0)
            return item
        except queue.Empty:
            pass
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        t0 = time.monotonic()
        while True:
            if shared.closed:
                return _CLOSED
            wait = 0.5 if deadline is None else min(0.5, deadline - time.monotonic())
            try:
                item = shared.queue.get(timeout=max(wait, 0.0))
                waited = time.monotonic() - t0
                self.metrics.wait.observe(waited)
                shared.model.waited += waited  # reported with TAKEN: the broker's demand estimate
                return item
            except queue.Empty:
                pass
            loop = shared.loop
            if loop is None or not loop.alive():
                if shared.closed:
                    return _CLOSED
                cause = loop.error if loop is not None else None
                raise FeedlineError(f"consumer I/O thread is not running: {cause!r}") from cause
            if deadline is not None and time.monotonic() >= deadline:
                raise ReceiveTimeout(self._timeout_text(shared))

    def _timeout_text(self, shared: Shared) -> str:
        """What a consumer that got no batch in time is told: what its link knows."""
        refusal = shared.io.refusal
        if refusal is not None:
            return (f"the broker at {self.addr} refused this consumer: {refusal.reason}"
                    f"{': ' + refusal.detail if refusal.detail else ''}")
        reach, explain = shared.io.reach, shared.io.explain
        waited = f"no batch within {self.timeout:.1f}s"
        if reach is not None and explain is not None:
            if reach.welcomed_at is None:
                return f"{waited}: never connected to a broker: {explain()}"
            silent = time.monotonic() - reach.heard_at
            if silent > self.link_config.heartbeat_timeout:
                # The link knew: the producers are not the story (they may be fine).
                return (f"{waited}: the broker at {self.addr} has been silent for "
                        f"{silent:.0f}s (it stopped, restarted, or the network between us is "
                        f"down): {explain()}")
        producers = sorted(shared.stats_copy())
        return (f"no batch from the broker at {self.addr} within {self.timeout:.1f}s "
                f"(stream {shared.setup.stream!r}; producers seen so far: {producers or 'none'}). "
                "Are producers connected to its ingress, with this stream?")


def _as_cursor(resume: Cursor | dict | bytes) -> Cursor:
    if isinstance(resume, Cursor):
        return resume.copy()
    if isinstance(resume, (bytes, bytearray)):
        return Cursor.decode(bytes(resume))
    return Cursor.from_dict(resume)


def _stop_loop(shared: Shared) -> None:
    """Finalizer of a dropped RemoteDataZMQ: signal its loop to stop, never wait (it may run
    in any thread, the loop's own included, in the middle of a garbage collection)."""
    shared.closed = True
    loop = shared.loop
    if loop is not None:
        loop.stop(timeout=None)


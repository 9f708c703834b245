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
import warnings
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import zmq
from prometheus_client import CollectorRegistry

from feedline import endpoints
from feedline.consumer.direct import DirectConfig, DirectIO
from feedline.consumer.io import ConsumerIO, Delivery, EpochMark, Marker, ProducerStats, Shared
from feedline.errors import ConfigError, FeedlineError, ReceiveTimeout
from feedline.exact import Cursor, Ledger, Lineage, check_ledger_path
from feedline.protocol.messages import DEFAULT_STREAM, check_stream
from feedline.security import ClientKeys, ServerKeys
from feedline.serving.budget import DEPTH
from feedline.serving.metrics import BrokerMetrics
from feedline.serving.server import DIRECT, check_exposure
from feedline.transport.client import ClientLoop, Waker
from feedline.transport.link import LinkConfig

__all__ = ["ConsumerConfig", "ConsumerOptions", "ProducerStats", "RemoteDataZMQ"]

_CLOSED = object()
WINDOW = 4  # batches a consumer may hold ahead of its model, by default
MAX_BYTES = 1 << 30  # bytes it may hold, by default


@dataclass(frozen=True)
class ConsumerConfig:
    """What a consumer registers with."""

    window: int = WINDOW
    max_bytes: int = MAX_BYTES
    stream: str = DEFAULT_STREAM


@dataclass(frozen=True)
class ConsumerOptions:
    """The settings of a :class:`RemoteDataZMQ` that most programs leave as they are:
    ``RemoteDataZMQ(addr, timeout=60, options=ConsumerOptions(window=8))``.

    ``window``: batches this process may hold ahead of the model (1 to
    ``link.limits.max_window``); ``max_bytes``: bytes it may hold (the broker delivers while
    both allow, and at least one batch at a time). ``consumer_id``: the name the broker's log
    and metrics give this process (None: ``HOST-PID``, taken when the RemoteDataZMQ is made).
    ``on_error``: ``"raise"`` a producer's failure in the iterating thread as
    :class:`~feedline.errors.ProducerError`, or ``"log"`` it and go on. ``link``: liveness
    and limits of the link (:class:`~feedline.transport.link.LinkConfig`). ``registry``: the
    Prometheus registry the consumer's metrics go in (None: a registry of its own, so two
    consumers in one process do not collide). ``direct`` and ``insecure`` apply with
    ``bind=True`` only: ``direct`` tunes how the trainer serves its producers
    (:class:`~feedline.consumer.direct.DirectConfig`), ``insecure=True`` lets it bind a
    non-loopback address without CURVE keys. ``ledger``: a file to append one JSON line to
    per batch the model takes, its lineage (:mod:`feedline.exact.lineage`: buffered, flushed
    at each epoch's end and at close; ``feedline replay`` and ``feedline diff`` read it).

    One value serves any number of RemoteDataZMQs (it is frozen; a shared ``registry`` is
    shared by them). A setting that can never work is a one-line
    :class:`~feedline.errors.ConfigError` here, when the options are made.
    """

    window: int = WINDOW
    max_bytes: int = MAX_BYTES
    consumer_id: str | None = None
    on_error: str = "raise"
    link: LinkConfig = field(default_factory=LinkConfig)
    registry: CollectorRegistry | None = None
    direct: DirectConfig = field(default_factory=DirectConfig)
    insecure: bool = False
    ledger: str | Path | None = None

    def __post_init__(self) -> None:
        for name, kind, what in (("window", int, "a count of batches"),
                                 ("max_bytes", int, "a count of bytes"),
                                 ("insecure", bool, "True or False"),
                                 ("link", LinkConfig, "a LinkConfig"),
                                 ("direct", DirectConfig, "a DirectConfig")):
            v = getattr(self, name)
            if not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
                raise ConfigError(f"ConsumerOptions: {name} must be {what}, not "
                                  f"{type(v).__name__} {v!r}")
        if self.consumer_id is not None and not isinstance(self.consumer_id, str):
            raise ConfigError(f"ConsumerOptions: consumer_id must be a string, not "
                              f"{type(self.consumer_id).__name__}")
        if self.registry is not None and not isinstance(self.registry, CollectorRegistry):
            raise ConfigError("ConsumerOptions: registry must be a prometheus_client "
                              f"CollectorRegistry, not {type(self.registry).__name__}")
        if not 0 < self.window <= self.link.limits.max_window:
            raise ConfigError(f"window must be in 1..{self.link.limits.max_window}")
        if self.on_error not in ("raise", "log"):
            raise ConfigError("on_error must be 'raise' or 'log'")
        if self.max_bytes < 1:
            raise ConfigError("max_bytes must be >= 1")
        if self.ledger is not None and not isinstance(self.ledger, (str, Path)):
            raise ConfigError("ledger must be a path (str or Path) or None")
        if self.ledger is not None:
            check_ledger_path(self.ledger)  # now, not at the first batch in the I/O thread


# The keywords RemoteDataZMQ took before ConsumerOptions held them, accepted with a warning
# until the next release (docs/tensorflow.md, "RemoteDataZMQ's keywords and ConsumerOptions").
MOVED = tuple(f.name for f in fields(ConsumerOptions) if f.name != "ledger")
_NONE_IS_DEFAULT = ("window", "max_bytes", "link", "direct")  # as keywords, None: default


def moved_options(who: str, options: ConsumerOptions | None, moved: dict[str, Any],
                  stacklevel: int = 3) -> ConsumerOptions:
    """``options`` (None: the defaults), or the ConsumerOptions that ``who``'s keywords of an
    earlier release spell (``window=8``), with one DeprecationWarning that gives the new
    spelling. A keyword that is no option, or one given with ``options=`` too, is a one-line
    TypeError. ``stacklevel``: the caller of ``who``, for the warning's line."""
    unknown = [k for k in moved if k not in MOVED]
    if unknown:
        raise TypeError(f"{who}() got an unexpected keyword argument {unknown[0]!r}")
    if options is not None and not isinstance(options, ConsumerOptions):
        raise TypeError(f"{who}: options= takes a ConsumerOptions, not "
                        f"{type(options).__name__}")
    if not moved:
        return options if options is not None else ConsumerOptions()
    spelled = ", ".join(f"{k}=..." for k in moved)
    if options is not None:
        raise TypeError(f"{who}: {spelled} cannot go with options=; set it there: "
                        f"options=ConsumerOptions({spelled})")
    warnings.warn(f"{who}({spelled}) is deprecated (it goes in the next release): write "
                  f"{who}(addr, options=ConsumerOptions({spelled}))", DeprecationWarning,
                  stacklevel=stacklevel)
    given = {k: v for k, v in moved.items() if not (v is None and k in _NONE_IS_DEFAULT)}
    return ConsumerOptions(**given)


class RemoteDataZMQ:
    """An iterable of batches from the broker at ``addr`` (``ipc://`` or ``tcp://``).

    Yields each batch in the structure its producer sent (list, tuple or dict), or a
    :class:`feedline.protocol.wire.Batch` with its metadata when ``return_meta=True``. Several
    processes on one broker share the stream; each batch goes to exactly one of them.

    ``timeout``: seconds to wait for a batch before raising :class:`ReceiveTimeout`
    (``None``: wait forever). ``curve``: this process's keys when the broker has CURVE keys
    (it then requires them on ``ipc://`` too), e.g.
    ``feedline.security.ClientKeys.load("trainer.key_secret", "broker.key")``.
    ``stream``: the named stream to receive (producers declare theirs). ``resume``: an exact
    stream's cursor to go on from (:meth:`state`).

    ``options``: the rest (:class:`ConsumerOptions`: the window, the byte budget, the link,
    the metrics registry, ...). Batches under 8 MiB are counted by their bytes: up to
    128 x ``options.window`` of them (:func:`feedline.serving.budget.depth`;
    docs/tensorflow.md, "Small batches"), except an exact stream's (one each: its ranks
    split each epoch). Those options given as keywords (``window=8``), as before
    ConsumerOptions, still work in this release with a DeprecationWarning.

    ``bind=True`` (direct mode, as tensorpack's RemoteDataZMQ binds): this process serves its
    producers itself at ``addr``, no broker, one network hop (:mod:`feedline.consumer.direct`);
    ``curve`` is then this trainer's :class:`~feedline.security.ServerKeys`, required on a
    non-loopback address unless ``options.insecure``; ``options.direct`` tunes the
    producers' window, the credit lease and a tensorpack ingress.

    Iteration ends with :class:`ReceiveTimeout`, :class:`ProducerError`, a
    :class:`FeedlineError` if the I/O thread failed, or ``StopIteration`` once
    :meth:`close` was called (from any thread).
    """

    def __init__(
        self,
        addr: str,
        *,
        stream: str = DEFAULT_STREAM,
        resume: Cursor | dict | bytes | None = None,
        timeout: float | None = None,
        return_meta: bool = False,
        curve: ClientKeys | ServerKeys | None = None,
        bind: bool = False,
        options: ConsumerOptions | None = None,
        **moved: Any,
    ) -> None:
        opts = moved_options("RemoteDataZMQ", options, moved)
        window, link, insecure = opts.window, opts.link, opts.insecure
        if not isinstance(addr, str):
            raise ConfigError(f"RemoteDataZMQ: the address must be a string such as "
                              f"'tcp://host:port', not {type(addr).__name__} {addr!r}")
        if timeout is not None and (isinstance(timeout, bool)
                                    or not isinstance(timeout, (int, float)) or timeout <= 0):
            raise ConfigError(f"RemoteDataZMQ: timeout must be a number of seconds > 0 (or "
                              f"None: wait for ever), not {timeout!r}")
        self.addr, self.timeout, self.options = addr, timeout, opts
        self.window = window
        self.config = ConsumerConfig(window, opts.max_bytes, stream)
        self.consumer_id = opts.consumer_id or f"{socket.gethostname()}-{os.getpid()}"
        self.return_meta, self.on_error = return_meta, opts.on_error
        self.stream = stream
        self._ledger: Ledger | None = None  # opened by the first iteration (opts.ledger)
        self._last: tuple | None = None  # the lineage of the batch taken last, as a tuple
        self._ended = -1  # the last epoch whose end an epoch() iteration here returned at
        self.link_config, self.curve, self.bind = link, curve, bind
        self.direct, self.insecure = opts.direct, insecure
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
        registry = opts.registry if opts.registry is not None else CollectorRegistry()
        self._shared = Shared(self.consumer_id, random.getrandbits(62), self.config.window,
                              self.config.max_bytes, stream, opts.on_error, registry,
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

    @property
    def lineage(self) -> Lineage | None:
        """Where the batch this iterator yielded last came from (None before the first):
        :class:`~feedline.exact.lineage.Lineage`, made when asked (nothing per batch)."""
        last = self._last
        return None if last is None else Lineage(self.stream, *last)

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
        frameworks, :func:`feedline.consumer.checkpoint.trackable` for ``tf.train.Checkpoint``).
        The ledger, if any, is flushed here: a run killed after its checkpoint keeps every
        line up to it, which is what a resumed run's ledger goes on from."""
        ledger = self._ledger
        if ledger is not None:
            ledger.flush()
        s = self._shared
        with s.lock:
            return s.exact.cursor.copy()

    def _deliveries(self, shared: Shared, epoch: int | None) -> Iterator[Any]:
        """Yield batches; ``epoch`` None: forever; -1: the epoch of the first batch, until
        its end (or the end of an epoch after the last one that ended here, if it comes
        first: one this consumer took nothing of)."""
        ledger = self._ledger
        if ledger is None and self.options.ledger is not None:
            ledger = self._ledger = Ledger(self.options.ledger, self.stream)
        while True:
            item = self._get(shared)
            if item is _CLOSED:
                return
            if isinstance(item, Marker):
                raise item.exc
            if isinstance(item, EpochMark):
                if ledger is not None:
                    ledger.flush()
                if epoch is not None and item.epoch > self._ended and (
                        epoch == -1 or item.epoch >= epoch):
                    # The end of our epoch; or, before any batch of it, of an epoch in which
                    # this consumer took nothing (the job's other consumers, or other hosts,
                    # took it all): that epoch is over for us too, empty.
                    self._ended = item.epoch
                    return
                continue
            assert isinstance(item, Delivery)
            b = item.batch
            if not shared.took(item):
                continue  # see Shared.took
            if epoch == -1 and b.unit >= 0:
                epoch = b.epoch
            # A tuple, not the batch: holding that would hold its frames past the model.
            self._last = (b.epoch, b.unit, b.index, b.producer, b.pipeline, b.pipeline_file,
                          b.code)
            if ledger is not None:
                ledger.write(b)
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
        ledger, self._ledger = self._ledger, None
        if ledger is not None:
            ledger.close()

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


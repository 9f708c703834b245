"""RemoteDataZMQ: the training process's iterator over batches served by a broker.

An I/O thread owns the DEALER socket to the broker: it registers with a *window* (how many
batches this process may hold undelivered to the model), keeps the link alive with heartbeats
while the model is busy (a long evaluation does not get us dropped), decodes what arrives and
hands it to the iterating thread through a bounded queue. Each batch the iterator takes
returns one credit to the broker, so at most ``window`` batches are ever buffered here.

Arrays are ``np.frombuffer`` views on the received frames: no copy is made between the socket
and the caller. They may be unaligned for their dtype (NumPy copes; ``a.copy()`` aligns).
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import zmq
from prometheus_client import CollectorRegistry

from consumer.metrics import ConsumerMetrics
from feedline import wire
from feedline.errors import ProducerError, ReceiveTimeout
from feedline.link import BrokerLink, LinkConfig
from feedline.logs import RateLimitedLog

log = logging.getLogger(__name__)
_REG = 4  # bytes of a registration number in a consumption signal


@dataclass
class ProducerStats:
    """What this consumer saw of one producer."""

    received: int = 0
    bytes: int = 0
    lost: int = 0  # batches the broker saw missing from this producer's sequence
    finished: bool = False  # the producer sent end-of-stream


class _Marker:
    __slots__ = ("exc",)

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class RemoteDataZMQ:
    """An iterable of batches from the broker at ``addr`` (``ipc://`` or ``tcp://``).

    Yields each batch in the structure its producer sent (list, tuple or dict), or a
    :class:`feedline.wire.Batch` with its metadata when ``return_meta=True``. Several
    processes on one broker share the stream; each batch goes to exactly one of them.

    ``timeout``: seconds to wait for a batch before raising :class:`ReceiveTimeout`
    (``None``: wait forever). ``on_error``: ``"raise"`` a producer's failure here as
    :class:`ProducerError`, or ``"log"`` it and go on. Iterate from one thread at a time;
    :meth:`close` (or leaving a ``with`` block) stops the I/O thread. ``curve``: this
    process's keys when the broker has CURVE keys (it then requires them on ``ipc://`` too),
    e.g. ``feedline.security.ClientKeys.load("trainer.key_secret", "broker.key")``.
    """

    def __init__(
        self,
        addr: str,
        *,
        window: int = 4,
        timeout: float | None = None,
        consumer_id: str | None = None,
        return_meta: bool = False,
        on_error: str = "raise",
        link: LinkConfig | None = None,
        registry: CollectorRegistry | None = None,
        curve: Any = None,
    ) -> None:
        if not 0 < window <= 4096:
            raise ValueError("window must be in 1..4096")
        if on_error not in ("raise", "log"):
            raise ValueError("on_error must be 'raise' or 'log'")
        self.addr, self.window, self.timeout = addr, window, timeout
        self.consumer_id = consumer_id or f"{socket.gethostname()}-{os.getpid()}"
        self.return_meta, self.on_error = return_meta, on_error
        self.link_config = link or LinkConfig()
        if curve is not None:
            self.link_config = replace(self.link_config, curve=curve)
        self._answered = False  # the broker has ever answered our HELLO
        self._reject_log = RateLimitedLog(log)
        self.metrics = ConsumerMetrics(registry if registry is not None else CollectorRegistry())
        self._stats: dict[str, ProducerStats] = {}
        self._stats_lock = threading.Lock()
        # Old registrations' batches may still sit here after a broker restart: 2 windows.
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=2 * window + 64)
        # Read at scrape time: exact whenever Prometheus looks, and free per batch.
        self.metrics.local_queue.set_function(self._queue.qsize)
        self.metrics.window.set(window)
        self._ctx: zmq.Context | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._signal: zmq.Socket | None = None
        self._sig_addr = f"inproc://feedline-consumer-{id(self)}"
        self._io_error: BaseException | None = None

    # --------------------------------------------------------------------- public API
    def reset_state(self) -> None:
        """DataFlow contract; the connection is made lazily by the first ``__iter__``."""

    def stats(self) -> dict[str, ProducerStats]:
        """Per producer id: batches received, bytes, batches lost, finished."""
        with self._stats_lock:
            return {k: replace(v) for k, v in self._stats.items()}

    def __iter__(self) -> Iterator[Any]:
        self._start()
        assert self._signal is not None
        while True:
            item = self._get()
            if isinstance(item, _Marker):
                raise item.exc
            reg, batch = item
            self._signal.send(reg.to_bytes(_REG, "big"))
            yield batch if self.return_meta else batch.datapoint

    def close(self) -> None:
        """Stop the I/O thread, tell the broker we leave, close sockets (bounded time)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.link_config.heartbeat_interval * 2 + 5)
            self._thread = None
        if self._signal is not None:
            self._signal.close(linger=0)
            self._signal = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    def __enter__(self) -> RemoteDataZMQ:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if self._thread is not None:
            self._stop.set()

    # ---------------------------------------------------------------------- internals
    def _start(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._ready.clear()
        self._ctx = self._ctx or zmq.Context()
        self._thread = threading.Thread(target=self._io_main, name="feedline-consumer-io",
                                        daemon=True)
        self._thread.start()
        self._ready.wait(10)
        if self._io_error is not None:
            raise self._io_error
        self._signal = self._ctx.socket(zmq.PAIR)
        self._signal.setsockopt(zmq.LINGER, 0)
        self._signal.connect(self._sig_addr)

    def _get(self) -> Any:
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        t0 = time.monotonic()
        while True:
            wait = 0.5 if deadline is None else min(0.5, deadline - time.monotonic())
            try:
                item = self._queue.get(timeout=max(wait, 0.0))
                self.metrics.wait.observe(time.monotonic() - t0)
                return item
            except queue.Empty:
                pass
            if self._thread is None or not self._thread.is_alive():
                raise self._io_error or RuntimeError("consumer I/O thread is not running")
            if deadline is not None and time.monotonic() >= deadline:
                with self._stats_lock:
                    producers = sorted(self._stats)
                if not self._answered:
                    raise ReceiveTimeout(
                        f"the broker at {self.addr} did not answer within {self.timeout:.1f}s. "
                        "Is it running at that address? If it has CURVE keys, it needs ours "
                        "(curve=ClientKeys.load(secret, broker_key), with our public key in its "
                        "--curve-allowed directory), on ipc:// too."
                    )
                raise ReceiveTimeout(
                    f"no batch from the broker at {self.addr} within {self.timeout:.1f}s "
                    f"(producers seen so far: {producers or 'none'}). Is the broker running, "
                    "and are producers connected to its ingress?"
                )

    def _io_main(self) -> None:
        assert self._ctx is not None
        sig = self._ctx.socket(zmq.PAIR)
        sig.setsockopt(zmq.LINGER, 0)
        link = None
        try:
            sig.bind(self._sig_addr)
            state = _IOState()
            link = BrokerLink(
                self._ctx,
                self.addr,
                hello=lambda: {"r": "consumer", "p": self.consumer_id, "c": self.window},
                config=self.link_config,
                on_register=state.new_registration,
                rcvhwm=2 * self.window + 64,
            )
            self._ready.set()
            self._io_loop(link, sig, state)
        except BaseException as e:  # surfaces in the iterating thread
            self._io_error = e
            self._ready.set()
            log.exception("consumer I/O thread failed")
        finally:
            if link is not None:
                link.send_control(wire.Kind.BYE)
                link.close(flush=True)
            sig.close(linger=0)

    def _io_loop(self, link: BrokerLink, sig: zmq.Socket, state: _IOState) -> None:
        limits = self.link_config.limits
        poll_ms = link.poll_timeout_ms()
        while not self._stop.is_set():
            poller = zmq.Poller()
            poller.register(sig, zmq.POLLIN)
            if link.socket is not None:
                poller.register(link.socket, zmq.POLLIN)
            events = dict(poller.poll(poll_ms))
            if sig in events:
                consumed = 0
                while True:
                    try:
                        reg = int.from_bytes(sig.recv(zmq.NOBLOCK), "big")
                    except zmq.Again:
                        break
                    if reg == state.registration:
                        consumed += 1
                if consumed:
                    state.consumed += consumed
                    link.send_control(wire.Kind.CREDIT, t=state.consumed)
            if link.socket is not None and link.socket in events:
                for _ in range(4 * self.window + 64):
                    try:
                        frames = link.socket.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self._on_message(link, frames, state, limits)
            link.tick()

    def _on_message(self, link: BrokerLink, frames: list, state: _IOState,
                    limits: wire.Limits) -> None:
        try:
            header = wire.decode_header(frames[0], limits)
            handled = link.handle(header)
            self._answered = self._answered or link.welcomed
            if handled:
                return
            kind = header["k"]
            if kind == wire.Kind.DELIVER:
                batch = wire.decode_batch(frames[1:], limits)
                self._deliver(state, batch, int(header.get("g") or 0))
            elif kind == wire.Kind.EOS:
                with self._stats_lock:
                    self._stats.setdefault(str(header.get("p")), ProducerStats()).finished = True
            elif kind == wire.Kind.ERROR:
                err = ProducerError(str(header.get("p")), str(header.get("m", "")),
                                    str(header.get("tb", "")))
                if self.on_error == "raise":
                    self._put(_Marker(err))
                else:
                    log.error("%s", err)
        except wire.DecodeError as e:
            self.metrics.rejected.labels(e.reason).inc()
            self._reject_log.warning("rejected a message from the broker: %s", e)

    def _deliver(self, state: _IOState, batch: wire.Batch, gap: int) -> None:
        with self._stats_lock:
            st = self._stats.setdefault(batch.producer, ProducerStats())
            st.received += 1
            st.bytes += batch.nbytes
            st.lost += max(0, gap)
        self.metrics.received_batches.inc()
        self.metrics.received_bytes.inc(batch.nbytes)
        if gap > 0:
            self.metrics.lost_batches.inc(gap)
        self._put((state.registration, batch))

    def _put(self, item: Any) -> None:
        try:
            self._queue.put_nowait(item)
        except queue.Full:  # only if the broker ignored our window
            self.metrics.rejected.labels("over_window").inc()


class _IOState:
    def __init__(self) -> None:
        self.registration = 0
        self.consumed = 0

    def new_registration(self) -> None:
        self.registration = (self.registration + 1) % (1 << 31)
        self.consumed = 0

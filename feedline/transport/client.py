"""The I/O thread of a producer or a consumer: one loop for both.

A :class:`ClientLoop` runs in its own thread and owns everything ZeroMQ of its peer: the
context, every :class:`~feedline.transport.link.Link` and its socket, from creation to close (rule
12:
a socket belongs to one thread for its whole life). The owner thread (a pipeline, a training
loop) never touches a socket: it hands work over through thread-safe objects of the role and
wakes the loop with a :class:`Waker` (a pipe, polled next to the sockets). So heartbeats go
on while the owner computes for minutes, and :meth:`ClientLoop.stop` is safe from any thread.

The loop: poll the waker and the links' sockets; hand each received control message to the
role (``on_message``); tell the role it was woken (``on_wake``); do each link's liveness work
(``Link.tick``) and the role's (``on_tick``); then ``after_turn`` (a consumer wakes its
iterating thread there, once for everything the turn received). At the end the role says its
last words (``on_close``) before the links close with a bounded flush.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Callable
from typing import Protocol

import zmq

from feedline.protocol import messages as m
from feedline.transport.link import Link

log = logging.getLogger(__name__)


def _close_fds(*fds: int) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


_DRAIN = 4096  # bytes one read of a Waker's pipe takes: a wake writes one


class Waker:
    """Wakes a poll loop from any thread: a non-blocking pipe whose read end is polled.

    Its file descriptors close when the last reference to it goes, never earlier, so a wake
    can never write into a descriptor that has been reused for something else.
    """

    def __init__(self) -> None:
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)
        weakref.finalize(self, _close_fds, self._r, self._w)

    def wake(self) -> None:
        try:
            os.write(self._w, b"\0")
        except (BlockingIOError, OSError):
            pass  # the pipe is full: the loop is going to wake anyway

    def fileno(self) -> int:
        return self._r

    def drain(self) -> None:
        """Read the wakes written so far. A read shorter than asked for emptied the pipe:
        the read after it, which raised BlockingIOError, was a syscall and an exception for
        every wake (two wakes a batch in a running transport)."""
        try:
            while len(os.read(self._r, _DRAIN)) == _DRAIN:
                pass
        except OSError:  # BlockingIOError: empty after all
            pass


class Role(Protocol):
    """What a producer or consumer plugs into the loop (all called in the loop's thread)."""

    def links(self) -> list[Link]: ...

    def sockets(self) -> list[zmq.Socket]:
        """Sockets of its own to poll besides the links' (a direct-mode trainer's ROUTER)."""
        ...

    def on_ready(self, ready: list[zmq.Socket]) -> None:
        """Some of :meth:`sockets` have messages."""
        ...

    def on_message(self, link: Link, msg: m.Message, frames: list[zmq.Frame]) -> None: ...

    def on_wake(self) -> None: ...

    def on_tick(self) -> None: ...

    def on_close(self) -> None: ...


class ClientLoop:
    """Start with :meth:`start`; ``make(ctx)`` builds the role (and its links) in the
    thread. Errors of the loop end it and are kept in :attr:`error` for the owner to raise.

    A role may also have ``poll_timeout_ms()``: the longest the loop may sleep now (``None``:
    as its links say)."""

    def __init__(self, name: str, make: Callable[[zmq.Context], Role], waker: Waker,
                 after_turn: Callable[[], None] | None = None) -> None:
        self.name, self._make, self.waker = name, make, waker
        self._after_turn = after_turn
        self.stopping = threading.Event()
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._running = False  # from start() until the thread's last step

    def start(self, timeout: float = 10.0) -> None:
        self._running = True
        try:
            self._thread.start()
        except BaseException:
            self._running = self._thread.is_alive()  # started before (a second start)
            raise
        self.ready.wait(timeout)
        if self.error is not None:
            raise self.error

    def alive(self) -> bool:
        """The loop's thread runs: a flag its last step clears (``Thread.is_alive`` takes a
        lock, and a producer asks before every batch)."""
        return self._running

    def in_loop_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def stop(self, timeout: float | None = 10.0) -> None:
        """Ask the loop to finish; wait for it (bounded) unless called from the loop itself
        or with ``timeout=None`` (a finalizer: signal only)."""
        self.stopping.set()
        self.waker.wake()
        if timeout is not None and not self.in_loop_thread() and self._thread.ident is not None:
            self._thread.join(timeout)

    def _main(self) -> None:
        ctx = zmq.Context()
        role: Role | None = None
        try:
            role = self._make(ctx)
            self.ready.set()
            self._loop(role)
        except BaseException as e:  # surfaces in the owner's thread
            self.error = e
            self.ready.set()
            if not isinstance(e, (zmq.ContextTerminated,)):
                log.exception("%s failed", self.name)
        finally:
            try:
                if role is not None:
                    role.on_close()
                    for link in role.links():
                        link.close(flush=True)
            finally:
                try:
                    ctx.term()
                finally:
                    self._running = False

    def _loop(self, role: Role) -> None:
        poller = zmq.Poller()
        polled: tuple[object, ...] = ()
        role_timeout = getattr(role, "poll_timeout_ms", None)
        after_turn = self._after_turn
        wake_fd = self.waker.fileno()
        while not self.stopping.is_set():
            links = role.links()
            own = role.sockets()
            # A new poller only when the sockets change (a reconnect, a new target), not for
            # every turn: a batch takes two turns, and each one's work shows in throughput.
            want = (*(s for link in links for s in link.poll_sockets()), *own)
            if len(want) != len(polled) or any(a is not b for a, b in zip(want, polled,
                                                                          strict=True)):
                poller, polled = zmq.Poller(), want
                poller.register(wake_fd, zmq.POLLIN)
                for sock in want:
                    poller.register(sock, zmq.POLLIN)
            timeout = min((link.poll_timeout_ms() for link in links), default=100)
            if role_timeout is not None:
                mine = role_timeout()
                if mine is not None:
                    timeout = min(timeout, mine)
            events = dict(poller.poll(timeout))
            if wake_fd in events:
                self.waker.drain()
            if own:
                ready = [s for s in own if s in events]
                if ready:
                    role.on_ready(ready)
            role.on_wake()
            for link in links:
                if link.socket is not None and link.socket in events:
                    link.receive(role.on_message)
            for link in links:
                link.tick()
            role.on_tick()
            if after_turn is not None:
                after_turn()

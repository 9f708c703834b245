"""Handing items between an I/O thread and its owner thread, with as few wake-ups as possible.

A wake-up is what a hand-over costs: ``queue.Queue`` notifies a condition on every put and
every get, and waking a sleeping thread (a futex, a context switch, the GIL handed over) took
20-40 us per batch in a running transport, more than decoding the batch. So the two queues
here wake the other thread only when it sleeps, and not for every item:

- :class:`Inbox` (I/O thread -> owner: a consumer's batches). ``put_nowait`` never wakes;
  the I/O thread calls :meth:`Inbox.flush` once per loop turn, which wakes a sleeping owner
  once for everything the turn received.
- :class:`Backlog` (owner -> I/O thread: a producer's batches). The owner sleeps only while
  it is full; the I/O thread wakes it when the box has drained to half, so an owner that
  makes small batches quickly is woken once for several. Bounded in items *and* bytes: small
  batches queue deeper than large ones.

Both rely on the GIL for the order of one thread's plain reads and writes (a ``deque``'s
append and popleft are atomic, and :class:`Sleeper` orders going to sleep against being woken
without a lock). One thread puts, one takes (plus :meth:`Inbox.put_and_wake` from a closing
thread).
"""

from __future__ import annotations

import queue
import select
import time
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

from feedline.transport.client import Waker

T = TypeVar("T")


class Sleeper:
    """A thread that sleeps until a condition holds, woken only if it really sleeps.

    The wake is a byte written to a pipe that the sleeper waits on (``select``), not a
    condition variable: Python releases the GIL around ``write()``, but not around the
    release of a lock. A notify holding the GIL let the woken thread preempt the waker and
    then wait for the GIL the waker held: 28-30 us per wake in a running transport, where
    the pipe costs a few.

    :meth:`sleep` sets ``asleep``, checks ``ready`` once more and only then waits;
    :meth:`wake` (after the waker made ``ready`` true) reads ``asleep``. If it reads False,
    the sleeper had not yet looked, and will see ``ready``; if True, the byte it writes ends
    the wait, or (if the sleeper saw ``ready`` first) the next one early, which callers
    treat as any early wake-up: they look again.
    """

    def __init__(self) -> None:
        self._pipe = Waker()
        self.asleep = False

    def sleep(self, ready: Callable[[], bool], timeout: float) -> bool:
        """Wait until ``ready()`` (or ``timeout`` seconds; a wake-up may also come early:
        callers loop). Returns ``ready()``."""
        self.asleep = True
        try:
            if ready():
                return True
            if timeout > 0 and select.select([self._pipe.fileno()], [], [], timeout)[0]:
                self._pipe.drain()
            return ready()
        finally:
            self.asleep = False

    def wake(self) -> None:
        if self.asleep:
            self._pipe.wake()


class Inbox(Generic[T]):
    """At most ``maxsize`` items from the I/O thread to the owner; drop-in for the
    ``queue.Queue`` methods its users call (``put_nowait``, ``get``, ``get_nowait``,
    ``qsize``, ``empty``), but ``put_nowait`` does not wake the owner: :meth:`flush` does."""

    def __init__(self, maxsize: int) -> None:
        self.maxsize = maxsize
        self._items: deque[T] = deque()
        self._sleeper = Sleeper()

    def put_nowait(self, item: T) -> None:
        """Queue ``item`` (``queue.Full`` beyond ``maxsize``); the owner sees it at the next
        :meth:`flush`, or whenever it looks."""
        if len(self._items) >= self.maxsize:
            raise queue.Full
        self._items.append(item)

    def put_and_wake(self, item: T) -> None:
        """Queue ``item`` beyond the bound (a closing marker: one) and wake the owner now."""
        self._items.append(item)
        self._sleeper.wake()

    def flush(self) -> None:
        """Wake the owner if it sleeps and there is something for it (once per loop turn)."""
        if self._items:
            self._sleeper.wake()

    def get_nowait(self) -> T:
        try:
            return self._items.popleft()
        except IndexError:
            raise queue.Empty from None

    def get(self, timeout: float) -> T:
        """The next item, waiting up to ``timeout`` seconds (``queue.Empty`` after)."""
        try:
            return self._items.popleft()
        except IndexError:
            pass
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or self._sleeper.sleep(self._ready, left):
                break
        return self.get_nowait()

    def _ready(self) -> bool:
        return bool(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def qsize(self) -> int:
        return len(self._items)

    def empty(self) -> bool:
        return not self._items


class Backlog(Generic[T]):
    """Items from the owner to the I/O thread: at most ``max_items`` and ``max_bytes`` (but
    always one, whatever its size). The owner's :meth:`put` sleeps while the box is full;
    the I/O thread's :meth:`get_nowait` wakes it once the box has drained to half."""

    def __init__(self, max_items: int, max_bytes: int) -> None:
        self.max_items, self.max_bytes = max_items, max_bytes
        self._items: deque[tuple[T, int]] = deque()
        self._bytes = 0  # written by the owner (+) and the I/O thread (-): see _room
        self._taken_bytes = 0
        self._sleeper = Sleeper()

    def _room(self, nbytes: int) -> bool:
        n = len(self._items)
        if n == 0:
            return True
        held = self._bytes - self._taken_bytes
        return n < self.max_items and held + nbytes <= self.max_bytes

    def put(self, item: T, nbytes: int, timeout: float) -> bool:
        """Queue ``item`` of ``nbytes``, sleeping up to ``timeout`` for room; False if
        there was none (the caller checks its stop conditions and tries again)."""
        if not self._room(nbytes):
            if timeout <= 0:
                return False
            deadline = time.monotonic() + timeout
            while not self._sleeper.sleep(lambda: self._room(nbytes), deadline
                                          - time.monotonic()):
                if time.monotonic() >= deadline:
                    return False
        self._bytes += nbytes
        self._items.append((item, nbytes))
        return True

    def get_nowait(self) -> T:
        """The oldest item (``queue.Empty`` if none); wakes a sleeping owner once the box
        holds half of what it may."""
        try:
            item, nbytes = self._items.popleft()
        except IndexError:
            raise queue.Empty from None
        self._taken_bytes += nbytes
        if self._sleeper.asleep and (2 * len(self._items) <= self.max_items
                                     and 2 * (self._bytes - self._taken_bytes)
                                     <= self.max_bytes):
            self._sleeper.wake()
        return item

    def peek(self) -> T | None:
        """The oldest item, left in the box (None if it is empty)."""
        try:
            return self._items[0][0]
        except IndexError:
            return None

    def __len__(self) -> int:
        return len(self._items)

    def empty(self) -> bool:
        return not self._items

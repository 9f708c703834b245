"""Hand-overs between an I/O thread and its owner (feedline/transport/handover.py): bounds, order,
and
no lost wake-up, with real threads, and the backlog's bounds as a model."""

from __future__ import annotations

import queue
import random
import threading
import time

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from feedline.transport.handover import Backlog, Inbox, Sleeper

# A wake-up that is lost shows as a wait this long; nothing here waits that long otherwise.
LOST = 20.0


def test_inbox_is_bounded_and_in_order():
    box: Inbox[int] = Inbox(3)
    for i in range(3):
        box.put_nowait(i)
    with pytest.raises(queue.Full):
        box.put_nowait(3)
    assert [box.get_nowait() for _ in range(3)] == [0, 1, 2]
    with pytest.raises(queue.Empty):
        box.get_nowait()
    with pytest.raises(queue.Empty):
        box.get(timeout=0.01)


def test_a_sleeping_owner_is_woken_by_flush_not_by_each_put():
    box: Inbox[int] = Inbox(8)
    got: list[int] = []
    owner = threading.Thread(target=lambda: got.append(box.get(timeout=LOST)))
    owner.start()
    deadline = time.monotonic() + LOST
    while not box._sleeper.asleep:  # the owner is in its wait
        assert time.monotonic() < deadline
        time.sleep(0.001)
    box.put_nowait(1)
    box.put_nowait(2)
    owner.join(0.3)
    assert owner.is_alive() and got == [], "a put alone does not wake the owner"
    box.flush()
    owner.join(LOST / 2)
    assert not owner.is_alive() and got == [1]
    assert box.get_nowait() == 2  # the rest of the turn's items wait for the next take


def test_put_and_wake_goes_beyond_the_bound_and_wakes():
    box: Inbox[object] = Inbox(1)
    box.put_nowait(1)
    marker = object()
    box.put_and_wake(marker)
    assert box.qsize() == 2 and box.get_nowait() == 1 and box.get_nowait() is marker


def test_no_wake_up_is_lost_either_way():
    """The I/O thread hands 3000 items to an owner through an Inbox (flushing after a random
    number of them) and takes 3000 from it through a Backlog, each side pausing at random:
    every item arrives, in order, and nobody sleeps until a timeout (a lost wake-up)."""
    n = 3000
    inbox: Inbox[int] = Inbox(16)
    backlog: Backlog[int] = Backlog(1, 0)
    received: list[int] = []
    taken: list[int] = []
    stalls: list[str] = []
    rng = random.Random(7)
    pauses = [rng.random() < 0.05 for _ in range(n)]

    def owner() -> None:
        for i in range(n):
            try:
                received.append(inbox.get(timeout=LOST))
            except queue.Empty:
                stalls.append(f"inbox at {i}")
                return
            if not backlog.put(i, 1, LOST):
                stalls.append(f"backlog at {i}")
                return
            if pauses[i]:
                time.sleep(0.0005)

    def io() -> None:
        sent = 0
        while len(taken) < n:
            burst = rng.randint(1, 4)
            while sent < n and burst and len(inbox) < inbox.maxsize:
                inbox.put_nowait(sent)
                sent, burst = sent + 1, burst - 1
            inbox.flush()
            try:
                taken.append(backlog.get_nowait())
            except queue.Empty:
                time.sleep(0)  # the real I/O thread is woken by the owner's nudge
            if rng.random() < 0.05:
                time.sleep(0.0005)

    threads = [threading.Thread(target=owner), threading.Thread(target=io)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(4 * LOST)
    assert not any(t.is_alive() for t in threads) and stalls == []
    assert received == list(range(n)) and taken == list(range(n))


def test_a_sleeper_woken_before_it_sleeps_does_not_sleep():
    s = Sleeper()
    flag = [False]
    s.asleep = True  # as a sleeper that is about to look at its condition
    flag[0] = True
    s.wake()  # a byte is left in its pipe: the next wait ends early, harmlessly
    s.asleep = False
    t0 = time.monotonic()
    assert s.sleep(lambda: flag[0], LOST) and time.monotonic() - t0 < LOST / 2
    flag[0] = False
    assert not s.sleep(lambda: flag[0], 0.05)  # the stale byte: an early, empty wake-up
    assert not s.sleep(lambda: flag[0], 0.05)  # and then a plain timeout


class BacklogModel(RuleBasedStateMachine):
    """Backlog's bounds against a model: it holds at most ``max_items`` items and
    ``max_bytes`` bytes, except that it always takes one item when empty; FIFO; ``peek``
    shows the next item without taking it."""

    def __init__(self) -> None:
        super().__init__()
        self.max_items, self.max_bytes = 3, 100
        self.box: Backlog[int] = Backlog(self.max_items, self.max_bytes)
        self.model: list[tuple[int, int]] = []
        self.next = 0

    @rule(nbytes=st.integers(0, 150))
    def put(self, nbytes: int) -> None:
        held = sum(b for _, b in self.model)
        room = not self.model or (len(self.model) < self.max_items
                                  and held + nbytes <= self.max_bytes)
        assert self.box.put(self.next, nbytes, 0) == room
        if room:
            self.model.append((self.next, nbytes))
        self.next += 1

    @precondition(lambda self: bool(self.model))
    @rule()
    def take(self) -> None:
        assert self.box.get_nowait() == self.model.pop(0)[0]

    @rule()
    def peek(self) -> None:
        """What a producer's bundle looks at before it takes: the oldest, left in place."""
        assert self.box.peek() == (self.model[0][0] if self.model else None)

    @precondition(lambda self: not self.model)
    @rule()
    def take_empty(self) -> None:
        with pytest.raises(queue.Empty):
            self.box.get_nowait()

    @invariant()
    def bounded(self) -> None:
        assert len(self.box) == len(self.model)
        if len(self.model) > 1:
            assert len(self.model) <= self.max_items
            assert sum(b for _, b in self.model) <= self.max_bytes


TestBacklogModel = BacklogModel.TestCase
TestBacklogModel.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)

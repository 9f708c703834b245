"""The producer processes of one ``feedline fleet``: start, stop gracefully, notice exits.

Scaling down sends SIGTERM to the newest producers first. A producer's SIGTERM handler stops
its pipeline and closes its sender: what it handed over and holds credit for is sent (for up
to the link's ``flush_ms``), then it says BYE, which gives its remaining credit back at once
and, in exact delivery, hands its work unit back to the broker (the next producer to ask
resumes it from the first batch the broker does not have; what was sent and is not settled
yet is de-duplicated by ``(epoch, unit, index)``). So nothing is lost or taken twice. A
producer still alive ``stop_timeout`` seconds later is killed (exact delivery still loses
nothing then: its unit goes back when the broker drops it, a heartbeat timeout later).
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from feedline.procs import Child, wait_all

log = logging.getLogger(__name__)


@dataclass
class Member:
    """One producer process."""

    name: str  # its producer id
    child: Child
    started: float
    deadline: float = 0.0  # stopping: killed after this


class Pool:
    """Producer processes, the newest last. ``argv(name)`` is a producer's command line.
    Call from one thread (the supervisor's loop)."""

    def __init__(self, argv: Callable[[str], Sequence[str]], prefix: str,
                 stop_timeout: float = 30.0, log_dir: Path | None = None) -> None:
        self.argv, self.prefix = argv, prefix
        self.stop_timeout, self.log_dir = stop_timeout, log_dir
        self.running: list[Member] = []
        self.stopping: list[Member] = []
        self.started = 0  # producers started, ever (numbers the ids: never reused)
        self.crashed = 0  # exits with a non-zero status that we did not ask for
        self.finished = 0  # exits with status 0 (the pipeline's epochs done)

    def start(self, n: int, now: float) -> list[str]:
        names = []
        for _ in range(max(0, n)):
            name = f"{self.prefix}-{self.started}"
            self.started += 1
            logfile = self.log_dir / f"{name}.log" if self.log_dir else None
            child = Child(list(self.argv(name)), logfile, inherit=logfile is None)
            self.running.append(Member(name, child, now))
            names.append(name)
        return names

    def stop(self, n: int, now: float) -> list[str]:
        """SIGTERM the ``n`` newest running producers; they finish in the background."""
        names = []
        for _ in range(min(max(0, n), len(self.running))):
            m = self.running.pop()
            m.deadline = now + self.stop_timeout
            m.child.signal(signal.SIGTERM)
            self.stopping.append(m)
            names.append(m.name)
        return names

    def reap(self, now: float) -> list[tuple[str, int]]:
        """Collect exits: producers we stopped that are gone (killed past their deadline),
        and running ones that exited by themselves, returned as (name, status)."""
        for m in list(self.stopping):
            if not m.child.alive():
                self.stopping.remove(m)
            elif now >= m.deadline:
                log.warning("producer %s did not stop within %.0fs of SIGTERM: killing it",
                            m.name, self.stop_timeout)
                m.child.kill9()
                self.stopping.remove(m)
        exited = []
        for m in list(self.running):
            code = m.child.proc.poll()
            if code is None:
                continue
            self.running.remove(m)
            exited.append((m.name, code))
            if code == 0:
                self.finished += 1
            else:
                self.crashed += 1
        return exited

    def close(self, timeout: float) -> None:
        """Stop every producer gracefully (SIGTERM, then kill past ``timeout``). Those
        stopping already got their SIGTERM: a second one would kill them mid-shutdown."""
        for m in self.running:
            m.child.signal(signal.SIGTERM)
        wait_all([m.child for m in [*self.running, *self.stopping]], timeout)
        self.running, self.stopping = [], []

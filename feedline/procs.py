"""Starting and stopping feedline daemons as child processes (for the demo and the tests).

A child never outlives its parent: :class:`Child` asks the kernel (Linux ``prctl
PR_SET_PDEATHSIG``) to send it SIGTERM when the parent dies, even by ``kill -9``, and a
forked worker calls :func:`die_with_parent`, which watches its parent from a thread.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from feedline.errors import Timeout

_PR_SET_PDEATHSIG = 1


def _pdeathsig(sig: int) -> Callable[[], None] | None:
    """A preexec_fn that makes the child get ``sig`` when the thread that forked it ends (the
    parent's death, if that thread is its main thread); None where prctl does not exist.

    Everything is looked up before the fork: between fork and exec the child only calls the
    C function and compares two pids (the parent may have died already: then it exits)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
        if os.getppid() != parent:
            os._exit(1)

    return preexec


def die_with_parent(parent_pid: int | None = None, interval: float = 0.5,
                    grace: float = 10.0) -> threading.Thread:
    """Make this process end when its parent does (call it first thing in a forked worker).

    A daemon thread checks every ``interval`` seconds whether ``parent_pid`` (default: the
    process that forked us, from multiprocessing, else the parent now) is still our parent.
    When it is not, it sends this process SIGTERM (a worker dies, a daemon stops cleanly),
    and if the process is still alive ``grace`` seconds later, ends it with ``os._exit(1)``.
    A thread, not ``PR_SET_PDEATHSIG``: the kernel sends that when the *thread* that forked us
    exits, which for a pipeline iterated in a worker thread is long before its process does.
    """
    if parent_pid is None:
        import multiprocessing

        parent = multiprocessing.parent_process()
        parent_pid = parent.pid if parent is not None and parent.pid else os.getppid()
    pid = parent_pid

    def watch() -> None:
        while os.getppid() == pid:
            time.sleep(interval)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace)
        os._exit(1)

    t = threading.Thread(target=watch, name="die-with-parent", daemon=True)
    t.start()
    return t


_LOWEST_PORT = 10000
_handed: set[int] = set()
_handed_lock = threading.Lock()


def _ephemeral_range() -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in
                  Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default
    return lo, hi


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free now, for a server this process starts next (the demo's broker, a
    test's daemon).

    Taken below the kernel's ephemeral range (from 10000 up to it), where there is room:
    the kernel gives ports of that range to outgoing connections, so a port of it that was
    free a moment ago may be a client's by the time the server binds it (a test suite makes
    thousands of connections). Each port is handed out once per process, at random, so
    processes asking at once (parallel test workers) rarely pick the same one; it is free
    (a bind succeeds) when handed out. Falls back to a port the kernel picks.
    """
    lo, _ = _ephemeral_range()
    rng = random.Random()
    for _ in range(64 if lo - _LOWEST_PORT >= 1000 else 0):
        port = rng.randrange(_LOWEST_PORT, lo)
        with _handed_lock:
            if port in _handed:
                continue
            _handed.add(port)
        try:
            with socket.socket() as s:
                s.bind((host, port))
            return port
        except OSError:
            continue
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class Child:
    """A child process running ``argv``, its output going to ``log_path`` (or nowhere, or with
    ``inherit`` where ours goes).

    On Linux the child gets SIGTERM when this process dies (``PR_SET_PDEATHSIG``), so a
    parent killed by ``kill -9`` or an abort leaves no orphans. The kernel ties that to the
    thread that started the child, so it is set only when the main thread starts it (a child
    started from another thread is stopped by :meth:`stop` only).
    """

    def __init__(self, argv: Sequence[str], log_path: Path | None = None,
                 env: dict[str, str] | None = None, cwd: Path | None = None,
                 inherit: bool = False) -> None:
        self.argv = list(argv)
        self.log_path = log_path
        preexec: Any = None
        if threading.current_thread() is threading.main_thread():
            preexec = _pdeathsig(signal.SIGTERM)
        out: Any = open(log_path, "ab") if log_path else (  # noqa: SIM115
            None if inherit else subprocess.DEVNULL)
        self.proc = subprocess.Popen(
            self.argv, stdout=out, stderr=None if out is None else subprocess.STDOUT,
            env={**os.environ, **(env or {})}, preexec_fn=preexec, cwd=cwd,
        )
        if log_path:
            out.close()  # type: ignore[union-attr]

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            os.kill(self.proc.pid, sig)

    def kill9(self) -> None:
        self.signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self, timeout: float = 10.0) -> int:
        """SIGTERM, wait up to ``timeout``, then SIGKILL. Returns the exit code."""
        stop_all([self], timeout)
        return self.proc.wait(10)

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path else ""


def stop_all(children: Sequence[Child], timeout: float = 10.0) -> None:
    """Stop several children at once: SIGTERM to each (in the order given), then
    :func:`wait_all`. Their shutdowns (a producer lets what it holds leave for up to
    ``flush_ms``) overlap instead of adding."""
    for c in children:
        c.signal(signal.SIGTERM)
    wait_all(children, timeout)


def wait_all(children: Sequence[Child], timeout: float) -> None:
    """Wait for children already told to stop, up to ``timeout`` in all, then SIGKILL what
    is left. (Not a second SIGTERM: a daemon that is shutting down takes that as "now",
    as a second Ctrl-C, and dies of it.)"""
    deadline = time.monotonic() + timeout
    for c in children:
        try:
            c.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            c.proc.kill()
            c.proc.wait(10)


class Daemon(Child):
    """A child process running ``python -m <module> ARGS``."""

    def __init__(self, module: str, args: Sequence[str], log_path: Path | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.module, self.args = module, list(args)
        super().__init__([sys.executable, "-m", module, *self.args], log_path, env)


def wait_for(predicate, timeout: float, interval: float = 0.05, what: str = "condition"):
    """Poll ``predicate`` until it returns a truthy value; TimeoutError after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise Timeout(f"{what} not reached within {timeout}s")
        time.sleep(interval)

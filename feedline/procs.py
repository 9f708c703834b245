"""Starting and stopping feedline daemons as child processes (for the demo and the tests)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path


def free_port(host: str = "127.0.0.1") -> int:
    """An ephemeral TCP port that was free a moment ago."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class Child:
    """A child process running ``argv``, its output going to ``log_path`` (or nowhere)."""

    def __init__(self, argv: Sequence[str], log_path: Path | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.argv = list(argv)
        self.log_path = log_path
        out = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115
        self.proc = subprocess.Popen(
            self.argv, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
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
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait(10)

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path else ""


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
            raise TimeoutError(f"{what} not reached within {timeout}s")
        time.sleep(interval)

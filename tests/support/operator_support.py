"""Helpers of the operator tests (tests/commands/test_operator_*.py): run ``feedline`` as an
operator does, and check that a failure is what an operator should see: one line, a non-zero
status."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psutil

from feedline.procs import free_port, wait_for

ROOT = Path(__file__).resolve().parents[2]


def feedline(*args: str, env: dict[str, str] | None = None, timeout: float = 60,
             cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    """``feedline ARGS`` (as ``python -m feedline.commands``, this checkout first on the path)."""
    return subprocess.run([sys.executable, "-m", "feedline.commands", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})


def one_line_failure(r: subprocess.CompletedProcess[str], *needles: str) -> str:
    """Assert that ``r`` failed with exactly one line on stderr holding every needle (and no
    traceback); return that line."""
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode != 0, f"exit status 0; stderr: {r.stderr}"
    assert "Traceback" not in r.stderr, r.stderr
    assert len(lines) == 1, f"{len(lines)} lines on stderr:\n{r.stderr}"
    for needle in needles:
        assert needle in lines[0], f"{needle!r} not in {lines[0]!r}"
    return lines[0]


def gone(pid: int) -> bool:
    """The process ``pid`` has exited (a zombie nobody reaped counts as exited)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    """Wait up to ``timeout`` for every pid to exit; return those still alive (killed, so a
    failing test leaves nothing behind)."""
    try:
        wait_for(lambda: all(gone(p) for p in pids), timeout, what="processes to exit")
        return []
    except TimeoutError:
        alive = [p for p in pids if not gone(p)]
        for p in alive:
            try:
                psutil.Process(p).kill()
            except psutil.NoSuchProcess:
                pass
        return alive


__all__ = ["ROOT", "feedline", "free_port", "gone", "one_line_failure", "wait_gone"]

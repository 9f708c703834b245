"""Where the suite's CPU goes: each test's CPU-seconds, its own and its child processes'.

The suite is CPU-bound on a small machine (the fault scenarios, the daemons and the TensorFlow
examples run as processes), so its wall time follows its CPU, not its longest test. Load
this plugin and name a file::

    python3 -m pytest -q -p tests.support.cpu_report --cpu-report cpu.jsonl

Each test appends one JSON line to the file (``id``, ``self`` and ``children`` CPU-seconds,
``wall`` seconds; every pytest-xdist worker appends its own, lines are written whole), and
the run ends with the tests and the files that took the most. ``children`` counts the
processes a test started and waited for (``RUSAGE_CHILDREN``): a daemon it killed and reaped
is counted, one it left running is not (``tests/conftest.py`` fails a test that does).
"""

from __future__ import annotations

import json
import os
import resource
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

TOP = 15  # tests and files listed at the end


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--cpu-report", metavar="FILE", default=None,
                     help="append each test's CPU-seconds (its own and its children's) to "
                     "FILE as JSON lines; list the costliest at the end")


def pytest_configure(config: pytest.Config) -> None:
    path = config.getoption("--cpu-report")
    if path and not hasattr(config, "workerinput"):  # the run's controller: a new report
        Path(path).write_text("")


def _cpu() -> tuple[float, float]:
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, kids.ru_utime + kids.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    path = item.config.getoption("--cpu-report")
    if not path:
        yield
        return
    own0, kids0 = _cpu()
    t0 = time.monotonic()
    yield
    own1, kids1 = _cpu()
    line = json.dumps({"id": item.nodeid.split("@")[0], "self": round(own1 - own0, 3),
                       "children": round(kids1 - kids0, 3),
                       "wall": round(time.monotonic() - t0, 3)})
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())  # one write: whole lines from every worker
    finally:
        os.close(fd)


def summary(path: Path, top: int = TOP) -> list[str]:
    """The costliest tests and test files in a report, as lines."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not rows:
        return [f"{path}: no tests recorded"]
    cost = {r["id"]: r["self"] + r["children"] for r in rows}
    files: Counter[str] = Counter()
    for test, cpu in cost.items():
        files[test.split("::")[0]] += cpu
    out = [f"CPU: {sum(cost.values()):.0f} s in {len(rows)} tests ({path}); the most:"]
    out += [f"  {cpu:7.1f} s  {test}" for test, cpu in Counter(cost).most_common(top)]
    out.append("by file:")
    out += [f"  {cpu:7.1f} s  {name}" for name, cpu in files.most_common(top)]
    return out


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter,
                            config: pytest.Config) -> None:
    path = config.getoption("--cpu-report")
    if path and not hasattr(config, "workerinput") and Path(path).exists():
        terminalreporter.section("cpu report")
        for line in summary(Path(path)):
            terminalreporter.write_line(line)
